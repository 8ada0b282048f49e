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


# At jax-v0.10.2: none (docs/jax_suite.md, "Fixed"). At jax-v0.11.0 (run on jax 0.11.2): the tests
# of XLA's "replica groups v3" lowering, which assert the StableHLO of lax's own collective.
EXPECTED: list[Expected] = [
    Expected("shard_map_test.py::ShardMapTest::test_*_rgv3*",
             "by design: asserts the StableHLO form of XLA's own collective (replica_groups = "
             "#stablehlo.replica_group_mesh_axes<...>, jax 0.11's use_rgv3); under replacement the "
             "collective is FlexLink's custom call, and the test's results still match"),
]
