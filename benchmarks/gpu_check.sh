#!/usr/bin/env bash
# The GPU checks of issue 12 (item 7), in one script a bare GPU machine runs from a clean checkout:
#
#   benchmarks/gpu_check.sh OUTDIR [--dry-run] [--skip-build]
#
# 1. build: the package with the CUDA module, against the machine's own python3, offline
#    (pip --no-build-isolation --no-deps -e . -C cmake.define.FLEXLINK_CUDA=ON, build/gpu-check);
#    cpp-build: the C++ tests with the CUDA ones (CMake, FLEXLINK_BUILD_TESTS=ON, build/gpu-check-tests);
# 2. topology: python -m jax_flexlink.topology --json > OUTDIR/topology.json (and the report);
# 3. gpus: what jax sees (jax.devices("gpu")); without a GPU the GPU steps are skipped, and fail;
# 4. pytest: the gpu-marked tests (tests/test_gpu.py: every collective against lax through each link);
# 5. cpp: every CUDA C++ test and bench binary cpp-build made (build/gpu-check-tests/cuda_*_test,
#    cuda_*_bench; their absence is a clear SKIP line, not a failure);
#    gpu_host_bench: the GPU engine's host path per call on this machine's cores, over a device that
#    does nothing (no GPU needed; ranks 2 and 8, the machine's own spin rule): beside cuda_pcie_bench's
#    4 KiB overhead, it tells FlexLink's host logic from the CUDA and NCCL calls;
# 6. bench: with 2+ GPUs, python -m jax_flexlink.bench --scenario gpu --links 'nccl;pcie', FlexLink
#    split over NVLink and PCIe by its balancer (stage 1, then stage 2 during the warm-up calls) vs
#    native (nccl-tests layout, OUTDIR/bench.txt and bench.json); with one GPU skipped;
# 7. processes, processes-gpus: FlexLink's GPU groups across processes, jobs of 2 processes under
#    python -m jax_flexlink.launch running tests/multiprocess/gpu_processes.py (the jobs of
#    tests/test_launch.py's two gpu-marked tests, which step 4 leaves out): both processes on GPU 0
#    through the pcie link, and with 2+ GPUs rank i on GPU 1-i through nccl;pcie; every collective
#    against numpy (OUTDIR/processes.log, processes-gpus.log);
# 8. OUTDIR/summary.md: a table of every step and the bench's numbers (benchmarks/gpu_check_summary.py).
#
# Every step is time-boxed (`timeout`) inside a total budget (GPU_CHECK_BUDGET_S, default 420 s; with
# the summary's 30 s the whole run stays under 8 minutes); a failing or timed-out step is recorded and the script goes
# on. Exit status: 0 when every step passed or was skipped for a stated reason, 1 when a step failed
# or timed out (no GPU visible counts as a failure), 2 on a usage error.
#
# --dry-run prints each step's command and time box without running anything (but still writes
# OUTDIR/summary.md); --skip-build uses the jax_flexlink already installed for python3.
# Environment: GPU_CHECK_PYTHON (default python3), GPU_CHECK_BUDGET_S (default 420),
# GPU_CHECK_BUILD_DIR (default build/gpu-check-tests: the C++ tests' CMake build directory).
# Details: docs/gpu_check.md.
set -uo pipefail

usage() { echo "usage: $0 OUTDIR [--dry-run] [--skip-build]" >&2; exit 2; }

OUT=""
DRY=0
SKIP_BUILD=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --skip-build) SKIP_BUILD=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "$0: unknown option $arg" >&2; usage ;;
    *) if [ -n "$OUT" ]; then echo "$0: one OUTDIR only" >&2; usage; fi; OUT=$arg ;;
  esac
done
[ -n "$OUT" ] || usage

cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT" || { echo "$0: cannot create $OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
PY=${GPU_CHECK_PYTHON:-python3}
TESTS_DIR=${GPU_CHECK_BUILD_DIR:-build/gpu-check-tests}
# The processes steps run these tests' jobs themselves (below), so the pytest step leaves them out.
PROCESSES_TESTS=(tests/test_launch.py::test_processes_share_one_gpu tests/test_launch.py::test_processes_on_gpus_in_reverse)
PY_EXE=$("$PY" -c 'import sys; print(sys.executable)' 2>/dev/null || echo "$PY")  # not a pyenv shim
BUDGET=${GPU_CHECK_BUDGET_S:-420}
START=$(date +%s)
DEADLINE=$(( START + BUDGET ))
export OUT_JSON="$OUT/topology.json" OUT_TXT="$OUT/topology.txt"
STEPS="$OUT/steps.tsv"
: > "$STEPS"
FAILED=0
NGPUS=0

# No package registry on the GPU machine: never wait on one. The machine's python3 may be
# "externally managed" (PEP 668); this build is what the machine is for.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 4)}

# record NAME STATUS SECONDS RC LOG NOTE: one line of OUTDIR/steps.tsv (what summary.md is made from).
record() {
  local note=${6//$'\t'/ }
  note=${note//$'\n'/ }
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$note" >> "$STEPS"
  echo "--- $1: $2 (${3}s)${note:+: $note}"
  case "$2" in FAIL|TIMEOUT) FAILED=1 ;; esac
}

# run NAME BOX LOG CMD...: CMD under `timeout`, its output in OUTDIR/LOG; returns CMD's status.
# The box shrinks to what the budget has left; with under 15 s left the step is skipped.
LAST_RC=0
LAST_SECONDS=0
run() {
  local name=$1 box=$2 log=$3
  shift 3
  local left=$(( DEADLINE - $(date +%s) ))
  if (( left < 15 )); then
    record "$name" TIMEOUT 0 "" "" "not started: the ${BUDGET}s budget is spent"
    LAST_RC=124
    return 124
  fi
  (( box > left - 5 )) && box=$(( left - 5 ))
  if (( DRY )); then
    local cmd="$*"
    echo "DRY-RUN $name (time box ${box}s): $cmd"
    cmd=${cmd//$'\n'/ }
    record "$name" DRY 0 "" "$log" "would run (time box ${box}s): ${cmd:0:160}"
    LAST_RC=0
    return 0
  fi
  echo "=== $name (time box ${box}s): $*"
  local t0
  t0=$(date +%s)
  timeout --kill-after=10 "$box" "$@" > "$OUT/$log" 2>&1
  LAST_RC=$?
  LAST_SECONDS=$(( $(date +%s) - t0 ))
  if (( LAST_RC == 124 || LAST_RC == 137 )); then
    record "$name" TIMEOUT "$LAST_SECONDS" "$LAST_RC" "$log" "killed after its ${box}s time box; see $log"
    return 124
  fi
  return "$LAST_RC"
}

# The last line of a log that says something (for the table).
last_line() { grep -v '^\s*$' "$OUT/$1" 2>/dev/null | tail -n 1 | cut -c1-200; }

echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), output in $OUT, budget ${BUDGET}s, python $PY"

# --- environment ----------------------------------------------------------------------------------
if run environment 60 environment.txt bash -c '
    echo "# git"; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
    echo "# uname"; uname -a
    echo "# python"; command -v "$0"; "$0" --version
    echo "# packages"; "$0" -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|jax-cuda|jax_cuda|nvidia|nanobind|scikit-build|cmake|ninja|pytest|numpy) " || true
    echo "# nvcc"; (nvcc --version 2>&1 || echo "no nvcc") | tail -n 2
    echo "# nvidia-smi"; timeout 20 nvidia-smi 2>&1 || echo "no nvidia-smi"
    echo "# nvidia-smi topo -m"; timeout 20 nvidia-smi topo -m 2>&1 || true' "$PY"; then
  (( DRY )) || record environment PASS "$LAST_SECONDS" 0 environment.txt "$("$PY" --version 2>&1)"
elif (( LAST_RC != 124 )); then
  record environment FAIL "$LAST_SECONDS" "$LAST_RC" environment.txt "$(last_line environment.txt)"
fi
if ! (( DRY )) && ! command -v "$PY" >/dev/null 2>&1; then
  record python FAIL 0 "" "" "no $PY on PATH: nothing else can run"
