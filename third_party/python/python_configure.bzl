"""@flexlink_python: headers, nanobind sources and a Python toolchain from one local interpreter.

The interpreter is $FLEXLINK_PYTHON when set (an absolute path, or a name looked up on PATH),
else `python3` on PATH. Pass it as `FLEXLINK_PYTHON=... bazel ...`, or
`bazel ... --repo_env=FLEXLINK_PYTHON=...`; `--action_env=FLEXLINK_PYTHON=...` works too in
Bazel 4.2.3. The repository is re-made when FLEXLINK_PYTHON or PATH changes. A virtual
environment's interpreter is used by its own path (never resolved through its symlink), so its
site-packages stay visible.
"""

def _fail(msg):
    fail("\n@flexlink_python: %s\nSet FLEXLINK_PYTHON to a Python that has jax and nanobind " % msg +
         "installed (docs/bazel.md), e.g. FLEXLINK_PYTHON=$PWD/venv/bin/python bazel test //tests/...")

def _find_python(rctx):
    name = rctx.os.environ.get("FLEXLINK_PYTHON", "").strip() or "python3"
    if name.startswith("/"):
        path = rctx.path(name)
        if not path.exists:
            _fail("FLEXLINK_PYTHON=%s does not exist" % name)
        return str(path)
    if "/" in name:
        # Relative to the workspace, e.g. FLEXLINK_PYTHON=venv/bin/python.
        path = rctx.path(str(rctx.path(Label("//:WORKSPACE")).dirname) + "/" + name)
        if not path.exists:
            _fail("FLEXLINK_PYTHON=%s does not exist (relative paths are taken from the workspace root)" % name)
        return str(path)
    found = rctx.which(name)
    if not found:
        _fail("no `%s` on PATH" % name)
    return str(found)

def _python_configure_impl(rctx):
    python = _find_python(rctx)
    res = rctx.execute([python, "-I", str(rctx.path(rctx.attr._probe))], quiet = True)
    if res.return_code != 0:
        _fail("%s failed to run the probe:\n%s%s" % (python, res.stdout, res.stderr))
    info = json.decode(res.stdout)
    if info["errors"]:
        _fail("%s lacks: %s" % (python, "; ".join(info["errors"])))

    nb = info["nanobind"]
    rctx.symlink(nb + "/include", "nanobind/include")
    rctx.symlink(nb + "/src", "nanobind/src")
    rctx.symlink(nb + "/ext/robin_map/include", "nanobind/robin_map/include")
    rctx.symlink(info["include"], "python/include")
    rctx.symlink(info["xla_ffi_include"], "xla_ffi/include")
    if info.get("nccl_include"):
        rctx.symlink(info["nccl_include"], "nccl/include")
    else:
        rctx.file("nccl/include/MISSING", "no nvidia-nccl-cu13 wheel in %s\n" % python)

    bin_dir = python.rpartition("/")[0]
    rctx.template("BUILD.bazel", rctx.attr._build_tpl, {
        "%{python}": python,
    })
    rctx.file("defs.bzl", "\n".join([
        '"""Facts about the interpreter @flexlink_python was made from."""',
        "PYTHON = %r" % python,
        "PYTHON_BIN_DIR = %r" % bin_dir,
        "PYTHON_VERSION = %r" % info["version"],
        "EXT_SUFFIX = %r" % info["ext_suffix"],
        "JAX_VERSION = %r" % info["jax_version"],
        "NANOBIND_VERSION = %r" % info["nanobind_version"],
        "",
    ]))

python_configure = repository_rule(
    implementation = _python_configure_impl,
    environ = ["FLEXLINK_PYTHON", "PATH"],
    configure = True,
    local = True,
    attrs = {
        "_probe": attr.label(default = Label("//third_party/python:probe.py")),
        "_build_tpl": attr.label(default = Label("//third_party/python:BUILD.tpl")),
    },
)
