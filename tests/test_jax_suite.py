"""The JAX-suite harness (tests/jax_suite/run.py) must fail on what it exists to catch: a test that
passes natively and not under replacement (failure, abort, hang), and only on that."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "jax_suite"))
import run as jax_suite  # noqa: E402
from expected_differences import Expected  # noqa: E402

SUITE = Path(__file__).parent / "jax_suite" / "selftest_suite.py"
S = "selftest_suite.py::SelfTest::"


def _res(**outcomes):
  return {"tests": {S + k: {"outcome": v, "message": f"{v} message"} for k, v in outcomes.items()}}


def test_compare_flags_only_native_passes_that_stop_passing():
  native = _res(a="passed", b="passed", c="passed", d="failed", e="skipped", f="passed", g="passed")
  replaced = _res(a="passed", b="failed", c="crash", d="failed", e="failed", f="timeout",
                  g="skipped")
  cmp = jax_suite.compare(native, replaced, expected=[])
  assert set(cmp["regressions"]) == {S + "b", S + "c", S + "f", S + "g"}
  assert cmp["compared"] == 5 and not cmp["expected"] and not cmp["stale"]


def test_compare_documented_and_stale_entries():
  native = _res(a="passed", b1="passed", b2="passed", c="passed")
  replaced = _res(a="passed", b1="failed", b2="passed", c="passed")
  expected = [Expected(S + "b*", "asserts XLA's collective"), Expected(S + "c", "fixed since"),
              Expected(S + "not_run", "another selection")]
  cmp = jax_suite.compare(native, replaced, expected=expected)
  assert not cmp["regressions"]
  assert list(cmp["expected"]) == [S + "b1"]
  assert cmp["stale"] == [S + "c"]  # c passes again; not_run did not run: not judged
  assert not jax_suite.report({}, {"selftest": cmp})  # a stale entry fails the run


def test_every_expected_difference_is_explained():
  for entry in jax_suite.EXPECTED:
    assert "::" in entry.pattern and entry.reason.strip(), entry


@pytest.fixture(scope="module")
def selftest_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("jax_suite")
  results = {mode: jax_suite.run_suite(SUITE, mode, out, test_timeout=10.0,
                                       deadline=jax_suite.time.monotonic() + 300)
             for mode in jax_suite.MODES}
  return results


def test_runner_records_every_outcome(selftest_run):
  native, replaced = selftest_run["native"], selftest_run["replaced"]
  outcomes = {mode: {t[len(S):]: r["outcome"] for t, r in res["tests"].items()}
              for mode, res in selftest_run.items()}
  assert outcomes["native"] == {"test_same": "passed", "test_native_collective": "passed",
                                "test_abort": "passed", "test_hang": "passed",
                                "test_fails_natively_too": "failed", "test_skipped": "skipped",
                                "test_zz_after_crashes": "passed"}
  assert outcomes["replaced"] == {**outcomes["native"], "test_native_collective": "failed",
                                  "test_abort": "crash", "test_hang": "timeout"}
  assert native["meta"]["pytest_runs"] == 1 and replaced["meta"]["pytest_runs"] == 3
  assert not native["meta"]["session_errors"] and not replaced["meta"]["session_errors"]
  assert replaced["tests"][S + "test_same"]["flexlink_calls"] > 0
  assert native["meta"]["jax_flexlink"] is None and replaced["meta"]["jax_flexlink"]
  assert "AssertionError" in replaced["tests"][S + "test_native_collective"]["message"]
  assert "Aborted" in replaced["tests"][S + "test_abort"]["message"]
  assert "in test_hang" in replaced["tests"][S + "test_hang"]["message"]


def test_runner_comparison_fails_on_replacement_only_failures(selftest_run):
  cmp = jax_suite.compare(selftest_run["native"], selftest_run["replaced"], expected=[])
  assert sorted(t[len(S):] for t in cmp["regressions"]) == [
      "test_abort", "test_hang", "test_native_collective"]
  assert not jax_suite.report({}, {"selftest": cmp})
  documented = [Expected(S + "test_native_collective", "asserts XLA's collective"),
                Expected(S + "test_abort", "x"), Expected(S + "test_hang", "x")]
  assert jax_suite.report({}, {"selftest": jax_suite.compare(
      selftest_run["native"], selftest_run["replaced"], expected=documented)})
