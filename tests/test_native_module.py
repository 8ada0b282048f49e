"""FLEXLINK_MODULE: the CPU module _flexlink loaded from a path (a sanitizer build's,
docs/sanitizers.md) instead of the package's own, and a clear error when the path is wrong."""
import os
import shutil

from helpers import run_python

_WHICH = """
    import sys
    import jax_flexlink as flx
    from jax_flexlink import _flexlink
    from jax_flexlink._src import native
    assert sys.modules["jax_flexlink._flexlink"] is _flexlink is native._flexlink
    print(_flexlink.__file__)
"""


def _own_module_path():
    res = run_python(_WHICH, env_remove=("FLEXLINK_MODULE",))
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_module_from_a_path_is_the_one_every_import_gets(tmp_path):
    own = _own_module_path()
    copy = tmp_path / os.path.basename(own)
    shutil.copy(own, copy)
    res = run_python(_WHICH + """
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((8,), ("x",))
    f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    x = jax.device_put(np.arange(8.0), jax.sharding.NamedSharding(mesh, P("x")))
    np.testing.assert_array_equal(f(x), [28.0])
    assert flx.stats()["links"]["shm"]["calls"] > 0
    """, env_extra={"FLEXLINK_MODULE": str(copy)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(copy)


def test_module_path_that_is_no_file_is_an_import_error_naming_it(tmp_path):
    missing = tmp_path / "_flexlink.so"
    res = run_python("import jax_flexlink", env_extra={"FLEXLINK_MODULE": str(missing)})
    assert res.returncode != 0
    assert f"ImportError: FLEXLINK_MODULE='{missing}': no such file" in res.stderr, res.stderr
