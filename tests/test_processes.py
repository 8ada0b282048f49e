"""FlexLink groups across jax.distributed processes on this host (tests/multiprocess/worker.py).

Each test starts a small job of 2 or 4 processes and checks what they print: every collective
against lax on groups inside and across processes, results identical over repeated calls, and a
killed process turning into an error that names it, fast, with nothing left in /dev/shm.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess", "worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _segments() -> set[str]:
  return set(glob.glob("/dev/shm/flexlink-*"))


def _start(n: int, k: int, mode: str, extra_env=None):
  """The job's processes started here, not by the launcher (which would stop the others as soon as
  one dies, before they can report what they saw)."""
  port = _free_port()
  procs = []
  for i in range(n):
    env = dict(os.environ)
    env.update(FLEXLINK_COORDINATOR=f"127.0.0.1:{port}", FLEXLINK_NUM_PROCESSES=str(n),
               FLEXLINK_PROCESS_ID=str(i), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={k}", **(extra_env or {}))
    procs.append(subprocess.Popen([sys.executable, WORKER, mode], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True))
  return procs


def _finish(procs, timeout: float):
  outs = []
  deadline = time.monotonic() + timeout
  try:
    for p in procs:
      out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
      outs.append(out)
  finally:
    for p in procs:  # never leave a process behind, whatever failed
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  return outs


def _run(n: int, k: int, mode: str, timeout: float = 240, errs: list | None = None, **env):
  """Runs the worker as a job of n processes x k devices through `python -m jax_flexlink.launch`;
  returns each rank's output lines (the launcher prefixes them with the rank); `errs`, when given,
  gets each rank's stderr lines."""
  before = _segments()
  out = subprocess.run(
      [sys.executable, "-m", "jax_flexlink.launch", "-n", str(n), "--devices-per-process", str(k),
       "--timeout", str(int(timeout)), "--", sys.executable, WORKER, mode],
      env=dict(os.environ, **env), capture_output=True, text=True, timeout=timeout + 30)
  assert out.returncode == 0, f"the job exited with {out.returncode}:\n{out.stdout[-4000:]}{out.stderr[-4000:]}"
  outs = ["\n".join(re.findall(rf"^\[{i}\] (.*)$", out.stdout, re.M)) for i in range(n)]
  if errs is not None:
    errs[:] = ["\n".join(re.findall(rf"^\[{i}\] (.*)$", out.stderr, re.M)) for i in range(n)]
  for i, text in enumerate(outs):
    assert "ALL OK" in text, f"rank {i}:\n{text[-4000:]}"
  assert _segments() <= before, "a shared-memory segment was left in /dev/shm"
  return outs


# The 2 x 4 job reduces directly from 1 MiB per device (off by default): its 8 MiB psums read the
# other process's inputs and reduced slices, and the same process's in place.
DIRECT_REDUCE = {(2, 4): "1M"}


@pytest.mark.parametrize("n,k", [(2, 1), (4, 1), (2, 4)])
def test_every_collective_against_lax(n, k):
  env = {"FLEXLINK_XPROC_DIRECT_REDUCE_BYTES": DIRECT_REDUCE[n, k]} if (n, k) in DIRECT_REDUCE else {}
  outs = _run(n, k, "collectives", **env)
  checks = int(re.search(r"ALL OK (\d+) checks", outs[0]).group(1))
  assert checks > 50
  # Every process set the cross-process groups up (the 2 x 4 job also runs in-process groups).
  assert all(re.search(r"cross-process groups set up here: [1-9]", out) for out in outs)
  # The whole job's group agreed on direct all_gather (its 1 MiB all_gathers read the peers'
  # inputs) and, where asked, all_reduce; or says why a rank could not read its peers' memory.
  for out in outs:
    (direct,) = json.loads(re.search(r"DIRECT (.*)", out).group(1))
    if direct[0] == -1:
      assert "cannot read" in direct[1] and direct[2:] == direct[:2], direct
    elif (n, k) in DIRECT_REDUCE:
      assert direct == [65536, "", 1 << 20, ""], direct
    else:
      assert direct[:2] == [65536, ""] and direct[2] == -1, direct
      assert "FLEXLINK_XPROC_DIRECT_REDUCE_BYTES is off in rank 0 " in direct[3], direct


def test_repeated_calls_identical_on_every_rank():
  outs = _run(2, 2, "plan")
  sums = {re.search(r"checksum (\S+)", out).group(1) for out in outs}
  assert len(sums) == 1, sums


