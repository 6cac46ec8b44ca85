"""The collectives layer: gloo's point-to-point all-gather and reduce-scatter against the native ones.

Note [gloo collectives] replaces gloo's all-gather and reduce-scatter with point-to-point messages.
These checks compare them bit for bit (all-gather) or to rounding (reduce-scatter) with
`torch.distributed`'s own collectives, on even and uneven world sizes, with several calls in flight
and waited out of order, empty shards, bf16, and the bytes counted.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardfn import _collectives as C


def _data(rank: int, n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g).to(dtype)


def rank_exchanges(post: str) -> dict:
    """Point to point against native, posting from the poster thread, from the calling one, or as
    one batch (`dist.batch_isend_irecv`), as on NCCL (Note [point-to-point on NCCL]): on gloo the
    batch's messages are the same, so this checks each one's peer, tag and buffer."""
    old = C.POST_FROM_THREAD, C._posts_as_batch, dist.batch_isend_irecv
    batches = []

    def counted(ops):
        batches.append(len(ops))
        return old[2](ops)

    C.POST_FROM_THREAD = post == "thread"
    if post == "batch":
        C._posts_as_batch = lambda group: True
        dist.batch_isend_irecv = counted
    try:
        out = _exchanges()
    finally:
        C.POST_FROM_THREAD, C._posts_as_batch, dist.batch_isend_irecv = old
    out["batched"] = bool(batches) == (post == "batch")
    return out


def _exchanges() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    out: dict = {}
    # All-gather: several in flight, waited in reverse order; sizes 0, 1 and large; fp32 and bf16.
    sizes = [(7, torch.float32), (0, torch.float32), (1, torch.bfloat16), (4099, torch.bfloat16), (300_001, torch.float32)]
    with C.gloo_collectives("p2p"):
        C.STATS.reset()
        pending, results = [], []
        for i, (n, dt) in enumerate(sizes):
            res = torch.full((world * n,), float("nan"), dtype=dt)
            pending.append(C.all_gather(res, _data(rank, n, i, dt), group, async_op=True))
            results.append(res)
        for w in reversed(pending):
            w.wait()
        ag_stats = (dict(C.STATS.calls), dict(C.STATS.bytes_sent))
    with C.gloo_collectives("native"):
        C.STATS.reset()
        for i, (n, dt) in enumerate(sizes):
            ref = torch.empty(world * n, dtype=dt)
            C.all_gather(ref, _data(rank, n, i, dt), group, async_op=False)
            out[f"ag{i}"] = torch.equal(results[i], ref)
        out["ag_stats_equal"] = ag_stats == (dict(C.STATS.calls), dict(C.STATS.bytes_sent))
    # In-place all-gather: the input is this rank's chunk of the output.
    with C.gloo_collectives("p2p"):
        buf = torch.zeros(world * 5)
        buf.view(world, 5)[rank] = rank + 1
        C.all_gather(buf, buf.view(world, 5)[rank], group, async_op=False)
        out["ag_in_place"] = torch.equal(buf, torch.arange(1, world + 1).float().repeat_interleave(5))

    # Reduce-scatter, with and without scratch, in flight together with an all-gather.
    for scratch in (False, True):
        got, want = [], []
        with C.gloo_collectives("p2p"):
            C.STATS.reset()
            pend = []
            for i, (n, dt) in enumerate(sizes):
                inp = _data(rank, world * n, 50 + i, dt)
                res = torch.full((n,), float("nan"), dtype=dt)
                pend.append(C.reduce_scatter(res, inp, group, async_op=True, scratch=scratch))
                got.append(res)
            g_out = torch.empty(world * 3)
            g = C.all_gather(g_out, torch.full((3,), float(rank)), group, async_op=True)
            for w in reversed(pend):
                w.wait()
            g.wait()
            rs_stats = (dict(C.STATS.calls), dict(C.STATS.bytes_sent))
        with C.gloo_collectives("native"):
            C.STATS.reset()
            for i, (n, dt) in enumerate(sizes):
                res = torch.empty(n, dtype=dt)
                C.reduce_scatter(res, _data(rank, world * n, 50 + i, dt), group, async_op=False)
                want.append(res)
            C.all_gather(torch.empty(world * 3), torch.zeros(3), group, async_op=False)
            out[f"rs_stats_equal_{scratch}"] = rs_stats == (dict(C.STATS.calls), dict(C.STATS.bytes_sent))
        for i, (a, b) in enumerate(zip(got, want)):
            # Sums of W bf16 values round at each addition, in an order that differs from gloo's.
            tol = 2 ** -8 * world if a.dtype == torch.bfloat16 else 1e-6
            out[f"rs{i}_{scratch}"] = bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=4 * tol))
        out[f"rs_ag_{scratch}"] = torch.equal(g_out, torch.arange(world).float().repeat_interleave(3))
    # A reduce-scatter without scratch leaves its input as it was.
    with C.gloo_collectives("p2p"):
        inp = _data(rank, world * 11, 99)
        keep = inp.clone()
        C.reduce_scatter(torch.empty(11), inp, group, async_op=False)
        out["rs_input_kept"] = torch.equal(inp, keep)
    # A permutation: a ring, and a send to every peer with one receive.
    got = C.permute_blocking(torch.full((4,), float(rank)), [(rank + 1) % world], (rank - 1) % world, group, "a ring")
    out["ring"] = torch.equal(got, torch.full((4,), float((rank - 1) % world)))
    got = C.permute_blocking(torch.full((3,), float(rank + 1)), list(range(world)) if rank == 0 else [], 0, group, "from 0")
    out["from_0"] = torch.equal(got, torch.ones(3))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("post", ["thread", "calling", "batch"])
def test_point_to_point_matches_native_collectives(pools, world, post):
    for r in pools(world).run(rank_exchanges, post):
        bad = [k for k, ok in r.items() if not ok]
        assert not bad, bad


def test_mode_is_validated():
    with pytest.raises(ValueError, match="one of"):
        with C.gloo_collectives("fast"):
            pass
    assert C.GLOO_COLLECTIVES == "p2p"


def rank_mismatched_gather() -> list:
    r = dist.get_rank()
    n = 4 if r == 0 else 5  # a collective mismatch: the ranks disagree on the size
    out = torch.zeros(dist.get_world_size() * n)
    C.all_gather(out, torch.full((n,), float(r + 1)), dist.group.WORLD, async_op=False)
    return out.tolist()


def test_mismatched_sizes_fail_loudly():
    """Where gloo's own all-gather hands one rank garbage, the point-to-point one stops the ranks."""
    from shardfn._pool import RankError, RankPool

    with RankPool(2, timeout=60, pg_timeout=10, warm=True) as pool:
        with pytest.raises(RankError):
            pool.run(rank_mismatched_gather)


