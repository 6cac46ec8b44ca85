"""`sf.launch` and fail-fast: from a notebook kernel (nbclient), through a kernel interrupt, and
under torchrun. Every check is bounded: the kernel's cells, the torchrun subprocesses and the
planted failures all have deadlines of seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import nbformat
import pytest
import torch

import shardfn as sf
from shardfn import _watch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jupyter_client's own deprecations

HERE = Path(__file__).parent

# A notebook as a user writes it: the function and the class it returns are defined in cells.
SETUP = r'''
import dataclasses, os, tempfile, time
import psutil, torch, torch.distributed as dist
import shardfn as sf

kernel = psutil.Process()
before = {p.pid for p in kernel.children(recursive=True)}
kernel_mesh = sf.mesh(dp=-1)          # the kernel's own one-rank mesh must not leak into the ranks
marks = tempfile.mkdtemp()

@dataclasses.dataclass
class Result:
    rank: int
    world: int
    losses: list

def train(mode="ok", steps=4, mark=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    apply, params = sf.functionalize(model, units=r"\d+")
    mesh = sf.mesh(dp=-1)
    rank = dist.get_rank()
    calls = [0]

    def plant():
        with open(mark, "w") as f:
            f.write(repr(time.time()))
        if mode == "raise":
            raise ValueError("planted on rank 1 at step 2")
        if mode == "exit":
            os._exit(3)
        if mode == "stall":
            time.sleep(600)

    def loss_fn(p, batch):
        if rank == 1 and calls[0] == 2 and mode in ("raise", "exit"):
            plant()                        # inside the step, between gathers
        calls[0] += 1
        x, y = batch
        return torch.nn.functional.mse_loss(apply(p, x), y)

    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), mesh)
    state = step.init(params)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for i in range(steps):
        if rank == 1 and i == 2 and mode == "stall":
            plant()                        # outside any shardfn call
        batch = (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    if mode == "subset" and rank == 0:
        sf.gather(state.params)            # on one rank only: rank 1 has returned
    return Result(rank, dist.get_world_size(), losses)

def failing(mode, **kw):
    mark = os.path.join(marks, mode)
    t0 = time.time()
    try:
        sf.launch(train, mode, mark=mark, **kw)
    except sf.RankError as e:
        planted = float(open(mark).read()) if os.path.exists(mark) else t0
        return e, time.time() - planted
    raise AssertionError(f"{mode}: sf.launch returned")
'''

RESULTS = r'''
for n in (1, 3):  # 2 ranks: every launch below
    res = sf.launch(train, "ok", nprocs=n)
    assert [type(r).__name__ for r in res] == ["Result"] * n, res
    assert [r.rank for r in res] == list(range(n)) and all(r.world == n for r in res), res
    assert all(r.losses == res[0].losses for r in res), res   # the loss is the mean over ranks
    print(n, "ranks:", res[0].losses)
'''

RAISE = r'''
e, after = failing("raise")
print(f"raise: RankError after {after:.1f} s: {e}")
assert e.rank == 1 and e.kind == "failed" and after < 10, (e.rank, e.kind, after)
assert "planted on rank 1 at step 2" in str(e) and "Traceback" in str(e)
# The rank's traceback shows the cell's line that raised (its code travels as "<dynamic-code>")
assert 'raise ValueError("planted on rank 1 at step 2")' in str(e) and "<dynamic-code>" not in str(e), str(e)
assert isinstance(e.__cause__, ValueError) and "planted" in str(e.__cause__)
'''

EXIT = r'''
e, after = failing("exit")
print(f"exit: RankError after {after:.1f} s: {e}")
assert e.rank == 1 and e.kind == "died" and "exit code 3" in str(e) and after < 10, (e, after)
'''

STALL = r'''
e, after = failing("stall", timeout=3)
print(f"stall: RankError {after:.1f} s after the stall began (timeout 3 s): {e}")
assert e.rank == 1 and e.kind == "stalled" and after < 3 + 10, (e, after)
'''

SUBSET = r'''
e, after = failing("subset")
print(f"subset: RankError after {after:.1f} s: {e}")
assert e.rank == 1 and e.kind == "returned" and "every rank" in str(e), e
'''

REFUSE = r'''
try:
    sf.launch(lambda: kernel_mesh.size(), nprocs=2)
except ValueError as e:
    assert "DeviceMesh" in str(e) and "sf.mesh" in str(e), e
else:
    raise AssertionError("a captured mesh was sent to the ranks")
'''

AGAIN = r'''
left = {p.pid: " ".join(p.cmdline()) for p in kernel.children(recursive=True)
        if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE}
# Python's own helpers, one per kernel: the resource tracker and the warm ranks' server (Note [warm
# ranks]), a child of the kernel itself (its forked ranks are the server's children)
left = {pid: cmd for pid, cmd in left.items() if "resource_tracker" not in cmd
        and not ("forkserver" in cmd and psutil.Process(pid).ppid() == kernel.pid)}
assert not left, f"processes left behind: {left}"
res = sf.launch(train, "ok", nprocs=2)
assert [r.rank for r in res] == [0, 1]
'''


def _run_notebook(cells: list[str], timeout: int) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def test_launch_from_a_notebook_returns_results_and_fails_fast():
    nb = _run_notebook([SETUP, RESULTS, RAISE, EXIT, STALL, SUBSET, REFUSE, AGAIN], timeout=90)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.output_type == "stream")
    assert "[rank1]: " in text or "[rank0]: " in text or "ranks:" in text
    for line in text.splitlines():
        if line.startswith(("raise:", "exit:", "stall:", "subset:", "1 ranks", "3 ranks")):
            print(line[:200])


INTERRUPT = r'''
import time, psutil, shardfn as sf
def sleeper():
    print("started", flush=True)
    time.sleep(120)
kernel = psutil.Process()
t0 = time.time()
try:
    sf.launch(sleeper, nprocs=2)
except KeyboardInterrupt:
    print(f"interrupted after {time.time() - t0:.1f} s", flush=True)
time.sleep(0.5)
left = [p.pid for p in kernel.children(recursive=True)
        if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]
print("left", left, flush=True)
'''


def test_a_kernel_interrupt_stops_every_rank_and_the_kernel_launches_again():
    from jupyter_client.manager import start_new_kernel

    # This kernel's launches spawn fresh interpreters, sf.launch's default (the suite's others are warm).
    env = {k: v for k, v in os.environ.items() if k != "SHARDFN_WARM_LAUNCH"}
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(HERE), env=env)
    try:
        out: list[str] = []

        def run(code: str, until: str, deadline: float, interrupt_on: str | None = None) -> None:
            msg_id = kc.execute(code)
            end, sent = time.time() + deadline, False
            while time.time() < end:
                try:
                    msg = kc.get_iopub_msg(timeout=1)
                except Exception:  # noqa: BLE001 - queue.Empty: keep polling until the deadline
                    continue
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["msg_type"] == "stream":
                    out.append(msg["content"]["text"])
                    if interrupt_on and not sent and interrupt_on in "".join(out):
                        km.interrupt_kernel()
                        sent = True
                if msg["msg_type"] == "error":
                    out.append("ERROR " + msg["content"]["ename"])
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
            assert until in "".join(out), "".join(out)[-2000:]

        run(INTERRUPT, "left", 60, interrupt_on="started")
        text = "".join(out)
        assert "interrupted after" in text and "left []" in text, text[-2000:]
        out.clear()
        run("print(sf.launch(lambda: 7, nprocs=2))", "[7, 7]", 60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


TORCHRUN_FAILURES = {
    # a job that succeeds: tests/test_multinode.py (sf.launch's results under torchrun, two nodes)
    "raise": ["rank 1 failed: ValueError: planted on rank 1 at step 2"],
    "exit": ["exitcode  : 3"],
    "stall": ["rank 1 stalled"],
    "subset": ["rank 1 returned from its function while rank 0 waited on it in sf.gather"],
}


@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory):
    """One failing torchrun job per mode, all started at once: each is mostly interpreters
    starting and ranks waiting, so together they take little more than the longest."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    logs = tmp_path_factory.mktemp("torchrun")
    t0, jobs = time.time(), {}
    for mode in TORCHRUN_FAILURES:
        # A short collective timeout where the stall is the failure; elsewhere a long one, so that a
        # rank slowed by the other jobs' start-ups is never taken for a stalled one.
        env = dict(os.environ, SHARDFN_TIMEOUT="4" if mode == "stall" else "60", OMP_NUM_THREADS="1")
        with open(logs / mode, "w") as out:  # a file, not a pipe: no job waits on a full pipe
            # A session of its own: the teardown ends the agent and its workers together.
            jobs[mode] = (subprocess.Popen([*cmd, str(HERE / "torchrun_script.py"), mode], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True), logs / mode)
    yield t0, jobs
    for p, _ in jobs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # a worker left sleeping (the stall) too
        p.wait()


