"""Several nodes: the torchrun recipe run as two agents on localhost, the node layout of
`sf.mesh(replicate=-1, shard=-1)` (Note [node layout] in `shardfn/_mesh.py`), and the errors for a
job that does not fit the mesh or an environment that describes part of a job."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from reference import OPT, Reference, global_batch, local_batch, make_loss_fn, make_model, rel_err, units_of
from shardfn import _launch, _mesh

HERE = Path(__file__).parent
NODES, PER_NODE = 2, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    """Ends the agents started here and their workers, by pid: SIGTERM (an agent stops its
    workers), then SIGKILL for whatever is left."""
    import psutil

    mine = []
    for p in procs:
        try:
            mine += [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in mine:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(mine, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        p.wait(timeout=10)


def test_two_torchrun_nodes_train_as_one_process_on_the_global_batch(tmp_path):
    """The README's recipe, both "nodes" on localhost: `torchrun --nnodes 2 --nproc-per-node 2` with
    c10d rendezvous, started twice. hybrid_shard on sf.mesh(replicate=-1, shard=-1) shards within
    each node and replicates across them; it and full_shard over all four ranks match one process
    training on the concatenated batch; sf.launch returns every rank's result; sf.describe works."""
    out = tmp_path / "results.pt"
    env = dict(os.environ, SHARDFN_TIMEOUT="20", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{_free_port()}", "--rdzv-id", uuid.uuid4().hex,
           "--rdzv-conf", "join_timeout=60", str(HERE / "multinode_script.py"), str(out)]
    logs = [tmp_path / f"node{n}.log" for n in range(NODES)]
    procs = []
    try:
        for log in logs:
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path))
        deadline = time.monotonic() + 120  # start-up is most of it; a hang fails here, not at the suite's timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _stop(procs)
        pytest.fail("the two torchrun agents did not finish in 120 s:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    text = "\n".join(f"--- node {n}:\n{log.read_text()[-3000:]}" for n, log in enumerate(logs))
    assert [p.returncode for p in procs] == [0, 0], text

    results = torch.load(out, weights_only=False)
    world = NODES * PER_NODE
    assert [r["env"]["RANK"] for r in results] == [str(r) for r in range(world)], text  # sf.launch: every rank, in order
    node_of = {int(r["env"]["RANK"]): r["env"]["GROUP_RANK"] for r in results}
    assert sorted(set(node_of.values())) == ["0", "1"], node_of  # two agents, two "nodes"
    for rank, r in enumerate(results):
        # Shard within the node, replicate across the nodes (Note [node layout]).
        assert r["groups"]["shard"] == [q for q in range(world) if node_of[q] == node_of[rank]], (rank, r["groups"])
        assert [node_of[q] for q in r["groups"]["replicate"]] == ["0", "1"], (rank, r["groups"])
        assert r["layout"] == [[0, 1], [2, 3]], r["layout"]
        assert r["hybrid_shard"]["describe"].startswith(f"mesh replicate=2 x shard=2, rank {rank}\n"), r["hybrid_shard"]["describe"]
        assert r["full_shard"]["describe"].startswith(f"mesh dp=4, rank {rank}\n"), r["full_shard"]["describe"]

    # The single-process reference: the unsharded model, torch's AdamW, the concatenated batch.
    from multinode_script import STEPS

    ref = Reference(make_model("gpt"), "gpt")
    ref_losses = [ref.step(global_batch("gpt", i, world))[0] for i in range(STEPS)]
    want = ref.state_dict()
    for strategy in ("hybrid_shard", "full_shard"):
        for r in results:
            errs = [abs(a - b) / abs(b) for a, b in zip(r[strategy]["losses"], ref_losses)]
            assert len(errs) == STEPS and max(errs) < 1e-5, (strategy, r[strategy]["losses"], ref_losses)
        got = results[0][strategy]["params"]
        err = max(rel_err(got[n], want[n]) for n in want)
        assert err < 1e-5, (strategy, err)


# ---- a fault on one node stops the other --------------------------------------------------------

NODE_FAULTS = {
    # what node 1's rank says; each names node 0's rank with its node (Note [fail fast across nodes])
    "raise": "rank 0 (node 0) failed: ValueError: planted on node 0",
    "exit": "rank 0 (node 0) died without raising an exception",
    "kill": "rank 0 (node 0) died without raising an exception",
    "stall": "rank 0 (node 0) stalled",
}
FAULT_TIMEOUT_S = 4  # the collective timeout of the stall's job: its stall is named once it runs out
FAULT_DELAY_S = {"raise": 0.0, "exit": 4.0, "kill": 8.0, "stall": 12.0}  # apart: the jobs' ends do not pile up


@pytest.fixture(scope="module")
def node_faults(tmp_path_factory):
    """One two-node torchrun job per planted fault, all started at once, each node one rank
    (`--nproc-per-node 1`); every job's ranks wait for the others at step 2, then each plants
    its fault a few seconds apart. The first agent started is node 0 (the rendezvous orders nodes by
    address, then process id) and hosts the job's store (MASTER_ADDR:MASTER_PORT), which ends
    with it; node 1's agent hosts the rendezvous (`is_host`), so node 0's agent ending leaves it
    running: node 1 stops only if its rank does. Every agent is waited on with one bound; each
    one's end time is kept."""
    logs = tmp_path_factory.mktemp("faults")
    jobs: dict = {}
    for mode in NODE_FAULTS:
        env = dict(os.environ, OMP_NUM_THREADS="1", SHARDFN_TIMEOUT=str(FAULT_TIMEOUT_S if mode == "stall" else 60),
                   PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        port, run = _free_port(), uuid.uuid4().hex
        procs = []
        for node in range(NODES):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", run,
                   "--rdzv-conf", f"join_timeout=60,is_host={int(node == 1)}", str(HERE / "multinode_script.py"),
                   "fault", mode, str(logs), str(len(NODE_FAULTS)), str(FAULT_DELAY_S[mode])]
            with open(logs / f"{mode}.node{node}", "w") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=logs))
        jobs[mode] = procs
    ended: dict = {}
    deadline = time.monotonic() + 150  # start-up is most of it; a hang fails here
    while time.monotonic() < deadline and len(ended) < NODES * len(jobs):
        for mode, procs in jobs.items():
            for node, p in enumerate(procs):
                if (mode, node) not in ended and p.poll() is not None:
                    ended[mode, node] = time.time()
        time.sleep(0.1)
    yield jobs, ended, logs
    _stop([p for procs in jobs.values() for p in procs])


