"""The README's runnable examples run as written (offline, CPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_trl_example_trains():
    pytest.importorskip("trl")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo_tiny.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'loss'" in done.stdout and "'kl'" in done.stdout