@pytest.mark.parametrize("mode", list(TORCHRUN_FAILURES))
def test_torchrun_fails_fast_and_names_the_rank(torchrun_jobs, mode):
    t0, jobs = torchrun_jobs
    p, log = jobs[mode]
    p.wait(timeout=max(1.0, 180 - (time.time() - t0)))
    took = time.time() - t0
    out = log.read_text()
    assert p.returncode == 1, out[-3000:]
    for name in TORCHRUN_FAILURES[mode]:
        assert name in out, out[-3000:]
    # Start-up (the four jobs' interpreters importing torch at once: 20-65 s on a busy 2-core
    # machine) plus at most the 4 s timeout and the reports: a bound on failing fast, far below
    # the 600 s default timeout.
    assert took < 180, (took, out[-2000:])


def test_a_rank_that_starts_after_the_collective_timeout_is_not_taken_for_a_stalled_one(torchrun_jobs):
    # In the "stall" job, rank 1 reaches sf.mesh 10 s after rank 0, with SHARDFN_TIMEOUT=4: start-up
    # has a bound of its own (Note [start-up] in shardfn/_mesh.py), so the job trains until rank 1
    # stalls at step 2, and that stall is what is named.
    t0, jobs = torchrun_jobs
    p, log = jobs["stall"]
    p.wait(timeout=max(1.0, 180 - (time.time() - t0)))
    out = log.read_text()
    assert "rank 1 starts late" in out and "rank 1 stalls at step 2" in out, out[-3000:]
    assert "rank 1 stalled" in out and "DistStoreError" not in out, out[-3000:]