@pytest.mark.parametrize("links", ["shm", "shm;tcp"])
def test_killed_process_is_named_before_the_deadline(links):
  before = _segments()
  procs = _start(2, 1, "kill", {"FLEXLINK_TIMEOUT_S": "60", "FLEXLINK_LINKS": links})
  outs = _finish(procs, 120)
  assert procs[1].returncode == -signal.SIGKILL, outs[1][-2000:]
  assert procs[0].returncode == 3, outs[0][-4000:]
  failed = re.search(r"FAILED after ([0-9.]+) s: (.*)", outs[0])
  assert failed, outs[0][-4000:]
  seconds, message = float(failed.group(1)), failed.group(2)
  assert seconds < 30, f"took {seconds} s, the deadline is 60 s"
  assert "rank 1" in message and "device 2048" in message, message
  assert "psum" in message, message
  assert _segments() <= before


def test_absent_rank_is_named_across_processes():
  """FLEXLINK_FAULTS rank:absent across processes (docs/faults.md): the process whose rank stays away
  from the second call, and the one that waited for it, both fail within the deadline, naming it."""
  before = _segments()
  procs = _start(2, 1, "absent", {"FLEXLINK_TIMEOUT_S": "3", "FLEXLINK_FAULTS": "rank:absent@rank=1,at_call=2"})
  outs = _finish(procs, 120)
  for p, out in zip(procs, outs):
    assert p.returncode == 3, out[-4000:]
  waited = re.search(r"FAILED after ([0-9.]+) s: (.*)", outs[0])
  absent = re.search(r"FAILED after ([0-9.]+) s: (.*)", outs[1])
  assert waited and absent, outs
  assert float(waited.group(1)) < 3 + 10 and float(absent.group(1)) < 1.5 * 3 + 10
  assert "rank 1" in waited.group(2) and "device 2048" in waited.group(2) and "psum" in waited.group(2), waited.group(2)
  assert "stayed away from call 2" in absent.group(2) and "injected rank:absent" in absent.group(2), absent.group(2)
  assert _segments() <= before


@pytest.mark.parametrize("fault,failed,to", [("tcp:error@at_call=2", "tcp", "shm"),
                                             ("shm:hang@at_call=2", "shm", "tcp")])
def test_link_fault_fails_over_across_processes(fault, failed, to):
  """A faulted link of a cross-process split call: every process agrees (the segment's barrier) and
  re-runs its range on the other link; exact, one failover, the link unhealthy in every process."""
  outs = _run(2, 1, "linkfault", FLEXLINK_LINKS="shm;tcp", FLEXLINK_FAULTS=fault, FLEXLINK_LINK_TIMEOUT_S="0.5")
  for out in outs:
    report = json.loads(re.search(r"^FAILOVERS (.*)$", out, re.M).group(1))
    assert report["count"] == 1 and report["to"] == [to], report
    assert report["health"][failed] == "unhealthy" and report["health"][to] == "healthy", report


def test_no_carrier_across_processes_names_every_link():
  """tcp's range fails (call 2) and so does its re-run on the segment (shm's 3rd call): with two links
  no carrier is left, so every process fails the call with each link's report (docs/faults.md,
  "Across processes"), and the group stays usable: call 3 is exact."""
  outs = _run(2, 1, "nocarrier", FLEXLINK_LINKS="shm;tcp", FLEXLINK_FAULTS="tcp:error@at_call=2;shm:error@at_call=3")
  for out in outs:
    m = re.search(r"^NOCARRIER (.*)$", out, re.M)
    assert m, out[-3000:]
    err = m.group(1)
    assert "no link could carry the bytes of call 2" in err and "across processes" in err, err
    assert "shm: " in err and "injected error at its call 3" in err, err
    assert "tcp: " in err and "injected error at its call 2" in err, err



