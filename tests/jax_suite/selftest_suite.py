"""A miniature "JAX test file" for test_jax_suite.py: one test per outcome the harness must tell
apart. Under replacement, some of these break on purpose. Not a test module of this project
(run.py runs it as a suite)."""
import os
import time

import jax
import numpy as np
from absl.testing import absltest
from jax import lax
from jax.sharding import PartitionSpec as P

REPLACED = os.environ.get("JAX_SUITE_MODE") == "replaced"


def _psum_program():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  return jax.jit(jax.shard_map(lambda v: lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                               out_specs=P()))


class SelfTest(absltest.TestCase):

  def test_same(self):
    """Passes in both modes, and proves replacement was on before tracing."""
    f, x = _psum_program(), np.arange(8 * 4, dtype=np.float32)
    hlo = f.lower(x).compile().as_text()
    self.assertEqual("flexlink_all_reduce" in hlo, REPLACED)
    np.testing.assert_allclose(f(x), x.reshape(8, 4).sum(0))

  def test_native_collective(self):
    """Fails under replacement only: asserts XLA's own all-reduce in the compiled program."""
    f = jax.jit(jax.shard_map(lambda v: lax.psum(v, "x"),
                              mesh=jax.sharding.Mesh(np.array(jax.devices()), ("x",)),
                              in_specs=P("x"), out_specs=P()))
    self.assertIn("all-reduce(", f.lower(np.ones(8)).compile().as_text())

  def test_abort(self):
    if REPLACED:
      os.abort()

  def test_hang(self):
    if REPLACED:
      time.sleep(600)

  def test_fails_natively_too(self):
    self.fail("broken in both modes")

  def test_skipped(self):
    self.skipTest("skipped in both modes")

  def test_zz_after_crashes(self):
    """Runs after the abort and the hang: the harness restarted pytest."""