fi

# --- build ----------------------------------------------------------------------------------------
# The Python package with the CUDA module (what every later step imports), then, on its own time
# box, a CMake build of the C++ tests with the CUDA ones: a slow or broken C++ test build does not
# cost the Python checks.
BUILD_OK=1
if (( SKIP_BUILD )); then
  record build SKIP 0 "" "" "--skip-build: the installed jax_flexlink"
  record cpp-build SKIP 0 "" "" "--skip-build: binaries already in $TESTS_DIR, if any"
else
  if run build 200 build.log "$PY" -m pip install --no-build-isolation --no-deps -v -e . \
        -C cmake.define.FLEXLINK_CUDA=ON -C build-dir=build/gpu-check; then
    (( DRY )) || record build PASS "$LAST_SECONDS" 0 build.log "jax_flexlink with FLEXLINK_CUDA=ON (build/gpu-check)"
  else
    BUILD_OK=0
    (( LAST_RC == 124 )) || record build FAIL "$LAST_SECONDS" "$LAST_RC" build.log "$(last_line build.log)"
  fi
  GENERATOR=()
  command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
  # Only the CUDA programs: the CPU tests are CI's, and their build would eat the time box.
  if run cpp-build 150 cpp_build.log sh -c 'cmake -S . -B "$0" "$@" && cmake --build "$0" --target cuda_ranks_test cuda_pcie_bench gpu_host_bench' "$TESTS_DIR" \
        "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release "-DPython_EXECUTABLE=$PY_EXE" \
        -DFLEXLINK_CUDA=ON -DFLEXLINK_BUILD_TESTS=ON; then
    (( DRY )) || record cpp-build PASS "$LAST_SECONDS" 0 cpp_build.log "C++ tests with FLEXLINK_CUDA=ON ($TESTS_DIR)"
  elif (( LAST_RC != 124 )); then
    record cpp-build FAIL "$LAST_SECONDS" "$LAST_RC" cpp_build.log "$(last_line cpp_build.log)"
  fi
fi

# --- topology -------------------------------------------------------------------------------------
# After a failed build the package cannot be imported; the module file runs on its own.
if (( BUILD_OK )); then TOPO=(-m jax_flexlink.topology); else TOPO=(jax_flexlink/topology.py); fi
if run topology 30 topology.log sh -c '"$0" "$@" > "$OUT_TXT"; "$0" "$@" --json > "$OUT_JSON"' \
    "$PY" "${TOPO[@]}"; then
  (( DRY )) || record topology PASS "$LAST_SECONDS" 0 topology.txt "$(sed -n 2p "$OUT/topology.txt")"
elif (( LAST_RC != 124 )); then
  if (( LAST_RC == 1 )); then
    record topology FAIL "$LAST_SECONDS" 1 topology.log "$(last_line topology.log)"
  else
    record topology FAIL "$LAST_SECONDS" "$LAST_RC" topology.log "exit status $LAST_RC: $(last_line topology.log)"
  fi
fi

# --- GPUs jax sees --------------------------------------------------------------------------------
if run gpus 90 gpus.txt env -u JAX_PLATFORMS "$PY" -c '
import jax
try:
    devices = jax.devices("gpu")
except RuntimeError as e:
    print(f"jax sees no GPU: {str(e).splitlines()[0]}")
    raise SystemExit(1)
print(f"jax {jax.__version__}: {len(devices)} GPU(s): " + ", ".join(f"{d.id}:{d.device_kind}" for d in devices))
print(f"GPUS={len(devices)}")'; then
  if (( DRY )); then
    NGPUS=2
  else
    NGPUS=$(sed -n 's/^GPUS=//p' "$OUT/gpus.txt")
    NGPUS=${NGPUS:-0}
    record gpus PASS "$LAST_SECONDS" 0 gpus.txt "$(head -n 1 "$OUT/gpus.txt")"
  fi
elif (( LAST_RC != 124 )); then
  record gpus FAIL "$LAST_SECONDS" "$LAST_RC" gpus.txt "$(last_line gpus.txt)"
fi

