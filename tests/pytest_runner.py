"""Bazel's entry point for one pytest file: `pytest_runner.py tests/test_x.py [pytest args]`.

Runs pytest in-process with the interpreter of @flexlink_python (a virtual environment), after
making sure that `jax_flexlink` resolves to the copy in this test's runfiles (Bazel's build of
`_flexlink.so`), not to an installed one.
"""
import importlib.util
import os
import sys


def _check_jax_flexlink():
    """Fails unless jax_flexlink (and its native module) come from this test's runfiles."""
    spec = importlib.util.find_spec("jax_flexlink")  # finds, does not import (jax stays unimported)
    if spec is None or not spec.origin:
        sys.exit("pytest_runner: jax_flexlink is not importable")
    pkg_dir = os.path.dirname(os.path.abspath(spec.origin))
    # Runfiles are symlinks into the source tree: compare unresolved paths.
    root = os.path.abspath(os.environ.get("TEST_SRCDIR") or os.environ.get("RUNFILES_DIR") or ".")
    if not pkg_dir.startswith(root + os.sep):
        sys.exit("pytest_runner: jax_flexlink resolves to %s, outside Bazel's runfiles %s "
                 "(an installed copy shadows the one under test)" % (pkg_dir, root))
    native = os.path.join(pkg_dir, "_flexlink.so")
    if not os.path.exists(native):
        sys.exit("pytest_runner: %s is missing from the runfiles" % native)
    print("pytest_runner: jax_flexlink from %s (native module %s)"
          % (pkg_dir, os.path.realpath(native)), flush=True)


def main(argv):
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    # The virtual environment's bin/ first on PATH, for tests that start tools by name.
    bin_dir = os.path.dirname(sys.executable)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    _check_jax_flexlink()

    import pytest

    args = ["-p", "no:cacheprovider", "-rfEs"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append("--junitxml=" + xml)
    code = pytest.main(args + argv)
    mod = sys.modules.get("jax_flexlink._flexlink")
    if mod is not None:
        print("pytest_runner: tests used %s" % getattr(mod, "__file__", "?"), flush=True)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