# ---- every collective through `_collectives` (Note [every collective here]) ----------------------

_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list",
}
_DTENSOR_COLLECTIVES = {"full_tensor", "redistribute"}  # DTensor methods that communicate
_ALLOWED = {"_collectives.py"}  # process-group set-up (_mesh, _pool, _launch) issues no collective


def _direct_collectives(path) -> list[str]:
    """`torch.distributed` collectives (and DTensor's) that the module at `path` calls itself."""
    import ast

    tree = ast.parse(path.read_text())
    aliases = {"torch.distributed"}  # names bound to torch.distributed (or its c10d module)
    direct = set()  # collectives imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.distributed") and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            direct |= {a.asname or a.name for a in node.names if a.name in _COLLECTIVES}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in direct:
            found.append(f"{path.name}:{node.lineno} {f.id}")
        elif isinstance(f, ast.Attribute):
            owner = ast.unparse(f.value)
            if f.attr in _COLLECTIVES and owner in aliases:
                found.append(f"{path.name}:{node.lineno} {owner}.{f.attr}")
            elif f.attr in _DTENSOR_COLLECTIVES and owner not in ("C", "_collectives"):
                found.append(f"{path.name}:{node.lineno} .{f.attr}")
    return found


def test_no_module_issues_a_collective_but_collectives():
    """Every collective shardfn issues is counted and watched: none goes to torch.distributed (or
    through a DTensor's gathers) from another module."""
    from pathlib import Path

    root = Path(C.__file__).parent
    found = [hit for p in sorted(root.rglob("*.py")) if p.name not in _ALLOWED for hit in _direct_collectives(p)]
    assert not found, f"collectives issued outside shardfn/_collectives.py: {found}"
    # The scan sees the spellings it is for.
    import tempfile
    from pathlib import Path as P

    with tempfile.TemporaryDirectory() as d:
        probe = P(d) / "probe.py"
        probe.write_text(
            "import torch\nimport torch.distributed as dist\nfrom torch.distributed import barrier as b\n"
            "dist.all_reduce(t)\ntorch.distributed.broadcast_object_list(x)\nb()\nx.full_tensor()\n"
        )
        assert [h.split(" ")[1] for h in _direct_collectives(probe)] == [
            "dist.all_reduce", "torch.distributed.broadcast_object_list", "b", ".full_tensor"
        ], _direct_collectives(probe)


