"""A short benchmark sweep as a test: `bench_test.py NAME -- BENCH ARGS`.

Runs `python -m jax_flexlink.bench BENCH ARGS --json $TEST_UNDECLARED_OUTPUTS_DIR/NAME.json`,
writes the printed table to NAME.txt there too (bazel-testlogs/.../test.outputs/), and fails when
the benchmark exits non-zero (it does on any wrong element or failing collective) or writes no JSON.
Sections whose FlexLink side this build cannot run (docs/bench.md, "Sections FlexLink cannot run")
do not fail it; they are named on the last line of the test's log.
"""
import json
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
    with open(json_path) as f:
        doc = json.load(f)
    skipped = doc.get("summary", {}).get("skipped") or []
    print("bench_test: %d rows; FlexLink side skipped in %d sections%s" % (
        len(doc.get("rows", [])), len(skipped),
        "".join("; %s %s %s: %s" % (s["collective"], s["op"], s["dtype"], s["reason"]) for s in skipped)),
        flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
