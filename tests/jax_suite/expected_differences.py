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


# Empty: every test that passes natively passes under replacement (docs/jax_suite.md, "Fixed").
EXPECTED: list[Expected] = []
