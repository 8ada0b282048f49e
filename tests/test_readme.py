"""README's usage snippets run as written, in a fresh interpreter that sets its own XLA_FLAGS, and
print what their comments say."""
import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _python_blocks():
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Using it"):text.index("## How it works")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_usage_snippet_runs_as_written():
    usage, replacement, coverage = _python_blocks()
    assert "train_step" in replacement  # illustrative only (names a program the reader has)
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64", "FLEXLINK_REPLACE_COLLECTIVES")}
    res = subprocess.run([sys.executable, "-c", usage + coverage], env=env, capture_output=True,
                         text=True, timeout=240, cwd=os.path.dirname(README))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert "CpuDevice(id=7)" in lines[0] and "CpuDevice(id=8)" not in lines[0], lines[0]
    assert lines[1] == "[14. 15. 16. 17.]"
    assert "'bytes': 16, 'calls': 1" in lines[2], lines[2]
    assert lines[3] == "[0. 1. 2. 3.]"
    assert lines[4] == "0"
    assert re.match(r"kind\s+runner\s+bytes\s+group", lines[5]), lines[5]
    assert re.match(r"all_reduce\s+flexlink\s+16\s+8\s+1\s+float32", lines[6]), lines[6]
