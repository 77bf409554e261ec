"""The README's runnable examples run as written (offline, CPU) and train."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_trl_example_trains():
    pytest.importorskip("trl")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo_tiny.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'kl'" in done.stdout, done.stdout[-3000:]
    losses = re.findall(r"'loss': '?([^,}']+)", done.stdout)  # each step's log line (quoted), then the example's
    change = re.search(r"max parameter change: (\S+)", done.stdout)
    assert losses and change, done.stdout[-3000:]
    assert all(math.isfinite(float(loss)) for loss in losses), f"logged losses {losses}"
    # Adam moves every parameter with a gradient by about the learning rate (TRL's default 1e-6) per step
    assert 0 < float(change[1]) < math.inf, f"the weights did not move: max change {change[1]}"
