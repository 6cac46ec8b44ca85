"""The GPU check script (benchmarks/device_check.py): its parity cases run and hold.

On a machine with a GPU this checks the CUDA paths; on CPU (CI) it is the script's dry run, which
keeps it from rotting between the times a GPU is available.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "device_check.py")


def test_device_check_parity_cases():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the mesh follows the hardware
    out = subprocess.run(
        [sys.executable, SCRIPT, "--device", device, "--no-bench"], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    ran = [line for line in rows if "skipped on CPU" not in line]
    # every case ran and held; on CPU all but the compiled ones (tests/test_compile.py covers those)
    assert len(rows) == 10 and len(ran) == (10 if device == "cuda" else 8), out.stdout
    assert all(line.rstrip().endswith("| yes |") for line in ran), out.stdout
