"""Random numbers per rank: what each rank draws in a step and in per-shard code.

Note [randomness per rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Ranks seeded alike (as scripts do, `torch.manual_seed(0)` on every rank) draw alike: left as it
is, every data-parallel rank would get the same dropout masks at every step, correlated noise
over the global batch that no single process would see. JAX keys randomness explicitly and
folds the axis index in (`fold_in(key, axis_index("dp"))`); shardfn does the same to torch's
generator for a block: one number is drawn from the generator as it stands (the same on ranks
that agree), the block runs on a generator seeded from that number and the rank's index along
the axes, and afterwards the generator is where that one draw left it, the same on every rank
again. So a step draws different numbers on each data-parallel rank, the same on the tensor-
parallel peers of one (they share a data index, and their generators are made equal each step:
Note [randomness on tp peers] in `_tp.py`), and the training stays reproducible from the seed.
`train_step(..., randomness="same")` (and `value_and_grad`) keeps the generator as it stands
instead; inside `sf.shard_map`, `with sf.fold_rng(axis):` folds in the index along `axis`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ._manual import axis_group, axis_names

__all__ = ["folded", "fold_rng", "RANDOMNESS"]

RANDOMNESS = ("per_rank", "same")
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(base: int, index: int) -> int:
    x = (base ^ ((index + 1) * _GOLDEN)) & ((1 << 64) - 1)
    x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & ((1 << 63) - 1)


@contextlib.contextmanager
def folded(index: int, device_type: str) -> Iterator[None]:
    """The block draws from a generator seeded from one draw of the current one and `index`;
    afterwards the generator is as that one draw left it (Note [randomness per rank])."""
    base = int(torch.randint(0, 1 << 62, (1,), dtype=torch.int64).item())
    devices = [torch.cuda.current_device()] if device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        # Exactly the generators the fork restores: torch.manual_seed would seed every backend's
        # (queueing a CUDA seed, with a captured stack, where CUDA is not initialized yet).
        seed = _mix(base, index)
        torch.default_generator.manual_seed(seed)
        if devices:  # the current device, initialized by current_device(): seeded at once
            torch.cuda.manual_seed(seed)
        yield


@contextlib.contextmanager
def fold_rng(axis: "str | Sequence[str]") -> Iterator[None]:
    """Inside per-shard code: the block's random draws differ along `axis` (JAX's
    `fold_in(key, axis_index(axis))`), and agree along the other axes where the generators agreed.

    Every rank along `axis` must enter the block (one draw of the generator each). Afterwards the
    generator is as one draw left it.

    Example:
        >>> def fn(x):
        ...     with sf.fold_rng("dp"):
        ...         return torch.nn.functional.dropout(x, 0.1)
    """
    reg, axes = axis_names(axis, "fold_rng")
    with folded(axis_group(reg.mesh, axes).index, reg.mesh.device_type):
        yield