# --- gpu-marked pytest tests ----------------------------------------------------------------------
if (( NGPUS < 1 )); then
  record pytest SKIP 0 "" "" "no GPU visible to jax (see gpus)"
elif run pytest 150 pytest_gpu.log env JAX_PLATFORMS=cpu,cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml" \
    --deselect "${PROCESSES_TESTS[0]}" --deselect "${PROCESSES_TESTS[1]}" tests; then
  (( DRY )) || record pytest PASS "$LAST_SECONDS" 0 pytest_gpu.log "$(last_line pytest_gpu.log)"
elif (( LAST_RC != 124 )); then
  if (( LAST_RC == 5 )); then
    record pytest FAIL "$LAST_SECONDS" 5 pytest_gpu.log "no gpu-marked test was collected"
  else
    record pytest FAIL "$LAST_SECONDS" "$LAST_RC" pytest_gpu.log "$(last_line pytest_gpu.log)"
  fi
fi

# --- CUDA C++ tests and benches -------------------------------------------------------------------
shopt -s nullglob
BINARIES=()
for b in "$TESTS_DIR"/cuda_*_test "$TESTS_DIR"/*/cuda_*_test "$TESTS_DIR"/cuda_*_bench "$TESTS_DIR"/*/cuda_*_bench; do
  [ -f "$b" ] && [ -x "$b" ] && BINARIES+=("$b")
done
shopt -u nullglob
if (( DRY )); then
  echo "DRY-RUN cpp (time box 60s each): every $TESTS_DIR/cuda_*_test and cuda_*_bench"
  record cpp DRY 0 "" "" "would run every $TESTS_DIR/cuda_*_test and cuda_*_bench (time box 60s each)"