@pytest.mark.parametrize("mode", list(NODE_FAULTS))
def test_a_fault_on_one_node_stops_the_other_within_seconds_naming_the_rank(node_faults, mode):
    """A raise, an os._exit, a SIGKILL and a stall of node 0's rank: node 1's rank names it, with
    its node, and node 1's agent ends within 10 s of the fault (of the collective timeout running
    out, for the stall); node 0's ends too."""
    jobs, ended, logs = node_faults
    text = "\n".join(f"--- node {n}:\n{(logs / f'{mode}.node{n}').read_text()[-4000:]}" for n in range(NODES))
    full = [(logs / f"{mode}.node{n}").read_text() for n in range(NODES)]
    assert "rank 0 on node 0" in full[0] and "rank 1 on node 1" in full[1], text  # the nodes as the test means them
    mark = logs / f"{mode}.mark"
    assert mark.exists(), text
    planted = float(mark.read_text())
    assert (mode, 1) in ended and (mode, 0) in ended, ("an agent did not end", sorted(ended), text)
    took = ended[mode, 1] - planted
    named = logs / f"{mode}.named.1"
    named = float(named.read_text()) - planted if named.exists() else float("nan")
    print(f"{mode}: node 1's rank named it {named:.1f} s after the fault, node 1 stopped after {took:.1f} s, "
          f"node 0 after {ended[mode, 0] - planted:.1f} s")
    assert took < 10 + (FAULT_TIMEOUT_S if mode == "stall" else 0), (took, text)
    assert ended[mode, 0] - planted < 10 + (FAULT_TIMEOUT_S if mode == "stall" else 0), text
    assert [p.returncode for p in jobs[mode]] == [1, 1], text
    assert NODE_FAULTS[mode] in full[1], text


EXIT_WITH_THE_WATCH = r"""
import datetime, sys, torch.distributed as dist
from shardfn import _watch
_watch.BEAT_S = 0  # the watch thread calls the store without pause: the exit always meets it in a call
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
_watch._Watch("127.0.0.1", server.port, 0, 2, "exit-test/")
print("exiting", flush=True)
"""


