"""JAX tests that pass natively and are expected not to pass under replacement, with the reason.

`pattern` is an fnmatch pattern over pytest node ids relative to the vendored tag's directory
(`shard_map_test.py::ShardMapTest::test_name`). run.py fails on any other difference, and on an
entry none of whose tests differ any more (so the list never outlives its reason: a fix removes its
entry). Two kinds: "by design" (the test asserts something replacement changes on purpose) and
"bug Gn" (a FlexLink defect; Gn is its group in docs/jax_suite.md, which says what to fix). Keep
docs/jax_suite.md's table in step.
"""
from typing import NamedTuple


class Expected(NamedTuple):
  pattern: str
  reason: str


_NAME = ("by design: asserts the primitive name in a jaxpr ('psum_invariant'); under replacement "
         "the equation is flexlink_all_reduce[lax_prim=psum_invariant]")

EXPECTED: list[Expected] = [
    Expected("shard_map_test.py::ShardMapTest::test_fanout_specs_transpose_to_psum", _NAME),
    Expected("shard_map_test.py::ShardMapTest::test_psum_with_implicit_fanout_self_transposes",
             _NAME),
    Expected("shard_map_test.py::ShardMapTest::test_rewrite_scan", _NAME),
    Expected("pmap_test.py::VmapPmapCollectivesTest::testCollectivesWithVmap*",
             "bug G1: psum/pmean/pmax/pmin over jax.vmap axes only, run eagerly (not under jit), "
             "reach flexlink_all_reduce's impl, which raises NotImplementedError"),
    Expected("shard_map_test.py::ShardMapTest::test_vmap_shmap_psum",
             "bug G2: shard_map manual over a subset of an Explicit-axis mesh (here made by vmap "
             "over an array sharded on the other axis): FlexLink's custom call in a partially "
             "manual computation aborts XLA (shape.h CHECK), the process dies"),
]