elif (( ${#BINARIES[@]} == 0 )); then
  record cpp SKIP 0 "" "" "no CUDA C++ test binary (expected $TESTS_DIR/cuda_*_test, e.g. cuda_ranks_test, from FLEXLINK_CUDA=ON with FLEXLINK_BUILD_TESTS=ON)"
elif (( NGPUS < 1 )); then
  record cpp SKIP 0 "" "" "no GPU visible to jax: ${#BINARIES[@]} binaries not run"
else
  for b in "${BINARIES[@]}"; do
    name=$(basename "$b")
    if run "$name" 60 "cpp_$name.log" "$b"; then
      record "$name" PASS "$LAST_SECONDS" 0 "cpp_$name.log" "$b: $(last_line "cpp_$name.log")"
    elif (( LAST_RC != 124 )); then
      record "$name" FAIL "$LAST_SECONDS" "$LAST_RC" "cpp_$name.log" "$b: exit $LAST_RC: $(last_line "cpp_$name.log")"
    fi
  done
fi

# --- the engine's host path on this machine's cores (no GPU needed) ------------------------------
HOST_BENCH="$TESTS_DIR/gpu_host_bench"
if ! (( DRY )) && [ ! -x "$HOST_BENCH" ]; then
  record gpu_host_bench SKIP 0 "" "" "no $HOST_BENCH (cpp-build makes it)"
elif run gpu_host_bench 60 cpp_gpu_host_bench.log "$HOST_BENCH" --ranks 2,8 --calls 20000 --reps 3; then
  (( DRY )) || record gpu_host_bench PASS "$LAST_SECONDS" 0 cpp_gpu_host_bench.log \
    "2 ranks, 4 KiB, us per call: $(awk '$1 == 2 { printf "%s%s %s", sep, $2, $3; sep = ", " }' "$OUT/cpp_gpu_host_bench.log")"
elif (( LAST_RC != 124 )); then
  record gpu_host_bench FAIL "$LAST_SECONDS" "$LAST_RC" cpp_gpu_host_bench.log "exit $LAST_RC: $(last_line cpp_gpu_host_bench.log)"
fi

# --- the nccl-tests-style bench across the GPUs ---------------------------------------------------
if (( NGPUS < 1 )); then
  record bench SKIP 0 "" "" "no GPU visible to jax"
elif (( NGPUS < 2 )); then
  record bench SKIP 0 "" "" "1 GPU: no cross-GPU collective to time"
elif run bench 150 bench.txt env -u JAX_PLATFORMS XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$PY" -m jax_flexlink.bench --scenario gpu --links 'nccl;pcie' -C all_reduce,all_gather,reduce_scatter \
    -b 4K -e 256M -f 4 -n 20 -w 12 --outofplace --json "$OUT/bench.json"; then
  (( DRY )) || record bench PASS "$LAST_SECONDS" 0 bench.txt "$(grep -m1 'Out of bounds' "$OUT/bench.txt")"
elif (( LAST_RC != 124 )); then
  record bench FAIL "$LAST_SECONDS" "$LAST_RC" bench.txt "exit $LAST_RC: $(last_line bench.txt)"
fi

# --- GPU groups across processes, under the launcher ---------------------------------------------
# Two jobs of 2 processes (tests/multiprocess/gpu_processes.py, every collective against numpy): both
# on GPU 0 through the pcie link (any GPU count), and with 2+ GPUs rank i on GPU 1-i through
# nccl;pcie. Last, so that their jax start-ups (~10 s a job) take time from no other step; each job
# needs about a minute, so with less of the budget left it is skipped, saying so. The launcher's own
# deadline (60 s) comes before the step's box, so that it, not `timeout`, stops the ranks.
processes_step() {  # NAME MIN_GPUS WHAT LAUNCH_ARGS... -- PROGRAM_ARGS
  local name=$1 min=$2 what=$3
  shift 3
  local left=$(( DEADLINE - $(date +%s) ))
  if (( NGPUS < 1 )); then
    record "$name" SKIP 0 "" "" "no GPU visible to jax"
  elif (( NGPUS < min )); then
    record "$name" SKIP 0 "" "" "$NGPUS GPU: $what needs $min"
  elif (( left < 75 )) && ! (( DRY )); then
    record "$name" SKIP 0 "" "" "not started: ${left}s of the ${BUDGET}s budget left, it needs about 75s"
  elif run "$name" 75 "$name.log" env JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
      "$PY" -m jax_flexlink.launch -n 2 --timeout 60 "$@"; then
    (( DRY )) || record "$name" PASS "$LAST_SECONDS" 0 "$name.log" "$(grep -c 'ALL OK' "$OUT/$name.log") of 2 processes: $(grep -m1 'ALL OK' "$OUT/$name.log" | cut -c1-120)"
  elif (( LAST_RC != 124 )); then
    record "$name" FAIL "$LAST_SECONDS" "$LAST_RC" "$name.log" "exit $LAST_RC: $(last_line "$name.log")"
  fi
}
processes_step processes 1 "" -- "$PY" tests/multiprocess/gpu_processes.py --shared
processes_step processes-gpus 2 "a process per GPU" --gpus-per-process 1 -- "$PY" tests/multiprocess/gpu_processes.py --reversed

# --- summary --------------------------------------------------------------------------------------
TOTAL=$(( $(date +%s) - START ))
if (( DRY )); then
  echo "DRY-RUN summary: $PY benchmarks/gpu_check_summary.py $OUT"
  record dry-run SKIP 0 "" "" "--dry-run: nothing was run"
fi
if ! timeout 30 "$PY" benchmarks/gpu_check_summary.py "$OUT" "$TOTAL" > "$OUT/summary.log" 2>&1; then
  {  # the plain table, if the summary script itself cannot run
    echo "# gpu_check summary (plain: benchmarks/gpu_check_summary.py failed, see summary.log)"
    echo
    echo "| step | result | s | note |"
    echo "| --- | --- | --- | --- |"
    while IFS=$'\t' read -r name status secs rc log note; do
      echo "| $name | $status | $secs | ${note//|/\\|} |"
    done < "$STEPS"
    echo
    echo "total ${TOTAL}s"
  } > "$OUT/summary.md"
fi
echo
cat "$OUT/summary.md"
echo
if (( FAILED )); then
  echo "gpu_check: FAILED (${TOTAL}s); everything is in $OUT"
  exit 1
fi
echo "gpu_check: OK (${TOTAL}s); everything is in $OUT"
exit 0
