"""`sf.export` and `sf.import_state_dict`: a sharded model to and from one safetensors file.

Note [export and import]
------------------------
Export writes `module.state_dict()` of the tree's model (Note: `sf.to_state_dict`), as one
safetensors file, without any rank holding the whole model:

* Rank 0 knows every entry's name, dtype and global shape before any value, so it writes the
  safetensors header first and then streams the values into the file. Leaves are gathered one at
  a time (`DTensor.full_tensor()`, a collective on every rank), in `state_dict()` order, and each
  is freed as soon as rank 0 has written it: every rank holds at most one full leaf (less than
  one unit) at any time, rank 0 one CPU copy of it, and no rank holds the model.
* Tied names are written as separate copies of the same values, each under its own name
  (safetensors refuses shared storage). So the file loads into the original module with
  `load_state_dict(safetensors.torch.load_file(path), strict=True)` and into Hugging Face
  `from_pretrained`, which ties the weights again (the duplicate costs the tied tensor's bytes
  once more in the file; Hugging Face's own `save_pretrained` omits tied names instead, and such
  files import fine, see below).
* The file is written under a temporary name, fsynced and renamed: a failed export never leaves a
  file that looks complete. A write error on rank 0 does not stop it joining the remaining
  gathers (the other ranks would otherwise wait on it); every rank raises it at the end.

Import reads a safetensors file (or a Hugging Face checkpoint folder, sharded with an index or
not, or an in-memory state dict) into a tree or train state in place. Each rank reads only the
rows it keeps: for each DTensor leaf, the offsets and sizes of the local shard
(`__create_chunk_list__`, what `torch.distributed.checkpoint` uses) select a slice of the file's
tensor (`safe_open(...).get_slice`), which safetensors reads from the memory-mapped file without
touching the rest. A parameter is found under any of its names (`info.aliases`: a file without
`lm_head.weight` fills the head from `wte.weight`), buffers in the file are copied into the
module's, and values are cast to the leaf's dtype, as `load_state_dict` does. Reading needs no
collective: every rank reads the same file and decides alike. Then, unless `sync=None`, the ranks
that hold the same rows (replicas, tp peers) and the module's buffers agree on what they read, in
case their sources differ (Note [one model] in `shardfn/_agree.py`): a few broadcasts, or a check.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _collectives as C
from . import _watch
from ._agree import Item, agree, check_sync, replicated_dims
from ._checkpoint import LoadReport
from ._files import replace_synced, temporary_name
from ._meta_init import refuse_unset_buffers
from ._models import model_of, persistent_buffers as _persistent_buffers
from ._state import params_of as _params_of
from ._tree import tree_flatten_with_paths

__all__ = ["export", "import_state_dict"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather_leaf(x: torch.Tensor) -> torch.Tensor:
    """One leaf's full value on every rank (a collective for a DTensor)."""
    if isinstance(x, DTensor):
        return C.full_tensor(x, "sf.export")
    return x


def _entries(tree: Any, apply: Any) -> tuple[list[tuple[str, int | None, torch.Tensor]], list[Any]]:
    """(name, leaf index or None for a buffer, tensor) in the order they are written; the leaves.

    A tied parameter's names follow each other, so its leaf is gathered once."""
    tree = _params_of(tree)
    info = model_of(tree, apply, "the tree")
    paths, leaves, _ = tree_flatten_with_paths(tree)
    for p, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"leaf {p!r} is a {type(x).__name__}: export writes tensors only")
        if x.is_meta:
            raise ValueError(f"leaf {p!r} is on the meta device: it holds no values (materialize it, e.g. with step.init)")
    index = {p: i for i, p in enumerate(paths)}
    if info is None:
        return [(p, i, x) for i, (p, x) in enumerate(zip(paths, leaves))], leaves
    owner = {name: path for path in info.param_paths for name in info.aliases[path]}
    buffers = _persistent_buffers(info)
    out, done = [], set()
    for name in info.module.state_dict(keep_vars=True):
        if name in buffers:
            out.append((name, None, buffers[name]))
        elif owner[name] not in done:
            path = owner[name]
            done.add(path)
            out += [(alias, index[path], leaves[index[path]]) for alias in info.aliases[path]]
    return out, leaves


