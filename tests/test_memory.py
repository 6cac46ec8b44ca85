"""Host memory: transparent huge pages on the large buffers allocated every step (Note [huge pages])."""

from __future__ import annotations

import os

import torch

from shardfn import _flat, _memory


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _vm_flags(ptr: int) -> set[str]:
    """The VmFlags of the mapping that holds address `ptr`, from /proc/self/smaps."""
    inside, flags = False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                flags = set(line.split()[1:])
                break
    assert flags is not None, "no mapping holds the buffer"
    return flags


def test_large_buffers_ask_for_huge_pages():
    t = torch.empty(0)
    _flat._storage_alloc(t, 16 << 20)
    ptr = t.untyped_storage().data_ptr()
    mode = _thp_mode()
    if os.path.exists("/proc/self/smaps") and mode in ("madvise", "always"):
        # "hg": the mapping was advised MADV_HUGEPAGE (the kernel then maps it 2 MB at a time).
        assert "hg" in _vm_flags(ptr + (4 << 20)), (mode, _vm_flags(ptr + (4 << 20)))
    _flat._storage_free(t)
    assert t.untyped_storage().nbytes() == 0


def test_small_buffers_and_switch_off_are_left_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(_memory, "_find_madvise", lambda: calls.append(1))
    _memory.huge_pages(torch.empty(1 << 18).untyped_storage())  # 1 MB: no aligned huge page inside
    monkeypatch.setattr(_memory, "HUGE_PAGES", False)
    t = torch.empty(0)
    _flat._storage_alloc(t, 16 << 20)
    assert calls == [] and t.untyped_storage().nbytes() == 16 << 20
