"""Compiled serving functions with frozen weights, scoped to the functions they compile.

``frozen_compile(fn)`` compiles ``fn`` with Inductor's weight freezing (weights become constants of the graph:
pre-packed oneDNN linears on CPU). Such graphs must never run after the weights change, so the model drops them
(``release``) and compiles again. Dynamo keeps compiled graphs on *code objects*, and ``fn``'s code is shared by
every instance of its class: so each compile runs a copy of ``fn`` with a code object of its own, whose graphs
nothing else can reach, and ``release`` clears exactly those. Other compiled functions in the process (a compiled
training step, another model's serving graphs) keep theirs: no global ``torch._dynamo.reset()``.

``fullgraph=True``: a graph break would leave the rest of the function to Dynamo frames on shared code objects
(the HF layers'), whose cached graphs would then outlive ``release``; breaking is an error instead.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch


class FrozenCompiled:
    """``fn`` compiled with frozen weights (see the module docstring); call it like ``fn``."""

    def __init__(
        self, fn: Callable[..., torch.Tensor], dynamic: bool | None = None, batch_dynamic: bool = False
    ) -> None:
        self.fn = _own_code_copy(fn)
        # ``batch_dynamic``: the first argument's first dimension is marked dynamic at every call (one graph for
        # every batch size but 1, which Dynamo specializes), where ``dynamic=True`` would not trace
        self.batch_dynamic = batch_dynamic
        self.code = getattr(self.fn, "__func__", self.fn).__code__
        # ``dynamic=None`` (serving): shapes start static and a dimension that changes (the prefix length, when the
        # prompt's token count changes) is recompiled once as dynamic: a new instruction costs one recompile.
        # ``dynamic=True`` (training): one graph for every shape from the start, so which graph a batch runs on
        # (and its exact rounding) does not depend on the shapes seen before it: a resumed run stays bitwise.
        self.compiled = torch.compile(self.fn, dynamic=dynamic, fullgraph=True)

    def __call__(self, *args: object) -> torch.Tensor:
        import torch._inductor.config as inductor_config

        if self.batch_dynamic and isinstance(args[0], torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(args[0], 0)
        with inductor_config.patch(freezing=True):  # read when a graph is compiled (a shape's first call)
            return self.compiled(*args)


def frozen_compile(
    fn: Callable[..., torch.Tensor], dynamic: bool | None = None, batch_dynamic: bool = False
) -> FrozenCompiled:
    return FrozenCompiled(fn, dynamic, batch_dynamic)


def release(fn: Callable[..., object]) -> None:
    """Free the compiled graphs of a ``FrozenCompiled`` (no-op for anything else)."""
    if isinstance(fn, FrozenCompiled):
        torch._dynamo.reset_code(fn.code)


def _own_code_copy(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` (a function or a bound method) as a new function object with a new, equal code object."""
    func = getattr(fn, "__func__", fn)
    copy = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__qualname__ = func.__qualname__
    return types.MethodType(copy, fn.__self__) if isinstance(fn, types.MethodType) else copy
