"""Measured peak memory of real code, independent of any estimate: what `sf.estimate_memory` is
checked against (tests, `benchmarks/memory.py`, `benchmarks/scale.py`).

Note [measured peak]
--------------------
Two witnesses on the CPU, one on CUDA:

- Live tensor bytes (CPU): PyTorch's profiler, with `profile_memory=True`, reports every allocation
  and free of the CPU allocator made while it runs, storage resizes included, in order. Summing
  them in order gives the bytes live at every moment among the allocations made since the meter
  started; the peak of a section is the largest such sum inside it. Memory allocated before the
  meter started is not seen (start it before `step.init` to see the state too), nor is memory
  allocated by threads the profiler does not follow (a collective library's own threads).
- RSS growth (CPU): the kernel's high-water mark of the process's resident memory (`VmHWM`, reset
  by writing 5 to `/proc/self/clear_refs`) minus the resident memory when the section starts. It
  sees everything the process touches, the allocator's own caching and fragmentation too, so it
  is a looser, independent check of the first. The meter sets glibc's mmap threshold to 64 KiB
  (`mallopt`), so that large buffers go back to the system when freed, as the first witness
  assumes; that changes where memory comes from, never what is computed. glibc has no way back to
  its own sliding threshold, and left at 64 KiB every later step of the process maps and unmaps
  its buffers (a small GPT's step took 1.4-1.7x as long): so when the meter exits, the threshold
  goes to what the environment asks for (`GLIBC_TUNABLES`' `glibc.malloc.mmap_threshold` and
  `trim_threshold`, else `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`), else
  to the top of the sliding range, 32 MiB (trim 64 MiB), where a long-running process's threshold
  ends up anyway (Note [process-wide state] in `_process.py`). glibc serves a request from a free
  block of its heap before it looks at the threshold, and a freed block's pages stay resident: so
  each section starts by handing the heap's free pages back (`malloc_trim(0)`), and a buffer
  served from a free block shows in the RSS as a new one does (pages already written before the
  section hid 8 MiB of a 24 MiB section in a process that had run a few hundred tests).
- CUDA: `torch.cuda.max_memory_allocated`, reset when the section starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch._C._profiler import _EventType

__all__ = ["PeakMeter", "Section", "rss_bytes", "step_peak"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_METERS_OPEN = [0]  # meters entered and not exited, in this process: the thresholds go back when none is


def _status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """The process's resident memory now (Linux), or None."""
    return _status("VmRSS")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mallopt(settings: dict[int, int]) -> None:
    if sys.platform.startswith("linux"):
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            return
        for param, value in settings.items():
            mallopt(param, value)


