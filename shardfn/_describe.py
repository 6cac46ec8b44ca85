"""`sf.describe`: how a parameter tree (or a train state) is laid out over the mesh, leaf by leaf.

The whole-tree analogue of JAX's `visualize_array_sharding`: one row per leaf with its dotted path,
global shape, partition spec, this rank's local shape, the bytes this rank holds and the padding
its shard has to the largest shard of the leaf (a dim split as `torch.chunk` does gives the last
ranks fewer rows, or none; collectives move shards padded to the largest). Totals per rank
follow, for the parameters and, for a `TrainState`, the optimizer state: each is the bytes of this
rank's shards padded to their leaves' largest, so the same on every rank and, for sharded leaves,
the padded whole divided by the number of shards. It prints as text and renders as an HTML table in a notebook.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from ._spec import P, axis_names, shard_slices, spec_of
from ._state import TrainState
from ._tree import tree_flatten_with_paths

__all__ = ["describe", "Description"]


@dataclass(frozen=True)
class Row:
    path: str
    shape: tuple
    spec: str
    local_shape: tuple
    nbytes: int
    padding: int  # bytes of padding to the even chunk size


def _spec_of(x: DTensor) -> P:
    """The partition spec of DTensor `x` (axes named `dim0`, `dim1`, ... on a mesh without names)."""
    return spec_of(x.placements, x.device_mesh, x.dim())


def _row(path: str, x: Any) -> Row:
    if isinstance(x, DTensor):
        local = x._local_tensor
        spec = _spec_of(x)
        mesh = x.device_mesh
        # The largest shard is the first along every axis (torch.chunk's first chunk is the
        # longest): the even size every shard pads to.
        names = axis_names(mesh)
        largest = shard_slices(spec, x.shape, dict(zip(names, mesh.shape)), dict.fromkeys(names, 0))
        padded = math.prod(b.stop - b.start for b in largest)
        pad = (padded - local.numel()) * local.element_size()
        return Row(path, tuple(x.shape), repr(spec), tuple(local.shape), local.numel() * local.element_size(), pad)
    return Row(path, tuple(x.shape), "(not sharded)", tuple(x.shape), x.numel() * x.element_size(), 0)


def _tensor_leaves(tree: Any) -> list[tuple[str, Any]]:
    paths, leaves, _ = tree_flatten_with_paths(tree)
    return [(p, x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


class Description:
    """The rows and totals of `sf.describe`; `str()` is a text table, `_repr_html_` an HTML one.

    Attributes:
        rows: one per parameter leaf.
        totals: {"params": bytes, "optimizer state": bytes} on this rank, padding included: the bytes
            of this rank's shards padded to their leaves' largest shard.
    """

    HEADER = ("leaf", "global shape", "spec", "local shape", "bytes on this rank", "padding")

    def __init__(self, rows: list[Row], totals: dict[str, int], mesh: str):
        self.rows, self.totals, self.mesh = rows, totals, mesh

    def _cells(self) -> list[tuple[str, ...]]:
        return [(r.path, str(r.shape), r.spec, str(r.local_shape), _mb(r.nbytes), _mb(r.padding) if r.padding else "") for r in self.rows]

    def __str__(self) -> str:
        cells = [self.HEADER, *self._cells()]
        widths = [max(len(c[i]) for c in cells) for i in range(len(self.HEADER))]
        lines = [self.mesh]
        for k, c in enumerate(cells):
            lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += [f"total {name} on this rank, padding included: {_mb(n)}" for name, n in self.totals.items()]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.HEADER)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in c) + "</tr>" for c in self._cells())
        totals = "".join(f"<li>total {html.escape(k)} on this rank, padding included: {_mb(n)}</li>" for k, n in self.totals.items())
        return f"<p>{html.escape(self.mesh)}</p><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><ul>{totals}</ul>"


def describe(tree_or_state: Any) -> Description:
    """Describes how a parameter tree, or a train state, is laid out on this rank.

    Args:
        tree_or_state: a pytree of tensors or DTensors (`sf.shard`, `state.params`, gradients), or
            an `sf.TrainState` (its parameters, plus totals for its optimizer state).

    Returns:
        A `Description`: print it, or let a notebook render it as HTML.

    Example:
        >>> print(sf.describe(state))
    """
    if isinstance(tree_or_state, TrainState):
        params, extra = tree_or_state.params, {"optimizer state": tree_or_state.opt_state}
    else:
        params, extra = tree_or_state, {}
    rows = [_row(p, x) for p, x in _tensor_leaves(params)]
    totals = {"params": sum(r.nbytes + r.padding for r in rows)}
    for name, tree in extra.items():
        totals[name] = sum(r.nbytes + r.padding for r in (_row(p, x) for p, x in _tensor_leaves(tree)))
    meshes = {x.device_mesh for x in optree.tree_leaves(params) if isinstance(x, DTensor)}
    if meshes:
        m = next(iter(meshes))
        names = m.mesh_dim_names or ()
        mesh = "mesh " + " x ".join(f"{n}={m.size(i)}" for i, n in enumerate(names)) + f", rank {m.get_rank()}"
    else:
        mesh = "not sharded"
    return Description(rows, totals, mesh)