def test_a_process_ends_cleanly_while_its_watch_thread_calls_the_store():
    """Note [watch thread at exit]: the node-0 worker's "terminate called without an active
    exception" (SIGABRT after its work was done) was the watch thread, a daemon, ended by the
    interpreter's finalization inside a store call. It is stopped and joined at exit now."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", EXIT_WITH_THE_WATCH], env=env, capture_output=True, text=True,
                           timeout=60)
        assert "exiting" in p.stdout, p.stderr[-2000:]
        assert p.returncode == 0 and "terminate called" not in p.stderr, (p.returncode, p.stderr[-2000:])


def test_a_store_slow_to_answer_is_reconnected_and_a_gone_one_dropped(monkeypatch):
    """Note [store links]: a store call that times out (a store slow under load) remakes the
    connection and asks again, so the link keeps the job's store; a store whose host is gone is
    dropped at once, without a reconnect. Before, the first failure of any kind left the link dead
    for the rest of the job."""
    import datetime

    from shardfn import _watch

    monkeypatch.setattr(_watch, "STORE_TIMEOUT_S", 0.5)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    link = _watch._Link("127.0.0.1", server.port, "links-test/")
    link.call(lambda st: st.set("failed", "the verdict"))
    first = link.store
    slow = [True]

    def read(st):
        if slow[0]:
            slow[0] = False
            st.wait(["never-written"])  # a call that times out, as a store slow to answer does
        return st.get("failed").decode()

    assert link.call(read) == "the verdict"
    assert (link.dead, link.remade) == (False, 1) and link.store is not first

    host = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as d\n"
                             "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
                             "print(s.port, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        gone = _watch._Link("127.0.0.1", int(host.stdout.readline()), "links-test/")
        gone.call(lambda st: st.set("seen/0", "1"))
    finally:
        host.kill()
        host.wait()
        host.stdout.close()
    with pytest.raises(_watch._Gone):
        gone.call(lambda st: st.check(["seen/0"]))
    assert (gone.dead, gone.remade) == (True, 0)  # a closed connection: gone, not reconnected
    with pytest.raises(_watch._Gone):
        gone.call(lambda st: st.get("seen/0"))  # and never asked again


def test_a_stall_read_in_the_verdict_asks_nobody_for_a_stack(monkeypatch):
    """Note [a stalled rank shows where]: the rank that finds a stall asks the stalled rank for its
    stack; a rank that reads the stall in the job's verdict (its text holds the stack) asks nobody,
    and never itself (a soak run showed "rank 1 was named stalled by rank 1"). Its RankError keeps
    the verdict's rank and kind."""
    import datetime

    from shardfn import _watch

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    w = _watch._Watch("127.0.0.1", server.port, 1, 2, "verdict-test/")
    monkeypatch.setattr(_watch, "_WATCH", [w])
    try:
        w.publish(1, "stalled", "rank 1 stalled: it is running its own code. Rank 1 was here: ...")
        asked: list = []
        monkeypatch.setattr(w, "stack_of", lambda r, wait_s: asked.append(r))
        e = _watch.explain(TimeoutError("Timed out"), "the train step")
        assert isinstance(e, sf.RankError) and (e.rank, e.kind) == (1, "stalled"), e
        assert asked == [] and w.get("dump/1") is None, asked
    finally:
        _watch._stop_at_exit(w)


NAMED_STALLED_WITHOUT_A_VERDICT = r"""
import datetime, time, torch.distributed as dist
from shardfn import _watch
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
w = _watch._Watch("127.0.0.1", server.port, 0, 2, "named-test/")
w.set("dump/0", "rank 1 (node 1)")  # rank 1 asks for this rank's stack...
time.sleep(60)  # ...while this rank stalls; no verdict is ever written where it can read it
print("not stopped", flush=True)
"""


def test_a_rank_named_stalled_stops_when_its_verdict_never_reaches_it():
    """Note [fail fast across nodes]: the rank that names a stalled rank on another node publishes
    the verdict after reading its stack, and may be gone with the store it wrote to before the
    stalled rank reads it. A rank asked for its stack counts the grace from then and ends itself,
    naming who named it (before: it ran on until its agent stopped it, 22 s late in a soak)."""
    env = dict(os.environ, GROUP_WORLD_SIZE="2", GROUP_RANK="0", LOCAL_RANK="0",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", NAMED_STALLED_WITHOUT_A_VERDICT], env=env, capture_output=True,
                       text=True, timeout=50)
    assert p.returncode == 1 and "not stopped" not in p.stdout, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "was named stalled by rank 1 (node 1)" in p.stderr, p.stderr[-3000:]
    assert ("shardfn: rank 0 (node 0) stalled: rank 1 (node 1) timed out waiting on it. Rank 0 (node 0) is "
            "stopped: the job's other ranks stopped on it") in p.stderr, p.stderr[-3000:]


