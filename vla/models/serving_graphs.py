"""A policy readied for serving: weights cast to the serving dtype, and compiled serving graphs that never outlive
the weights they froze.

``ServingGraphs`` is a base class of a policy module with a ``backbone`` (``VLMBackbone``) and a ``flow_step``
method (one denoising step, the function serving runs ``num_steps`` times per chunk). The graphs come from
``vla.models.compiled.frozen_compile``.

Compiled serving graphs hold *copies* of the weights (Inductor freezing), so they must never outlive a change of
the weights: ``train()`` and ``prepare_inference()`` drop them, and ``_check_serving()`` (called by the policy
before each prefix) recompiles when any parameter or buffer was replaced, moved or updated in place since they
were built (``load_state_dict``, an EMA step, ``.to()``). Writing through ``param.data`` bypasses the version
counters and is not detected. Each compile has graphs of its own, and dropping frees only those.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from vla.models.attention import SharedKVLayer, check_inference_attention, is_attention_module
from vla.models.compiled import frozen_compile, release

if TYPE_CHECKING:
    from typing import Self

    from vla.models.backbone import VLMBackbone

log = logging.getLogger(__name__)


class ServingGraphs(nn.Module):
    """``prepare_inference`` and the lifecycle of the compiled serving graphs (see the module docstring)."""

    backbone: VLMBackbone
    flow_step: Callable[..., torch.Tensor]
    _serving_step: Callable[..., torch.Tensor] | None = None  # the compiled flow_step, while valid
    _serving_weights: tuple[tuple[int, int], ...] | None = None  # what the compiled graphs froze

    def prepare_inference(
        self, dtype: torch.dtype | str = torch.float32, *, compile: bool = False, attention: str = "sdpa"
    ) -> Self:
        """Ready the model for serving: ``eval()``, weights cast to ``dtype`` (``"bfloat16"`` uses AMX on recent
        Xeons and tensor cores on GPUs; the flow integration state stays float32), every language layer's attention
        kernel (and the vision tower's) set to ``attention`` (``"sdpa"`` or ``"explicit"``,
        ``vla.models.attention.INFERENCE_ATTENTION``;
        which is faster depends on the CPU and dtype: ``vla serve`` measures) and, with ``compile``, the flow step,
        vision tower and language layers compiled with frozen weights (one-time compile cost). ``train()`` puts
        ``"auto"`` back (``vla.models.attention.choose_kernel``)."""
        check_inference_attention(attention)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.release_serving_graphs()
        # RoPE frequencies are buffers that .to(dtype) would round to bfloat16 (an angle error of ~1 rad at
        # position 600): keep them float32, as HF computes them in float32 whatever the model dtype.
        rope = [
            (m, n, b.clone())
            for m in self.modules()
            for n, b in m.named_buffers(recurse=False)
            if "inv_freq" in n
        ]
        self.eval().to(dtype)
        for module, name, buf in rope:
            setattr(module, name, buf)
        self._set_inference_attention(attention)
        if compile:
            self._compile_serving()
        return self

    def release_serving_graphs(self) -> None:
        """Drop every compiled graph that froze this model's weights (serving's, and training's frozen backbone):
        each holds a copy of the weights it froze."""
        self._drop_compiled()
        self.backbone.drop_frozen_compiled()  # training's graphs froze other weights (and dtype)

    def _compile_serving(self) -> None:
        self._drop_compiled()
        self._serving_step = frozen_compile(self.flow_step)
        self.backbone.compile_for_serving(frozen_compile)
        self._serving_weights = self._weights_key()

    def _drop_compiled(self) -> None:
        if self._serving_weights is not None:
            release(self._serving_step)
            self._serving_step, self._serving_weights = None, None
            self.backbone.drop_compiled()

    def _weights_key(self) -> tuple[tuple[int, int], ...]:
        return tuple((t.data_ptr(), t._version) for t in (*self.parameters(), *self.buffers()))

    def _check_serving(self) -> None:
        if self._serving_weights is not None and self._weights_key() != self._serving_weights:
            log.warning(
                "weights changed after prepare_inference(compile=True): recompiling the serving graphs"
            )
            self._compile_serving()

    def train(self, mode: bool = True) -> Self:
        # passes without a gradient (frozen parts, validation) take a measured kernel (choose_kernel)
        if mode:
            self._drop_compiled()
            self._set_inference_attention("auto")
        return super().train(mode)

    def set_inference_attention(self, kernel: str) -> None:
        """Switch the attention kernel of an eager serving model (``prepare_inference(compile=False)``) without
        preparing it again: ``vla serve`` times the kernels call by call, interleaved. Refused while compiled
        serving graphs are live (they froze the kernel they were traced with; ``prepare_inference`` recompiles)."""
        check_inference_attention(kernel)
        if self._serving_weights is not None:
            raise ValueError(
                f"set_inference_attention({kernel!r}): the compiled serving graphs run the kernel they were "
                f"compiled with; call prepare_inference(..., compile=True, attention={kernel!r}) instead"
            )
        self._set_inference_attention(kernel)

    def _set_inference_attention(self, kernel: str) -> None:
        for module in self.modules():
            if is_attention_module(module):
                module.inference_attention = kernel

    @property
    def inference_attention(self) -> str:
        """The attention kernel ``prepare_inference`` set (``"sdpa"`` until then, ``"auto"`` after ``train()``)."""
        kernels = {m.inference_attention for m in self.modules() if isinstance(m, SharedKVLayer)}
        return kernels.pop() if len(kernels) == 1 else "sdpa"
