"""Debug mode (`SHARDFN_DEBUG=1`, Note [freed memory] in shardfn/_debug.py): the same results as
without it, and a read of a freed unit's parameters stopped with an error naming the unit."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardfn as sf
from shardfn import _debug, _flat, _process
from reference import OPT, global_batch, local_batch, make_loss_fn, make_model, units_of

STEPS = 3

CONFIGS = {
    "full_shard": dict(strategy="full_shard"),
    # one unit per block: the slot arenas are shared; every large leaf received in place
    "full_shard_slots_in_place": dict(strategy="full_shard", group_bytes=0, small_segment=0),
    "shard_grad_op": dict(strategy="shard_grad_op", group_bytes=0),
    "no_shard": dict(strategy="no_shard"),
    "remat": dict(strategy="full_shard", group_bytes=0, remat=True),
    "accumulate": dict(strategy="full_shard", group_bytes=0, accumulation_steps=2),
    "bf16_clip": dict(strategy="full_shard", group_bytes=0, mp=True, max_grad_norm=0.05),
    # frozen leaves past the reduction's input in a shared slot: poisoned while the reduction runs
    "frozen_in_slots": dict(strategy="full_shard", group_bytes=0, small_segment=0, frozen=r"blocks\.\d+\.(fc|attn\.qkv)\.weight"),
}


def _train(cfg: dict, debug: bool) -> list[torch.Tensor]:
    """This rank's parameter shards after STEPS steps of the test GPT, debug mode on or off."""
    _debug.enable(debug)
    cfg = dict(cfg)
    old = _flat.SMALL_SEGMENT
    _flat.SMALL_SEGMENT = cfg.pop("small_segment", old)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        strategy = cfg.pop("strategy")
        mp = sf.MixedPrecision(torch.bfloat16, torch.float32) if cfg.pop("mp", False) else None
        mesh = sf.mesh(replicate=2, shard=-1) if strategy == "hybrid_shard" else sf.mesh(dp=-1)
        apply, params = sf.functionalize(make_model("gpt"), units=units_of("gpt"))
        step = sf.train_step(make_loss_fn("gpt", apply), sf.optim.adamw(**OPT), mesh, strategy=strategy, mixed_precision=mp, **cfg)
        state = step.init(params)
        for i in range(STEPS):
            state, _ = step(state, local_batch(global_batch("gpt", i, world, per_rank=2), rank, world))
        return [p.to_local().clone() for p in optree.tree_leaves(state.params)]
    finally:
        _flat.SMALL_SEGMENT = old
        _debug.enable(False)


def rank_same_with_debug(names: list[str], hybrid: bool) -> dict[str, bool]:
    """Per config: the shards after training with debug mode on equal, bit for bit, those without."""
    out = {}
    for name in names:
        cfg = dict(strategy="hybrid_shard", group_bytes=0) if hybrid else CONFIGS[name]
        off, on = _train(cfg, False), _train(cfg, True)
        out[name] = len(off) == len(on) and all(torch.equal(a, b) for a, b in zip(off, on))
    return out


# At world 3 (shards of uneven rows, p2p reduce-scatters with a scratch chunk) the configs that
# reuse memory most; world 2 runs them all.
AT_WORLD_3 = ["full_shard_slots_in_place", "remat", "accumulate", "bf16_clip", "frozen_in_slots"]


@pytest.mark.parametrize("world", [2, 3])
def test_debug_mode_changes_no_result(pools, world):
    for result in pools(world).run(rank_same_with_debug, list(CONFIGS) if world == 2 else AT_WORLD_3, False):
        assert all(result.values()), result


def test_debug_mode_changes_no_result_hybrid(pools):
    for result in pools(4).run(rank_same_with_debug, ["hybrid_shard"], True):
        assert all(result.values()), result


