"""Committed native baselines of JAX's suites (tests/jax_suite/baselines/<tag>.json).

A native run executes no FlexLink code (the plugin imports jax_flexlink only under replacement), so
which of JAX's tests pass natively depends only on what is recorded here: the jax/jaxlib (and the
other packages the tests import) versions, the Python, the vendored test files, the harness files
that decide how they run (plugin, pytest.ini, the selection), the per-test deadline and the
environment variables run.py records. When every one of them is equal, a baseline stands in for the
native run; when any differs, run.py runs natively and says which setting differed.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path

FORMAT = "jax_flexlink.jax_suite_baseline"
VERSION = 1
# Distributions JAX's suites import (directly or through jax's test_util) besides the standard library.
PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes", "scipy", "opt_einsum", "absl-py", "pytest")


def _sha256(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def settings(*, here: Path, test_file: Path, exclude: Path | None, test_timeout: float,
             env_recorded: tuple[str, ...]) -> dict:
  """Everything a native run's outcomes depend on, for one suite."""
  return {
      "python": platform.python_version(),
      "packages": {d: _version(d) for d in PACKAGES},
      "tag": test_file.parent.name,
      "suite_sha256": _sha256(test_file),
      "plugin_sha256": _sha256(here / "jax_suite_plugin.py"),
      "pytest_ini_sha256": _sha256(here / "pytest.ini"),
      "exclude_sha256": _sha256(exclude) if exclude is not None else None,
      "test_timeout_s": test_timeout,
      "env": {k: v for k, v in sorted(os.environ.items()) if k in env_recorded},
  }


def path_for(baselines: Path, tag: str) -> Path:
  return baselines / f"{tag}.json"


def write(path: Path, native_results: dict[str, dict], suite_settings: dict[str, dict]) -> None:
  """Records the native results of each suite (outcome per test id) with its settings."""
  doc = {"format": FORMAT, "version": VERSION, "suites": {}}
  for suite, res in sorted(native_results.items()):
    m = res["meta"]
    if m["session_errors"]:
      raise ValueError(f"{suite}: a native run with session errors is no baseline: {m['session_errors']}")
    doc["suites"][suite] = {
        "settings": suite_settings[suite],
        "recorded": {"counts": m["counts"], "wall_s": m["wall_s"]},
        "tests": {t: rec["outcome"] for t, rec in sorted(res["tests"].items())},
    }
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _differences(want: dict, have: dict, prefix: str = "") -> list[str]:
  out = []
  for k in sorted(set(want) | set(have)):
    a, b = want.get(k), have.get(k)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _differences(a, b, f"{prefix}{k}.")
    elif a != b:
      out.append(f"{prefix}{k}: baseline {a!r}, here {b!r}")
  return out


def load(path: Path, suite: str, current: dict) -> tuple[dict | None, str]:
  """(native results in run.py's shape, "") when the baseline of `suite` was recorded with exactly
  `current` settings; else (None, why not)."""
  if not path.exists():
    return None, f"no baseline {path}"
  try:
    doc = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    return None, f"baseline {path} unreadable: {e}"
  if doc.get("format") != FORMAT or doc.get("version") != VERSION:
    return None, f"baseline {path}: not a version-{VERSION} {FORMAT} file"
  entry = doc.get("suites", {}).get(suite)
  if entry is None:
    return None, f"baseline {path} has no {suite}"
  diff = _differences(entry["settings"], current)
  if diff:
    return None, f"baseline {path} recorded with other settings: " + "; ".join(diff)
  tests = {t: {"outcome": o, "message": "", "duration": None, "flexlink_calls": None}
           for t, o in entry["tests"].items()}
  meta = {"suite": suite, "tag": current["tag"], "mode": "native", "baseline": str(path),
          "jax": current["packages"]["jax"], "jax_flexlink": None, "env": current["env"],
          "wall_s": 0.0, "pytest_runs": 0, "session_errors": [], "counts": entry["recorded"]["counts"],
          "recorded_wall_s": entry["recorded"]["wall_s"]}
  return {"meta": meta, "tests": tests}, ""


def check_same_tests(native: dict, replaced: dict) -> str:
  """A baseline must list exactly the tests the replaced run collected; "" or the difference."""
  a, b = set(native["tests"]), set(replaced["tests"])
  if a == b:
    return ""
  only_b, only_a = sorted(b - a), sorted(a - b)
  return (f"the baseline {native['meta'].get('baseline')} does not match the tests collected: "
          f"{len(only_b)} collected and not in it (e.g. {only_b[:2]}), {len(only_a)} in it and not "
          f"collected (e.g. {only_a[:2]}); record it again (run.py --record-baseline)")
