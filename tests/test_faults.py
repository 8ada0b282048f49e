"""Fault injection, failover, link health and deadlines (docs/faults.md).

One test per fault kind per link (shm, tcp, emulated): results exact against lax (integers, so
bitwise), the link's health state, the failover count and a bounded run time. A hang turns into a
failover within the link's deadline, or, with no other link, into an error within the global one;
a rank that never arrives is named by the others' error. Bad fault specs are ValueErrors.

Deadlines are short here (configure(timeout_s=4, link_timeout_s=0.5)) so that every case takes a
second or less; the bounds asserted are generous (seconds) since this VM's scheduling is noisy.
"""
import time

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flexlink as flx
from jax_flexlink import _flexlink
from helpers import mesh as make_mesh

N = 8
COUNT = 1 << 18  # int32 per device: a 1 MiB call
BUCKET = 1 << 20
TIMEOUT_S = 4.0
LINK_TIMEOUT_S = 0.5
# The link under test, and the two-link set it is faulted in (the other link takes its bytes).
LINK_SETS = {
    "shm": ("shm", "shm;tcp"),
    "tcp": ("tcp", "shm;tcp"),
    "emulated": ("pcie", "shm;emulated:pcie@gbps=4"),
}
_AUTOTUNE = _flexlink.autotune_min_bytes()
_TIMEOUT = _flexlink.timeout()


@pytest.fixture(autouse=True)
def _clean():
  flx.configure(timeout_s=TIMEOUT_S, link_timeout_s=LINK_TIMEOUT_S, autotune_min_bytes=0)
  flx.reset_stats()
  yield
  flx.inject_faults("")
  _flexlink.set_health_option("probe_calls", 16)
  _flexlink.set_health_option("link_timeout_s", 10)
  flx.configure(links="shm", timeout_s=_TIMEOUT, autotune_min_bytes=_AUTOTUNE)
  flx.reset_stats()


@pytest.fixture(scope="module")
def case():
  m = make_mesh((N,), ("x",))
  fns = {mod: jax.jit(jax.shard_map(lambda v, mod=mod: mod.psum(v, "x"), mesh=m, in_specs=P("x"),
                                    out_specs=P("x"), check_vma=False)) for mod in (lax, flx)}
  x = np.random.default_rng(0).integers(-2**31, 2**31 - 1, size=(N * COUNT,), dtype=np.int32)
  x = jax.device_put(x, NamedSharding(m, P("x")))
  return fns[flx], x, np.asarray(fns[lax](x))


def configure(links, shares=(0.5, 0.5)):
  flx.configure(links=links)
  _flexlink.set_shares("all_reduce", BUCKET, list(shares), True)


def timed_calls(case, calls):
  f, x, want = case
  times = []
  for _ in range(calls):
    t = time.perf_counter()
    got = np.asarray(f(x))
    times.append(time.perf_counter() - t)
    np.testing.assert_array_equal(got, want)
  return times


def health(link):
  [h] = [h for h in flx.stats()["health"] if h["link"] == link]
  return h


@pytest.mark.parametrize("kind", ["error", "hang", "sticky"])
@pytest.mark.parametrize("which", sorted(LINK_SETS))
def test_link_fault_fails_over_exactly(case, which, kind):
  link, links = LINK_SETS[which]
  configure(links)
  timed_calls(case, 1)  # compiled, links open
  spec = {"error": f"{link}:error@at_call=2", "hang": f"{link}:hang@at_call=2",
          "sticky": f"{link}:error@at_call=2,sticky=1"}[kind]
  flx.inject_faults(spec)
  times = timed_calls(case, 4)  # the fault at the link's second call; exact every time
  s = flx.stats()
  assert s["failovers"]["count"] == 1, s["failovers"]
  [f] = s["failovers"]["recent"]
  assert f["link"] == link and f["to"] != link and f["collective"] == "all_reduce"
  assert f["group"] == "[0, 1, 2, 3, 4, 5, 6, 7]" and f["bytes"] > 0 and "injected" in f["reason"]
  h = health(link)
  assert h["state"] == "unhealthy" and h["errors"] == 1 and h["failovers"] == 1, h
  assert ("hang" if kind == "hang" else "error") in h["reason"]
  assert s["links"][link]["healthy"] is False and s["links"][link]["state"] == "unhealthy"
  # Bounded: a hang costs the link's deadline, an error almost nothing.
  assert times[1] < (LINK_TIMEOUT_S if kind == "hang" else 0) + 3, times
  if kind == "hang":
    assert times[1] >= LINK_TIMEOUT_S * 0.9, times  # it did wait for the deadline