# -- a planted use after free -------------------------------------------------------------------
class _KeptInContext(torch.autograd.Function):
    """Doubles `x`; keeps `w` on its context (not `save_for_backward`, so autograd checks no version)
    and reads it in the backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 + ctx.w.sum(), None


class Block(nn.Module):
    """A block that keeps a reference to its own bias in its forward (a cache), and, when `other`
    is set, reads the bias another block kept: in its forward, an add, which saves nothing for the
    backward, or in its backward, through a custom Function's context. Either way a read of that
    block's freed parameters that autograd never sees."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.other: list = []  # [the block whose kept bias to read], outside the module tree
        self.kept = None

    def forward(self, x):
        self.kept = self.lin.bias
        h = torch.tanh(self.lin(x))
        if self.other and READ_FREED[0]:
            h = h + self.other[0].kept if READ_FREED[0] == "forward" else _KeptInContext.apply(h, self.other[0].kept)
        return h


READ_FREED: list = [None]


def rank_use_after_free(debug: bool, where: str = "forward") -> tuple[str, list[bool]]:
    """Trains a stack of blocks, one of which reads block 0's kept bias on the third step (block 1 in
    its forward, or block 3 in its backward, which comes before block 0's); returns the error (or "")
    and whether each step's loss was finite."""
    _debug.enable(debug)
    READ_FREED[0] = None
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(8) for _ in range(4)])
        model[1 if where == "forward" else 3].other.append(model[0])
        apply, params = sf.functionalize(model, units=r"\d+")

        def loss_fn(p, batch):
            return apply(p, batch).pow(2).mean()

        step = sf.train_step(loss_fn, sf.optim.sgd(0.1), sf.mesh(dp=-1), strategy="full_shard", group_bytes=0)
        state = step.init(params)
        finite = []
        for i in range(4):
            READ_FREED[0] = where if i == 2 else None  # slot arenas are planned after step 0: memory stays mapped
            try:
                state, m = step(state, torch.randn(4, 8, generator=torch.Generator().manual_seed(i)))
            except _debug.UseAfterFreeError as e:
                return str(e), finite
            finite.append(bool(torch.isfinite(m["loss"])))
        return "", finite
    finally:
        READ_FREED[0] = None
        _debug.enable(False)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_read_of_a_freed_unit_is_stopped_naming_it(pools, where):
    for err, finite in pools(2).run(rank_use_after_free, True, where):
        assert "unit '0'" in err and "freed" in err, err
        assert finite == [True, True]  # nothing before the planted read went wrong


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_without_debug_mode_the_read_is_silent(pools, where):
    # What debug mode is for: the same read computes on whatever the freed memory holds.
    for err, finite in pools(2).run(rank_use_after_free, False, where):
        assert err == "" and len(finite) == 4


def test_reset_puts_back_the_environments_debug_mode():
    _debug.enable(not _debug.ENV)
    _process.reset()
    assert _debug.enabled() is _debug.ENV


def test_a_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv("SHARDFN_DEBUG", "maybe")
    with pytest.raises(ValueError, match="SHARDFN_DEBUG=1"):
        _debug._from_env()
    for value, on in [("1", True), ("0", False), ("", False), ("on", True)]:
        monkeypatch.setenv("SHARDFN_DEBUG", value)
        assert _debug._from_env() is on


def test_poison_fills_without_moving_version_counters():
    x = torch.arange(10, dtype=torch.float32)
    v = x[2:5]
    before = v._version
    _debug.poison(v)
    assert torch.isnan(x[2:5]).all() and not torch.isnan(x[:2]).any() and v._version == before
    i = torch.zeros(4, dtype=torch.int32)
    _debug.poison(i)
    assert (i == int.from_bytes(b"\xa5" * 4, "little", signed=True)).all()


