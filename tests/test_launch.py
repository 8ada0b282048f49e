"""`python -m jax_flexlink.launch`: output, exit codes, deadline, cleanup, and a real jax.distributed job.

Every launcher run here is a subprocess with a timeout; children report their pids in a directory so
that the tests can check that none is left running afterwards.
"""
import os
import platform
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jax_flexlink import launch

LAUNCH = [sys.executable, "-m", "jax_flexlink.launch"]


def run_launcher(args, timeout=120, env=None):
    return subprocess.run(LAUNCH + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout, env=env)


def script(tmp_path, body, name="prog.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def alive(pid):
    """Running (a zombie no longer runs; our container's init may be slow to reap orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_all_gone(pids, within_s=5.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for p in left:  # do not leave them to the next test either
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes left running: {left}"


def read_pids(d):
    return [int(f.read_text()) for f in d.iterdir() if f.suffix == ".pid"]


# A rank that records its pid (and its child's, if it starts one), then behaves as told by argv.
PIDS_PROG = """
    import os, subprocess, sys, time
    d, role = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["FLEXLINK_PROCESS_ID"])
    n = int(os.environ["FLEXLINK_NUM_PROCESSES"])
    def record(name, pid):  # written whole, then renamed: the test polls the directory meanwhile
        open(os.path.join(d, name + ".tmp"), "w").write(str(pid))
        os.replace(os.path.join(d, name + ".tmp"), os.path.join(d, name + ".pid"))
    record(f"rank{rank}", os.getpid())
    if rank == 0:  # a grandchild in rank 0's process group: it must not outlive the job either
        child = subprocess.Popen(["sleep", "300"])
        record("child", child.pid)
    deadline = time.monotonic() + 60
    while len([f for f in os.listdir(d) if f.endswith(".pid")]) < n + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    print(f"rank {rank} ready", flush=True)
    action = role[rank] if rank < len(role) else "sleep"
    if action == "sleep":
        time.sleep(300)
    elif action == "ok":
        sys.exit(0)
    elif action == "kill":
        os.kill(os.getpid(), 9)
    else:
        time.sleep(0.2)
        sys.exit(int(action))
"""


def test_all_ranks_succeed_with_prefixed_whole_lines(tmp_path):
    prog = script(tmp_path, """
        import os, sys
        r = os.environ["FLEXLINK_PROCESS_ID"]
        print(f"rank {r} of {os.environ['FLEXLINK_NUM_PROCESSES']} flags {os.environ['XLA_FLAGS']!r} "
              f"platforms {os.environ['JAX_PLATFORMS']} coord {os.environ['FLEXLINK_COORDINATOR']}")
        print(f"to stderr {r}", file=sys.stderr)
        for i in range(300):  # long lines, written in pieces, from all ranks at once
            sys.stdout.write(f"{r}:{i}:" + r * 3000)
            sys.stdout.write("\\n")
        sys.stdout.write(f"no newline {r}")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_foo=1 --xla_force_host_platform_device_count=8")
    res = run_launcher(["-n", "3", "--devices-per-process", "2", "--", sys.executable, prog], env=env)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    coords = set()
    for r in range(3):
        head = [ln for ln in lines if ln.startswith(f"[{r}] rank {r} of 3 ")]
        assert len(head) == 1, lines[:5]
        assert "flags '--xla_cpu_foo=1 --xla_force_host_platform_device_count=2'" in head[0]
        assert "platforms cpu" in head[0]
        coords.add(head[0].split("coord ")[1])
        assert f"[{r}] to stderr {r}" in res.stderr.splitlines()
        assert f"[{r}] no newline {r}" in lines
    assert len(coords) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", coords.pop())
    body = [ln for ln in lines if re.match(r"\[\d\] \d:\d+:", ln)]
    assert len(body) == 900
    for ln in body:  # every line whole: its prefix, its rank's text only, its full length
        m = re.fullmatch(r"\[(\d)\] (\d):(\d+):(\d{3000})", ln)
        assert m and m.group(1) == m.group(2) and set(m.group(4)) == {m.group(1)}, ln[:80]


def test_one_process(tmp_path):
    res = run_launcher(["-n", "1", "--", sys.executable, "-c",
                        "import os; print(os.environ['FLEXLINK_PROCESS_ID'], os.environ['FLEXLINK_NUM_PROCESSES'])"])
    assert res.returncode == 0, res.stderr
    assert res.stdout == "[0] 0 1\n"