def _header(entries: list[tuple[str, int | None, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    table: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, _, x in entries:
        if x.dtype not in _DTYPES:
            raise NotImplementedError(f"{name!r} has dtype {x.dtype}, which safetensors cannot store")
        nbytes = x.numel() * x.element_size()
        table[name] = {"dtype": _DTYPES[x.dtype], "shape": list(x.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def export(
    tree_or_state: Any,
    path: str | os.PathLike,
    *,
    apply: Any = None,
    metadata: dict[str, str] | None = None,
) -> str:
    """Writes a (sharded) model as one safetensors file with `module.state_dict()` names.

    A collective: every rank calls it. Leaves are gathered one at a time and streamed into the
    file by rank 0, so no rank holds more than one full leaf (Note [export and import] in
    `shardfn/_export.py`). Tied names are written as copies, so the file loads into the original
    module with `strict=True` and into Hugging Face `from_pretrained`.

    Args:
        tree_or_state: a parameter tree (DTensor or plain leaves) or an `sf.TrainState`.
        path: the file to write (replaced atomically if it exists), e.g. `"out/model.safetensors"`.
        apply: the model's `sf.functionalize` function, when several live models have these
            parameter names and differ (see `sf.to_state_dict`).
        metadata: extra string entries for the file's header (`{"format": "pt"}` is always set).

    Returns:
        `path`, on every rank.

    Example:
        >>> sf.export(state, "hf_out/model.safetensors")
        >>> model.load_state_dict(safetensors.torch.load_file("hf_out/model.safetensors"))
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    meta = {"format": "pt"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"metadata holds str keys and str values (safetensors' rule), got {k!r}: {v!r}")
        if k == "format" and v != "pt":  # what Hugging Face's loaders read to take the file as torch tensors
            raise ValueError(f"metadata['format'] is 'pt' in a file sf.export writes (torch tensors), got {v!r}")
        meta[k] = v
    entries, _ = _entries(tree_or_state, apply)
    final = os.path.abspath(os.fspath(path))
    writer = _Writer(final, _header(entries, meta)) if _rank() == 0 else None
    with _watch.watched("sf.export"):
        last_index, full = None, None
        for name, i, x in entries:
            if i is None or i != last_index:
                full = None  # the previous leaf is freed before the next is gathered
                full = _gather_leaf(x) if i is not None else x
                last_index = i
            if writer is not None:
                writer.write(full)
        full = None
        error = writer.finish() if writer is not None else None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            error = C.broadcast_object(error, "sf.export")
    if error is not None:
        raise RuntimeError(f"rank 0 could not write {final!r}: {error}; no file was left under that name")
    return os.fspath(path)


class _Writer:
    """Rank 0's side of an export: the header, then each value as it comes; a write error is kept
    (and the rest skipped) so that rank 0 still joins every gather."""

    def __init__(self, final: str, header: bytes):
        self.final = final
        self.tmp = temporary_name(final)
        self.error: str | None = None
        self.f = None
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            self.f = open(self.tmp, "wb")
            self.f.write(header)
        except OSError as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        self.error = self.error or f"{type(e).__name__}: {e}"

    def write(self, x: torch.Tensor) -> None:
        if self.error is not None:
            return
        try:
            t = x.detach().to("cpu").contiguous().reshape(-1)
            self.f.write(memoryview(t.view(torch.uint8).numpy()))  # type: ignore[union-attr]
        except (OSError, RuntimeError, TypeError) as e:
            self._fail(e)

    def finish(self) -> str | None:
        try:
            if self.f is not None:
                self.f.close()
            if self.error is None:
                replace_synced(self.tmp, self.final)
        except OSError as e:
            self._fail(e)
        if self.error is not None and os.path.exists(self.tmp):
            os.unlink(self.tmp)
        return self.error


# -- import --------------------------------------------------------------------------------------
class _Source:
    """Named tensors to read slices of: safetensors files (memory-mapped) or a dict."""

    def __init__(self, source: Any):
        self.tensors: dict[str, torch.Tensor] | None = None
        self.files: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        if isinstance(source, dict):
            bad = [k for k, v in source.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
            if bad:
                raise ValueError(f"a state dict maps names to tensors; these entries do not: {bad[:5]}")
            self.tensors = source
            return
        if not isinstance(source, (str, os.PathLike)):
            raise ValueError(f"source must be a safetensors file, a checkpoint folder or a state dict, got {type(source).__name__}")
        path = os.fspath(source)
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self.where = {k: os.path.join(path, v) for k, v in weight_map.items()}
            elif os.path.exists(single):
                path = single
            else:
                raise ValueError(f"{source!r} has neither model.safetensors nor model.safetensors.index.json")
        elif not os.path.exists(path):
            raise ValueError(f"no file {source!r}")
        if not self.where:
            self.where = {k: path for k in self._open(path).keys()}

    def _open(self, path: str) -> Any:
        if path not in self.files:
            from safetensors import safe_open

            self.files[path] = safe_open(path, framework="pt", device="cpu")
        return self.files[path]

    renamed: dict[str, str] = {}
    """The model's name -> the source's name, where they differ by the base model's prefix."""

    def rename(self, names: dict[str, str]) -> None:
        self.renamed = names

    def keys(self) -> list[str]:
        back = {v: k for k, v in self.renamed.items()}
        return [back.get(k, k) for k in (self.tensors if self.tensors is not None else self.where)]

    def shape(self, name: str) -> tuple[int, ...]:
        name = self.renamed.get(name, name)
        if self.tensors is not None:
            return tuple(self.tensors[name].shape)
        return tuple(self._open(self.where[name]).get_slice(name).get_shape())

    def read(self, name: str, box: tuple[slice, ...] | None) -> torch.Tensor:
        """The whole tensor (`box` None) or the slice `box` of it."""
        name = self.renamed.get(name, name)
        if self.tensors is not None:
            t = self.tensors[name]
            return t if box is None else t[box]
        f = self._open(self.where[name])
        if box is None or not box:
            return f.get_tensor(name)
        return f.get_slice(name)[box]


def _local_box(x: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """Where a leaf's values go (its local tensor) and which part of the full tensor they are."""
    if not isinstance(x, DTensor):
        return x, None
    chunks = x.__create_chunk_list__()
    if len(chunks) != 1:
        raise NotImplementedError(f"a DTensor whose local tensor holds {len(chunks)} chunks cannot be imported yet")
    c = chunks[0]
    return x._local_tensor, tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))


def import_state_dict(
    source: str | os.PathLike | dict[str, torch.Tensor],
    like: Any,
    *,
    strict: bool = True,
    apply: Any = None,
    sync: str | None = "broadcast",
) -> Any:
    """Reads a state dict (a safetensors file, a Hugging Face checkpoint) into a sharded tree or state.

    Each rank reads only the rows it keeps (Note [export and import] in `shardfn/_export.py`);
    then the ranks that hold the same rows agree on them (`sync`). Values are written in place into `like`'s tensors (a train step's own
    buffers included) and `like` is returned. Names are `module.state_dict()` names of `like`'s
    model: a tied parameter is read from whichever of its names the source has; buffers in the
    source are copied into the module's buffers. Values are cast to the leaves' dtypes.

    Args:
        source: a `.safetensors` file, a folder with `model.safetensors` or a sharded
            `model.safetensors.index.json` (as Hugging Face saves them), or a dict of tensors.
        like: a parameter tree (DTensor or plain leaves, e.g. from `sf.shard`) or an
            `sf.TrainState` (e.g. `step.init(params)`), whose values are overwritten.
        strict: if True, every parameter and persistent buffer must be in the source and every
            name of the source must be one of them. If False, the others are skipped and reported.
        apply: the model's `sf.functionalize` function, when several live models have these
            parameter names (see `sf.to_state_dict`).
        sync: for DTensor leaves, how the ranks that hold the same shard (a replicated leaf under
            `no_shard`, `hybrid_shard`'s replicas, the tp peers of a leaf whole on tp) and the
            module's buffers come to agree when their sources differ (files that differ by node,
            a dict built per rank): `"broadcast"` (default) gives them the values of the first
            such rank (rank 0's for buffers and replicated leaves), `"check"` raises a `ValueError`
            on every rank naming the leaves and ranks that differ, None leaves each rank's own
            (and then no collective runs). The rows of a leaf split across ranks are read by their
            rank alone: every rank must read the same source. With the default, a collective on
            the mesh of `like`'s DTensors (Note [one model] in `shardfn/_agree.py`); plain
            leaves are each rank's own and are never sent.

    Returns:
        `like` (strict), or `(like, sf.LoadReport(missing_keys, unexpected_keys))` (`strict=False`).

    Raises:
        ValueError: shapes that differ (always, naming them); missing or unexpected names (strict).

    Example:
        >>> state = step.init(params)
        >>> state = sf.import_state_dict("llama/model.safetensors", like=state)
    """
    check_sync(sync, "sf.import_state_dict")
    src = _Source(source)
    tree = _params_of(like)
    info = model_of(tree, apply, "like")
    refuse_unset_buffers(info, "sf.import_state_dict")  # Note [buffers under init="empty"]
    paths, leaves, _ = tree_flatten_with_paths(tree)
    names = {p: (info.aliases[p] if info is not None else [p]) for p in paths}
    buffers = (dict(info.module.named_buffers(remove_duplicate=False)) if info is not None else {})
    persistent = set(_persistent_buffers(info)) if info is not None else set()
    have = set(src.keys())
    prefix = getattr(info.module, "base_model_prefix", "") if info is not None else ""
    if prefix:
        # A Hugging Face base model's checkpoint (e.g. the hub's `gpt2`: "h.0.attn...") read into a
        # model with a head ("transformer.h.0.attn..."), or the other way round, as from_pretrained does.
        known = {n for p in paths for n in names[p]} | set(buffers)
        add = {f"{prefix}.{k}": k for k in have - known if f"{prefix}.{k}" in known}
        strip = {k[len(prefix) + 1:]: k for k in have - known if k.startswith(prefix + ".") and k[len(prefix) + 1:] in known}
        if add or strip:
            src.rename(add if len(add) >= len(strip) else strip)
            have = set(src.keys())
    if apply is None and info is not None and have & set(buffers):
        model_of(  # buffers are written into one module: equal buffers do not make them the same
            flat=(paths, leaves), what="like", alike=False,
            reason=" and the source has buffers, which are written into one of them",
            hint="say which with apply=apply; nothing was read",
        )
    found: dict[str, str] = {}
    missing = []
    for p in paths:
        hit = next((n for n in names[p] if n in have), None)
        if hit is None:
            missing.append(p)
        else:
            found[p] = hit
    missing += sorted(b for b in persistent if b not in have)
    known = {n for p in paths for n in names[p]} | set(buffers)
    unexpected = sorted(have - known)
    differ = []
    for p, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"leaf {p!r} of like is a {type(x).__name__}, not a tensor")
        if x.is_meta:
            raise ValueError(f"leaf {p!r} of like is on the meta device: build like with step.init or sf.shard first")
        if p in found and src.shape(found[p]) != tuple(x.shape):
            differ.append(f"{found[p]}: source {src.shape(found[p])}, like {tuple(x.shape)}")
    for b in sorted(have & set(buffers)):
        if src.shape(b) != tuple(buffers[b].shape):
            differ.append(f"{b}: source {src.shape(b)}, buffer {tuple(buffers[b].shape)}")
    if differ:
        raise ValueError(f"{len(differ)} entries differ in shape between the source and like: {differ[:6]}; nothing was read")
    for p in paths:  # a tied parameter given different values under two of its names cannot be both
        given = [n for n in names[p] if n in have]
        if len(given) > 1:
            first = src.read(given[0], None)
            for n in given[1:]:
                other = src.read(n, None)
                if other.shape != first.shape or not torch.equal(other.to(first.dtype), first):
                    raise ValueError(
                        f"the source gives {given[0]!r} and {n!r} different values, but they are one tied parameter "
                        "of the model: untie them in the model (or drop one name from the source); nothing was read"
                    )
            del first
    if strict and (missing or unexpected):
        raise ValueError(
            f"the source and like have different entries: missing from the source: {missing[:8]}"
            f"{f' ({len(missing)} in all)' if len(missing) > 8 else ''}; in the source but not in the model: "
            f"{unexpected[:8]}{f' ({len(unexpected)} in all)' if len(unexpected) > 8 else ''}. Pass strict=False "
            "to read the common entries and get a LoadReport of the others"
        )
    with torch.no_grad():
        for p, x in zip(paths, leaves):
            if p not in found:
                continue
            dst, box = _local_box(x)
            if dst.numel() == 0:
                continue  # a rank with no rows of this leaf reads nothing
            dst.copy_(src.read(found[p], box))
        for b in sorted(have & set(buffers)):
            buffers[b].copy_(src.read(b, None))
    _agree_read(paths, leaves, found, {b: buffers[b] for b in sorted(have & set(buffers))}, sync)
    return like if strict else (like, LoadReport(missing, unexpected))


def _agree_read(paths: list[str], leaves: list, found: dict, buffers: dict[str, torch.Tensor], sync: str | None) -> None:
    """The ranks that hold the same rows of a DTensor leaf read, and the buffers read, agree on
    them (Note [one model] in `_agree.py`), mesh by mesh in the order the leaves name them."""
    by_mesh: dict[Any, list[Item]] = {}
    for p, x in zip(paths, leaves):
        if p in found and isinstance(x, DTensor):
            by_mesh.setdefault(x.device_mesh, []).append(Item(p, x._local_tensor, _copier(x._local_tensor), replicated_dims(x), tuple(x.shape)))
    if by_mesh and buffers:
        mesh = next(iter(by_mesh))
        by_mesh[mesh] += [Item(f"buffer {b}", t, _copier(t), tuple(range(mesh.ndim))) for b, t in buffers.items()]
    for mesh, items in by_mesh.items():
        agree(items, mesh, sync, "sf.import_state_dict", fix="Give every rank the same source (the same file, or a dict built alike)")


def _copier(dst: torch.Tensor) -> Any:
    def copy(value: torch.Tensor) -> None:
        if value is not dst:
            with torch.no_grad():
                dst.copy_(value)
    return copy

