"""What the benchmark scripts read of their own process: memory figures from /proc/self/status."""

from __future__ import annotations

__all__ = ["status_kb"]


def status_kb(field: str) -> int:
    """A `/proc/self/status` field in kB, e.g. "VmHWM" (peak RSS) or "VmRSS"."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")
