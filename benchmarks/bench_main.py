"""`bazel run //benchmarks:bench -- ARGS` == `python -m jax_flexlink.bench ARGS` on Bazel's build.

Relative paths in ARGS (--json out.json, --plot out.png) are taken from the directory bazel run
was called from, not from the runfiles.
"""
import os
import runpy
import sys

if __name__ == "__main__":
    cwd = os.environ.get("BUILD_WORKING_DIRECTORY")
    if cwd:
        os.chdir(cwd)
    sys.argv[0] = "python -m jax_flexlink.bench"
    runpy.run_module("jax_flexlink.bench", run_name="__main__", alter_sys=True)