def _where() -> tuple[int, int, str | None, int]:
    import torch.distributed as dist

    return dist.get_rank(), os.getppid(), os.environ.get("SHARDFN_PROBE"), torch.initial_seed()


def test_later_launches_fork_their_ranks_from_a_warm_server(monkeypatch):
    """Note [warm ranks]: by default every rank is a fresh interpreter; under SHARDFN_WARM_LAUNCH=1
    the ranks of every launch come from one server process that imported torch before any of them
    existed, each seeded afresh; once the caller's environment changes, they spawn fresh and see
    it."""
    import psutil

    from shardfn import _launch

    monkeypatch.setattr(_launch, "_WARM", None)  # whatever earlier tests' environments were
    monkeypatch.delenv("SHARDFN_PROBE", raising=False)
    monkeypatch.delenv(_launch.WARM_ENV, raising=False)
    assert {ppid for _, ppid, _, _ in sf.launch(_where, nprocs=2)} == {os.getpid()}  # spawned: the default
    monkeypatch.setenv(_launch.WARM_ENV, "1")
    runs = [sf.launch(_where, nprocs=2) for _ in range(2)]
    assert [[r for r, _, _, _ in run] for run in runs] == [[0, 1], [0, 1]], runs
    servers = {ppid for run in runs for _, ppid, _, _ in run}
    assert len(servers) == 1 and os.getpid() not in servers, runs
    server = psutil.Process(servers.pop())
    assert "forkserver" in " ".join(server.cmdline()) and server.ppid() == os.getpid()
    assert any("libtorch_cpu" in m.path for m in server.memory_maps()), "torch was not imported in the server"
    seeds = [seed for run in runs for _, _, _, seed in run]
    assert len(set(seeds)) == 4, seeds  # each rank of each launch seeded afresh, as a new interpreter
    monkeypatch.setenv("SHARDFN_PROBE", "set after the server started")
    assert [r[:3] for r in sf.launch(_where, nprocs=2)] == [(r, os.getpid(), "set after the server started") for r in (0, 1)]
    monkeypatch.delenv("SHARDFN_PROBE")
    assert {ppid for _, ppid, _, _ in sf.launch(_where, nprocs=2)} == {server.pid}  # the environment it started with


