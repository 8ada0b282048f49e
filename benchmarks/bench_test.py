"""A short benchmark sweep as a test: `bench_test.py NAME -- BENCH ARGS`.

Runs `python -m jax_flexlink.bench BENCH ARGS --json $TEST_UNDECLARED_OUTPUTS_DIR/NAME.json`,
writes the printed table to NAME.txt there too (bazel-testlogs/.../test.outputs/), and fails when
the benchmark exits non-zero (it does on any wrong element) or prints no FlexLink row.
"""
import os
import subprocess
import sys


def main(argv):
    name, args = argv[0], argv[1:]
    if args and args[0] == "--":
        args = args[1:]
    outdir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or os.environ.get("TEST_TMPDIR", ".")
    os.makedirs(outdir, exist_ok=True)
    json_path = os.path.join(outdir, name + ".json")
    cmd = [sys.executable, "-m", "jax_flexlink.bench"] + args + ["--json", json_path]
    print("bench_test: " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(os.path.join(outdir, name + ".txt"), "w") as f:
        f.write(proc.stdout)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        print("bench_test: benchmark exited with %d" % proc.returncode, flush=True)
        return 1
    if not os.path.exists(json_path):
        print("bench_test: benchmark wrote no %s" % json_path, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
