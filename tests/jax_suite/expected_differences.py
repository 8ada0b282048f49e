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


# At jax-v0.10.2 none: every test that passes natively passes under replacement (docs/jax_suite.md,
# "Fixed"). Patterns of tests that exist at one tag only match nothing (and are not stale) at others.
EXPECTED: list[Expected] = [
    # jax-v0.11.0 (run on jax 0.11.2): test_all_reduce_rgv3, ..._multiple_meshes, test_all_gather_rgv3,
    # test_all_to_all_rgv3, test_reduce_scatter_rgv3_{simple,multidim_mesh,multidim_mesh_tuple_sharding}.
    Expected("shard_map_test.py::ShardMapTest::test_*_rgv3*",
             "by design: after checking the result (which passes under replacement) the test asserts that "
             "the lowered module holds XLA's collective with jax 0.11's mesh-axes replica groups "
             "(config.use_rgv3: replica_group_mesh_axes); under replacement FlexLink's custom call "
             "stands in for that collective"),
]
