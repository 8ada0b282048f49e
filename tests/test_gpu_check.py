"""benchmarks/gpu_check.sh's control flow on this GPU-less machine: it parses, creates OUTDIR, says
clearly that there is no GPU, and, on a faked GPU machine (a stand-in python3 and cmake that answer
as a 2-GPU machine would), records every step, goes on after failures, keeps to its time budget and
writes summary.md (benchmarks/gpu_check_summary.py)."""
import json
import os
import re
import stat
import subprocess
import sys
import time

import pytest

import topology_fakes as tf
from jax_flexlink import topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")

FAKE_PYTHON = r"""#!/usr/bin/env bash
# python3 of a faked GPU machine: answers gpu_check.sh's commands, hands everything else to Python.
if [ "$1" = "-m" ]; then
  case "$2" in
    pip) echo "fake pip $*"; exit "${FAKE_BUILD_RC:-0}" ;;
    jax_flexlink.topology) shift 2; exec "$REAL_PYTHON" "$REPO/jax_flexlink/topology.py" --load "$FAKE_TOPO" "$@" ;;
    pytest)
      for a in "$@"; do case "$a" in --junitxml=*) cp "$FAKE_JUNIT" "${a#--junitxml=}" ;; esac; done
      echo "3 passed, 1 skipped in 0.50s"; exit "${FAKE_PYTEST_RC:-0}" ;;
    jax_flexlink.launch)
      echo "fake launch $*"; echo "[0] ALL OK 45 checks; links: fake"; echo "[1] ALL OK 45 checks; links: fake"
      exit "${FAKE_LAUNCH_RC:-0}" ;;
    jax_flexlink.bench)
      prev=""; for a in "$@"; do [ "$prev" = "--json" ] && cp "$FAKE_BENCH" "$a"; prev=$a; done
      echo "# Out of bounds values : 0 OK"; exit "${FAKE_BENCH_RC:-0}" ;;
  esac
fi
if [ "$1" = "-c" ] && [ -n "${FAKE_GPUS:-}" ]; then
  echo "jax 0.11.2: $FAKE_GPUS GPU(s): 0:NVIDIA H100 80GB HBM3"; echo "GPUS=$FAKE_GPUS"; exit 0
fi
exec "$REAL_PYTHON" "$@"
"""

BENCH = {
    "schema": "jax_flexlink.bench/1", "command": "python -m jax_flexlink.bench --scenario gpu", "devices": 8,
    "links": "nccl;pcie", "versions": {"jax": "0.11.2"}, "summary": {"out_of_bounds": 0, "ok": True},
    "rows": [
        {"collective": "all_reduce", "op": "sum", "dtype": "float", "inplace": False, "bytes": 4096,
         "time_us": 30.0, "baseline_time_us": 25.0, "busbw_gbps": 0.24, "baseline_busbw_gbps": 0.29,
         "speedup": 0.83, "wrong": 0, "shares": {"nccl": 1.0}},
        {"collective": "all_reduce", "op": "sum", "dtype": "float", "inplace": False, "bytes": 268435456,
         "time_us": 1100.0, "baseline_time_us": 1300.0, "busbw_gbps": 427.0, "baseline_busbw_gbps": 361.3,
         "speedup": 1.18, "wrong": 0, "shares": {"nccl": 0.88, "pcie": 0.12}},
    ]}

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_gpu" name="test_topology_sees_jax_gpus" time="0.1"/>
<testcase classname="tests.test_gpu" name="test_lax_collectives_on_the_gpus" time="0.1"/>
<testcase classname="tests.test_gpu" name="test_one_gpu_is_nothing_to_do" time="0.1"/>
<testcase classname="tests.test_gpu" name="test_a_build_without_the_cuda_module" time="0.0">
<skipped type="pytest.skip" message="this build has the CUDA module">skip</skipped></testcase>
</testsuite></testsuites>"""


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def machine(tmp_path):
    """A faked 2-GPU machine: env for gpu_check.sh, and its C++ test directory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "cmake", "#!/bin/sh\necho \"fake cmake $*\"\n")
    py = _executable(tmp_path / "python3", FAKE_PYTHON)
    fake = tf.h100()
    topo_path = tmp_path / "topology.json"
    topo_path.write_text(topology.dumps(topology.discover(nvml=tf.FakeNvml(fake),
                                                          sysfs=tf.build_sysfs(str(tmp_path / "sys"), fake))))
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    (tmp_path / "junit.xml").write_text(JUNIT)
    tests_dir = tmp_path / "cpp"
    tests_dir.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GPU_CHECK_PYTHON=py,
               REAL_PYTHON=sys.executable, REPO=ROOT, FAKE_TOPO=str(topo_path), FAKE_BENCH=str(tmp_path / "bench.json"),
               FAKE_JUNIT=str(tmp_path / "junit.xml"), FAKE_GPUS="2", GPU_CHECK_BUILD_DIR=str(tests_dir))
    return env, tests_dir