def rank_planted_stalls(tmp: str, timeout_s: float, after_s: float) -> list:
    """Rank 1 does not enter a collective of each shardfn call in turn; rank 0 waits in it until
    the process group's short timeout (`timeout_s`) and reports the error it got. Before each plant
    the ranks meet on the job's store and start a new default group (a gloo timeout closes the
    old one); the last has the pool's own timeout (`after_s`), for the tests that follow."""
    import datetime
    import os

    import shardfn as sf
    from shardfn import _watch
    from shardfn.optim import clip_by_global_norm

    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()  # keeps the job's store up across the groups
    _watch.start()  # as sf.mesh or sf.launch start it: rank 1's heartbeat says where it is

    def new_group(k: int, seconds: float) -> None:
        dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=seconds)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"plant/{k}/", store), rank=rank, world_size=2, timeout=timeout)

    def sharded():
        mesh = sf.mesh(dp=-1)
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 2)
        apply, params = sf.functionalize(lin)
        # sync=None: rank 0 alone shards (its peer is away): the agreement would be the stall
        return mesh, apply, sf.shard(params, {"weight": sf.P("dp"), "bias": sf.P()}, mesh, sync=None)

    def save():
        _, _, params = sharded()
        sf.save({"params": params}, os.path.join(tmp, "ckpt"))

    def export():
        _, _, params = sharded()
        sf.export(params, os.path.join(tmp, "model.safetensors"))

    def clip():
        _, _, params = sharded()
        clip_by_global_norm(1.0).update(params, None)

    def per_sample():
        _, apply, params = sharded()
        loss = lambda p, x: apply(p, x).pow(2).sum()  # noqa: E731
        sf.per_sample_grad_norms(loss, apply=apply)(params, torch.ones(3, 4))

    def ppermute():
        ring = sf.shard_map(lambda x: sf.ppermute(x, "dp", [(0, 1), (1, 0)]), mesh=sf.mesh(dp=-1), in_specs=sf.P("dp"), out_specs=sf.P("dp"))
        ring(torch.ones(4, 3))

    plants = {"sf.save": save, "sf.export": export, "sf.optim.clip_by_global_norm": clip, "sf.per_sample_grad_norms": per_sample,
              "sf.ppermute": ppermute}
    out = []
    if rank == 1:  # Note [a stalled rank shows where]: its stderr, kept to read back
        import os
        import sys
        import tempfile

        sys.stderr.flush()
        kept, caught = os.dup(2), tempfile.TemporaryFile(mode="w+")
        os.dup2(caught.fileno(), 2)
    for k, (name, fn) in enumerate(plants.items()):
        new_group(k, timeout_s)
        if rank == 0:
            try:
                fn()
                out.append((name, "returned", None, ""))
            except sf.RankError as e:
                out.append((name, e.kind, e.rank, str(e)))
            except Exception as e:  # noqa: BLE001 - reported to the test
                out.append((name, type(e).__name__, None, str(e)))
            store.set(f"plant/{k}", "done")
        else:
            store.wait([f"plant/{k}"])  # outside any shardfn call, as a rank stuck in its own code is
    if rank == 1:
        import time

        end = time.monotonic() + 10
        while time.monotonic() < end:  # the watch thread prints within a beat of being asked
            caught.seek(0)
            said = caught.read()
            if said.count("was named stalled by rank 0") >= len(plants) and "rank_planted_stalls" in said:
                break
            time.sleep(0.1)
        sys.stderr.flush()
        os.dup2(kept, 2)
        os.close(kept)
        out.append(("stderr", said))
    new_group(len(plants), after_s)
    t = torch.ones(1)
    dist.all_reduce(t)  # the pool's ranks work together again
    return [*out, t.item()]


