"""Size parser and sweeps of jax_flexlink.bench."""
import pytest

from jax_flexlink.bench.sizes import format_size, parse_size, size_sweep


@pytest.mark.parametrize("text,want", [
    ("0", 0), ("512", 512), ("4K", 4096), ("4k", 4096), ("64M", 64 << 20), ("1G", 1 << 30),
    ("1.5K", 1536), ("4KB", 4096), ("4KiB", 4096), ("8MiB", 8 << 20), (" 2M ", 2 << 20), ("16B", 16),
    (4096, 4096),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "K", "-4K", "4X", "4 K K", "1.3", "0.1K", "abc", "4Q"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_size():
    assert [format_size(x) for x in (4096, 64 << 20, 1 << 30, 1000, 1536, 0)] == \
        ["4K", "64M", "1G", "1000", "1536", "0"]


def test_sweep_default_is_factor_two():
    sizes = size_sweep(4 << 10, 64 << 20)
    assert sizes[0] == 4096 and sizes[-1] == 64 << 20 and len(sizes) == 15
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))


def test_sweep_factor_and_step():
    assert size_sweep(1024, 16384, stepfactor=4) == [1024, 4096, 16384]
    assert size_sweep(1024, 4096, stepbytes=1024) == [1024, 2048, 3072, 4096]
    # nccl-tests: a factor > 1 wins over stepbytes
    assert size_sweep(1024, 4096, stepfactor=2, stepbytes=1) == [1024, 2048, 4096]
    assert size_sweep(4096, 4096) == [4096]
    assert size_sweep(100, 150, stepfactor=1.1)[:3] == [100, 110, 121]


def test_sweep_errors():
    with pytest.raises(ValueError):
        size_sweep(4096, 1024)
    with pytest.raises(ValueError):
        size_sweep(0, 1024, stepfactor=2)
    with pytest.raises(ValueError):
        size_sweep(1024, 4096, stepfactor=1)
