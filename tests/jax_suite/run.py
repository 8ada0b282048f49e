"""Runs JAX's own shard_map and pmap tests natively and under FlexLink's replacement mode, and fails
when a test that passes natively does not pass under replacement (docs/jax_suite.md).

  python tests/jax_suite/run.py                  # CI's selection: replaced, compared with native
  python tests/jax_suite/run.py --native run     # ... running native too (the full comparison)
  python tests/jax_suite/run.py --record-baseline  # run native, write tests/jax_suite/baselines/<tag>.json
  python tests/jax_suite/run.py --select all     # the full suites (~15-20 min here)
  python tests/jax_suite/run.py --test pmap_test.py::PythonPmapTest::testBasic   # one test
  python tests/jax_suite/run.py --compare-only   # compare the last run's results again

The native outcomes come from the committed baseline of the tag (baseline.py) when it was recorded
with exactly this run's settings (jax and the other packages' versions, Python, the vendored files,
the harness, the selection, the recorded environment); otherwise native runs, and run.py says why.

Each (suite, mode) runs pytest in a subprocess with jax_suite_plugin.py, which records one JSON line
per test. A test that aborts the process or passes its deadline ends that subprocess; it is recorded
("crash" / "timeout", with the first lines of what the process printed) and pytest starts again
without the tests already done, so one crasher costs one restart, not the run. Results (OUT is
build/jax_suite/<tag>): OUT/<suite>.<mode>.json, the comparison OUT/comparison.json, pytest's output
OUT/<suite>.<mode>.log.
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

# Not resolve(): under Bazel this file is a symlink in the runfiles, whose jax_flexlink (with
# Bazel's build of the native module) the subprocesses must import, not the source tree's.
HERE = Path(__file__).absolute().parent
ROOT = HERE.parents[1]
VENDORED = ROOT / "third_party" / "jax_tests"
SUITES = ("shard_map_test", "pmap_test")
MODES = ("native", "replaced")

# Settings that change what JAX's tests do; recorded with the results.
ENV_RECORDED = ("JAX_ENABLE_X64", "JAX_NUM_GENERATED_CASES", "JAX_SKIP_SLOW_TESTS",
                "JAX_ENABLE_CHECKS", "XLA_FLAGS", "FLEXLINK_TIMEOUT_S", "FLEXLINK_LINKS",
                "PYTEST_ADDOPTS")

BASELINES = HERE / "baselines"

sys.path.insert(0, str(HERE))
import baseline  # noqa: E402
from expected_differences import EXPECTED  # noqa: E402


def default_tag() -> str:
  """The vendored tag for the installed jax: same major.minor, the newest not above it."""
  version = tuple(int(p) for p in re.findall(r"\d+", importlib.metadata.version("jax"))[:3])
  tags = []
  for d in VENDORED.glob("jax-v*"):
    tag = tuple(int(p) for p in re.findall(r"\d+", d.name)[:3])
    if tag[:2] == version[:2] and tag <= version:
      tags.append((tag, d.name))
  if not tags:
    sys.exit(f"run.py: no vendored JAX tests under {VENDORED} for jax {version}")
  return max(tags)[1]


_FATAL = re.compile(r"[FE]\d{4} \d\d:\d\d:\d\d\.\d+ .*|Fatal Python error.*|terminate called.*")


def _crash_message(text: str) -> str:
  """The first fatal message (absl's F-line of a CHECK failure, Python's fatal error), with the
  innermost Python frame of the thread that died; else the output's last lines."""
  m = _FATAL.search(text)
  if m is None:
    return "\n".join([l for l in text.splitlines() if l.strip()][-6:])
  frame = re.search(r"most recent call first\):\n(.*)", text[m.start():])
  return m.group(0).strip() + ("\n" + frame.group(1).strip() if frame else "")


