"""busbw factors, size conventions and name parsing of jax_flexlink.bench."""
import pytest

from jax_flexlink.bench import collectives as C


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_busbw_factors(n):
    assert C.COLLECTIVES["all_reduce"].busbw_factor(n) == pytest.approx(2 * (n - 1) / n)
    assert C.COLLECTIVES["all_gather"].busbw_factor(n) == pytest.approx((n - 1) / n)
    assert C.COLLECTIVES["reduce_scatter"].busbw_factor(n) == pytest.approx((n - 1) / n)
    assert C.COLLECTIVES["ppermute"].busbw_factor(n) == 1.0  # SendRecv: busbw = algbw
    assert C.COLLECTIVES["all_to_all"].busbw_factor(n) == pytest.approx((n - 1) / n)


def test_busbw_factor_values_for_8():
    assert C.COLLECTIVES["all_reduce"].busbw_factor(8) == 1.75
    assert C.COLLECTIVES["all_gather"].busbw_factor(8) == 0.875
    assert C.COLLECTIVES["ppermute"].busbw_factor(8) == 1.0
    assert C.COLLECTIVES["all_to_all"].busbw_factor(8) == 0.875


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


def test_counts_of_sendrecv_and_alltoall():
    pp, a2a = C.COLLECTIVES["ppermute"], C.COLLECTIVES["all_to_all"]
    assert (pp.title, pp.has_op, a2a.title, a2a.has_op) == ("SendRecv", False, "AlltoAll", False)
    # SendRecv: size and count are the per-rank buffer, sent whole to the next rank.
    assert pp.counts(4096, 4, 8) == (1024, 1024, 1024)
    assert pp.actual_bytes(1024, 4, 8) == 4096
    assert pp.counts(4099, 4, 8) == (1024, 1024, 1024) and pp.counts(3, 4, 8)[0] == 0
    # AlltoAll: size is the per-rank buffer of n blocks; count is one block (nccl-tests' paramcount).
    assert a2a.counts(4096, 4, 8) == (128, 1024, 1024)
    assert a2a.actual_bytes(128, 4, 8) == 4096
    assert a2a.counts(4100, 4, 8) == (128, 1024, 1024) and a2a.counts(7 * 4, 4, 8)[0] == 0 and a2a.counts(31 * 4, 4, 8)[0] == 3
    assert a2a.counts(4096, 2, 3) == (682, 2046, 2046) and a2a.actual_bytes(682, 2, 3) == 4092


def _nccl_tests_row(kind, size, itemsize, n, sec):
    """nccl-tests' own arithmetic (src/sendrecv.cu, src/alltoall.cu, common.cu setupArgs): the printed
    size is max(sendBytes, expectedBytes), the printed count is paramcount, bandwidths from GetBw."""
    count = size // itemsize
    if kind == "ppermute":
        send = recv = param = count
        algbw = param * itemsize / 1e9 / sec
        busbw = algbw * 1
    else:
        send = recv = (count // n) * n
        param = count // n
        algbw = param * n * itemsize / 1e9 / sec
        busbw = algbw * (n - 1) / n
    return max(send, recv) * itemsize, param, algbw, busbw


@pytest.mark.parametrize("kind", ["ppermute", "all_to_all"])
@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("size", [64, 1000, 4096, 4100, 12345, 1 << 20])
def test_sizes_and_bandwidths_match_nccl_tests(kind, n, itemsize, size):
    from jax_flexlink.bench import timing
    coll = C.COLLECTIVES[kind]
    count = coll.counts(size, itemsize, n)[0]
    nbytes = coll.actual_bytes(count, itemsize, n)
    algbw, busbw = timing.bandwidths(nbytes, 1e-3, coll.busbw_factor(n))
    want = _nccl_tests_row(kind, size, itemsize, n, 1e-3)
    assert (nbytes, count) == want[:2]
    assert (algbw, busbw) == pytest.approx(want[2:], rel=1e-12)


def test_ring_perm_and_legend():
    assert C.ring_perm(4) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert C.ring_perm(1) == [(0, 0)]
    assert C.busbw_legend(["all_reduce", "all_gather", "ppermute", "all_to_all"]) == (
        "2(n-1)/n (AllReduce), (n-1)/n (AllGather, AlltoAll), 1 (SendRecv)")


def test_parse_lists():
    assert C.parse_collectives("all") == ["all_reduce", "all_gather", "reduce_scatter", "ppermute",
                                          "all_to_all"]
    assert C.parse_collectives("ppermute,all_to_all") == ["ppermute", "all_to_all"]
    assert C.parse_collectives("SendRecv,AlltoAll,alltoall") == ["ppermute", "all_to_all"]
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
