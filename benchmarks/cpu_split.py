"""Where a rank's CPU goes, by kind of work: `perf` samples of `step_parts.py`'s timed steps.

On the 2-core machine both ranks keep the cores about 90% busy, so a step's time follows the CPU
work the ranks do, and the question is which work: the model's kernels, the page faults of fresh
buffers, the kernel's socket copies (gloo over loopback), the Python of the hooks. This runs
`step_parts.py` under `perf record` (call graphs, 1000 samples a second per thread, so a sample is
about a millisecond of CPU), sampling only during its timed steps, sorts each sample of the two
busiest processes (the ranks, with all their threads) into a kind by the functions on its stack,
and prints the kinds in ms of CPU per step.

    .venv/bin/python benchmarks/cpu_split.py                          # MLP: shardfn and DDP, world 2
    .venv/bin/python benchmarks/cpu_split.py --model deep --impls shardfn,ddp,fsdp2

Needs Linux `perf` allowed to sample this user's processes (`perf_event_paranoid` <= 2, or root).
The kinds are a reading of stack frames, first match wins, in the order of `KINDS`.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FREQ = 1000  # samples per second per thread: a sample is about 1 ms of CPU

# (kind, substrings of the stack's function names; any one matches), first match wins.
KINDS = [
    ("page faults while receiving (fresh buffers)", ("recv",), ("page_fault", "clear_page")),
    ("page faults (fresh tensors, huge pages)", (), ("page_fault", "clear_page")),
    ("unmapping freed buffers", (), ("munmap", "unmap_page")),
    ("socket receive", (), ("recv",)),
    ("socket send", (), ("writev", "sendmsg", "sendAsyncMode", "send")),
    ("waiting for the socket (epoll)", (), ("epoll",)),
    ("matrix products", (), ("sgemm", "gemm")),
    ("optimizer (fused Adam)", (), ("adam",)),
    ("copies and concatenations", (), ("cat_serial", "direct_copy", "copy_kernel", "memcpy", "memmove")),
    ("sums (reductions, gradient adds)", (), ("add_kernel", "gloo::sum", "sum_kernel")),
    ("Python interpreter", (), ("_PyEval", "libpython", "PyObject", "_Py")),
    ("locks and scheduling", (), ("futex", "schedule", "pthread_mutex", "pthread_cond")),
]


def kind_of(stack: list[str]) -> str:
    """The kind of one sample, from its stack (innermost frame first)."""
    joined = " ".join(stack)
    for kind, also, any_of in KINDS:
        if any(s in joined for s in any_of) and all(s in joined for s in also):
            return kind
    return "other"


def samples(script: str) -> list[tuple[str, str, list[str]]]:
    """(pid, thread name, stack) per sample of `perf script -F comm,pid,tid,ip,sym` output."""
    out, cur = [], None
    for line in script.splitlines():
        if not line.strip():
            if cur is not None:
                out.append(cur)
            cur = None
        elif not line[0].isspace():
            head = line.split()
            cur = (head[-1].split("/")[0], " ".join(head[:-1]), [])
        elif cur is not None:
            parts = line.split(None, 1)
            cur[2].append(parts[1] if len(parts) > 1 else "?")
    if cur is not None:
        out.append(cur)
    return out


def split(impl: str, args) -> tuple[dict, dict, str, list]:
    """Runs `step_parts.py` for `impl` under perf: ms of CPU per step by kind, and by thread name,
    for each rank; step_parts' own table; and the innermost functions of rank 0's "other" samples."""
    tmp = tempfile.mkdtemp(prefix="cpu_split_")
    ctl, ack, data = (os.path.join(tmp, n) for n in ("ctl", "ack", "perf.data"))
    os.mkfifo(ctl)
    os.mkfifo(ack)
    try:
        cmd = ["perf", "record", "-g", "-F", str(FREQ), "-D", "-1", f"--control=fifo:{ctl},{ack}", "-o", data, "-q", "--",
               sys.executable, os.path.join(HERE, "step_parts.py"), "--model", args.model, "--impls", impl,
               "--world", str(args.world), "--steps", str(args.steps), "--perf-ctl", f"{ctl},{ack}"]
        table = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.timeout).stdout
        script = subprocess.run(["perf", "script", "-i", data, "-F", "comm,pid,tid,ip,sym"], check=True,
                                capture_output=True, text=True, timeout=args.timeout).stdout
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    got = samples(script)
    ranks = [pid for pid, _ in collections.Counter(s[0] for s in got).most_common(args.world)]
    kinds, threads = {}, {}
    other = collections.Counter(s[2][0] if s[2] else "?" for s in got if s[0] == ranks[0] and kind_of(s[2]) == "other")
    others = [(name, 1000 * n / FREQ / args.steps) for name, n in other.most_common(args.top)]
    for pid in ranks:
        mine = [s for s in got if s[0] == pid]
        kinds[pid] = {k: 1000 * n / FREQ / args.steps for k, n in collections.Counter(kind_of(s[2]) for s in mine).items()}
        threads[pid] = {k: 1000 * n / FREQ / args.steps for k, n in collections.Counter(s[1] for s in mine).items()}
    return kinds, threads, table, others


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "gpt", "deep"])
    p.add_argument("--impls", default="shardfn,ddp", help="any of bench.py's: shardfn, shardfn_vg, shardfn_no_shard, fsdp2, ddp")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--top", type=int, default=6, help='how many of the innermost functions of "other" to name')
    args = p.parse_args()
    if shutil.which("perf") is None:
        sys.exit("cpu_split.py needs Linux perf on the PATH")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    impls = args.impls.split(",")
    results = {impl: split(impl, args) for impl in impls}
    print(f"# {args.model}, world {args.world}, {args.steps} timed steps; ms of CPU per step (all threads of a rank; "
          "both ranks shown as rank0 / rank1)\n")
    rows = sorted({k for kinds, *_ in results.values() for per in kinds.values() for k in per},
                  key=lambda k: [x[0] for x in KINDS].index(k) if k != "other" else len(KINDS))
    print("| kind | " + " | ".join(impls) + " |")
    print("|---|" + "---:|" * len(impls))
    for k in rows + ["total"]:
        cells = []
        for impl in impls:
            kinds = results[impl][0]
            vals = [sum(per.values()) if k == "total" else per.get(k, 0.0) for per in kinds.values()]
            cells.append(" / ".join(f"{v:.0f}" for v in vals))
        print(f"| {k} | " + " | ".join(cells) + " |")
    for impl in impls:
        _, threads, table, others = results[impl]
        print(f"\n{impl}: CPU by thread (ms per step, rank0 / rank1): " + ", ".join(
            f"{name} " + " / ".join(f"{per.get(name, 0.0):.0f}" for per in threads.values())
            for name in sorted({n for per in threads.values() for n in per})))
        whole = [line for line in table.splitlines() if line.startswith("whole process")]
        step = [line for line in table.splitlines() if line.startswith("| step |")]
        print(f"{impl}, step_parts rank 0: {step[0] if step else ''} {whole[0] if whole else ''}")
        print(f'{impl}, "other" on rank 0, innermost functions (ms per step): ' + "; ".join(f"{n[:70]} {v:.1f}" for n, v in others))


if __name__ == "__main__":
    main()