# -- memory given back under a collective in flight ----------------------------------------------
def rank_free_in_flight(mode: str) -> dict[str, str]:
    """Rank 0 starts an all-gather (or a reduce-scatter) that cannot complete yet (rank 1 joins a
    second later) and gives its output's storage back at once: debug mode refuses the free before
    it happens, naming the collective; once the collective is complete the same free goes through.
    Then a message posted into a buffer already given back is refused in the poster thread."""
    import time

    from shardfn import _collectives as C

    rank = dist.get_rank()
    out = {}
    _debug.enable(True)
    try:
        with C.gloo_collectives(mode):
            for op in ("all_gather", "reduce_scatter"):
                n = 1 << 16
                if op == "all_gather":
                    buf, src = torch.empty(2 * n), torch.full((n,), float(rank))
                    work = C.all_gather(buf, src, None)
                else:
                    src, buf = torch.ones(2 * n), torch.empty(n)
                    work = C.reduce_scatter(buf, src, None, scratch=True)
                if rank == 1:
                    time.sleep(1.0)
                if rank == 0:
                    try:
                        _flat._storage_free(buf)
                        out[op] = "freed"
                    except RuntimeError as e:
                        out[op] = str(e)
                C.wait(work)
                assert buf.untyped_storage().nbytes() == buf.numel() * 4  # the refused free left it whole
                _flat._storage_free(buf)  # complete: allowed
                C.barrier("the test")
            if rank == 0 and mode == "p2p":
                gone = torch.empty(16)
                gone.untyped_storage().resize_(0)
                try:
                    C._exchange(None, [], [(gone, 1, 12345)]).wait(10)
                    out["posted"] = "posted"
                except RuntimeError as e:
                    out["posted"] = str(e)
    finally:
        _debug.enable(_debug.ENV)
    return out


@pytest.mark.parametrize("mode", ["p2p", "native"])
def test_memory_given_back_under_a_collective_in_flight_is_refused(pools, mode):
    out = pools(2).run(rank_free_in_flight, mode)[0]
    for op, what in (("all_gather", "all-gather" if mode == "native" else "point-to-point exchange"),
                     ("reduce_scatter", "reduce-scatter" if mode == "native" else "point-to-point exchange")):
        assert out[op].startswith("a storage given back, while a " + what + " still in flight"), out
    if mode == "p2p":
        assert "posted into a buffer already given back" in out["posted"], out


def test_a_reset_names_the_collectives_left_in_flight(capsys):
    """What one test abandons in flight may still receive into memory the next one reuses: a reset
    in debug mode forgets it, and names on stderr those not complete."""
    _debug.enable(True)
    try:
        buf = torch.zeros(4)
        _debug.in_flight(lambda: False, [buf], "point-to-point exchange", object())
        _debug.in_flight(lambda: True, [buf], "all-reduce", object())  # complete: not named
        _process.reset()
    finally:
        _debug.enable(_debug.ENV)
    err = capsys.readouterr().err
    assert "1 collectives left in flight at a reset: ['point-to-point exchange']" in err, err
    assert not _debug._IN_FLIGHT


GUARD_PROBE = """
import ctypes, torch
n = 25600  # 100 KiB: glibc serves it from its heap (under its mmap threshold), the trap maps it
x = torch.empty(n)
usable = ctypes.CDLL(None).malloc_usable_size
usable.argtypes, usable.restype = [ctypes.c_void_p], ctypes.c_size_t
print("usable", usable(x.data_ptr()), flush=True)
p = x.data_ptr()
del x  # given back
ys = []  # smaller tensors (an aligned block of the same size may not fit the freed one)
for _ in range(64):  # until glibc hands the freed memory out again
    ys.append(torch.zeros(n // 4))
    if ys[-1].data_ptr() <= p + 1000 < ys[-1].data_ptr() + n:
        break
ctypes.memset(p + 1000, 7, 8)  # a late write into the freed block, as a message landing after the free
print("the write went unseen; another tensor changed:", any(bool(y.ne(0).any()) for y in ys), flush=True)
"""


def _build_guardmalloc(tmp_path) -> str:
    import shutil
    import subprocess

    from pathlib import Path

    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "a C compiler is needed (Inductor's C++ backend needs one too)"
    lib = tmp_path / "guardmalloc.so"
    src = Path(__file__).resolve().parents[1] / "scripts" / "guardmalloc.c"
    subprocess.run([gcc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src), "-lpthread"], check=True, timeout=60)
    return str(lib)


