"""`sf.TrainState`: what a train step carries from one step to the next."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["TrainState", "params_of"]


class TrainState(NamedTuple):
    """What a train step carries from one step to the next.

    Attributes:
        params: the parameter tree, DTensor leaves holding this rank's shards (fp32 master weights).
        opt_state: the optimizer state, sharded like `params`.
        step: the number of steps taken.
    """

    params: Any
    opt_state: Any
    step: int = 0


def params_of(tree: Any) -> Any:
    """A train state's parameter tree; any other tree as it is."""
    return tree.params if isinstance(tree, TrainState) else tree
