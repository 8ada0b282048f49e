"""Several processes playing two hosts (`python -m jax_flexlink.launch --hosts 2`): a collective over
every device runs hierarchically, and each host's FlexLink leg is a group spanning that host's
processes (tests/multiprocess/hosts_worker.py)."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess", "hosts_worker.py")


def test_two_emulated_hosts_of_two_processes():
  before = set(glob.glob("/dev/shm/flexlink-*"))
  env = dict(os.environ, FLEXLINK_TIMEOUT_S="60")
  out = subprocess.run(
      [sys.executable, "-m", "jax_flexlink.launch", "-n", "4", "--hosts", "2", "--timeout", "240", "--",
       sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  done = re.findall(r"^\[(\d)\] ALL OK (\d+) checks; in-host cross-process groups: (.*)$", out.stdout, re.M)
  assert sorted(int(r) for r, _, _ in done) == [0, 1, 2, 3], out.stdout[-4000:]
  assert all(int(c) == 12 for _, c, _ in done)
  # Processes 0, 1 are host0 and 2, 3 host1: each pair set up one group spanning its two processes.
  groups = {int(r): g for r, _, g in done}
  assert groups[0] == groups[1] and groups[2] == groups[3] and groups[0] != groups[2], groups
  assert set(glob.glob("/dev/shm/flexlink-*")) <= before
