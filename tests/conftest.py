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
import tempfile  # noqa: E402

os.environ["FLEXLINK_TUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="flexlink-tests-"), "tune.json")
# Tests turn replacement on explicitly; never inherit it from the caller's environment.
os.environ.pop("FLEXLINK_REPLACE_COLLECTIVES", None)

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "large: a 64 MiB-per-device case")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    devices = jax.devices()
    assert len(devices) == _DEVICES, f"expected {_DEVICES} host devices, got {devices}"
    assert jax.config.jax_enable_x64
    return devices


@pytest.fixture(scope="session")
def mesh1d():
    return Mesh(np.array(jax.devices()), ("x",))


@pytest.fixture(scope="session")
def reversed_mesh():
    return Mesh(np.array(jax.devices()[::-1]), ("x",))

