"""Run by python_configure.bzl with the chosen interpreter: prints what the build needs as JSON."""
import json
import os
import sys
import sysconfig

out = {
    "executable": sys.executable,
    "version": "%d.%d" % sys.version_info[:2],
    "prefix": sys.prefix,
    "include": sysconfig.get_paths()["include"],
    "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
}
errors = []
try:
    import nanobind

    out["nanobind"] = os.path.dirname(os.path.abspath(nanobind.__file__))
    out["nanobind_version"] = nanobind.__version__
except ImportError as e:
    errors.append("nanobind: %s" % e)
try:
    import jax.ffi

    out["xla_ffi_include"] = jax.ffi.include_dir()
    out["jax_version"] = jax.__version__
except ImportError as e:
    errors.append("jax: %s" % e)
# Optional: NCCL's header from the nvidia-nccl-cu13 wheel, for //xla_ffi:cuda_runtime_nvcc (the CUDA
# sources compiled by nvcc, bazel build --config=cuda); "" when the wheel is not installed.
out["nccl_include"] = ""
try:
    import nvidia.nccl

    for base in nvidia.nccl.__path__:
        if os.path.exists(os.path.join(base, "include", "nccl.h")):
            out["nccl_include"] = os.path.join(base, "include")
except ImportError:
    pass
out["errors"] = errors
print(json.dumps(out))
