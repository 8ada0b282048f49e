"""pytest plugin for running JAX's own test files natively or under FlexLink's replacement mode.

Loaded with `-p jax_suite_plugin` by run.py, which puts this directory on PYTHONPATH; pytest imports
it before collecting, i.e. before the test module imports jax. Driven by environment variables:

  JAX_SUITE_MODE     "native" or "replaced" (replacement on, FlexLink imported, before any tracing)
  JAX_SUITE_LOG      JSON lines: {"start": nodeid} before a test, then its outcome record
  JAX_SUITE_SKIP     file of node ids not to run (done before a restart, or crashed)
  JAX_SUITE_ONLY     file of node ids to run; absent: every collected test
  JAX_SUITE_EXCLUDE  file of fnmatch patterns of node ids not to run ('#' starts a comment)
  JAX_SUITE_TEST_TIMEOUT_S  per-test deadline: faulthandler dumps every thread's stack to
                     JAX_SUITE_TIMEOUT_LOG and exits; run.py records the test as "timeout"
"""
import faulthandler
import fnmatch
import json
import os
import tempfile

MODE = os.environ.get("JAX_SUITE_MODE", "native")
if MODE not in ("native", "replaced"):
  raise RuntimeError(f"JAX_SUITE_MODE={MODE!r}: expected native or replaced")

# Before jax is imported: 8 host devices on XLA:CPU, as in JAX's CPU CI and this project's tests.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A FlexLink collective that cannot complete fails in 30 s instead of the default 300 s.
os.environ.setdefault("FLEXLINK_TIMEOUT_S", "30")
if "FLEXLINK_TUNE_CACHE" not in os.environ:  # run.py gives one per run; never the user's
  os.environ["FLEXLINK_TUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="jax-suite-"), "tune.json")
os.environ["FLEXLINK_REPLACE_COLLECTIVES"] = "1" if MODE == "replaced" else "0"
os.environ.pop("JAX_FLEXLINK_REPLACE_COLLECTIVES", None)

_flexlink_stats = None
if MODE == "replaced":
  import jax_flexlink as flx  # noqa: E402 - routes lax's binds; the env var above turned it on

  if not flx.replacing_collectives():
    raise RuntimeError("replacement mode did not turn on")
  _flexlink_stats = flx.stats

_log = open(os.environ["JAX_SUITE_LOG"], "a", buffering=1)  # line-buffered: survives an abort
if MODE == "replaced":  # which build ran (an installed copy, the source tree, Bazel's runfiles)
  _log.write(json.dumps({"jax_flexlink": os.path.dirname(flx.__file__)}) + "\n")
_timeout_s = float(os.environ.get("JAX_SUITE_TEST_TIMEOUT_S", "0"))
_timeout_log = None
if _timeout_s > 0:
  _timeout_log = open(os.environ["JAX_SUITE_TIMEOUT_LOG"], "a")


def _read_ids(var):
  path = os.environ.get(var)
  if not path:
    return None
  with open(path) as f:
    return {line.split("#")[0].strip() for line in f} - {""}


def _flexlink_calls():
  if _flexlink_stats is None:
    return 0
  return sum(link["calls"] for link in _flexlink_stats()["links"].values())


def pytest_configure(config):
  config.addinivalue_line("markers", "multiaccelerator: JAX's marker (tests/BUILD tag)")


def pytest_collection_modifyitems(config, items):
  skip, only = _read_ids("JAX_SUITE_SKIP") or set(), _read_ids("JAX_SUITE_ONLY")
  exclude = _read_ids("JAX_SUITE_EXCLUDE") or set()
  keep = [it for it in items if it.nodeid not in skip and (only is None or it.nodeid in only)
          and not any(fnmatch.fnmatchcase(it.nodeid, pattern) for pattern in exclude)]
  dropped = [it for it in items if it not in keep]
  if dropped:
    config.hook.pytest_deselected(items=dropped)
  items[:] = keep


def pytest_collection_finish(session):
  # After every plugin's selection (also -k / -m from PYTEST_ADDOPTS): what will run.
  _log.write(json.dumps({"collected": [it.nodeid for it in session.items]}) + "\n")


_current = {}


def _message(report):
  """Exception type and the first lines of its message, from pytest's long representation."""
  crash = getattr(report.longrepr, "reprcrash", None)
  if crash is not None:
    return "\n".join(crash.message.splitlines()[:6])
  if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
    return str(report.longrepr[2])
  return "\n".join(str(report.longrepr).splitlines()[-6:])


def pytest_runtest_logstart(nodeid, location):
  _log.write(json.dumps({"start": nodeid}) + "\n")
  _current.clear()
  _current.update(outcome="passed", message="", duration=0.0, calls0=_flexlink_calls())
  if _timeout_log is not None:
    faulthandler.dump_traceback_later(_timeout_s, exit=True, file=_timeout_log)


def pytest_runtest_logreport(report):
  _current["duration"] += report.duration
  if report.passed and not hasattr(report, "wasxfail"):
    return
  if report.skipped and hasattr(report, "wasxfail"):
    outcome = "xfailed"
  elif report.passed:
    outcome = "xpassed"
  elif report.skipped:
    outcome = "skipped"
  else:
    outcome = "failed" if report.when == "call" else "error"
  if _current["outcome"] in ("passed", "skipped"):  # the first failure of a test is its outcome
    _current.update(outcome=outcome, message=_message(report))


def pytest_runtest_logfinish(nodeid, location):
  if _timeout_log is not None:
    faulthandler.cancel_dump_traceback_later()
  calls = _flexlink_calls() - _current.pop("calls0")
  _log.write(json.dumps({"test": nodeid, **_current, "flexlink_calls": calls}) + "\n")
