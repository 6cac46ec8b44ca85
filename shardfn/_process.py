"""What stays process-wide in shardfn, named in one place.

Note [process-wide state]
-------------------------
Everything a step, a transform or a hook needs on its way is held by an object the call owns: the
engine (units, schedule, plan), the model's info (names, units, and the runtimes active on it,
Note [unit runtime] in `_runtime.py`), the train step or transform. What is left belongs to the
process, one per process by nature (process groups, the watch's heartbeat), or is a cache, a counter
or a setting, all in the table below.

On a path the backward takes, only the collectives' and the watch's globals are read or written,
never a thread-local, so a backward on another thread than its forward sees the same: a unit's
reduce-scatter (and the prefetched all-gather) reads `_collectives.GLOO_COLLECTIVES` (and, point to
point, `POST_FROM_THREAD` and the `_POSTER` thread), adds to `_collectives.STATS`, and takes the next
tag from its group's counter in `_collectives._GROUPS`; waiting on it sets `_watch.WHERE.waiting`;
in debug mode it is remembered in `_debug._IN_FLIGHT` until waited for.
The torch.func check of a DTensor meeting a differentiated scalar (`_functorch.install_mixing_check`)
returns inside a backward before it reads `_functorch._transforms`.

| where | what | kind |
|---|---|---|
| `_collectives._GROUPS` | per process group: rank map and point-to-point tag counters (weak keys) | process groups |
| `_collectives._POSTER` | the thread that posts point-to-point messages | process |
| `_collectives.STATS` | collective counts and bytes since the last reset | counters |
| `_collectives.GLOO_COLLECTIVES`, `POST_FROM_THREAD` | how gloo collectives run | settings |
| `_collectives.GATHER_BUCKET_BYTES`, `_flat.SMALL_SEGMENT` | the bytes one packed all-gather of `full_tensors` receives at most; which sharded leaves count as small (gathered together, Note [flat unit layout]) | settings |
| `_mesh._MESHES` | the meshes `sf.mesh` and the context-parallel step built, one per layout and axis names, with the default group they were made under (Note [one mesh per layout]) | process groups |
| `_mesh._AXES_GROUPS` | per mesh (by identity, `ByMesh`): the process group over several of its axes | process groups |
| `_manual._GROUPS` | per mesh (by identity) and axes named in `sf.shard_map` collectives: the process group over them | process groups |
| `_checkpoint._background_group`, `_in_flight` | background saves' group, the save running | process groups, process |
| `_watch._WATCH`, `WHERE`, `FAILED_HERE`, `TOLD`, `RETURNED`, `_STEPS_ENDED`, `_STEP_FAILED`, `_LINGER`, `PG_TIMEOUT_S` | fail fast: the watch thread and the stores, where this rank is, whether it failed, was told of a failure or returned, the steps it ended and the last if it raised | process |
| `_layouts._ASKING` | how many asked-for relayouts (`sf.constrain`, sequence parallelism's gathers) are moving data now: their gathers are no fallback | process |
| `_models.REGISTRY` | the live functionalized models (weakly held) | cache |
| `_functorch._transforms` | the torch.func transforms `sf.gather` ran under, weakly held, read only in a forward to name a sharded leaf read directly | cache |
| `_memory._madvise`, `HUGE_PAGES` | the madvise function found, huge pages on or off | cache, setting |
| `_debug.ON` (from `SHARDFN_DEBUG`, kept in `_debug.ENV`), `_debug._UNITS`, `_debug._IN_FLIGHT` | the debug mode on or off (Note [freed memory]); every flat unit, weakly held, to name a freed one; in debug mode, the async collectives in flight with the memory they hold | setting, cache, process |
| `_meta_init._state` | the construction being recorded under `sf.meta_device()` (thread-local: construction only, never a backward) | thread |
| `_manual._LOCAL` | the `sf.shard_map` regions open on this thread (thread-local: read in a region's forward; its collectives' backwards hold their groups) | thread |
| `torch.nn.functional.scaled_dot_product_attention` | torch's own: swapped for ring attention while a context-parallel step runs, put back after it (Note [context parallelism] in `_context.py`) | process |
| `_dtensor_mends._REGISTERED` | whether the sharding strategies for CPU's fused attention are registered with DTensor (`register_sharding`, once per process) | process |
| DTensor's op dispatcher (`_custom_op_handlers`, `_try_replicate_spec_for_scalar_tensor`) | torch's own, process-wide: the handlers `_dtensor_mends` (and `_tp`'s dropout) and `_forward_ad` add and the check `_functorch.install_mixing_check` wraps in (each idempotent) | process |
| `_tp._LIVE` | the live `TensorParallel` steerings by id (weakly held): the graph op that counts a compiled unit's steering (`shardfn::count_steering`) takes constants, not the object (Note [compiled units]) | cache |
| torch's op registry: `shardfn::count`, `shardfn::count_steering` (`torch.library.custom_op`, marked by `torch.fx.node.has_side_effect`) | the ops that count collectives traced into a compiled unit, on every run of its graph (registered at import) | process |
| `_launch._BORN_ENV` | this process's environment when shardfn was imported: a rank tells from it what torch's launcher set since, and keeps that over its caller's environment (Note [warm ranks]) | process |
| `_launch._WARM` | the process that started the warm server, and the environment it started with (Note [warm ranks]) | process |
| glibc's `M_MMAP_THRESHOLD`, `M_TRIM_THRESHOLD` (`mallopt`, by `_peak.PeakMeter`) | 64 KiB (trim 128 KiB) while a meter runs (`_peak._METERS_OPEN` counts them); after the first measurement, fixed at the environment's `GLIBC_TUNABLES` `glibc.malloc.mmap_threshold` (`trim_threshold`), else `MALLOC_MMAP_THRESHOLD_` (`MALLOC_TRIM_THRESHOLD_`), else 32 MiB (64 MiB): glibc offers no way back to its own sliding threshold (Note [measured peak] in `_peak.py`; the heap-corruption notes in `docs/heap-corruption.md`) | process |

`reset()` puts back what one test may leave for the next: the counters, models nobody holds, the
collectives debug mode remembered (those not complete are named on stderr: a message may still land
in their memory), and the debug mode as the environment set it (tests switch it with `_debug.enable`). Process groups, the watch (whose failure flags pair with records in the job's store) and settings
stay (tests change settings only inside context managers that restore them).
"""

from __future__ import annotations

import sys

from . import _collectives, _debug, _functorch, _models

__all__ = ["reset"]


def reset() -> None:
    """Clears the collective counters, forgets models and transforms nobody holds and the
    collectives debug mode remembered, and puts the debug mode back as the environment set it."""
    _collectives.STATS.reset()
    left = _debug.forget_in_flight()
    if left:  # debug mode only: what the previous code abandoned may still receive (Note [freed memory])
        print(f"shardfn debug mode: {len(left)} collectives left in flight at a reset: {sorted(set(left))}", file=sys.stderr)
    _debug.enable(_debug.ENV)
    _models.REGISTRY.prune()
    _functorch._transforms[:] = [r for r in _functorch._transforms if _functorch._live(r)]
