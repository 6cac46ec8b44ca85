"""The README's demo runs and reports loss, memory and time."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_two_ranks_and_learns():
    out = subprocess.run(
        [sys.executable, "-m", "shardfn.demo", "--steps", "25"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout
    assert "2 ranks" in out and "peak RSS" in out and "median step" in out, out
    assert re.search(r"rank 1: holds [\d.]+ MiB sharded state", out), out
    first = float(re.search(r"step   0  loss ([\d.]+)", out).group(1))
    last = float(re.search(r"final loss ([\d.]+)", out).group(1))
    assert last < first - 0.5, out  # it learns