@pytest.mark.parametrize("n,k", [(2, 1), (2, 2)])
def test_stage1_across_processes(n, k, tmp_path):
  """The first psum of the autotune size profiles shm and tcp across the processes inside the call
  (docs/xproc.md, "Stage 1 across processes"): every process ends with the same fits and measured
  threshold, and tune() of another collective returns the same in every process. The leader stores
  the fits in the tuning cache under the group's key (links, ranks and processes), and the next job
  plans from them without profiling, every process reporting them."""
  cache = tmp_path / "tune.json"
  env = {"FLEXLINK_LINKS": "shm;tcp", "FLEXLINK_TUNE_MAX_BYTES": "2M", "FLEXLINK_TUNE_CACHE": str(cache),
         "FLEXLINK_DEBUG": "INFO"}
  errs = []
  outs = _run(n, k, "stage1", errs=errs, **env)
  assert re.search(r"stage 1 for all_reduce on cross-process group .*: [0-9.]+ s, \d+ sizes", errs[0]), errs[0][-3000:]
  entries = json.loads(cache.read_text())["entries"]
  assert [(e["links"], e["ranks"], e["processes"]) for e in entries] == [("shm;tcp", n * k, n)], entries
  fits = [json.loads(re.search(r"^FITS (.*)$", out, re.M).group(1)) for out in outs]
  assert fits[0] is not None and "all_reduce" in fits[0]["fits"], outs[0][-3000:]
  assert all(f == fits[0] for f in fits), fits  # every process computed the same model
  ar = fits[0]["fits"]["all_reduce"]
  assert len(ar) == 2 and all(beta > 0 for _, beta in ar), ar
  assert fits[0]["profiled_bytes"]["all_reduce"] == 1 << 20, fits[0]  # the call's bucket
  assert "all_reduce" in fits[0]["split_min_bytes"], fits[0]
  tuned = [json.loads(re.search(r"^TUNED (.*)$", out, re.M).group(1)) for out in outs]
  assert all(t == tuned[0] for t in tuned), tuned
  assert len(tuned[0]["fits"]["all_gather"]) == 2, tuned[0]
  assert "all_gather" in tuned[0]["split_min_bytes"], tuned[0]
  assert re.search(r"^PLANS .*all_reduce", outs[0], re.M), outs[0][-3000:]

  again = _run(n, k, "stage1", errs=errs, **env)
  assert re.search(r"stage 1 for all_reduce on cross-process group .* from cache ", errs[0]), errs[0][-3000:]
  assert not re.search(r"stage 1 for all_reduce on cross-process group .*: [0-9.]+ s, \d+ sizes", errs[0]), errs[0]
  cached = [json.loads(re.search(r"^FITS (.*)$", out, re.M).group(1)) for out in again]
  # Every process reports the cached all_reduce model, and only it: the cached all_gather fits are
  # installed at all_gather's first large call, which every process then learns of alike.
  assert all(c == cached[0] for c in cached), cached
  assert list(cached[0]["fits"]) == ["all_reduce"], cached[0]
  assert cached[0]["fits"]["all_reduce"] == fits[0]["fits"]["all_reduce"], (cached[0], fits[0])
  assert cached[0]["split_min_bytes"]["all_reduce"] == fits[0]["split_min_bytes"]["all_reduce"]

def test_reconfiguring_links_across_processes_keeps_no_old_entries():
  """configure(links=...) again and again (shm;tcp, shm) with a call queued across each change: every
  result right, and each process releases its part of the cross-process group's earlier link sets
  (the tcp workers' threads; xproc::ReleaseEarlierXprocEntries), so its threads stay flat. Before,
  2 x 2 processes gained 32 threads each over 8 rounds."""
  outs = _run(2, 2, "reconfigure", FLEXLINK_LINKS="shm;tcp")  # 2 x 2: several local ranks per entry
  for out in outs:
    early, late = map(int, re.search(r"^THREADS (\d+) (\d+)$", out, re.M).groups())
    assert late <= early + 2, out[-2000:]
    # The last change's release may have kept a group a rank had not left yet (np.asarray waits for
    # one shard); the one at the end finds every rank gone.
    release = json.loads(re.search(r"^RELEASE (.*)$", out, re.M).group(1))
    assert release["kept"] == 0 and release["kept_across_processes"] == 0, release


@pytest.mark.parametrize("n,k", [(2, 1), (2, 2)])
def test_several_links_split_agreed_across_processes(n, k):
  """FLEXLINK_LINKS="shm;tcp": cross-process calls split across the segment and the tcp ring by the
  leader's plan; every rank of every process cut the same ranges at every call, and the plan moved."""
  # Stage 2 alone, from equal shares (stage 1 across processes: test_stage1_across_processes).
  outs = _run(n, k, "multilink", FLEXLINK_LINKS="shm;tcp", FLEXLINK_AUTOTUNE_MIN_BYTES="0")
  by_call = {}
  for out in outs:
    splits = json.loads(re.search(r"^SPLITS (.*)$", out, re.M).group(1))
    for call, ranks in splits.items():
      for rank, ranges in ranks.items():
        by_call.setdefault(int(call), {})[int(rank)] = tuple(map(tuple, ranges))
  assert len(by_call) >= 30
  distinct = set()
  for call, ranks in by_call.items():
    assert len(ranks) == n * k, (call, ranks)  # every rank of every process recorded the call
    assert len(set(ranks.values())) == 1, (call, ranks)  # ...and cut the same ranges
    distinct.add(next(iter(ranks.values())))
  assert len(distinct) >= 2, "stage 2 never moved the split"
  assert any(len([r for r in ranges if r[1] > r[0]]) == 2 for ranges in distinct), "tcp never carried bytes"
  for out in outs:
    groups = json.loads(re.search(r"^GROUPS (.*)$", out, re.M).group(1))
    assert len(groups) == 1 and groups[0]["links"] == ["shm", "tcp"] and groups[0]["left_out"] == [], groups
    assert groups[0]["refused_connections"] == {"tcp": 0}, groups
  assert re.search(r"^PLANS [1-9]", outs[0], re.M), outs[0][-2000:]
