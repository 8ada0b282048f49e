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


def test_native_baseline_stands_in_only_with_the_same_settings(selftest_run, tmp_path, monkeypatch):
  """A recorded native baseline gives the same comparison as the native run it was recorded from,
  and is refused (with the setting named) when anything it was recorded with differs."""
  import baseline  # noqa: PLC0415 - tests/jax_suite, on sys.path above
  here = Path(jax_suite.HERE)
  current = baseline.settings(here=here, test_file=SUITE, exclude=None, test_timeout=10.0,
                              env_recorded=jax_suite.ENV_RECORDED)
  path = tmp_path / "selftest.json"
  baseline.write(path, {"selftest_suite": selftest_run["native"]}, {"selftest_suite": current})
  native, why = baseline.load(path, "selftest_suite", current)
  assert why == "" and native["meta"]["baseline"] == str(path)
  assert {t: r["outcome"] for t, r in native["tests"].items()} == {
      t: r["outcome"] for t, r in selftest_run["native"]["tests"].items()}
  assert (jax_suite.compare(native, selftest_run["replaced"], expected=[])
          == jax_suite.compare(selftest_run["native"], selftest_run["replaced"], expected=[]))
  assert baseline.check_same_tests(native, selftest_run["replaced"]) == ""
  fewer = {"tests": dict(list(selftest_run["replaced"]["tests"].items())[1:])}
  assert "1 in it and not collected" in baseline.check_same_tests(native, fewer)

  other_jax = {**current, "packages": {**current["packages"], "jax": "0.0.1"}}
  assert baseline.load(path, "selftest_suite", other_jax)[0] is None
  assert "packages.jax: baseline" in baseline.load(path, "selftest_suite", other_jax)[1]
  monkeypatch.setenv("JAX_NUM_GENERATED_CASES", "7")
  with_cases = baseline.settings(here=here, test_file=SUITE, exclude=None, test_timeout=10.0,
                               env_recorded=jax_suite.ENV_RECORDED)
  res, why = baseline.load(path, "selftest_suite", with_cases)
  assert res is None and "env.JAX_NUM_GENERATED_CASES: baseline None, here '7'" in why
  assert "no baseline" in baseline.load(tmp_path / "none.json", "selftest_suite", current)[1]
  assert "has no pmap_test" in baseline.load(path, "pmap_test", current)[1]
  failed = {"meta": {**selftest_run["native"]["meta"], "session_errors": ["deadline"]},
            "tests": {}}
  with pytest.raises(ValueError, match="no baseline"):
    baseline.write(tmp_path / "bad.json", {"s": failed}, {"s": current})


def test_committed_baselines_are_well_formed():
  """Every committed baseline is readable, names a vendored tag and records outcomes only."""
  import baseline  # noqa: PLC0415
  paths = sorted(Path(jax_suite.BASELINES).glob("*.json"))
  assert paths, "no committed baseline"
  for path in paths:
    doc = baseline.json.loads(path.read_text())
    assert doc["format"] == baseline.FORMAT and doc["version"] == baseline.VERSION
    # Bazel's runfiles carry the baselines but not the vendored suites (third_party/, ~MBs); the
    # pytest run from the source tree checks the tag against them.
    if Path(jax_suite.VENDORED).is_dir():
      assert (Path(jax_suite.VENDORED) / path.stem).is_dir(), path
    assert path.stem.startswith("jax-v"), path
    for suite, entry in doc["suites"].items():
      assert suite in jax_suite.SUITES and entry["settings"]["tag"] == path.stem
      assert set(entry["tests"].values()) <= {"passed", "skipped", "failed", "error", "xfailed", "xpassed"}
      assert sum(entry["recorded"]["counts"].values()) == len(entry["tests"])