ORPHAN = r"""
import os, sys, time
import shardfn as sf

def sleep(marks):
    import torch.distributed as dist
    with open(os.path.join(marks, str(os.getpid())), "w") as f:
        f.write(str(os.getppid()))
    time.sleep(60)

if __name__ == "__main__":
    sf.launch(sleep, sys.argv[1], nprocs=2)
"""


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_warm_ranks_end_when_the_caller_is_killed(tmp_path):
    """A caller killed outright (the out-of-memory killer, kill -9) leaves no warm rank behind:
    torch's launcher would have them wait for it forever (Note [warm ranks])."""
    import signal

    script, marks = tmp_path / "orphan.py", tmp_path / "marks"
    script.write_text(ORPHAN)
    marks.mkdir()
    env = dict(os.environ, SHARDFN_WARM_LAUNCH="1", OMP_NUM_THREADS="1")
    caller = subprocess.Popen([sys.executable, str(script), str(marks)], env=env)
    try:
        deadline = time.time() + 60
        while len(os.listdir(marks)) < 2 and time.time() < deadline and caller.poll() is None:
            time.sleep(0.1)
        ranks = [int(p) for p in os.listdir(marks)]
        assert len(ranks) == 2, ranks
        parents = {int((marks / str(r)).read_text()) for r in ranks}
        assert len(parents) == 1 and caller.pid not in parents, parents  # forked from the server
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    deadline = time.time() + 15
    alive = ranks
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [r for r in ranks if _running(r)]
    for r in alive:
        os.kill(r, signal.SIGKILL)
    assert not alive, "warm ranks outlived their caller"


def test_a_forked_rank_takes_the_callers_environment(monkeypatch):
    """A rank forked from a server that someone else's code started, with another environment,
    still runs with the caller's (plus what torch's launcher set in it)."""
    from shardfn import _launch

    monkeypatch.setattr(_launch, "_BORN_ENV", {"A": "server's", "B": "only the server's"})
    for k in [*os.environ, "C"]:
        monkeypatch.delenv(k, raising=False)  # all put back afterwards, C (which _take_env sets) removed
    monkeypatch.setenv("A", "server's")
    monkeypatch.setenv("B", "only the server's")
    monkeypatch.setenv("RANK", "1")  # torch's launcher sets these after the rank is born
    _launch._take_env({"A": "caller's", "C": "caller's"})
    assert dict(os.environ) == {"A": "caller's", "C": "caller's", "RANK": "1"}


def _exits(how: str) -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if how == "exit0":
            sys.exit(0)
        if how == "exit":
            sys.exit()
        raise KeyboardInterrupt
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits on rank 1
    return dist.get_rank()


@pytest.mark.parametrize("how", ["exit0", "exit", "interrupt"])
def test_sys_exit_or_an_interrupt_in_a_rank_fails_fast(how):
    t0 = time.time()
    with pytest.raises(sf.RankError) as info:
        sf.launch(_exits, how, nprocs=2)
    assert info.value.rank == 1 and info.value.kind == "failed", info.value
    assert ("sys.exit" in str(info.value)) == how.startswith("exit"), info.value
    assert time.time() - t0 < 30


def test_bad_launch_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="nprocs"):
        sf.launch(print, nprocs=0)
    with pytest.raises(ValueError, match="callable"):
        sf.launch("train", nprocs=2)
    for bad in (-1, float("inf"), True):
        with pytest.raises(ValueError, match="timeout"):
            sf.launch(print, nprocs=2, timeout=bad)
    with pytest.raises(ValueError, match="cannot be sent"):
        sf.launch(lambda g: g, (x for x in range(3)), nprocs=2)  # a generator does not pickle


def test_collective_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHARDFN_TIMEOUT", "12.5")
    assert _watch.collective_timeout().total_seconds() == 12.5
    monkeypatch.setenv("SHARDFN_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SHARDFN_TIMEOUT"):
        _watch.collective_timeout()
    monkeypatch.delenv("SHARDFN_TIMEOUT")
    assert _watch.collective_timeout().total_seconds() == _watch.DEFAULT_TIMEOUT_S


def test_start_up_timeout_comes_from_the_environment_else_from_the_collective_one(monkeypatch):
    monkeypatch.delenv("SHARDFN_TIMEOUT", raising=False)
    monkeypatch.delenv("SHARDFN_STARTUP_TIMEOUT", raising=False)
    assert _watch.startup_timeout().total_seconds() == 600
    monkeypatch.setenv("SHARDFN_TIMEOUT", "1200")
    assert _watch.startup_timeout().total_seconds() == 1200  # unset: never below the collective timeout
    monkeypatch.setenv("SHARDFN_STARTUP_TIMEOUT", "5")
    assert _watch.startup_timeout().total_seconds() == 5  # set: as given
    monkeypatch.setenv("SHARDFN_STARTUP_TIMEOUT", "0")
    with pytest.raises(ValueError, match="SHARDFN_STARTUP_TIMEOUT"):
        sf.launch(print, nprocs=2)  # refused before any rank starts


