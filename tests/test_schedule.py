"""The unit schedule as a state machine (Note [the schedule's moves] in shardfn/_schedule.py), on a
recording `Buffers`: the moves of a 3-unit full_shard step and each unit's state along it."""

from __future__ import annotations

import torch.distributed as dist

from shardfn._engine import Policy
from shardfn._schedule import ROOT, ReductionStarted, Schedule, UnitState


class _Recorder:
    """A `Buffers` that records what the schedule asks of it."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def before_collective(self):
        pass

    def start_gather(self, u):
        self.calls.append(("gather", u))
        return ("work", u)

    def finish_gather(self, u, work, timeout=None):
        assert work == ("work", u)
        self.calls.append(("wait", u))

    def free(self, u):
        self.calls.append(("free", u))

    def gathers_in_place(self, u):
        return False

    def reduces_in_slot(self, u, live):
        return False

    def start_reduce(self, u, pair, in_slot, accumulate):
        self.calls.append(("reduce", u))
        return ("reduction", u)

    def finish_reduce(self, u, pending, timeout=None):
        self.calls.append(("reduced", u))

    def keep_grads(self, u):
        self.calls.append(("keep", u))

    def release_idle_slots(self, live):
        pass

    def release_slot(self, u):
        pass

    def release_gathered(self, u):
        pass

    def release_all(self):
        self.calls.append(("release_all", ROOT))


def _step(s: Schedule, b: _Recorder) -> dict:
    """One forward and backward of units 0, 1, 2 (one trained leaf each, inputs needing a gradient),
    the states seen at each point."""
    seen = {}
    s.begin(accumulate=False, reduce_now=True)
    seen["begin"] = [s.state(u) for u in (0, 1, 2, ROOT)]
    for u in range(3):
        s.forward_starts(u)
        s.inputs_hooked(u)
        assert s.state(u) == UnitState.GATHERED
        s.forward_ends(u)
    seen["forward over"] = [s.state(u) for u in (0, 1, 2)]
    s.forward_over()
    s.backward()
    for u in (2, 1, 0):
        s.backward_starts(u)
        assert s.state(u) == UnitState.GATHERED
        s.grad_ready(u)
        assert s.state(u) == UnitState.GATHERED  # its use is not over yet: its inputs' gradients come next
        s.use_over(u)
        seen[f"after {u}"] = s.state(u)
    assert s.end() is not None or s.planned
    seen["end"] = [s.state(u) for u in (0, 1, 2, ROOT)]
    return seen


def test_a_full_shard_step_moves_as_the_paper_and_keeps_the_last_unit():
    policy = Policy(reshard_after_forward=True, share_slots=False)
    b = _Recorder()
    s = Schedule(policy, ["u0", "u1", "u2"], {0: 1, 1: 1, 2: 1, ROOT: 1}, (), b)
    first = _step(s, b)
    assert first["begin"] == [UnitState.GATHERING, UnitState.SHARDED, UnitState.SHARDED, UnitState.GATHERED], first
    # The first forward does not know the order yet: every unit is freed after its forward.
    assert first["forward over"] == [UnitState.SHARDED] * 3, first
    assert all(first[f"after {u}"] in (UnitState.REDUCING, UnitState.REDUCED) for u in range(3)), first
    assert first["end"] == [UnitState.SHARDED] * 4, first  # the step is over: shards only, until the next
    assert s.order_known and s.order == [0, 1, 2] and s.last_ran == 2
    b.calls.clear()
    s.planned = True
    second = _step(s, b)
    # Once the order is known the last unit stays gathered from its forward to its backward.
    assert second["forward over"] == [UnitState.SHARDED, UnitState.SHARDED, UnitState.GATHERED], second
    gathers = [u for what, u in b.calls if what == "gather"]
    assert gathers == [ROOT, 0, 1, 2, 1, 0], gathers  # one gather fewer than twice per unit
    reduces = [u for what, u in b.calls if what == "reduce"]
    assert reduces == [2, 1, 0, ROOT], reduces
    assert s.stats.max_live_units <= policy.max_live
    # Every gather is waited for before the unit is freed or the step ends; every reduction too.
    assert sum(1 for what, _ in b.calls if what == "wait") == len(gathers)
    assert sum(1 for what, _ in b.calls if what == "reduced") == len(reduces)


def test_local_accumulation_keeps_the_gradients_and_reduces_nothing():
    b = _Recorder()
    s = Schedule(Policy(reshard_after_forward=False, share_slots=False), ["u0"], {0: 1, ROOT: 0}, (), b)
    s.begin(accumulate=False, reduce_now=False)
    s.forward_starts(0)
    s.forward_ends(0)
    assert s.state(0) == UnitState.GATHERED  # shard_grad_op: kept to its backward
    s.forward_over()
    s.backward()
    s.backward_starts(0)
    s.grad_ready(0)
    assert ("keep", 0) in b.calls and not any(what == "reduce" for what, _ in b.calls), b.calls
    s.end()


class _PeerGone(_Recorder):
    """A `Buffers` whose all-gather of one unit fails while waited for (a peer died), `fails` times."""

    def __init__(self, unit: int, fails: int):
        super().__init__()
        self.unit, self.fails = unit, fails

    def finish_gather(self, u, work, timeout=None):
        if u == self.unit and self.fails:
            self.fails -= 1
            raise RuntimeError("Connection closed by peer")
        super().finish_gather(u, work, timeout)


def test_a_gather_whose_wait_raised_stays_in_flight_until_abort_waits_for_it():
    # Its buffers may still receive messages from the other peers: nothing may free them before
    # the gather completes (Note [freed memory] in shardfn/_debug.py).
    for fails, abort_completes in ((1, True), (2, False)):
        b = _PeerGone(unit=0, fails=fails)
        s = Schedule(Policy(reshard_after_forward=True, share_slots=False), ["u0", "u1"], {0: 1, 1: 1, ROOT: 1}, (), b)
        s.begin(accumulate=False, reduce_now=True)
        try:
            s.forward_starts(0)
        except RuntimeError:
            pass
        else:
            raise AssertionError("the failed wait did not raise")
        assert 0 in s.works, "a gather whose wait raised left the schedule's works: its buffers could be freed"
        if abort_completes:
            s.abort(timeout=1.0)  # waited for again: complete now
            assert not s.works and b.calls.count(("wait", 0)) == 1, b.calls
        else:
            try:
                s.abort(timeout=1.0)
            except RuntimeError:
                pass  # the engine keeps the buffers and refuses later steps (Engine.abort)
            else:
                raise AssertionError("abort did not report a gather that failed again")
            assert 0 in s.works


class _ReduceFailsHalfWay(_Recorder):
    """A `Buffers` whose reduction of one unit fails after its first collective started."""

    def __init__(self, unit: int):
        super().__init__()
        self.unit = unit

    def start_reduce(self, u, pair, in_slot, accumulate):
        if u == self.unit:
            try:
                raise RuntimeError("the all-reduce could not be issued")
            except RuntimeError as e:
                raise ReductionStarted(("reduction", u)) from e
        return super().start_reduce(u, pair, in_slot, accumulate)

    def finish_reduce(self, u, pending, timeout=None):
        assert pending == ("reduction", u), pending
        super().finish_reduce(u, pending, timeout)


def test_a_reduction_that_failed_half_way_stays_in_flight_until_abort_waits_for_it():
    # Its reduce-scatter still writes the gradient shard and reads its input: nothing may free
    # them before it completes (Note [freed memory] 9 in shardfn/_debug.py).
    b = _ReduceFailsHalfWay(unit=0)
    s = Schedule(Policy(reshard_after_forward=True, share_slots=False), ["u0"], {0: 1, ROOT: 1}, (), b)
    s.begin(accumulate=False, reduce_now=True)
    s.forward_starts(0)
    s.forward_ends(0)
    s.forward_over()
    s.backward()
    s.backward_starts(0)
    try:
        s.grad_ready(0)
    except RuntimeError as e:
        assert not isinstance(e, ReductionStarted) and "could not be issued" in str(e), repr(e)  # the failure itself
    else:
        raise AssertionError("the failed reduction did not raise")
    assert [u for u, *_ in s.in_flight] == [0], "what the failed reduction started left the schedule: its buffers could be freed"
    s.abort(timeout=1.0)
    assert b.calls.count(("reduced", 0)) == 1 and not s.in_flight, b.calls


def test_a_flat_unit_whose_all_reduce_fails_after_its_reduce_scatter_started_says_what_started(monkeypatch):
    import torch

    from shardfn import _collectives
    from shardfn._flat import Arena, FlatUnit, LeafSpec

    leaves = [LeafSpec(0, "w", torch.Size([4, 3]), sharded=True, trained=True), LeafSpec(1, "b", torch.Size([3]), sharded=False, trained=True)]
    unit = FlatUnit("u", leaves, torch.float32, torch.float32, torch.float32, group=None, world=2, rank=0, device="cpu")
    sizes = unit.sizes()
    unit.bind({k: Arena(max(n, 1), torch.float32, "cpu", shared=False) for k, n in sizes.items()}, reduce_in_full=False)
    for p in unit.proxies:
        p.grad = torch.ones_like(p)
    started = []

    def reduce_scatter(out, inp, group, async_op=True, scratch=False):
        started.append("reduce_scatter")
        return "reduce-scatter in flight"

    def all_reduce(t, group, async_op=False):
        raise RuntimeError("the all-reduce could not be issued")

    monkeypatch.setattr(_collectives, "reduce_scatter", reduce_scatter)
    monkeypatch.setattr(_collectives, "all_reduce", all_reduce)
    rs = [Arena(64, torch.float32, "cpu", shared=False) for _ in range(2)]
    try:
        unit.start_reduce(False, rs[0], rs[1])
    except ReductionStarted as e:
        assert started == ["reduce_scatter"] and e.pending[0] == ["reduce-scatter in flight"], e.pending
        assert "could not be issued" in str(e.__cause__)
    else:
        raise AssertionError("start_reduce did not say what had started")


# ---- the step after a broken one (Note [freed memory] 10 in `_debug.py`) -------------------------

def rank_steps_after_a_broken_step() -> dict:
    """A step, then the engine left broken as `Engine.abort` leaves it when a collective it waits
    for does not complete (a peer alive and silent: a message may still land in the buffers it
    kept), then another step."""
    import torch.nn.functional as F

    import shardfn as sf
    from reference import GPT_UNITS, global_batch, local_batch, make_model

    rank = dist.get_rank()
    apply, params = sf.functionalize(make_model("gpt"), units=GPT_UNITS)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply(p, x).flatten(0, 1), y.flatten())

    step = sf.train_step(loss_fn, sf.optim.adamw(1e-2), sf.mesh(dp=2))
    state = step.init(params)
    state, _ = step(state, local_batch(global_batch("gpt", 0, 2), rank, 2))
    units = list(step.core.units.values())
    held = [u.grad.untyped_storage().nbytes() for u in units]  # the reductions' outputs
    step.core.engine.broken = "broken: restart the processes"
    out: dict = {}
    try:
        step(state, local_batch(global_batch("gpt", 1, 2), rank, 2))
    except RuntimeError as e:
        out["error"] = str(e)
    out["grad_bytes"] = (held, [u.grad.untyped_storage().nbytes() for u in units])
    return out


def test_a_step_after_a_broken_one_refuses_before_it_gives_back_any_buffer(pools):
    """Before: the step after a broken one gave the gradient shards back (`resize_(0)`) and only then
    refused, while a reduce-scatter its abort could not finish may still write into them."""
    for r in pools(2).run(rank_steps_after_a_broken_step):
        assert r["error"] == "broken: restart the processes", r
        before, after = r["grad_bytes"]
        assert any(before) and after == before, r