def test_a_stall_in_any_collective_is_named(pools, tmp_path):
    """A checkpoint save, an export, the clip's global norm, a per-sample norm and a shard_map's
    ppermute whose peer never comes: the waiting rank gets a RankError naming the stalled rank and the call, as for a
    stalled gather."""
    results = pools(2).run(rank_planted_stalls, str(tmp_path), 2.5, 60.0)
    *got, together = results[0]
    assert together == 2 and len(got) == 5, got
    said = results[1][0][1]  # the stalled rank's stderr: Note [a stalled rank shows where]
    assert said.count("rank 1 was named stalled by rank 0; where each of its threads is now:") == 5, said
    assert "in rank_planted_stalls" in said and "Current thread" in said, said  # its main thread, in its own code
    for name, kind, rank, msg in got:
        assert (kind, rank) == ("stalled", 1), (name, kind, rank, msg)
        assert f"while rank 0 timed out waiting on it in {name}" in msg, (name, msg)
        # and where rank 1 was: in its own code, waiting on the store (Note [a stalled rank shows where])
        assert "Rank 1 was here (its main thread, innermost last):" in msg and "in rank_planted_stalls" in msg, msg


def rank_mesh_groups_and_counts() -> dict:
    """`mesh_group` over one, several and all axes; the counts of the watched collectives."""
    import pickle

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardfn._mesh import mesh_group

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("x", "y", "z"))
    ranks = lambda g: dist.get_process_group_ranks(g)  # noqa: E731
    out["all_axes_world"] = mesh_group(mesh) is dist.group.WORLD
    out["one_axis"] = ranks(mesh_group(mesh, "x")) == list(range(world)) and mesh_group(mesh, 0) is mesh_group(mesh, "x")
    xy = mesh_group(mesh, ("x", "y"))
    out["two_axes"] = ranks(xy) == list(range(world)) and mesh_group(mesh, ("y", "x")) is xy  # made once
    out["two_axes_alone"] = ranks(mesh_group(mesh, ("y", "z"))) == [rank]
    t = torch.tensor([float(rank + 1)])
    C.STATS.reset()
    C.all_reduce_blocking(t, xy, "a test")
    out["sum"] = t.item() == world * (world + 1) / 2
    t = torch.tensor([float(rank + 1)])
    C.all_reduce_blocking(t, xy, "a test", op="max")
    out["max"] = t.item() == world
    obj = {"rank": rank, "pad": "x" * rank}
    out["objects"] = C.all_gather_object(obj, "a test") == [{"rank": r, "pad": "x" * r} for r in range(world)]
    out["broadcast"] = C.broadcast_object(f"from {rank}", "a test", src=1) == "from 1"
    # A tensor broadcast (the agreement on the model at init): point to point on gloo, so that no
    # thread of gloo's holds the buffer after it returns (Note [a broadcast's buffer]).
    import weakref

    native, dist.broadcast = dist.broadcast, None  # not called on this path
    try:
        for group in (None, xy):
            buf = torch.full((1000, 7), float(rank))
            C.broadcast(buf, 1, group)
            out[f"tensor_broadcast_{group is None}"] = torch.equal(buf, torch.full((1000, 7), 1.0))
            ref = weakref.ref(buf)
            del buf
            out[f"tensor_broadcast_{group is None}_gone"] = ref() is None
    finally:
        dist.broadcast = native
    C.barrier("a test")
    x = distribute_tensor(torch.arange(6.0 * world), init_device_mesh("cpu", (world,)), [Shard(0)])
    out["full"] = torch.equal(C.full_tensor(x, "a test"), torch.arange(6.0 * world))
    out["replicated"] = torch.equal(C.redistribute(x, x.device_mesh, [Replicate()], "a test").to_local(), torch.arange(6.0 * world))
    sent = 6 * 4 * (world - 1)  # each rank's 6 fp32 to every peer
    want_calls = {"all_reduce": 2, "all_gather_object": 1, "barrier": 1, "all_gather": 1, "redistribute": 1, "broadcast": 2}
    if rank == 1:
        want_calls["broadcast_object"] = 1
    out["calls"] = C.STATS.calls == want_calls or C.STATS.calls
    out["bytes"] = (
        C.STATS.bytes_sent["all_gather_object"] == len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) * (world - 1)
        and C.STATS.bytes_sent["all_gather"] == sent
        and C.STATS.bytes_sent["redistribute"] == sent
    ) or dict(C.STATS.bytes_sent)
    return out


