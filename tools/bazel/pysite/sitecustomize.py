"""Under Bazel, `import jax_flexlink` must load the package in the runfiles, Bazel's build.

Bazel puts the runfiles on PYTHONPATH, ahead of site-packages, which is enough against a regular
`pip install .`. An editable install (`pip install -e .`, scikit-build-core) instead puts a finder
at the front of sys.meta_path that redirects `jax_flexlink` to the source tree and its own build
directory. This module, found first on PYTHONPATH by every Python process Bazel starts (and by
their subprocesses, which inherit PYTHONPATH), removes such finders for jax_flexlink only, then
runs whatever sitecustomize the interpreter would otherwise have run.
"""
import importlib.util
import os
import sys

_PACKAGE = "jax_flexlink"


def _redirects_us(finder):
    for attr in ("known_source_files", "known_wheel_files", "known_packages"):
        names = getattr(finder, attr, None)
        if names and any(n == _PACKAGE or n.startswith(_PACKAGE + ".") for n in names):
            return True
    return False


sys.meta_path[:] = [f for f in sys.meta_path if not _redirects_us(f)]


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        path = os.path.join(entry or os.curdir, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_flexlink_next_sitecustomize", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain()
