"""Pytree helpers over optree: dotted leaf paths and nested dicts built from them."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Sequence

import optree
import torch

__all__ = ["tree_paths", "tree_flatten_with_paths", "nest", "is_leaf_tensor", "compile_patterns"]


def is_leaf_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _entry_name(entry: Any) -> str:
    return str(entry)


def tree_flatten_with_paths(tree: Any, is_leaf: Callable[[Any], bool] | None = None, none_is_leaf: bool = False):
    """Flattens `tree` into (dotted paths, leaves, treespec), in optree's leaf order; `none_is_leaf`
    keeps None entries (a gradient tree's frozen leaves) as leaves."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, is_leaf=is_leaf, none_is_leaf=none_is_leaf)
    return [".".join(_entry_name(e) for e in p) for p in paths], leaves, spec


def tree_paths(tree: Any) -> list[str]:
    """Lists the dotted names of the leaves of `tree`, in leaf order.

    Args:
        tree: a pytree, e.g. the params of `sf.functionalize`.

    Returns:
        One name per leaf, e.g. `"blocks.0.attn.weight"`.

    Example:
        >>> sf.tree_paths({"a": {"w": torch.zeros(2)}, "b": torch.zeros(1)})
        ['a.w', 'b']
    """
    return tree_flatten_with_paths(tree)[0]


def nest(items: Iterable[tuple[str, Any]]) -> dict:
    """Builds a nested dict from (dotted path, value) pairs, keeping their order."""
    root: dict = {}
    for path, value in items:
        node = root
        keys = path.split(".")
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ValueError(f"path {path!r} passes through leaf {k!r}: a name is both a leaf and a module")
            node = child
        if keys[-1] in node:
            raise ValueError(f"duplicate path {path!r}")
        node[keys[-1]] = value
    return root


def compile_patterns(patterns: str | Sequence[str] | None, what: str, over: str) -> list[re.Pattern]:
    """`patterns` (a regex, a list of regexes, or None for none) compiled, to be matched in full
    against dotted names; a ValueError naming the option `what` and the names it matches (`over`)
    for anything else."""
    if patterns is None:
        return []
    try:
        pats = [patterns] if isinstance(patterns, str) else list(patterns)
    except TypeError:
        pats = [patterns]
    out = []
    for p in pats:
        if not isinstance(p, str):
            raise ValueError(f"{what} must be a regex or a list of regexes over {over}, got {p!r}")
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"{what}: {p!r} is not a valid regex ({e}); {what} takes regexes over {over}") from None
    return out