def test_mesh_groups_and_the_watched_collectives_counts(pools):
    for r in pools(3).run(rank_mesh_groups_and_counts):
        bad = {k: ok for k, ok in r.items() if ok is not True}
        assert not bad, bad


def rank_equal_meshes_keep_their_own_groups() -> dict:
    """A ppermute over `tp` of a new mesh while an older, equal mesh (DeviceMesh's `==` compares
    layouts) is still alive on half of the ranks only, as the garbage collector may leave it."""
    import gc
    import weakref

    import shardfn as sf

    rank = dist.get_rank()
    swap = [(0, 1), (1, 0)]

    def run(mesh):
        f = sf.shard_map(lambda x: sf.ppermute(x * 2, "tp", swap), mesh=mesh, in_specs=sf.P(("dp", "tp")), out_specs=sf.P(("dp", "tp")))
        return sf.gather(f(torch.arange(8.0)))

    from shardfn._manual import axis_group

    from torch.distributed.device_mesh import init_device_mesh

    # Meshes the user builds (sf.mesh hands out one mesh per layout: Note [one mesh per layout]).
    old = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    axis_group(old, ("tp",))  # what a collective over tp of `old` keeps (DTensor's caches would keep `old` alive)
    kept = [old] if rank % 2 == 0 else []
    gone = weakref.ref(old)
    del old
    gc.collect()
    new = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    got = run(new)
    want = torch.arange(8.0).view(2, 2, 2).flip(1).flatten() * 2  # each dp pair's two tp blocks swapped
    return {"equal": kept[0] == new if kept else gone() is None, "value": torch.equal(got, want) or (got, want)}


def test_equal_meshes_keep_their_own_process_groups(pools):
    """shardfn keeps a mesh's groups by the mesh's identity: a map by equality handed ranks 0 and 2
    the dead-on-1-and-3 mesh's tp groups, and the ring waited on two process groups forever."""
    for r in pools(4).run(rank_equal_meshes_keep_their_own_groups):
        assert r == {"equal": True, "value": True}, r


def _gloo_loops() -> int:
    """The gloo event-loop threads of this process: one per process group it holds a connection of."""
    import os

    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # a thread that ended meanwhile
    return names.count("gloo_tcp_loop")


def rank_meshes_asked_for_again() -> dict:
    import shardfn as sf
    from shardfn._context import ContextParallel

    mesh = sf.mesh(dp=2, tp=2)
    flat = ContextParallel(sf.mesh(dp=2, cp=2), sf.P(None, "cp")).flat  # the cp step's data mesh
    before = _gloo_loops()
    again = [sf.mesh(dp=2, tp=2) for _ in range(5)]
    again_flat = [ContextParallel(sf.mesh(dp=2, cp=2), sf.P(None, "cp")).flat for _ in range(3)]
    same = _gloo_loops()
    other = sf.mesh(tp=2, dp=2)  # another layout: a mesh, and groups, of its own
    return {
        "same mesh": all(m is mesh for m in again) and all(f is flat for f in again_flat),
        "same groups": all(m.get_group("tp") is mesh.get_group("tp") for m in again),
        "no new groups": same == before or (before, same),
        "a new layout is new": (other is not mesh and _gloo_loops() > same) or (same, _gloo_loops()),
    }


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in Linux's /proc")
def test_a_mesh_asked_for_again_is_the_same_and_makes_no_process_group(pools):
    """Note [one mesh per layout]: each DeviceMesh of two axes made new gloo groups, kept by torch
    until the job ends, each with a thread that wakes while idle: 120 of them cost each idle rank of
    four 18% of a core, and 360 made an all-reduce 5x slower (the suite's pools slowed down 3x)."""
    for r in pools(4).run(rank_meshes_asked_for_again):
        assert all(v is True for v in r.values()), r