@pytest.mark.parametrize("which", sorted(LINK_SETS))
def test_slow_link_stays_exact_without_failover(case, which):
  link, links = LINK_SETS[which]
  configure(links)
  timed_calls(case, 1)
  flx.inject_faults(f"{link}:slow@factor=3")
  times = timed_calls(case, 3)
  s = flx.stats()
  assert s["failovers"]["count"] == 0
  assert health(link)["state"] != "unhealthy" and health(link)["errors"] == 0
  assert max(times) < 3, times  # slower, never stuck


@pytest.mark.parametrize("which", sorted(LINK_SETS))
def test_single_link_call_fails_over(case, which):
  # The plan gives the faulted link everything: its one-link path (RunAlone) fails over too.
  link, links = LINK_SETS[which]
  configure(links, shares=(1.0, 0.0) if link == "shm" else (0.0, 1.0))
  timed_calls(case, 1)
  flx.inject_faults(f"{link}:error@at_call=1")
  timed_calls(case, 3)
  assert flx.stats()["failovers"]["count"] == 1
  assert health(link)["state"] == "unhealthy"
  other = [h for h in flx.stats()["health"] if h["link"] != link]
  assert other and all(h["state"] == "healthy" for h in other)


def test_probe_readmits_a_recovered_link(case):
  configure("shm;tcp")
  _flexlink.set_health_option("probe_calls", 3)
  flx.inject_faults("tcp:error@at_call=1")
  timed_calls(case, 6)  # fails at 1; excluded; probed at call 4, which succeeds
  h = health("tcp")
  assert h["state"] == "healthy" and h["probes"] == 1 and "re-admitted" in h["reason"], h
  assert flx.stats()["failovers"]["count"] == 1


def test_probe_of_a_still_broken_link_fails_over(case):
  configure("shm;tcp")
  _flexlink.set_health_option("probe_calls", 2)
  flx.inject_faults("tcp:error@at_call=1,sticky=1")
  timed_calls(case, 6)  # fails at 1, probe at 3 fails (over), next probe 4 calls later: 7
  h = health("tcp")
  assert h["state"] == "unhealthy" and h["probes"] == 1 and h["errors"] == 2, h
  assert flx.stats()["failovers"]["count"] == 2


def test_no_link_left_names_every_link(case):
  configure("shm;tcp")
  flx.inject_faults("shm:error@at_call=1,sticky=1;tcp:error@at_call=1,sticky=1")
  f, x, _ = case
  t = time.perf_counter()
  with pytest.raises(Exception, match=r"(?s)all_reduce on group \[0, 1, 2, 3, 4, 5, 6, 7\]: no link could "
                                      r"carry.*shm: .*injected error.*tcp: .*injected error"):
    np.asarray(f(x))
  assert time.perf_counter() - t < 3


@pytest.mark.parametrize("which", sorted(LINK_SETS))
def test_hang_without_another_link_is_an_error_within_the_deadline(case, which):
  link, links = LINK_SETS[which]
  flx.configure(links=links.split(";")[1] if which != "shm" else "shm", timeout_s=1.5)
  flx.inject_faults(f"{link}:hang@at_call=1")
  f, x, _ = case
  t = time.perf_counter()
  with pytest.raises(Exception, match=rf"(?s)psum.*link {link}: injected hang.*on group \[0, 1, 2, 3, 4, 5, 6, "
                                      rf"7\].*link {link}.*did not complete within its deadline"):
    np.asarray(f(x))
  assert time.perf_counter() - t < 1.5 + 3
  flx.inject_faults("")
  timed_calls(case, 1)  # nothing left blocked