def _release_free_heap() -> None:
    """Note [measured peak]: the free pages of glibc's heap back to the system (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            return
        trim(0)


def _low_mmap_threshold() -> None:
    # glibc's default trim threshold too, whatever an earlier meter's exit left: every measurement
    # starts from the same settings, so freed heap at the top goes back as it would in the first.
    _mallopt({_M_MMAP_THRESHOLD: 65536, _M_TRIM_THRESHOLD: 128 << 10})


def _env_bytes(tunable: str, alias: str, default: int) -> int:
    """A malloc setting as the environment gives it to glibc: `GLIBC_TUNABLES`'s
    `glibc.malloc.<tunable>=N` (colon-separated), else the alias variable (`MALLOC_..._`), else the
    default. A value that is not a whole number counts as not given, as glibc ignores it."""
    for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name.strip() == f"glibc.malloc.{tunable}" and value.strip().isdigit():
            return int(value)
    value = os.environ.get(alias, "").strip()
    return int(value) if value.isdigit() else default


def _usual_mmap_threshold() -> None:
    """Note [measured peak]: the environment's thresholds, else the top of glibc's sliding range."""
    _mallopt({_M_MMAP_THRESHOLD: _env_bytes("mmap_threshold", "MALLOC_MMAP_THRESHOLD_", 32 << 20),
              _M_TRIM_THRESHOLD: _env_bytes("trim_threshold", "MALLOC_TRIM_THRESHOLD_", 64 << 20)})


@dataclass
class Section:
    """What one measured section saw (bytes).

    Attributes:
        name: the section's name.
        peak: the most live tensor bytes during the section, counting every allocation the meter
            saw since it started (so with the meter started before `step.init`, the state too).
        start: the live tensor bytes when the section began (same count).
        rss_growth: the resident memory's high-water mark during the section minus the resident
            memory at its start (CPU, Linux; None elsewhere).
        cuda_peak: `torch.cuda.max_memory_allocated` over the section (CUDA only, else None).
    """

    name: str
    peak: int = 0
    start: int = 0
    rss_growth: int | None = None
    cuda_peak: int | None = None
    _t0: int = 0
    _t1: int = 0


@dataclass
class PeakMeter:
    """Measures live tensor bytes over sections of real code (see Note [measured peak]).

        meter = PeakMeter()
        with meter:                       # start before step.init to count the state too
            state = step.init(params)
            state, _ = step(state, batch)
            with meter.section("step"):
                state, _ = step(state, batch)
        meter["step"].peak                # bytes

    `sections` holds every section in order; `meter[name]` is the last of that name.
    """

    sections: list[Section] = field(default_factory=list)
    cuda: bool = False

    def __post_init__(self) -> None:
        self._prof = None

    def __enter__(self) -> "PeakMeter":
        from torch.profiler import ProfilerActivity, profile

        if not _METERS_OPEN[0]:
            _low_mmap_threshold()
        _METERS_OPEN[0] += 1
        try:
            self.cuda = torch.cuda.is_available()
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
            self._prof.__enter__()
        except BaseException:
            self._closed()
            raise
        return self

    def __exit__(self, *exc) -> None:
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(*exc)
        finally:
            self._closed()
        if exc[0] is None:
            self._settle(prof)

    @staticmethod
    def _closed() -> None:
        _METERS_OPEN[0] -= 1
        if not _METERS_OPEN[0]:  # the last meter open: the thresholds go back (Note [measured peak])
            _usual_mmap_threshold()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[Section]:
        """Measures the code inside: its peak is known once the meter has exited."""
        if self._prof is None:
            raise ValueError("PeakMeter.section runs inside `with meter:`")
        sec = Section(name)
        self.sections.append(sec)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        _release_free_heap()
        hwm = _reset_hwm()
        rss0 = rss_bytes()
        with torch.profiler.record_function(f"shardfn.peak::{len(self.sections) - 1}"):
            yield sec
        if self.cuda:
            torch.cuda.synchronize()
            sec.cuda_peak = torch.cuda.max_memory_allocated()
        top = _status("VmHWM")
        if hwm and rss0 is not None and top is not None:
            sec.rss_growth = top - rss0

    def __getitem__(self, name: str) -> Section:
        for sec in reversed(self.sections):
            if sec.name == name:
                return sec
        raise KeyError(name)

    def _settle(self, prof) -> None:
        # The profiler's own sum of live bytes can count frees of blocks allocated before it
        # started (at an address it saw in an earlier session): pair frees with allocations seen
        # here by address instead.
        spans: dict[int, tuple[int, int]] = {}
        allocs: list[tuple[int, int, int]] = []
        todo = list(prof.profiler.kineto_results.experimental_event_tree())
        while todo:
            e = todo.pop()
            todo.extend(e.children)
            if e.name.startswith("shardfn.peak::"):
                spans[int(e.name.rpartition("::")[2])] = (e.start_time_ns, e.end_time_ns)
            elif e.tag == _EventType.Allocation:
                f = e.extra_fields
                if f.device.type == "cpu":
                    allocs.append((e.start_time_ns, f.ptr, f.alloc_size))
        allocs.sort(key=lambda a: a[0])
        deltas = []
        live: dict[int, int] = {}
        for t, ptr, n in allocs:
            if n > 0:
                live[ptr] = n
                deltas.append((t, n))
            elif ptr in live:
                deltas.append((t, -live.pop(ptr)))
        for k, sec in enumerate(self.sections):
            sec._t0, sec._t1 = spans[k]
        cur, j = 0, 0
        for k in sorted(range(len(self.sections)), key=lambda k: self.sections[k]._t0):
            sec = self.sections[k]
            while j < len(deltas) and deltas[j][0] < sec._t0:
                cur += deltas[j][1]
                j += 1
            sec.start = sec.peak = run = cur
            jj = j
            while jj < len(deltas) and deltas[jj][0] <= sec._t1:
                run += deltas[jj][1]
                sec.peak = max(sec.peak, run)
                jj += 1


def step_peak(step: Any, params: Any, batch: Any, steps: int = 2) -> Section:
    """The measured peak of `step.init(params)` and then `steps` steps on `batch`: the step section
    whose peak is highest (each step is a section "step0", "step1", ...; the state `init` builds is
    live in all of them). The first step runs before the engine's slot plan, the later ones after,
    so two steps see both."""
    meter = PeakMeter()
    with meter:
        state = step.init(params)
        for i in range(steps):
            with meter.section(f"step{i}"):
                state, _ = step(state, batch)
    return max((meter[f"step{i}"] for i in range(steps)), key=lambda sec: sec.peak)