def _run(args, env=None, timeout=300):
    t0 = time.monotonic()
    res = subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=timeout)
    res.seconds = time.monotonic() - t0
    return res


def _steps(out):
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    return {r[0]: {"result": r[1], "rc": r[3], "log": r[4], "note": r[5]} for r in rows}


def test_parses():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


@pytest.mark.parametrize("args", [[], ["--bogus", "x"], ["a", "b"]])
def test_usage_errors(args):
    res = _run(args)
    assert res.returncode == 2 and "usage:" in res.stderr


def test_help():
    res = _run(["--help"])
    assert res.returncode == 0 and "GPU_CHECK_BUDGET_S" in res.stdout and "set -uo" not in res.stdout


def test_dry_run_creates_outdir_and_runs_nothing(tmp_path):
    out = tmp_path / "a" / "b"
    res = _run([str(out), "--dry-run"])
    assert res.returncode == 0, res.stdout + res.stderr
    steps = _steps(out)
    assert list(steps) == ["environment", "build", "cpp-build", "topology", "gpus", "pytest", "cpp",
                           "gpu_host_bench", "bench", "processes", "processes-gpus", "dry-run"]
    assert all(s["result"] == "DRY" for name, s in steps.items() if name != "dry-run")
    assert "cmake.define.FLEXLINK_CUDA=ON" in steps["build"]["note"] and "--no-build-isolation" in steps["build"]["note"]
    assert "-m jax_flexlink.topology" in steps["topology"]["note"]
    assert "-m pytest -q -m gpu" in steps["pytest"]["note"]
    # The cross-process GPU jobs run as steps of their own, last, and the pytest step leaves their tests out.
    pytest_line = next(ln for ln in res.stdout.splitlines() if ln.startswith("DRY-RUN pytest "))
    assert ("--deselect tests/test_launch.py::test_processes_share_one_gpu "
            "--deselect tests/test_launch.py::test_processes_on_gpus_in_reverse tests") in pytest_line, pytest_line
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("DRY-RUN processes "))
    assert line.endswith("-m jax_flexlink.launch -n 2 --timeout 60 -- python3 tests/multiprocess/gpu_processes.py "
                         "--shared"), line
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("DRY-RUN processes-gpus "))
    assert line.endswith("-m jax_flexlink.launch -n 2 --timeout 60 --gpus-per-process 1 -- python3 "
                         "tests/multiprocess/gpu_processes.py --reversed"), line
    # The bench splits over both GPU links (the balancer's claim), not nccl alone (the GPU default).
    assert "jax_flexlink.bench --scenario gpu --links nccl;pcie" in steps["bench"]["note"], steps["bench"]
    assert "--target cuda_ranks_test cuda_pcie_bench gpu_host_bench" in steps["cpp-build"]["note"], steps["cpp-build"]
    assert "gpu_host_bench --ranks 2,8 --calls 20000 --reps 3" in steps["gpu_host_bench"]["note"]
    assert (out / "summary.md").read_text().startswith("# gpu_check summary")
    assert not (out / "topology.json").exists()