@pytest.mark.parametrize("links", ["shm", "shm;tcp"])
def test_absent_rank_is_named(case, links):
  configure(links) if ";" in links else flx.configure(links=links)
  flx.configure(timeout_s=1.5)
  flx.inject_faults("rank:absent@rank=3,at_call=2")
  f, x, _ = case
  timed_calls(case, 1)
  t = time.perf_counter()
  with pytest.raises(Exception, match=r"timed out after 1.5 s waiting for rank 3 \(device 3\) to arrive"):
    np.asarray(f(x))
  assert time.perf_counter() - t < 1.5 * 1.5 + 3
  timed_calls(case, 2)  # the next calls meet again


def test_slow_link_is_degraded_with_evidence(case):
  # Stage-1 fits give the expected rate; a link 8x slower than its fit for 8 calls is degraded.
  flx.configure(links="emulated:a@gbps=1;emulated:b@gbps=1")
  assert flx.tune(collectives=["all_reduce"], max_bytes="1M", use_cache=False)["fits"]["all_reduce"]
  _flexlink.set_shares("all_reduce", BUCKET, [1.0, 0.0], True)
  timed_calls(case, 8)
  assert health("a")["state"] == "healthy", health("a")
  flx.inject_faults("a:slow@factor=8")
  timed_calls(case, 9)
  h = health("a")
  assert h["state"] == "degraded", h
  assert h["expected_bytes_per_s"] > 4 * h["observed_bytes_per_s"] > 0
  assert "over the last 8 calls" in h["reason"] and "of the profiled" in h["reason"]


def test_stage2_moves_load_off_a_slow_link(case):
  flx.configure(links="emulated:a@gbps=0.5;emulated:b@gbps=0.5")
  _flexlink.set_shares("all_reduce", BUCKET, [0.5, 0.5], False)  # a starting point stage 2 adapts
  flx.inject_faults("a:slow@factor=4")
  timed_calls(case, 16)
  [plan] = [p for p in flx.stats()["plans"] if p["collective"] == "all_reduce" and p["bucket_bytes"] == BUCKET]
  assert plan["shares"]["a"] < 0.35, plan


BAD_SPECS = [
    ("nvlink:error@at_call=1", "no link named \"nvlink\""),
    ("shm:explode@at_call=1", "unknown fault kind \"explode\""),
    ("shm:error", "error needs at_call"),
    ("shm:error@at_call=0", "at_call=\"0\""),
    ("shm:slow@factor=fast", "factor=\"fast\""),
    ("shm:hang@at_call=1,sticky=1", "unknown parameter \"sticky\""),
    ("shm:error@at_call=1;;", "part 2"),
    ("rank:absent@at_call=1", "absent needs rank"),
]


@pytest.mark.parametrize("spec,why", BAD_SPECS)
def test_bad_fault_spec_is_a_value_error(spec, why):
  with pytest.raises(ValueError, match="grammar: NAME:slow@factor=K") as e:
    flx.inject_faults(spec)
  assert why in str(e.value) and spec.rstrip(";") in str(e.value)
  assert flx.faults() == ""  # nothing was set


def test_inject_faults_sets_and_clears():
  flx.configure(faults="shm:slow@factor=2")
  assert flx.faults() == "shm:slow@factor=2"
  flx.inject_faults("")
  assert flx.faults() == ""
  with pytest.raises(ValueError, match="expected a fault spec string"):
    flx.inject_faults(3)


def test_fault_env_is_checked_at_import():
  from helpers import run_python  # noqa: PLC0415
  r = run_python("import jax_flexlink", env_extra={"FLEXLINK_FAULTS": "tcp:error@at_call=1",
                                                   "FLEXLINK_LINKS": "shm"})
  assert r.returncode != 0 and "FLEXLINK_FAULTS" in r.stderr and "no link named \"tcp\"" in r.stderr, r.stderr