def test_failing_rank_propagates_its_code_and_stops_the_rest(tmp_path):
    prog = script(tmp_path, PIDS_PROG)
    t0 = time.monotonic()
    res = run_launcher(["-n", "4", "--", sys.executable, prog, str(tmp_path), "sleep", "sleep", "7", "sleep"])
    took = time.monotonic() - t0
    assert res.returncode == 7, res.stderr
    assert "jax_flexlink.launch: rank 2 exited with code 7; stopping ranks 0, 1, 3" in res.stderr
    assert took < 60  # not the sleepers' 300 s (speed itself is not the point)
    pids = read_pids(tmp_path)
    assert len(pids) == 5  # four ranks and rank 0's child
    assert_all_gone(pids)


def test_rank_killed_by_a_signal(tmp_path):
    prog = script(tmp_path, PIDS_PROG)
    res = run_launcher(["-n", "2", "--", sys.executable, prog, str(tmp_path), "sleep", "kill"])
    assert res.returncode == 128 + 9, res.stderr
    assert "rank 1 was killed by SIGKILL; stopping ranks 0" in res.stderr
    assert_all_gone(read_pids(tmp_path))


def test_deadline_names_the_ranks_still_running(tmp_path):
    prog = script(tmp_path, PIDS_PROG)
    # 8 s: on a loaded 2-core machine three interpreters can take seconds to start; rank 0 must have
    # finished (and left its child behind) before the deadline for the message to name 1 and 2 only.
    res = run_launcher(["-n", "3", "--timeout", "8", "--", sys.executable, prog, str(tmp_path), "ok"])
    assert res.returncode == 124, res.stderr
    assert re.search(r"deadline of 8 s passed; ranks 1, 2 still running; stopping all", res.stderr)
    assert "[0] rank 0 ready" in res.stdout
    assert_all_gone(read_pids(tmp_path))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path, sig):
    prog = script(tmp_path, PIDS_PROG)
    p = subprocess.Popen(LAUNCH + ["-n", "2", "--", sys.executable, prog, str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(read_pids(tmp_path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(read_pids(tmp_path)) == 3
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    assert p.returncode == 128 + sig, err
    assert f"interrupted ({sig.name}); stopping ranks 0, 1" in err
    assert_all_gone(read_pids(tmp_path))


def test_hosts_split_ranks_into_consecutive_blocks(tmp_path):
    show = "import os; print(os.environ.get('FLEXLINK_HOST_ID'), os.environ.get('FLEXLINK_NUM_HOSTS'))"
    res = run_launcher(["-n", "4", "--hosts", "2", "--", sys.executable, "-c", show])
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] host0 2", "[1] host0 2", "[2] host1 2", "[3] host1 2"]
    # Without --hosts no rank is told it is an emulated host, whatever the launcher inherited.
    res = run_launcher(["-n", "2", "--", sys.executable, "-c", show],
                       env=dict(os.environ, FLEXLINK_HOST_ID="host7", FLEXLINK_NUM_HOSTS="9"))
    assert sorted(res.stdout.splitlines()) == ["[0] None None", "[1] None None"]


@pytest.mark.parametrize("argv, message", [
    (["-n", "0", "--", "true"], "-n must be >= 1"),
    (["-n", "2"], "no command to run"),
    (["-n", "2", "--"], "no command to run"),
    (["-n", "2", "--devices-per-process", "0", "--", "true"], "--devices-per-process must be >= 1"),
    (["-n", "2", "--gpus-per-process", "0", "--", "true"], "--gpus-per-process must be >= 1"),
    (["-n", "2", "--devices-per-process", "2", "--gpus-per-process", "1", "--", "true"],
     "--devices-per-process sets host (CPU) devices and --gpus-per-process GPUs: give one of them"),
    (["-n", "4", "--hosts", "3", "--", "true"], "--hosts 3 must be >= 1 and divide -n 4"),
    (["-n", "4", "--hosts", "0", "--", "true"], "--hosts 0 must be"),
    (["-n", "2", "--timeout", "0", "--", "true"], "--timeout must be a finite number of seconds > 0"),
    (["-n", "2", "--timeout", "inf", "--", "true"], "got inf"),
    (["-n", "2", "--timeout", "nan", "--", "true"], "got nan"),
    (["--", "true"], "required: -n"),
    (["-n", "x", "--", "true"], "invalid int value"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        launch.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err


def test_gpus_beyond_the_machine_are_a_usage_error(monkeypatch, capsys):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(SystemExit) as e:
        launch.parse(["-n", "2", "--gpus-per-process", "2", "--", "true"])
    assert e.value.code == 2
    assert "-n 2 --gpus-per-process 2 needs 4 GPUs; this machine shows 3 (CUDA_VISIBLE_DEVICES='0,1,2')" in \
        capsys.readouterr().err
    a = launch.parse(["-n", "3", "--gpus-per-process", "1", "--", "true"])
    assert (a.gpus_per_process, a.devices_per_process) == (1, None)
    assert launch.parse(["-n", "3", "--", "true"]).devices_per_process == 1
    # A GPU job whose default backend would not be CUDA (the first of JAX_PLATFORMS): refused.
    for platforms in ("cpu", "cpu,cuda"):
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        with pytest.raises(SystemExit):
            launch.parse(["-n", "1", "--gpus-per-process", "1", "--", "true"])
        assert f"JAX_PLATFORMS={platforms!r} does not make CUDA jax's default backend" in capsys.readouterr().err
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert launch.parse(["-n", "1", "--gpus-per-process", "1", "--", "true"]).gpus_per_process == 1


def test_gpu_count():
    assert launch.gpu_count({"CUDA_VISIBLE_DEVICES": "2,3"}, nvml_count=lambda: 8) == (2, "CUDA_VISIBLE_DEVICES='2,3'")
    assert launch.gpu_count({"CUDA_VISIBLE_DEVICES": ""}, nvml_count=lambda: 8)[0] == 0  # CUDA shows none
    assert launch.gpu_count({}, nvml_count=lambda: 8) == (8, "NVML")

    def no_nvml():
        raise RuntimeError("NVML not found")
    assert launch.gpu_count({}, nvml_count=no_nvml) == (None, "not counted: NVML not found")


def test_usage_error_from_the_command_line():
    res = run_launcher(["-n", "0", "--", "true"], timeout=60)
    assert res.returncode == 2 and "error: -n must be >= 1" in res.stderr


def test_missing_program_is_a_clear_failure():
    res = run_launcher(["-n", "2", "--", "/nonexistent/prog"], timeout=60)
    assert res.returncode == 1
    assert "cannot start rank 0: /nonexistent/prog" in res.stderr


def test_environment_helpers():
    assert launch.with_device_count("", 3) == "--xla_force_host_platform_device_count=3"
    assert (launch.with_device_count("--a=1 --xla_force_host_platform_device_count=8 --b", 2)
            == "--a=1 --b --xla_force_host_platform_device_count=2")
    assert [launch.host_of(r, 6, 3) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    env = launch.child_env({"JAX_PLATFORMS": "cuda", "FLEXLINK_PROCESS_ID": "5"}, 1, 2, 4, None, 1234)
    assert env["JAX_PLATFORMS"] == "cuda"  # a caller's choice stays
    assert (env["FLEXLINK_PROCESS_ID"], env["FLEXLINK_NUM_PROCESSES"], env["FLEXLINK_DEVICES_PER_PROCESS"]) == (
        "1", "2", "4")
    assert env["FLEXLINK_COORDINATOR"] == env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
    assert env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:1234"
    assert "FLEXLINK_HOST_ID" not in env
    keep = "glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432"
    assert env["GLIBC_TUNABLES"] == launch.with_malloc_tunables("") == keep
    # The caller's own settings win and stay; others are added after them.
    assert (launch.child_env({"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.trim_threshold=1"}, 0, 2, 1,
                             None, 1)["GLIBC_TUNABLES"]
            == "glibc.pthread.rseq=0:glibc.malloc.trim_threshold=1:glibc.malloc.mmap_threshold=33554432")
    assert "GLIBC_TUNABLES" not in launch.child_env({}, 0, 2, 1, None, 1, keep_freed_memory=False)
    assert launch.child_env({"GLIBC_TUNABLES": "x=1"}, 0, 2, 1, None, 1, keep_freed_memory=False)[
        "GLIBC_TUNABLES"] == "x=1"
    # A GPU job: rank 1 of K=2 drives GPUs 2 and 3; no host device count; JAX_PLATFORMS cuda unless set.
    env = launch.child_env({"XLA_FLAGS": "--a=1", "FLEXLINK_LOCAL_DEVICE_IDS": "7"}, 1, 2, 2, None, 1, gpus=True)
    assert env["FLEXLINK_LOCAL_DEVICE_IDS"] == env["JAX_LOCAL_DEVICE_IDS"] == "2,3"
    assert env["FLEXLINK_DEVICES_PER_PROCESS"] == "2"
    assert env["XLA_FLAGS"] == "--a=1" and env["JAX_PLATFORMS"] == "cuda"
    assert launch.child_env({"JAX_PLATFORMS": "cpu,cuda"}, 0, 2, 1, None, 1, gpus=True)["JAX_PLATFORMS"] == "cpu,cuda"
    # A host-device job never passes on GPU ids inherited from an outer GPU launch.
    cpu_env = launch.child_env({"FLEXLINK_LOCAL_DEVICE_IDS": "0", "JAX_LOCAL_DEVICE_IDS": "0"}, 0, 2, 1, None, 1)
    assert "FLEXLINK_LOCAL_DEVICE_IDS" not in cpu_env and "JAX_LOCAL_DEVICE_IDS" not in cpu_env


# Frees 8 MiB and allocates it again: the page faults of touching it the second time.
REUSE_PROG = '''
    import ctypes, resource
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    size = 8 << 20
    for i in range(2):
        p = libc.malloc(size)
        before = faults()
        ctypes.memset(p, 1, size)
        touched = faults() - before
        libc.free(p)
    print("pages", size // 4096, "faults", touched, flush=True)
'''


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="GLIBC_TUNABLES is glibc's")
def test_ranks_keep_freed_memory_for_reuse(tmp_path):
    """The settings take effect in the ranks: an 8 MiB block freed and allocated again is the same memory,
    resident (glibc's defaults unmap it at the free, and the next one faults every page in again)."""
    prog = script(tmp_path, REUSE_PROG)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    counts = {}
    for flag in ("--keep-freed-memory", "--no-keep-freed-memory"):
        res = run_launcher(["-n", "1", flag, "--", sys.executable, prog], timeout=60, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        m = re.search(r"pages (\d+) faults (\d+)", res.stdout)
        assert m, res.stdout
        counts[flag] = int(m.group(2)), int(m.group(1))
    faults, pages = counts["--keep-freed-memory"]
    assert faults < pages // 16, counts
    faults, pages = counts["--no-keep-freed-memory"]
    assert faults > pages // 2, counts


def test_initialize_outside_the_launcher_says_how_to_start(monkeypatch):
    monkeypatch.delenv("FLEXLINK_COORDINATOR", raising=False)
    with pytest.raises(RuntimeError, match=r"FLEXLINK_COORDINATOR.*not set.*python -m jax_flexlink.launch -n N"):
        launch.initialize()


def test_initialize_gives_jax_the_ranks_gpus(monkeypatch):
    """FLEXLINK_LOCAL_DEVICE_IDS (a --gpus-per-process job) reaches jax.distributed.initialize as
    local_device_ids; a caller's own local_device_ids win; malformed ids are refused before jax."""
    import jax
    got = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: got.append((a, kw)))
    monkeypatch.setenv("FLEXLINK_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("FLEXLINK_NUM_PROCESSES", "2")
    monkeypatch.setenv("FLEXLINK_PROCESS_ID", "1")
    monkeypatch.setenv("FLEXLINK_LOCAL_DEVICE_IDS", "2,3")
    assert launch.initialize() == (1, 2)
    assert got[-1] == (("127.0.0.1:1234",), {"num_processes": 2, "process_id": 1, "local_device_ids": [2, 3],
                                             "cluster_detection_method": "deactivate"})
    launch.initialize(local_device_ids=[5])
    assert got[-1][1]["local_device_ids"] == [5]
    monkeypatch.delenv("FLEXLINK_LOCAL_DEVICE_IDS")
    launch.initialize()
    assert "local_device_ids" not in got[-1][1]
    for bad in ("2;3", "a", "2,", "-1"):
        monkeypatch.setenv("FLEXLINK_LOCAL_DEVICE_IDS", bad)
        with pytest.raises(RuntimeError, match="FLEXLINK_LOCAL_DEVICE_IDS must be GPU numbers"):
            launch.initialize()
    assert len(got) == 3


def test_gpu_job_environment_through_the_launcher(tmp_path):
    """--gpus-per-process on this GPU-less machine (CUDA_VISIBLE_DEVICES stands for the count): each
    rank gets its GPUs and JAX_PLATFORMS=cuda, and no host device count."""
    prog = script(tmp_path, """
        import os
        print(os.environ["FLEXLINK_LOCAL_DEVICE_IDS"], os.environ["JAX_PLATFORMS"],
              "force" in os.environ.get("XLA_FLAGS", ""), flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["CUDA_VISIBLE_DEVICES"] = "0,1,2,3"
    res = run_launcher(["-n", "2", "--gpus-per-process", "2", "--", sys.executable, prog], timeout=60, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] 0,1 cuda False", "[1] 2,3 cuda False"]



GPU_PROCESSES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess", "gpu_processes.py")


def test_gpu_processes_program_on_host_devices():
    """tests/multiprocess/gpu_processes.py's own expectations (numpy's results for every collective),
    on 2 processes of one host device each through FlexLink's CPU links: what the GPU checks below
    compare against is right."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "FLEXLINK_LINKS")}
    res = run_launcher(["-n", "2", "--timeout", "200", "--", sys.executable, GPU_PROCESSES, "--cpu"], timeout=240,
                       env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    assert sum("ALL OK 45 checks" in ln for ln in lines) == 2, res.stdout[-4000:]
    assert sum(ln.endswith("ok bfloat16: psum, pmax, pmin, all_gather, psum_scatter, ppermute, all_to_all")
               for ln in lines) == 2, res.stdout[-4000:]
    bad = run_launcher(["-n", "1", "--", sys.executable, GPU_PROCESSES, "--bogus"], timeout=60, env=env)
    assert bad.returncode == 1 and "usage: gpu_processes.py --shared|--reversed|--cpu" in bad.stderr


def _gpu_job(args, mode):
    from jax_flexlink._src import native
    if native.cuda_module() is None:
        pytest.skip("this jax_flexlink was built without the CUDA module (FLEXLINK_CUDA=ON)")
    env = {k: v for k, v in os.environ.items() if k != "FLEXLINK_LINKS"}
    env.update(JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    res = run_launcher(["-n", "2", *args, "--timeout", "150", "--", sys.executable, GPU_PROCESSES, mode],
                       timeout=180, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert sum("ALL OK 45 checks" in ln for ln in res.stdout.splitlines()) == 2, res.stdout[-4000:]


@pytest.mark.gpu
def test_processes_share_one_gpu(gpus):
    """What one GPU can check of FlexLink's GPU groups across processes: 2 processes both on GPU 0,
    every collective in 6 dtypes and a 16 MiB psum through the pcie link across processes (staging
    through the shared segment, registered with cudaHostRegister, ordered by stream memory
    operations), against numpy (NCCL, and so XLA's collectives, refuse two ranks on one GPU)."""
    _gpu_job([], "--shared")


@pytest.mark.gpu
def test_processes_on_gpus_in_reverse(gpus):
    """2+ GPUs: 2 processes of one GPU each (--gpus-per-process 1), rank i on GPU 1-i, every
    collective through nccl;pcie across processes against numpy. Rank 0 runs GPU 1 (CUDA ordinal 1)
    as jax's device 0 and rank 1 GPU 0 as device 1, so a wrong ordinal -> id map fails the job
    (docs/cuda.md, "Device ids")."""
    if len(gpus) < 2:
        pytest.skip(f"needs 2 or more GPUs, this machine has {len(gpus)}")
    _gpu_job(["--gpus-per-process", "1"], "--reversed")


JAX_JOB = """
    import numpy as np
    import jax_flexlink.launch
    rank, n = jax_flexlink.launch.initialize(initialization_timeout=60)
    import jax
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    K = 2
    assert jax.process_count() == n == 2 and jax.process_index() == rank, (jax.process_count(), rank)
    local = jax.local_devices()
    assert len(local) == K and all(d.process_index == rank for d in local), local
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    assert len(devices) == n * K
    mesh = Mesh(np.array(devices), ("x",))
    m = 1000
    glob = np.stack([np.arange(m, dtype=np.float32) * (i + 1) for i in range(n * K)])  # device i: its row
    sharding = NamedSharding(mesh, P("x"))
    x = jax.make_array_from_callback((n * K * m,), sharding, lambda idx: glob.reshape(-1)[idx])
    f = jax.jit(jax.shard_map(lambda v: lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    y = f(x)
    want = glob.sum(axis=0)
    for s in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), want)
    print(f"psum ok on {[d.id for d in local]} of {len(devices)}", flush=True)
"""


def test_real_two_process_jax_job(tmp_path):
    prog = script(tmp_path, JAX_JOB)
    res = run_launcher(["-n", "2", "--devices-per-process", "2", "--timeout", "240", "--",
                        sys.executable, prog], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    oks = sorted(ln for ln in res.stdout.splitlines() if "psum ok" in ln)
    assert len(oks) == 2 and oks[0].startswith("[0] psum ok") and oks[1].startswith("[1] psum ok")
    assert all(ln.endswith("of 4") for ln in oks)
