"""pytest configuration for jax_flexlink: 8 host devices on XLA's CPU backend, 64-bit dtypes on.

Both settings must be in the environment before jax is imported, so they are made here, at the top
of the first module pytest imports. 64-bit mode is on for the whole suite (every test compares
against jax.lax under the same mode, so nothing depends on the default dtype).
"""
import os
import sys

_DEVICES = 8

if "jax" in sys.modules:  # pragma: no cover - a plugin imported jax before us
    raise RuntimeError("jax was imported before tests/conftest.py could set XLA_FLAGS")

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={_DEVICES}".strip()
os.environ["JAX_ENABLE_X64"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A hang in a collective should fail a test in a minute, not in the default five.
os.environ.setdefault("FLEXLINK_TIMEOUT_S", "60")
# Stage 1 caches what it measures; a test run must neither read a cache from earlier runs (plans
# would depend on history) nor write into the user's. One fresh cache per test session.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

_tune_dir = tempfile.mkdtemp(prefix="flexlink-tests-")
os.environ["FLEXLINK_TUNE_CACHE"] = os.path.join(_tune_dir, "tune.json")
# Gone with the process (each pytest-xdist worker makes and removes its own), so that runs leave
# nothing in /tmp; the processes tests start have ended by then.
atexit.register(shutil.rmtree, _tune_dir, ignore_errors=True)
# Tests turn replacement on explicitly; never inherit it from the caller's environment.
os.environ.pop("FLEXLINK_REPLACE_COLLECTIVES", None)

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "large: a 64 MiB-per-device case")
    config.addinivalue_line(
        "markers", "gpu: needs a GPU, i.e. jax.devices('gpu') non-empty under a jax with a CUDA plugin; "
        "skipped with the reason otherwise. The suite's JAX_PLATFORMS default is cpu: run them with "
        "JAX_PLATFORMS=cpu,cuda (cpu stays the default backend), as benchmarks/gpu_check.sh does")


def gpu_devices():
    """(jax's GPUs, "") or ([], why there are none)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    names = {p.strip() for p in platforms.split(",") if p.strip()}
    if names and not names & {"cuda", "gpu"}:
        return [], (f"no GPU: JAX_PLATFORMS={platforms!r} leaves out CUDA (the suite's default is 'cpu'; "
                    "run GPU tests with JAX_PLATFORMS=cpu,cuda)")
    try:
        devices = jax.devices("gpu")
    except RuntimeError as e:
        return [], f"no GPU: jax.devices('gpu') failed: {str(e).splitlines()[0]}"
    if not devices:
        return [], "no GPU: jax.devices('gpu') is empty"
    return devices, ""


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    devices, reason = gpu_devices()
    if not devices:
        skip = pytest.mark.skip(reason=reason)
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    devices = jax.devices()
    assert len(devices) == _DEVICES, f"expected {_DEVICES} host devices, got {devices}"
    assert jax.config.jax_enable_x64
    return devices


@pytest.fixture(scope="session")
def gpus():
    """jax's GPUs (tests that take this fixture are marked gpu, so they only run when there are some)."""
    devices, reason = gpu_devices()
    if not devices:
        pytest.skip(reason)
    return devices


@pytest.fixture(scope="session")
def mesh1d():
    return Mesh(np.array(jax.devices()), ("x",))


@pytest.fixture(scope="session")
def reversed_mesh():
    return Mesh(np.array(jax.devices()[::-1]), ("x",))