def test_the_guard_allocator_stops_a_write_into_freed_memory(tmp_path):
    """scripts/guardmalloc.c (the soak's `SOAK_GUARD=1`, docs/heap-corruption.md): a tensor's
    memory written after it was given back faults at once, naming the freed block and the stack
    that freed it; without the trap the same write lands, unseen, in the tensor allocated next."""
    import os
    import subprocess
    import sys

    lib = _build_guardmalloc(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    plain = subprocess.run([sys.executable, "-c", GUARD_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "the write went unseen; another tensor changed: True" in plain.stdout, plain.stdout + plain.stderr
    guarded = subprocess.run([sys.executable, "-c", GUARD_PROBE], env=dict(env, LD_PRELOAD=str(lib)), capture_output=True, text=True,
                             timeout=120)
    assert guarded.returncode == -11, (guarded.returncode, guarded.stdout, guarded.stderr[-3000:])
    assert "usable 102400" in guarded.stdout and "the write went unseen" not in guarded.stdout, guarded.stdout
    assert "inside a FREED block of 102400 bytes" in guarded.stderr, guarded.stderr[-3000:]
    assert "guardmalloc: the faulting thread:" in guarded.stderr, guarded.stderr[-3000:]


CANARY_PROBE = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
p = libc.malloc(102404)  # 60 bytes short of the guard page that follows it
offset = {"end": 102404 + 10, "start": -8, "header": -40, "none": 0}[sys.argv[1]]
ctypes.memset(p + offset, 7, 1)
libc.free(p)
print("freed", flush=True)
"""


@pytest.mark.parametrize("where,message", [("end", "a write past the end of a block of 102404 bytes"),
                                           ("start", "a write before the start of a block of 102404 bytes"),
                                           ("header", "the header before the block at"),
                                           ("none", None)])
def test_the_guard_allocator_names_a_write_just_outside_a_block(tmp_path, where, message):
    """Writes that stop short of the guard page (past a block's end) or land just before a block's
    start (over the header glibc's free reads, as in `munmap_chunk(): invalid pointer`) change a
    canary, and the block's free aborts naming them; a write inside the block changes none."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", CANARY_PROBE, where], env=dict(env, LD_PRELOAD=_build_guardmalloc(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    if message is None:
        assert out.returncode == 0 and "freed" in out.stdout, (out.returncode, out.stdout, out.stderr[-2000:])
    else:
        assert out.returncode == -6 and "freed" not in out.stdout, (out.returncode, out.stdout, out.stderr[-2000:])
        assert message in out.stderr and "found at its free" in out.stderr, out.stderr[-2000:]


def rank_unequal_gather(debug: bool) -> str:
    """A contrastive loss gathering embeddings over "dp" when the ranks' shares differ (5 rows over
    2 ranks: 3 and 2). Debug mode compares the operands' shapes first and names each rank's."""
    rank = dist.get_rank()
    mesh = sf.mesh(dp=-1)
    model = torch.nn.Linear(4, 4)
    apply, params = sf.functionalize(model)
    sharded = sf.shard(params, sf.specs(params, mesh), mesh)

    def loss_fn(p, x):
        e = apply(p, x)
        return (e @ sf.all_gather(e, "dp", tiled=True).T).mean()

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)).split([3, 2])[rank]
    _debug.enable(debug)
    try:
        sf.value_and_grad(loss_fn)(sharded, x)
    except ValueError as e:
        return str(e)
    finally:
        _debug.enable(False)
    return "NO ERROR"


def test_debug_mode_names_a_collective_of_unequal_shapes(pools):
    """Without debug mode gloo aborts the rank (unequal sizes in one all-gather); with it, every rank
    raises a ValueError naming each rank's shape before anything is sent. (The pool's ranks go on
    after it, together: Note [out of step].)"""
    for msg in pools(2).run(rank_unequal_gather, True):
        assert "sf.all_gather: the ranks passed tensors of different shapes" in msg, msg
        assert "rank 0: (3, 4) torch.float32, rank 1: (2, 4) torch.float32" in msg, msg
