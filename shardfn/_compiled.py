"""Compiled code handed to a step: the `compile=` option, and what a user compiled before.

Note [compiled code in a step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A step cannot be compiled yet: `compile=True` (or a dict of `torch.compile` options) is refused
where the step or the transform is built, with `NotImplementedError`, rather than silently run
eager. What users already write is refused too, before anything is traced: a block compiled
before `sf.functionalize` (`block.compile()`, or `torch.compile(block)` put back into its parent)
and a compiled `loss_fn` (`torch.compile(loss_fn)`). Traced, they reach the engine's views of its
flat buffers (Note [flat unit layout] in `_flat.py`), which AOTAutograd fails on with an internal
`AssertionError`; `step.init`, and the first call of an `sf.value_and_grad` function, refuse them
with a `ValueError` that names what was compiled and the fix.

torch 2.13 has no public way to ask whether a module or a function was compiled; what
`torch.compile` leaves on them is read instead (docs/private-torch-apis.md): the wrapper module's
`_orig_mod`, `Module.compile()`'s `_compiled_call_impl`, and the compiled function's
`_torchdynamo_orig_callable`. Nothing of `torch._dynamo` is imported.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

__all__ = ["check_compile_option", "compiled_function", "compiled_modules", "refuse_compiled"]

_NOT_YET = (
    "compiled steps are not supported yet: the step runs eager. Leave compile=False (the default) and pass the "
    "model and loss_fn uncompiled"
)


def check_compile_option(compile: Any, where: str) -> None:
    """Refuses a `compile=` setting other than the default False.

    Args:
        compile: the `compile=` argument: False, True, or a dict of `torch.compile` options.
        where: what the option was given to, for messages (`"sf.train_step"`).

    Raises:
        NotImplementedError: for True or a dict (compiled steps are not supported yet).
        ValueError: for anything else than False, True or a dict.
    """
    if compile is False:
        return
    if compile is True or isinstance(compile, dict):
        raise NotImplementedError(f"{where}(..., compile={compile!r}): {_NOT_YET}")
    raise ValueError(
        f"{where}(..., compile={compile!r}): compile must be False (the default), True, or a dict of "
        "torch.compile options"
    )


def compiled_function(fn: Any) -> bool:
    """Whether `fn` is what `torch.compile` returns for a function (or a partial of one), or a
    compiled module (see `compiled_modules`)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, nn.Module):
        return bool(compiled_modules(fn))
    return getattr(fn, "_torchdynamo_orig_callable", None) is not None


def _compiled_module(module: nn.Module) -> str | None:
    """How `module` was compiled (`"a torch.compile(...) wrapper"`, `"compiled by .compile()"`), or None."""
    if isinstance(getattr(module, "_orig_mod", None), nn.Module):
        return "a torch.compile(...) wrapper"
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "compiled by .compile()"
    return None


def compiled_modules(module: nn.Module) -> list[tuple[str, str]]:
    """The compiled modules in `module` (itself included), outermost only: `(dotted path, how)`,
    the path `""` for `module` itself."""
    found: list[tuple[str, str]] = []
    for name, sub in module.named_modules(remove_duplicate=False):
        if any(p == "" or name.startswith(p + ".") for p, _ in found):
            continue  # inside a compiled module: the outer one is named
        how = _compiled_module(sub)
        if how is not None:
            found.append((name, how))
    return found


def refuse_compiled(loss_fn: Any, module: nn.Module | None, where: str) -> None:
    """Refuses a compiled `loss_fn`, or a model (`module`, the functionalized model; None for a
    plain pure function) that holds compiled modules, before anything is traced.

    Args:
        loss_fn: the user's loss function.
        module: the functionalized module whose units the step runs, or None.
        where: what they were given to, for messages (`"sf.train_step"`).

    Raises:
        ValueError: naming the compiled loss function or module paths, and the fix.
    """
    if compiled_function(loss_fn):
        name = getattr(loss_fn, "__name__", None) or type(loss_fn).__name__
        raise ValueError(
            f"{where}: loss_fn {name!r} is compiled (torch.compile(loss_fn)); shardfn cannot run a compiled loss_fn, "
            "whose trace would reach the step's own buffers. Pass the uncompiled function; compiling the step is "
            f"{where}(..., compile=True), which is not supported yet (run the step eager)"
        )
    if module is None:
        return
    found = compiled_modules(module)
    if not found:
        return
    shown = ", ".join(f"{(repr(p) if p else 'the model itself')} ({how})" for p, how in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    raise ValueError(
        f"{where}: the model holds compiled modules: {shown}{more}. shardfn cannot run modules compiled before "
        "sf.functionalize, whose traces would reach the step's own buffers. Pass the uncompiled module to "
        "sf.functionalize (build the model without module.compile(); for torch.compile(block) put back into its "
        "parent, keep the block itself, which the compiled one holds as ._orig_mod); compiling the step is "
        f"{where}(..., compile=True), which is not supported yet (run the step eager)"
    )
