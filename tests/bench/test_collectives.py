"""busbw factors, size conventions and name parsing of jax_flexlink.bench."""
import pytest

from jax_flexlink.bench import collectives as C


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_busbw_factors(n):
    assert C.COLLECTIVES["all_reduce"].busbw_factor(n) == pytest.approx(2 * (n - 1) / n)
    assert C.COLLECTIVES["all_gather"].busbw_factor(n) == pytest.approx((n - 1) / n)
    assert C.COLLECTIVES["reduce_scatter"].busbw_factor(n) == pytest.approx((n - 1) / n)


def test_busbw_factor_values_for_8():
    assert C.COLLECTIVES["all_reduce"].busbw_factor(8) == 1.75
    assert C.COLLECTIVES["all_gather"].busbw_factor(8) == 0.875


def test_counts_follow_nccl_tests():
    ar, ag, rs = (C.COLLECTIVES[k] for k in ("all_reduce", "all_gather", "reduce_scatter"))
    # AllReduce: the per-rank buffer.
    assert ar.counts(4096, 4, 8) == (1024, 1024, 1024)
    assert ar.actual_bytes(1024, 4, 8) == 4096
    # AllGather: size is the gathered output; count is what each rank sends.
    assert ag.counts(4096, 4, 8) == (128, 128, 1024)
    assert ag.actual_bytes(128, 4, 8) == 4096
    # ReduceScatter: size is the per-rank input; count is what each rank receives.
    assert rs.counts(4096, 4, 8) == (128, 1024, 128)
    assert rs.actual_bytes(128, 4, 8) == 4096
    # Truncation to whole elements per rank, as nccl-tests.
    assert ag.counts(4100, 4, 8)[0] == 128
    assert ar.counts(4099, 4, 8)[0] == 1024
    assert ag.counts(16, 4, 8)[0] == 0


def test_parse_lists():
    assert C.parse_collectives("all") == ["all_reduce", "all_gather", "reduce_scatter"]
    assert C.parse_collectives("allreduce,all-gather") == ["all_reduce", "all_gather"]
    assert C.parse_collectives("reduce_scatter,reduce_scatter") == ["reduce_scatter"]
    assert C.parse_ops("all") == ["sum", "prod", "max", "min"]
    assert C.parse_dtypes("float,half,bf16,double") == ["float", "half", "bfloat16", "double"]
    assert "bfloat16" in C.parse_dtypes("all") and "float" in C.parse_dtypes("all")
    assert C.parse_dtypes("float32,float") == ["float"]


@pytest.mark.parametrize("fn,text", [(C.parse_collectives, "broadcast"), (C.parse_ops, "avg"),
                                     (C.parse_dtypes, "float8")])
def test_parse_rejects(fn, text):
    with pytest.raises(ValueError, match=text):
        fn(text)


def test_dtype_sizes():
    assert C.DTYPES["float"].itemsize == 4 and C.DTYPES["half"].itemsize == 2
    assert C.DTYPES["bfloat16"].itemsize == 2 and C.DTYPES["double"].itemsize == 8