def test_a_rank_that_never_arrives_is_named_at_start_up(monkeypatch):
    # Rank 1 of a two-rank job whose rank 0 holds the store but never arrives: after the start-up
    # bound, a RankError names rank 0. (`_meet` is what sf.mesh runs before it starts the process
    # group; called directly, as this process may hold a group from an earlier test.)
    import socket

    import torch.distributed as dist

    from shardfn import _mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    for k, v in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     SHARDFN_TIMEOUT="0.5", SHARDFN_STARTUP_TIMEOUT="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    t0 = time.time()
    with pytest.raises(sf.RankError, match=r"start-up: rank 0 did not reach sf.mesh within 1 s") as info:
        _mesh._meet(_mesh.job_env(), _watch.collective_timeout())
    assert info.value.rank == 0 and info.value.kind == "stalled"
    assert "SHARDFN_STARTUP_TIMEOUT" in str(info.value)
    assert time.time() - t0 < 20
    assert server.check(["shardfn/arrived/0/1"])


def _marks_teardown(marks: str, fail: bool) -> int:
    import torch.distributed as dist

    rank, destroy = dist.get_rank(), dist.destroy_process_group

    def recorded(*args, **kwargs):
        open(os.path.join(marks, str(rank)), "w").close()
        return destroy(*args, **kwargs)

    dist.destroy_process_group = recorded
    t = torch.ones(1)
    dist.all_reduce(t)
    if fail and rank == 1:
        raise ValueError("planted")
    import gc

    return rank, gc.get_freeze_count()  # Note [launch]: the start-up's objects are frozen


def test_a_rank_that_returned_destroys_its_process_group_at_exit(tmp_path):
    """Note [orderly exit]: gloo's threads are stopped while Python is whole (left to the
    interpreter's teardown they end a finished process with SIGABRT now and then); a rank that
    failed leaves its group to the exit, as a destroy could wait on a peer."""
    ok, failed = tmp_path / "ok", tmp_path / "failed"
    ok.mkdir(), failed.mkdir()
    out = sf.launch(_marks_teardown, str(ok), False, nprocs=2)
    assert [r for r, _ in out] == [0, 1] and all(frozen > 100_000 for _, frozen in out), out
    assert sorted(os.listdir(ok)) == ["0", "1"]
    with pytest.raises(sf.RankError):
        sf.launch(_marks_teardown, str(failed), True, nprocs=2)
    assert "1" not in os.listdir(failed)


def _returns_while_waited_on() -> str:
    import torch.distributed as dist

    x = sf.shard({"w": torch.arange(6.0)}, {"w": sf.P("dp")}, sf.mesh(dp=-1))
    if dist.get_rank() == 1:
        return "returned early"
    try:
        sf.gather(x)  # rank 1 never joins
    except sf.RankError as e:
        return f"caught {e.kind} of rank {e.rank}"
    return "gathered"


def test_a_rank_that_catches_the_rank_error_and_returns_ends_the_launch():
    """A rank that returned leaves when another waits on it; the one that waited catches the
    RankError and returns. The launch returns both results (it used to wait forever for the rank
    that left to wake in the launcher's wait)."""
    import threading

    out: list = []
    t = threading.Thread(target=lambda: out.append(sf.launch(_returns_while_waited_on, nprocs=2)), daemon=True)
    t0 = time.time()
    t.start()
    t.join(90)
    assert not t.is_alive(), "sf.launch did not return"
    assert out == [["caught returned of rank 1", "returned early"]], out
    assert time.time() - t0 < 60


def _dies_after_returning() -> int:
    import atexit
    import signal

    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:  # as gloo's threads did now and then in the interpreter's teardown
        atexit.register(os.kill, os.getpid(), signal.SIGABRT)
    return rank


def test_results_stand_when_a_rank_dies_while_its_process_ends(capfd):
    """Every rank returned; one was killed in its teardown (as a SIGABRT in the interpreter's
    exit did now and then): the function's results are complete, and the launch returns them,
    saying on stderr what happened."""
    assert sf.launch(_dies_after_returning, nprocs=2) == [0, 1]
    assert "after every rank had returned from the function" in capfd.readouterr().err