FAIL_ON_A_NODE = r"""
import atexit, sys, threading, time
from shardfn import _watch

class Finalized:
    def __del__(self):
        print("finalized", flush=True)  # runs only in the interpreter's finalization

KEPT = Finalized()
def late_writer():
    time.sleep(0.5)
    print("thread done", flush=True)
threading.Thread(target=late_writer).start()  # not a daemon: the exit waits for it
atexit.register(lambda: print("exit handler ran", flush=True))
log = open(sys.argv[1], "w")  # left open: what it holds is flushed, not lost
log.write("last words")
_watch._install_hooks()
print("unbuffered", end="")
raise ValueError("planted")
"""


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_failed_rank_on_several_nodes_skips_only_the_finalization(nodes, tmp_path):
    """Note [a failed rank ends at once]: on several nodes a rank whose script raised ends as the
    interpreter would (traceback, non-daemon threads joined, exit handlers run, open files and
    streams flushed, status 1) but without the finalization, which took 2-9 s under load; on one node it exits as
    it always did."""
    env = dict(os.environ, GROUP_WORLD_SIZE=str(nodes), GROUP_RANK="0",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("SHARDFN_LAUNCHED", None)  # a torchrun rank, not one sf.launch started
    log = tmp_path / "log"
    p = subprocess.run([sys.executable, "-c", FAIL_ON_A_NODE, str(log)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert log.read_text() == "last words"
    assert "ValueError: planted" in p.stderr, p.stderr[-2000:]
    assert p.stdout.startswith("unbuffered"), p.stdout
    assert "thread done" in p.stdout and "exit handler ran" in p.stdout, p.stdout
    assert p.stdout.index("thread done") < p.stdout.index("exit handler ran"), p.stdout  # the interpreter's order
    assert ("finalized" in p.stdout) == (nodes == 1), p.stdout

# ---- the node layout, on one machine's ranks ------------------------------------------------------


def rank_node_layouts() -> dict:
    """sf.mesh(replicate=-1, shard=-1) under the node numbers torchrun would give (GROUP_RANK), and
    a hybrid step on a layout whose nodes are not contiguous blocks of ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    old = os.environ.pop("GROUP_RANK", None)
    out: dict = {}
    try:
        m = sf.mesh(replicate=-1, shard=-1)  # no GROUP_RANK: one host, one node
        out["one host"] = m.mesh.tolist()
        for name, node in [("blocks", rank // 2), ("strided", rank % 2), ("uneven", int(rank == 3))]:
            os.environ["GROUP_RANK"] = str(node)
            try:
                m = sf.mesh(replicate=-1, shard=-1)
            except ValueError as e:
                out[name] = str(e)
                continue
            out[name] = (m.mesh.tolist(), dist.get_process_group_ranks(m.get_group("shard")))
        os.environ["GROUP_RANK"] = str(rank // 2)
        out["pp"] = sf.mesh(pp=2, replicate=-1, shard=-1).mesh.tolist()

        # hybrid_shard on the strided layout: shards over {0, 2} and {1, 3}, equal to the reference.
        os.environ["GROUP_RANK"] = str(rank % 2)
        mesh = sf.mesh(replicate=-1, shard=-1)
        model = make_model("mlp")
        ref = Reference(model, "mlp")
        apply, params = sf.functionalize(model, units=units_of("mlp"))
        step = sf.train_step(make_loss_fn("mlp", apply), sf.optim.adamw(**OPT), mesh, strategy="hybrid_shard")
        state = step.init(params)
        errs = []
        for i in range(2):
            batch = global_batch("mlp", i, world)
            state, metrics = step(state, local_batch(batch, rank, world))
            errs.append(abs(metrics["loss"].item() - ref.step(batch)[0]))
        full = sf.to_state_dict(sf.gather(state.params), apply)
        errs += [rel_err(full[n], t) for n, t in ref.state_dict().items()]
        out["strided step"] = max(errs)
    finally:
        os.environ.pop("GROUP_RANK", None)
        if old is not None:
            os.environ["GROUP_RANK"] = old
    return out


def test_a_mesh_laid_out_by_node_shards_within_each_node(pools):
    res = pools(4).run(rank_node_layouts)
    for rank, r in enumerate(res):
        assert r["one host"] == [[0, 1, 2, 3]], r
        assert r["blocks"] == ([[0, 1], [2, 3]], [0, 1] if rank < 2 else [2, 3]), r
        assert r["strided"] == ([[0, 2], [1, 3]], [0, 2] if rank % 2 == 0 else [1, 3]), r
        assert "the nodes hold different numbers of ranks (3, 1)" in r["uneven"] and "--nproc-per-node" in r["uneven"], r
        assert r["pp"] == [[[0, 1]], [[2, 3]]], r
        assert r["strided step"] < 1e-5, r


# ---- errors before anything starts ---------------------------------------------------------------


@pytest.fixture
def no_group(monkeypatch):
    """A process without a process group, where starting one fails the test: every error below must
    come before that."""
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def never(*a, **k):
        raise AssertionError("a process group was started")

    monkeypatch.setattr(dist, "init_process_group", never)
    monkeypatch.setattr(_launch, "_spawn", never)
    return monkeypatch


JOB = dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="node0", MASTER_PORT="29500")


@pytest.mark.parametrize("env, says", [
    (dict(RANK="1"), "RANK='1' is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not"),
    (dict(RANK="0", WORLD_SIZE="4"), "RANK='0', WORLD_SIZE='4' are set but MASTER_ADDR, MASTER_PORT are not"),
    (dict(WORLD_SIZE="4", MASTER_ADDR="node0", MASTER_PORT="29500"), "are set but RANK is not"),
    (dict(JOB, RANK="4"), "RANK='4' in the environment: it must be an int in [0, 3]"),
    (dict(JOB, WORLD_SIZE="four"), "WORLD_SIZE='four' in the environment: it must be an int >= 1"),
    (dict(JOB, MASTER_PORT="0"), "MASTER_PORT='0'"),
    (dict(JOB, LOCAL_WORLD_SIZE="8"), "LOCAL_WORLD_SIZE='8' in the environment: it must be an int in [1, 4]"),
])
def test_a_partial_torchrun_environment_is_refused_before_anything_starts(no_group, env, says):
    for k, v in env.items():
        no_group.setenv(k, v)
    for call in (lambda: sf.mesh(dp=-1), lambda: sf.launch(print)):
        with pytest.raises(ValueError) as info:
            call()
        assert says in str(info.value), info.value
        assert "torchrun" in str(info.value), info.value


@pytest.mark.parametrize("world, local, axes, says", [
    (6, 2, dict(replicate=4, shard=-1), "sf.mesh(replicate=4, shard=-1): the axes of fixed size take 4 ranks, which do "
                                        "not divide the job's 6: start the job with a multiple of 4 ranks"),
    (6, 2, dict(replicate=2, shard=2), "sf.mesh(replicate=2, shard=2) has 4 ranks but the job has 6: give sizes whose "
                                       "product is 6"),
    (6, 4, dict(replicate=-1, shard=-1), "axis 'shard' spans the ranks of one node (4, LOCAL_WORLD_SIZE), but the job's "
                                         "6 ranks (WORLD_SIZE) are not a whole number of nodes"),
    (8, 4, dict(replicate=-1, shard=-1, tp=3), "the axes after 'shard' take 3 ranks, which do not divide the 4 ranks of a node"),
    (8, 4, dict(pp=3, replicate=-1, shard=-1), "take 3 nodes, which do not divide the job's 2 nodes (8 ranks, 4 per node)"),
    (8, 4, dict(a=-1, b=-1, c=-1), "at most two axes may be -1"),
    (8, 4, dict(dp=0), "axis 'dp' has size 0"),
])
def test_a_job_that_does_not_fit_the_mesh_is_refused_before_anything_starts(no_group, world, local, axes, says):
    for k, v in dict(JOB, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local)).items():
        no_group.setenv(k, v)
    with pytest.raises(ValueError) as info:
        sf.mesh(**axes)
    assert says in str(info.value), info.value


def test_master_address_alone_is_one_process(no_group):
    # Some shells and cluster templates export MASTER_ADDR/MASTER_PORT: without RANK and WORLD_SIZE
    # they describe no job, and the process is a job of its own.
    no_group.setenv("MASTER_ADDR", "node0")
    no_group.setenv("MASTER_PORT", "29500")
    assert _mesh.job_env() is None


def test_one_process_gets_a_one_rank_node_mesh():
    m = sf.mesh(replicate=-1, shard=-1)
    assert m.mesh.tolist() == [[0]] and m.mesh_dim_names == ("replicate", "shard")
