"""What stays process-wide in shardfn, named in one place.

Note [process-wide state]
-------------------------
Everything a step, a transform or a hook needs on its way is held by an object the call owns: the
engine (units, schedule, plan), the model's info (names, units, and the runtimes active on it,
Note [unit runtime] in `_runtime.py`), the train step or transform. Nothing on a path the backward
takes reads a global or a thread-local. What is left belongs to the process, one per process by
nature (process groups, the watch's heartbeat), or is a cache or a setting:

| where | what | kind |
|---|---|---|
| `_collectives._GROUPS` | per process group: rank map and point-to-point tag counters (weak keys) | process groups |
| `_collectives._POSTER` | the thread that posts point-to-point messages | process |
| `_collectives.STATS` | collective counts and bytes since the last reset | counters |
| `_collectives.GLOO_COLLECTIVES`, `POST_FROM_THREAD` | how gloo collectives run | settings |
| `_mesh._AXES_GROUPS` | per mesh: the process group over several of its axes (weak keys) | process groups |
| `_checkpoint._background_group`, `_in_flight` | background saves' group, the save running | process groups, process |
| `_watch._WATCH`, `WHERE`, `FAILED_HERE`, `_STEP_FAILED`, `PG_TIMEOUT_S` | fail fast: heartbeat, where this rank is, whether it failed | process |
| `_models.REGISTRY` | the live functionalized models (weakly held) | cache |
| `_functorch._transforms` | the torch.func transforms `sf.gather` ran under, weakly held, read only in a forward to name a sharded leaf read directly | cache |
| `_memory._madvise`, `HUGE_PAGES` | the madvise function found, huge pages on or off | cache, setting |
| `_meta_init._state` | the construction being recorded under `sf.meta_device()` (thread-local: construction only, never a backward) | thread |

`reset()` puts back what one test may leave for the next: the counters, and models nobody holds.
Process groups, the watch (whose failure flags pair with records in the job's store) and settings
stay (tests change settings only inside context managers that restore them).
"""

from __future__ import annotations

from . import _collectives, _functorch, _models

__all__ = ["reset"]


def reset() -> None:
    """Clears the collective counters and forgets models and transforms nobody holds."""
    _collectives.STATS.reset()
    _models.REGISTRY.prune()
    _functorch._transforms[:] = [r for r in _functorch._transforms if _functorch._live(r)]