def _one_rank_skips_a_failed_step() -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    apply, params = sf.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), units=r"\d")
    calls = [0]

    def loss_fn(p, x):
        calls[0] += 1
        out = apply(p, x).pow(2).mean()
        if rank == 1 and calls[0] == 2:
            raise ValueError("planted in rank 1's loss")
        return out

    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), sf.mesh(dp=-1))
    state = step.init(params)
    said = []
    for _ in range(3):  # "skip a bad batch": every rank catches and goes on
        try:
            state, _ = step(state, torch.ones(2, 4))
        except Exception as e:  # noqa: BLE001
            said.append(f"{type(e).__name__}: {e}")
    if rank == 0:
        try:  # the process group is broken now: another collective says why
            sf.gather(state.params)
        except Exception as e:  # noqa: BLE001
            said.append(f"{type(e).__name__}: {e}")
        time.sleep(2)  # rank 1 explains its own timeout while rank 0 is still in its function
    return said if said else ["no error"]


def test_a_step_that_failed_on_one_rank_which_went_on_is_named():
    """Rank 1's step raised and rank 1 caught it and went on; rank 0, left waiting on it, gets a
    RankError naming rank 1's exception (after the collective timeout), not a bare gloo timeout, and
    so does rank 1 at its next step, which no other rank joins, and rank 0 at a collective after
    that."""
    out = sf.launch(_one_rank_skips_a_failed_step, nprocs=2, timeout=4)
    assert out[1][0].startswith("ValueError: planted"), out
    assert out[1][1].startswith("RankError: rank 1's last train step raised ValueError: planted in rank 1's loss, and "
                                "rank 1 went on"), out
    assert "the ranks are out of step" in out[1][1], out
    assert out[0][0].startswith("RankError: rank 1's train step raised ValueError: planted in rank 1's loss"), out
    # and a collective after it on rank 0 (gloo: "Application timeout caused pair closure") says the same
    assert out[0][-1].startswith("RankError: rank 1's train step raised") and "in sf.gather" in out[0][-1], out


def _every_rank_fails_a_step_then_one_stalls() -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    apply, params = sf.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), units=r"\d")
    fail = [False]

    def loss_fn(p, x):
        if fail[0]:
            raise ValueError("planted on every rank")
        return apply(p, x).pow(2).mean()

    step = sf.train_step(loss_fn, sf.optim.sgd(0.1), sf.mesh(dp=-1))
    state = step.init(params)
    for failing in (True, False, True, True):  # every rank raises, catches and goes on: still in step
        fail[0] = failing
        try:
            state, _ = step(state, torch.ones(2, 4))
        except ValueError:
            pass
    if rank == 1:
        time.sleep(8)  # stalls in its own code
        return "slept"
    try:
        sf.gather(state.params)
    except sf.RankError as e:
        return str(e)
    return "no error"


def test_a_step_that_failed_on_every_rank_is_not_taken_for_the_cause_of_a_later_stall():
    """Every rank's step raised the same error, each caught it and went on (together: Note [out of
    step]); later rank 1 stalls in its own code. Rank 0 names the stall, not the step every rank
    failed, which once named the wrong cause and kept the stalled rank from saying where it was."""
    said, slept = sf.launch(_every_rank_fails_a_step_then_one_stalls, nprocs=2, timeout=3)
    assert slept == "slept"
    assert "rank 1 stalled: it is running its own code" in said, said
    assert "went on" not in said and "planted" not in said, said


def test_a_rank_error_passed_on_is_named_once(tmp_path):
    """A rank's RankError, passed on by the launch, reads "RankError: rank 1 ...", not "RankError: RankError: ..."."""
    from shardfn import _launch

    _launch._write_error(str(tmp_path), 0, sf.RankError("rank 1 stalled: it is running its own code", 1, "stalled"))
    e = _launch._culprit(RuntimeError("a child failed"), str(tmp_path), 2)
    assert (e.rank, e.kind) == (1, "stalled")
    text = "".join(traceback.format_exception_only(e))
    assert text.startswith("shardfn.RankError: rank 1 stalled") and text.count("RankError") == 1, text
    assert _watch.exception_text(ValueError("bad")) == "ValueError: bad"