def _test_thread_frame(dump: str) -> str:
  """The innermost frame of the test's thread, from faulthandler's dump of all threads."""
  for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump):
    if "_callTestMethod" in block or "pytest_runtest_call" in block:
      frames = re.findall(r'^\s*(File .*)$', block, re.M)
      if frames:
        return frames[0]
  return "(no stack of the test's thread)"


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def run_suite(test_file: Path, mode: str, out: Path, *, test_timeout: float, deadline: float,
              only: list[str] | None = None, exclude: Path | None = None) -> dict:
  """Runs one suite in one mode until every selected test has an outcome (or the deadline passes).

  only: the test ids to run (default: all collected); exclude: a file of fnmatch patterns of test
  ids not to run."""
  name = f"{test_file.stem}.{mode}"
  log, pytest_log = out / f"{name}.jsonl", out / f"{name}.log"
  skip_file, only_file = out / f"{name}.skip", out / f"{name}.only"
  timeout_log = out / f"{name}.timeouts"
  for f in (log, pytest_log, timeout_log):
    f.write_text("")
  (out / f"{name}.tune.json").unlink(missing_ok=True)
  env = {**os.environ, "JAX_SUITE_MODE": mode, "JAX_SUITE_LOG": str(log),
         "JAX_SUITE_SKIP": str(skip_file), "JAX_SUITE_TEST_TIMEOUT_S": str(test_timeout),
         "JAX_SUITE_TIMEOUT_LOG": str(timeout_log),
         # FlexLink's stage-1 cache: fresh for each run, never the user's.
         "FLEXLINK_TUNE_CACHE": str(out / f"{name}.tune.json"),
         "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
  if only is not None:
    only_file.write_text("\n".join(only) + "\n")
    env["JAX_SUITE_ONLY"] = str(only_file)
  if exclude is not None:
    env["JAX_SUITE_EXCLUDE"] = str(exclude)
  cmd = [sys.executable, "-m", "pytest", str(test_file), "-c", str(HERE / "pytest.ini"),
         "--rootdir", str(test_file.parent), "-p", "jax_suite_plugin", "-q", "-rN",
         # No capture: what XLA writes to fd 2 before aborting (a CHECK failure) reaches the log
         # instead of dying with pytest's capture file (and --capture=sys breaks JAX's tests
         # that redirect fd 1 themselves, jtu.capture_stdout).
         "--capture=no"]
  tests, selected, pytest_runs, session_errors, flexlink_dir = {}, None, 0, [], None
  started = time.monotonic()
  while True:
    skip_file.write_text("".join(f"{t}\n" for t in tests))
    offset, log_offset = log.stat().st_size, pytest_log.stat().st_size
    timeouts_before = timeout_log.stat().st_size
    pytest_runs += 1
    with open(pytest_log, "a") as sink:
      proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
                              start_new_session=True)
      try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        rc = None
      finally:  # pytest's own process group: whatever is left of it (also on ^C) goes
        _kill_group(proc)
    current = None
    with open(log) as f:
      f.seek(offset)
      for line in f:
        rec = json.loads(line)
        if "collected" in rec and selected is None:
          selected = rec["collected"]
        elif "jax_flexlink" in rec:
          flexlink_dir = rec["jax_flexlink"]
        elif "start" in rec:
          current = rec["start"]
        elif "test" in rec:
          tests[rec.pop("test")] = rec
          current = None
    output = pytest_log.read_text()[log_offset:]
    if rc is None:  # the whole run's deadline
      session_errors.append(f"deadline reached after {time.monotonic() - started:.0f} s")
      break
    if current is not None:  # the process ended inside a test: it crashed or timed out
      timed_out = timeout_log.stat().st_size > timeouts_before
      if timed_out:
        where = _test_thread_frame(timeout_log.read_text()[timeouts_before:])
        message = f"no outcome after {test_timeout:.0f} s, in {where}"
      else:
        message = f"process ended (exit status {rc}): {_crash_message(output)}"
      tests[current] = {"outcome": "timeout" if timed_out else "crash", "duration": None,
                        "message": message, "flexlink_calls": None}
      if selected is not None and all(t in tests for t in selected):
        break
      continue
    if rc not in (0, 1):  # 2: collection error, 3: internal error, 4: usage, 5: no tests
      session_errors.append(f"pytest exit status {rc}: {_crash_message(output)}")
    break
  for t in selected or ():
    tests.setdefault(t, {"outcome": "not run", "duration": None, "message": "",
                         "flexlink_calls": None})
  meta = {"suite": test_file.stem, "tag": test_file.parent.name, "mode": mode,
          "jax": importlib.metadata.version("jax"), "jax_flexlink": flexlink_dir,
          "env": {k: v for k, v in os.environ.items() if k in ENV_RECORDED},
          "wall_s": round(time.monotonic() - started, 1), "pytest_runs": pytest_runs,
          "session_errors": session_errors, "counts": counts(tests)}
  result = {"meta": meta, "tests": tests}
  (out / f"{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
  for f in (log, skip_file, only_file):
    f.unlink(missing_ok=True)
  if not timeout_log.stat().st_size:
    timeout_log.unlink()
  return result


def counts(tests: dict) -> dict:
  c = {}
  for rec in tests.values():
    c[rec["outcome"]] = c.get(rec["outcome"], 0) + 1
  return dict(sorted(c.items()))


def compare(native: dict, replaced: dict, expected=EXPECTED) -> dict:
  """Tests that pass natively and do not pass under replacement, split into the documented
  (expected) and the rest; plus expected entries none of whose tests differ any more (stale).
  Returns {"regressions": {...}, "expected": {...}, "stale": [...], "compared": n}."""
  regressions, documented, matched, still_differs = {}, {}, set(), set()
  compared = 0
  for test_id, rec in sorted(native["tests"].items()):
    if rec["outcome"] != "passed" or test_id not in replaced["tests"]:
      continue
    compared += 1
    entry = next((e for e in expected if fnmatch.fnmatchcase(test_id, e.pattern)), None)
    if entry is not None:
      matched.add(entry.pattern)
    got = replaced["tests"][test_id]
    if got["outcome"] == "passed":
      continue
    row = {"outcome": got["outcome"], "message": got["message"]}
    if entry is None:
      regressions[test_id] = row
    else:
      documented[test_id] = {**row, "reason": entry.reason}
      still_differs.add(entry.pattern)
  return {"compared": compared, "regressions": regressions, "expected": documented,
          "stale": sorted(matched - still_differs)}


def _first_line(text: str) -> str:
  return (text.splitlines() or [""])[0][:160]


def report(results: dict, comparisons: dict) -> bool:
  ok = True
  print(f"\n{'suite':16} {'mode':9} {'wall s':>7}  counts")
  for (suite, mode), res in results.items():
    m = res["meta"]
    if "baseline" in m:
      print(f"{suite:16} {mode:9} {'-':>7}  {m['counts']}  from the baseline (recorded in "
            f"{m['recorded_wall_s']:.0f} s)")
    else:
      print(f"{suite:16} {mode:9} {m['wall_s']:7.0f}  {m['counts']}  pytest runs {m['pytest_runs']}")
    for err in m["session_errors"]:
      ok = False
      print(f"  SESSION ERROR: {err}")
  for suite, cmp in comparisons.items():
    print(f"\n{suite}: {cmp['compared']} tests pass natively; under replacement "
          f"{len(cmp['expected'])} differ as documented, {len(cmp['regressions'])} regress")
    if not cmp["compared"]:
      ok = False
      print("  NOTHING COMPARED: no test passed natively")
    for test_id, row in cmp["regressions"].items():
      ok = False
      print(f"  REGRESSION {test_id}: {row['outcome']}: {_first_line(row['message'])}")
    for pattern in cmp["stale"]:
      ok = False
      print(f"  STALE expected difference {pattern}: its tests pass under replacement now; "
            "remove it from tests/jax_suite/expected_differences.py and docs/jax_suite.md")
  if not comparisons:
    print("\n(no comparison: that needs both modes of a suite)")
  print("\njax_suite:", "OK" if ok else "FAILED")
  return ok


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tag", help="vendored JAX tag under third_party/jax_tests "
                                "(default: the installed jax's)")
  ap.add_argument("--suite", nargs="+", choices=SUITES, default=list(SUITES))
  ap.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
  ap.add_argument("--select", choices=("ci", "all"), default="ci",
                  help="ci (default): all tests but those in tests/jax_suite/ci_exclude.txt; all")
  ap.add_argument("--test", action="append", metavar="ID",
                  help="run only this test id (repeatable), "
                       "e.g. pmap_test.py::PythonPmapTest::testBasic")
  ap.add_argument("--out", type=Path, default=ROOT / "build" / "jax_suite")
  ap.add_argument("--test-timeout", type=float, default=300.0,
                  help="seconds per test (default 300)")
  ap.add_argument("--deadline", type=float, default=3 * 3600.0,
                  help="seconds for the whole run (default 3 h)")
  ap.add_argument("--compare-only", action="store_true",
                  help="compare the results already in --out")
  ap.add_argument("--native", choices=("auto", "run", "baseline"), default="auto",
                  help="auto (default): native outcomes from the tag's committed baseline when its "
                       "recorded settings equal this run's, else run native; run: always run native "
                       "(the full comparison); baseline: the baseline or fail")
  ap.add_argument("--record-baseline", action="store_true",
                  help="run native and write its outcomes with the settings to --baselines/<tag>.json")
  ap.add_argument("--baselines", type=Path, default=BASELINES, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.record_baseline and (args.test or args.compare_only or "native" not in args.mode):
    ap.error("--record-baseline runs the native mode of whole suites (no --test, no --compare-only)")

  tag = args.tag or default_tag()
  out = args.out / tag
  out.mkdir(parents=True, exist_ok=True)
  exclude = HERE / "ci_exclude.txt" if args.select == "ci" and not args.test else None
  deadline = time.monotonic() + args.deadline
  results, suite_settings = {}, {}
  baseline_path = baseline.path_for(args.baselines, tag)
  for suite in args.suite:
    test_file = VENDORED / tag / f"{suite}.py"
    for mode in args.mode:
      if args.compare_only:
        results[suite, mode] = json.loads((out / f"{suite}.{mode}.json").read_text())
        continue
      only = args.test and [t for t in args.test if t.startswith(f"{suite}.py::")]
      if only == []:
        continue
      if mode == "native" and not args.record_baseline and args.native != "run":
        suite_settings[suite] = baseline.settings(
            here=HERE, test_file=test_file, exclude=exclude, test_timeout=args.test_timeout,
            env_recorded=ENV_RECORDED)
        res, why = (None, "--test runs chosen tests natively") if only else baseline.load(
            baseline_path, suite, suite_settings[suite])
        if res is not None:
          print(f"jax_suite: {tag} {suite} native: from {baseline_path.relative_to(ROOT)} "
                f"(recorded with this run's settings; --native run runs it)", flush=True)
          (out / f"{suite}.native.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
          results[suite, mode] = res
          continue
        if args.native == "baseline":
          print(f"jax_suite: {suite} native: no usable baseline: {why}")
          return 1
        print(f"jax_suite: {tag} {suite} native: running it, the baseline does not apply: {why}",
              flush=True)
      print(f"jax_suite: {tag} {suite} {mode} ...", flush=True)
      results[suite, mode] = run_suite(test_file, mode, out, only=only, exclude=exclude,
                                       test_timeout=args.test_timeout, deadline=deadline)
    if (suite, "native") in results and (suite, "replaced") in results and not args.test:
      mismatch = (baseline.check_same_tests(results[suite, "native"], results[suite, "replaced"])
                  if "baseline" in results[suite, "native"]["meta"] else "")
      if mismatch:
        results[suite, "native"]["meta"]["session_errors"].append(mismatch)
  if args.record_baseline:
    native = {suite: results[suite, "native"] for suite in args.suite}
    baseline.write(baseline_path, native, {
        suite: baseline.settings(here=HERE, test_file=VENDORED / tag / f"{suite}.py",
                                 exclude=exclude, test_timeout=args.test_timeout,
                                 env_recorded=ENV_RECORDED) for suite in args.suite})
    print(f"jax_suite: wrote {baseline_path}")
  comparisons = {}
  for suite in args.suite:
    if (suite, "native") in results and (suite, "replaced") in results:
      comparisons[suite] = compare(results[suite, "native"], results[suite, "replaced"])
  (out / "comparison.json").write_text(json.dumps(comparisons, indent=1) + "\n")
  return 0 if report(results, comparisons) else 1


if __name__ == "__main__":
  sys.exit(main())