def test_a_mesh_is_made_anew_once_the_default_group_has_ended():
    import shardfn as sf

    was = dist.is_initialized()  # a one-process group in this process, as a notebook's
    try:
        a = sf.mesh(x=1, y=1)
        assert sf.mesh(x=1, y=1) is a and sf.mesh(y=1, x=1) is not a
        dist.destroy_process_group()
        b = sf.mesh(x=1, y=1)  # a new default group: the old mesh's groups ended with the old one
        assert b is not a and sf.mesh(x=1, y=1) is b
        t = torch.ones(3)
        dist.all_reduce(t, group=b.get_group("x"))
        assert torch.equal(t, torch.ones(3))
    finally:
        if not was and dist.is_initialized():
            dist.destroy_process_group()  # later test modules expect no group here


def test_a_map_by_mesh_is_by_identity():
    from shardfn._mesh import ByMesh

    class Equal:  # as DeviceMesh: equal to any other over the same ranks
        __eq__ = lambda self, other: True  # noqa: E731
        __hash__ = lambda self: 0  # noqa: E731

    m, a, b = ByMesh(), Equal(), Equal()
    assert m.setdefault(a, "a") == "a" and m.setdefault(b, "b") == "b" and m.setdefault(a, "x") == "a"
    del a
    import gc

    gc.collect()
    assert len(m) == 1 and m.setdefault(b, "y") == "b"


def rank_stall_on_a_2d_mesh(timeout_s: float, after_s: float) -> tuple:
    """Rank 3 stays out of a psum over `tp` of a (dp=2, tp=2) mesh, its own code running; its tp
    peer, rank 2, waits in it. The default group has a short timeout (`timeout_s`), which the
    mesh's tp groups must take (Note [one collective timeout]); then the pool's (`after_s`)."""
    import datetime
    import time

    import shardfn as sf
    from shardfn import _watch

    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    _watch.start()

    def new_group(k: int, seconds: float) -> None:
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"plant2d/{k}/", store), rank=rank, world_size=4,
                                timeout=datetime.timedelta(seconds=seconds))

    new_group(0, timeout_s)
    mesh = sf.mesh(dp=2, tp=2)
    total = sf.shard_map(lambda x: sf.psum(x, "tp"), mesh=mesh, in_specs=sf.P(("dp", "tp")), out_specs=sf.P("dp"))
    got = None
    start = time.monotonic()
    if rank == 3:
        store.wait(["plant2d/done"])  # outside any shardfn call
    else:
        try:
            got = ("value", total(torch.arange(8.0)).to_local().tolist())
        except sf.RankError as e:
            got = (e.kind, e.rank, str(e))
        if rank == 2:
            store.set("plant2d/done", "1")
    took = time.monotonic() - start
    new_group(1, after_s)
    t = torch.ones(1)
    dist.all_reduce(t)  # the pool's ranks work together again
    return got, took, t.item()


def test_a_stall_on_a_2d_mesh_is_named_after_the_jobs_timeout(pools):
    """Torch makes a DeviceMesh's axis groups with its own default timeout (30 minutes for gloo);
    `sf.mesh` gives them the job's, so the stall is named within seconds, not half an hour."""
    r = pools(4).run(rank_stall_on_a_2d_mesh, 2.5, 60.0)  # unnamed, it would wait out the pool's 120 s bound
    (kind, rank, text), _, together = r[2]
    assert (kind, rank) == ("stalled", 3) and "rank 3" in text, text
    assert r[0][0] == r[1][0] == ("value", [2.0, 4.0]), r[:2]  # dp row 0: its tp pair [0, 1] + [2, 3]
    assert together == 4