def test_no_gpu_on_this_machine(tmp_path):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    out = tmp_path / "out"
    # An empty C++ build directory: the checkout's own (build/gpu-check-tests) holds binaries once
    # gpu_check.sh has built there, and the cpp step's note then counts them.
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable, GPU_CHECK_BUILD_DIR=str(tmp_path / "cpp"))
    env.pop("JAX_PLATFORMS", None)
    res = _run([str(out), "--skip-build"], env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    steps = _steps(out)
    assert steps["environment"]["result"] == "PASS" and steps["build"]["result"] == "SKIP"
    assert steps["topology"]["result"] == "FAIL"
    assert steps["topology"]["note"].startswith("jax_flexlink.topology: no NVIDIA GPU visible: NVML not found")
    assert steps["gpus"]["result"] == "FAIL" and steps["gpus"]["note"].startswith("jax sees no GPU: ")
    assert steps["pytest"] == {"result": "SKIP", "rc": "", "log": "", "note": "no GPU visible to jax (see gpus)"}
    assert steps["cpp"]["result"] == "SKIP" and "no CUDA C++ test binary" in steps["cpp"]["note"]
    assert steps["gpu_host_bench"]["result"] == "SKIP" and "cpp-build makes it" in steps["gpu_host_bench"]["note"]
    assert steps["bench"]["result"] == "SKIP"
    assert steps["processes"]["note"] == steps["processes-gpus"]["note"] == "no GPU visible to jax"
    doc = json.loads((out / "topology.json").read_text())
    assert doc["format"] == "jax_flexlink.topology" and doc["gpus"] == []
    summary = (out / "summary.md").read_text()
    assert "**FAILED**: topology, gpus." in summary and "No GPU through NVML: NVML not found" in summary
    assert "Traceback" not in res.stdout + res.stderr
    assert "gpu_check: FAILED" in res.stdout


def test_faked_gpu_machine_passes(tmp_path, machine):
    env, tests_dir = machine
    _executable(tests_dir / "cuda_ranks_test", "#!/bin/sh\necho 'cuda_ranks_test: 96 checks, all passed'\n")
    _executable(tests_dir / "cuda_pcie_bench", "#!/bin/sh\necho 'd2h 52.1 GB/s (pinned memcpy 55.0)'\n")
    # gpu_host_bench's layout (tests/cpp/gpu_host_bench.cc), and its arguments echoed.
    _executable(tests_dir / "gpu_host_bench",
                "#!/bin/sh\necho \"args: $*\"\necho 'ranks  links        us/call       min       max'\n"
                "echo '    2  nccl            2.90      2.85      3.04'\necho '    2  pcie            5.68      5.20      6.75'\n"
                "echo '    8  nccl            4.10      4.00      4.50'\n")
    out = tmp_path / "out"
    res = _run([str(out)], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    steps = _steps(out)
    assert {k: v["result"] for k, v in steps.items()} == {
        "environment": "PASS", "build": "PASS", "cpp-build": "PASS", "topology": "PASS", "gpus": "PASS",
        "pytest": "PASS", "cuda_ranks_test": "PASS", "cuda_pcie_bench": "PASS", "gpu_host_bench": "PASS",
        "bench": "PASS", "processes": "PASS", "processes-gpus": "PASS"}
    assert steps["processes"]["note"] == "2 of 2 processes: [0] ALL OK 45 checks; links: fake", steps["processes"]
    assert "fake launch -m jax_flexlink.launch -n 2 --timeout 60 --gpus-per-process 1 --" in \
        (out / "processes-gpus.log").read_text()
    assert steps["gpu_host_bench"]["note"] == "2 ranks, 4 KiB, us per call: nccl 2.90, pcie 5.68", steps["gpu_host_bench"]
    assert "args: --ranks 2,8 --calls 20000 --reps 3" in (out / "cpp_gpu_host_bench.log").read_text()
    assert "fake pip -m pip install --no-build-isolation --no-deps -v -e . -C cmake.define.FLEXLINK_CUDA=ON" in \
        (out / "build.log").read_text()
    assert "-DFLEXLINK_CUDA=ON -DFLEXLINK_BUILD_TESTS=ON" in (out / "cpp_build.log").read_text()
    assert topology.load(str(out / "topology.json")).gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert steps["gpus"]["note"] == "jax 0.11.2: 2 GPU(s): 0:NVIDIA H100 80GB HBM3"
    summary = (out / "summary.md").read_text()
    assert "every step passed or was skipped for the reason given" in summary
    assert "8 × NVIDIA H100 80GB HBM3; driver 580.65.06" in summary
    assert "| nccl | 450.0 | 10.18 |" in summary
    assert "3 passed, 0 failed, 1 skipped." in summary and "- skipped 1: this build has the CUDA module" in summary
    assert "d2h 52.1 GB/s (pinned memcpy 55.0)" in summary
    assert "`gpu_host_bench`: PASS" in summary and "    8  nccl            4.10" in summary
    assert "| 268435456 | 1100.0 | 1300.0 | 427.00 | 361.30 | 1.18 | 0 | nccl:88% pcie:12% |" in summary
    assert "- 4 KiB AllReduce: FlexLink 30.0 us, native 25.0 us: +5.0 us, within the 10 us target." in summary
    assert "Lowest speedup (native time / FlexLink time): 0.83x at all_reduce 4096 B (misses" in summary


def test_failures_are_recorded_and_the_run_goes_on(tmp_path, machine):
    env, tests_dir = machine
    _executable(tests_dir / "cuda_ranks_test", "#!/bin/sh\necho 'rank 3: 12 wrong elements'\nexit 3\n")
    env = dict(env, FAKE_BUILD_RC="1", FAKE_BENCH_RC="1", FAKE_LAUNCH_RC="3")
    out = tmp_path / "out"
    res = _run([str(out)], env=env)
    assert res.returncode == 1
    steps = _steps(out)
    assert steps["build"]["result"] == "FAIL" and steps["build"]["rc"] == "1"
    # Without a build the module file runs on its own (here: the real machine, no GPU).
    assert steps["topology"]["result"] == "FAIL" and "no NVIDIA GPU visible" in steps["topology"]["note"]
    assert steps["pytest"]["result"] == "PASS"  # it still ran
    assert steps["cuda_ranks_test"]["result"] == "FAIL"
    assert steps["cuda_ranks_test"]["note"].endswith("exit 3: rank 3: 12 wrong elements")
    assert steps["bench"]["result"] == "FAIL" and steps["bench"]["rc"] == "1"
    summary = (out / "summary.md").read_text()
    assert steps["processes"]["result"] == steps["processes-gpus"]["result"] == "FAIL"
    assert steps["processes"]["note"] == "exit 3: [1] ALL OK 45 checks; links: fake", steps["processes"]
    assert "**FAILED**: build, topology, cuda_ranks_test, bench, processes, processes-gpus." in summary
    assert "| cuda_ranks_test | **FAIL** |" in summary


def test_one_gpu_skips_the_cross_gpu_bench(tmp_path, machine):
    env, _ = machine
    out = tmp_path / "out"
    res = _run([str(out), "--skip-build"], env=dict(env, FAKE_GPUS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    steps = _steps(out)
    assert steps["bench"] == {"result": "SKIP", "rc": "", "log": "", "note": "1 GPU: no cross-GPU collective to time"}
    assert steps["processes"]["result"] == "PASS"  # both processes on GPU 0
    assert steps["processes-gpus"] == {"result": "SKIP", "rc": "", "log": "",
                                       "note": "1 GPU: a process per GPU needs 2"}
    assert steps["cpp"]["result"] == "SKIP" and steps["pytest"]["result"] == "PASS"
    assert not (out / "bench.json").exists()
    assert "No bench.json" in (out / "summary.md").read_text()


def test_time_boxes_and_the_budget(tmp_path, machine):
    env, tests_dir = machine
    _executable(tests_dir / "cuda_slow_test", "#!/bin/sh\nsleep 120\n")
    out = tmp_path / "out"
    res = _run([str(out), "--skip-build"], env=dict(env, GPU_CHECK_BUDGET_S="20"))
    assert res.returncode == 1
    assert res.seconds < 60
    steps = _steps(out)
    assert steps["cuda_slow_test"]["result"] == "TIMEOUT" and "killed after its" in steps["cuda_slow_test"]["note"]
    assert steps["bench"] == {"result": "TIMEOUT", "rc": "", "log": "", "note": "not started: the 20s budget is spent"}
    assert steps["processes"]["result"] == "SKIP" and "of the 20s budget left, it needs about 75s" in \
        steps["processes"]["note"], steps["processes"]
    assert "| cuda_slow_test | **TIMEOUT** |" in (out / "summary.md").read_text()


@pytest.mark.parametrize("platforms, reason", [
    ("cpu", "no GPU: JAX_PLATFORMS='cpu' leaves out CUDA (the suite's default is 'cpu'; run GPU tests with "
            "JAX_PLATFORMS=cpu,cuda)"),
    ("cpu,cuda", "no GPU: jax.devices('gpu') failed: "),
])
def test_the_gpu_marker_skips_with_the_reason(platforms, reason):
    """`pytest -m gpu` here: every gpu-marked test skipped, saying why; nothing else selected."""
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    env = dict(os.environ, JAX_PLATFORMS=platforms)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
                          os.path.join(ROOT, "tests", "test_gpu.py")], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.join(ROOT, "tests"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"^\d+ skipped in ", res.stdout.splitlines()[-1]), res.stdout[-2000:]
    assert "passed" not in res.stdout.splitlines()[-1] and reason in res.stdout
