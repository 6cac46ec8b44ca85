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


def rank_exchanges(thread: bool) -> dict:
    """Point to point against native, posting from the poster thread or from the calling one."""
    old, C.POST_FROM_THREAD = C.POST_FROM_THREAD, thread
    try:
        return _exchanges()
    finally:
        C.POST_FROM_THREAD = old


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
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("thread", [True, False])
def test_point_to_point_matches_native_collectives(pools, world, thread):
    for r in pools(world).run(rank_exchanges, thread):
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

    with RankPool(2, timeout=60, pg_timeout=10) as pool:
        with pytest.raises(RankError):
            pool.run(rank_mismatched_gather)
