"""Hugging Face decoder layers that share keys/values across token groups: the backbone's prefix and the action
expert's suffix.

Both passes run the HF layer *modules* (norms, q/k/v/o projections, MLP) with our own computation:
``shared_kv(layer)`` turns a HF decoder layer into an instance of a small subclass of its own class
(``SharedKV<HFClass>``, parameter names and state-dict keys unchanged) whose ``forward`` attends over other tokens'
keys/values besides its own and also returns its own keys/values (``SharedKVLayer.forward``). Every layer runs
through its module call, so module hooks fire: FSDP2's per-layer unshard/reshard (``vla.models.sharding``), and
activation checkpointing wraps the layer's body inside ``forward``, under those hooks.

Works for the Llama family (SmolVLM's text model), Gemma (PaliGemma) and Gemma2 (PaliGemma2: extra sandwich norms,
attention logit soft-capping). Attention is SDPA (grouped-query without repeating K/V) or the explicit three-op form
(``grouped_attention``, the only one with soft-capping): bf16 training on the CPU measures the faster kernel per
layout, serving sets one per model (``prepare_inference(attention=)``, measured by ``vla serve``).

The vision towers (SigLIP, SmolVLM's) keep their HF modules and run their attention through the same kernels:
``use_vla_attention(vision)`` sets their attention implementation to ``"vla"``, a function registered with
HF's ``AttentionInterface`` (``vision_attention``). Before, they ran HF's default, SDPA, which in bf16 on an
AVX-512-BF16 EPYC ("Zen 4") took 1.9x the explicit form's time at the vision tower's shapes, compiled (16 images x
6 heads x 196 patches: 10.7 against 5.6 ms, ``benchmarks/results/attention_2026-12-07_zen4_vision.json``). HF's
own eager form (``attn_implementation="eager"``) would not do: Inductor rewrites its matmul-softmax-matmul into the
fused SDPA kernel; the ``baddbmm`` form here is not rewritten.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import rotate_half

KeysValues = tuple[torch.Tensor, torch.Tensor]
log = logging.getLogger(__name__)

#: ``VLA_CPU_BF16_ATTENTION=sdpa|explicit|sdpa_fp32`` pins the kernel of bf16 training on the CPU (every pass: with
#: a gradient, and without one, e.g. a frozen backbone's); ``auto`` (default) measures per layout. ``sdpa_fp32``
#: runs SDPA on float32 copies of q/k/v outside autocast (more exact, and on CPUs whose bf16 SDPA backward is slow,
#: e.g. an AVX-512-BF16 EPYC without AMX, faster).
KERNEL_ENV = "VLA_CPU_BF16_ATTENTION"
KERNELS = ("sdpa", "explicit", "sdpa_fp32")
#: Kernels of inference (no gradient), set per model by ``prepare_inference(attention=)``: ``sdpa`` (default) or
#: ``explicit``; in bf16 on an AVX-512-BF16 EPYC ("Zen 4") the explicit three-op form took 0.56x SDPA's time for the
#: expert's chunk at batch 8 but 0.9x at batch 1, and the whole chunk barely moved (``benchmarks/attention.py``,
#: ``benchmarks/serve.py``): the gain depends on the CPU and batch, so ``vla serve`` measures both. ``train()`` sets
#: ``auto`` instead: passes without a gradient in bf16 on the CPU (a frozen backbone's, validation) take the kernel
#: measured for their layout, as the passes with one do (``choose_kernel``).
INFERENCE_ATTENTION = ("sdpa", "explicit")


def check_inference_attention(kernel: str) -> None:
    """Refuse an inference kernel not in ``INFERENCE_ATTENTION``, naming the allowed ones."""
    if kernel not in INFERENCE_ATTENTION:
        raise ValueError(f"attention must be one of {INFERENCE_ATTENTION}, got {kernel!r}")


#: Calls of at most this many queries are a layout of their own: a frozen backbone trains its embodiment token in
#: one-query passes (``VLMBackbone.refresh_summary_token``) of the same heads as the expert's chunk pass, and the
#: fastest kernel there is not the fastest for the chunk (measured on an AVX-512-BF16 EPYC "Zen 4", forward +
#: backward at batch 8: SDPA on float32 copies 0.76 ms against the explicit form's 1.11 ms for one query, but 7.7 ms
#: against 4.6 ms for 51); a layout is measured on its first call, which is the one-query one. One query only, so
#: that a short action chunk is not measured on that pass either.
SHORT_QUERY = 1
#: (query heads, kv heads, head dim, at most SHORT_QUERY queries, forward only): a pass without a gradient (a frozen
#: backbone's prefix, the frozen vision tower, validation) is measured forward only, as a layout of its own
#: (recorded as ``HxKVxd[-short]-forward``): on a "Zen 4" EPYC in bf16, compiled, the explicit form took 0.53x
#: SDPA's time for the frozen vision tower of ``bench_smolvla`` at batch 8 and 0.61x for its language prefix.
Layout = tuple[int, int, int, bool, bool]
_chosen: dict[Layout, str] = {}  # measured, pinned per layout or restored: once per process, recorded
# short layouts an older record's "HxKVxd" covers: used, recorded as it was read
_implied: dict[Layout, str] = {}
_pinned: str | None = None
_restored = False  # _chosen holds a resumed checkpoint's record, which wins over the environment variable
_env_used: str | None = None  # the environment variable's kernel, once a bf16 CPU attention has run with it


def check_window(text_config: object, length: int, where: str) -> None:
    """Sliding-window layers (Gemma2's every other layer) are run here with full attention, which is exact only
    while every sequence fits in the window (4096 for PaliGemma2: ~600 tokens for two 224 px cameras + prompt)."""
    window = getattr(text_config, "sliding_window", None)
    if (
        window
        and "sliding_attention" in (getattr(text_config, "layer_types", None) or ())
        and length > window
    ):
        raise ValueError(
            f"{where} has {length} tokens, more than the backbone's sliding_window {window}; sliding-window "
            "attention is not implemented: use fewer cameras, a smaller image_size or fewer max_prompt_tokens"
        )


def _heads(x: torch.Tensor, proj: nn.Module, head_dim: int) -> torch.Tensor:
    """``[B, T, hidden]`` -> projection -> ``[B, heads, T, head_dim]``."""
    y = proj(x)
    return y.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[B, heads, T, d]`` with angles ``[B, T, d]`` (HF's ``apply_rotary_pos_emb``, one tensor)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _bf16_cpu(x: torch.Tensor) -> bool:
    """True when attention on CPU runs in bfloat16 (bf16 tensors, or bf16 autocast casting them)."""
    return x.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    )


def env_kernel() -> str | None:
    """The kernel ``VLA_CPU_BF16_ATTENTION`` pins (None for ``auto`` or unset); any other value is an error naming
    the allowed ones (``Trainer`` checks it at start, before any data is read)."""
    env = os.environ.get(KERNEL_ENV, "auto")
    if env not in (*KERNELS, "auto"):
        raise ValueError(f"{KERNEL_ENV}={env!r}: must be one of {', '.join(KERNELS)} or auto (measure)")
    return None if env == "auto" else env


def pin_cpu_bf16_kernel(kernel: str | None) -> None:
    """Use ``kernel`` (one of ``KERNELS``) for bf16 training attention on the CPU from now on, in passes with and
    without a gradient (None: the environment variable's kernel, else measure). A resumed run pins the kernel its
    checkpoint was trained with, so resuming never switches kernels."""
    global _pinned, _restored, _env_used
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"CPU bf16 attention kernel must be one of {KERNELS} or None, got {kernel!r}")
    _pinned, _restored, _env_used = kernel, False, None


def reset_cpu_bf16_kernels() -> None:
    """Forget every kernel measured, pinned or restored in this process: a new training run (several run in one
    process, e.g. the demo's pretraining and fine-tunes) measures afresh and records only the layouts it used."""
    _chosen.clear()
    _implied.clear()
    pin_cpu_bf16_kernel(None)


def cpu_bf16_kernel_choices() -> dict[str, str]:
    """The kernels this process used for bf16 attention on the CPU, for the checkpoint: ``{"pinned": kernel}``
    (pinned by ``pin_cpu_bf16_kernel``, a resumed record, or the environment variable), ``{"<H>x<KV>x<d>": kernel,
    "<H>x<KV>x<d>-short": kernel, ...}`` (measured per head layout, the ``-short`` one for calls of at most
    ``SHORT_QUERY`` queries, ``-forward`` for passes without a gradient, or taken over from a resumed record), or
    ``{}`` when none ran (fp32 or GPU training: the environment variable is then not recorded, as it chose
    nothing)."""
    if _pinned is not None:
        return {"pinned": _pinned}
    if _env_used is not None and not _restored:
        return {"pinned": _env_used}
    return {_layout_key(layout): k for layout, k in _chosen.items()}


def _layout_key(layout: Layout) -> str:
    h, kv, d, short, forward = layout
    return f"{h}x{kv}x{d}" + ("-short" if short else "") + ("-forward" if forward else "")


def _parse_layout(key: str) -> Layout:
    forward = key.endswith("-forward")
    key = key.removesuffix("-forward")
    short = key.endswith("-short")
    h, kv, d = (int(x) for x in key.removesuffix("-short").split("x"))
    return h, kv, d, short, forward


def restore_cpu_bf16_kernels(choices: dict[str, str]) -> None:
    """Take over the choices a checkpoint recorded (``cpu_bf16_kernel_choices``): a resumed run uses the kernels its
    first part measured or was pinned to, so resuming never switches kernels (bitwise resume), whatever
    ``VLA_CPU_BF16_ATTENTION`` says now (a different value is logged as ignored). An empty record (fp32 or GPU
    training, or a checkpoint from before the record) leaves the choice to the environment variable or a
    measurement. A record from before short layouts (``SHORT_QUERY``) has one key per head layout: its kernel runs
    the short calls too (so the resume keeps the kernels that ran), and the record is written back as it was read.
    A record from before forward-only layouts (no ``-forward`` key) ran its passes without a gradient with SDPA,
    unmeasured, and its vision tower with HF's SDPA: such a resume measures (or pins) those as this version does.

    Not bitwise across an upgrade of the kernels themselves: a record from before the three-op explicit form
    (``grouped_attention``) resumes with the new form, the same attention rounded differently."""
    global _restored
    _chosen.clear()  # another run's measurements in this process are not this run's
    _implied.clear()
    pin_cpu_bf16_kernel(choices.get("pinned"))
    before_short = not any("-short" in key for key in choices)
    for key, kernel in choices.items():
        if key != "pinned" and kernel in KERNELS:
            layout = _parse_layout(key)
            _chosen[layout] = kernel
            if before_short and not layout[3] and not layout[4]:  # it ran the short calls too
                _implied[(*layout[:3], True, False)] = kernel
    for layout in _chosen:
        _implied.pop(layout, None)
    _restored = bool(choices)
    env = env_kernel()
    if choices and env is not None and set(choices.values()) != {env}:
        log.warning(
            "%s=%s ignored for the layouts its checkpoint recorded: this resumed run keeps their CPU bf16 attention "
            "kernels (%s); a layout the record lacks runs with %s=%s",
            KERNEL_ENV, env, choices, KERNEL_ENV, env,
        )  # fmt: skip


def _cpu_bf16_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    forward: bool = False,
) -> str:
    """The faster attention kernel of a bf16 forward + backward (``forward``: forward only) on this CPU, measured
    once per head layout.

    CPU families and shapes disagree (``benchmarks/attention.py``): on an AMX Xeon SDPA's bf16 backward took ~3x
    the explicit grouped form at the expert's shapes; on an AVX-512-BF16 EPYC (no AMX) the three-op explicit form
    took 0.35x SDPA's time for the expert's chunk pass while SDPA on float32 copies won the one-query pass. So
    the choice is measured here, on copies of the first inputs, and logged.
    Calls of at most ``SHORT_QUERY`` queries are measured as a layout of their own.

    Inside ``torch.compile`` (a frozen part's graph) nothing is measured or read from the environment: the choice
    made by an eager call before the compile (``Trainer`` runs one) is used, else SDPA."""
    global _env_used
    key = (q.shape[1], k.shape[1], q.shape[3], q.shape[2] <= SHORT_QUERY, forward)
    if torch.compiler.is_compiling():
        return _pinned or _chosen.get(key) or _implied.get(key) or _env_used or "sdpa"
    env = env_kernel()
    if _pinned is not None:
        return _pinned
    known = _chosen.get(key) or _implied.get(key)
    if env is not None and not (_restored and known):
        if _restored:  # a layout the resumed record lacks: recorded with it, so the next resume keeps it too
            _chosen[key] = env
        else:
            _env_used = env
        return env
    if known:
        return known
    _chosen[key] = _measure(q, k, v, mask, scale, forward=forward)
    log.info("bf16 CPU attention for %s: %s (measured)", _layout_key(key), _chosen[key])
    return _chosen[key]


def _measure(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    forward: bool = False,
) -> str:
    copies = [t.detach().clone().requires_grad_(not forward) for t in (q, k, v)]
    times: dict[str, list[float]] = {kind: [] for kind in KERNELS}
    with torch.set_grad_enabled(not forward):
        for i in range(4):  # interleaved; the first round warms both up and is not counted
            for kind in KERNELS if i % 2 == 0 else KERNELS[::-1]:
                t0 = time.perf_counter()
                out = attend(kind, *copies, mask, scale)
                if not forward:
                    out.float().sum().backward()
                if i:
                    times[kind].append(time.perf_counter() - t0)
    return min(KERNELS, key=lambda kind: statistics.median(times[kind]))


def choose_kernel(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> str:
    """The kernel an attention ``module`` (a ``SharedKVLayer``, or a vision tower's attention) runs now: with a
    gradient, bf16 on the CPU takes the kernel measured for the layout, anything else SDPA; without one, an eval
    model runs its ``inference_attention`` (set by ``prepare_inference``), except ``"auto"`` (set by ``train()``)
    and a model in training mode (a frozen part): bf16 on the CPU then takes the kernel measured forward only."""
    cpu_bf16 = q.device.type == "cpu" and _bf16_cpu(q)
    if torch.is_grad_enabled() and q.requires_grad:
        return _cpu_bf16_kernel(q, k, v, mask, scale) if cpu_bf16 else "sdpa"
    kernel = getattr(module, "inference_attention", "sdpa")
    if not module.training and kernel != "auto":
        return kernel
    return _cpu_bf16_kernel(q, k, v, mask, scale, forward=True) if cpu_bf16 else "sdpa"


def attend(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention ``[B, H, Tq, d]`` of ``q`` ``[B, H, Tq, d]`` over ``k``/``v`` ``[B, KV, Tk, d]`` (boolean ``mask``
    ``[B, 1, Tq, Tk]``, True = may attend; None: every key) with ``kernel``: "sdpa" (PyTorch's fused kernel,
    grouped-query without repeating K/V), "explicit" (``grouped_attention``; the only one with logit soft-capping)
    or "sdpa_fp32" (SDPA on float32 copies outside autocast, the result in ``q``'s dtype)."""
    if softcap or kernel == "explicit":
        return grouped_attention(q, k, v, mask, scale, softcap)
    gqa = q.shape[1] != k.shape[1]
    if gqa and mask is not None and _repeat_kv_for_masked_sdpa(q.device.type):
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        gqa = False
    if kernel == "sdpa_fp32":
        with torch.autocast(q.device.type, enabled=False):
            out = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _repeat_kv_for_masked_sdpa(device_type: str) -> bool:
    """Whether SDPA needs K/V repeated to the query heads for a masked grouped-query call on this device. On CUDA,
    ``enable_gqa`` works only with the flash and math kernels (torch's documentation of the argument), and flash
    takes no mask: every masked call (the backbone's prefix, the expert's suffix) fell back to the math kernel,
    with float32 ``[B, H, Tq, Tk]`` intermediates. Repeated K/V let the memory-efficient kernel take it. On CPU the
    fused kernel handles grouped queries with a mask itself."""
    return device_type == "cuda"


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Explicit attention ``[B, H, Tq, d]`` for grouped-query heads without repeating K/V: the ``H / KV`` query
    heads of each KV head are stacked along the query axis (HF's head order, ``repeat_kv``: query head ``h`` reads
    KV head ``h // (H / KV)``).

    Three ops: one ``baddbmm`` (the mask as an additive bias of the dtype's lowest value, the scale as ``alpha``),
    the softmax, one ``bmm``, all in the compute dtype (the input's, or autocast's). In bf16 on AVX-512-BF16 EPYCs
    this beat SDPA's fused kernel at the model's longer shapes, forward and backward (``benchmarks/attention.py``;
    not at every shape and CPU, hence the measurements), where casting to float32 around the softmax (the former
    form) cost more than the matmuls. Logits are rounded to the compute dtype, as in HF's eager attention; a row
    with no key allowed gets uniform weights, as there. Logit soft-capping (Gemma2) and float16 (where the lowest
    value plus a negative logit overflows to -inf, and a row with no key allowed would be NaN) keep a form that
    masks with ``masked_fill`` and takes the softmax in float32. ``mask=None`` (every key, e.g. a vision tower's
    full images): a zero bias broadcast over the batch, nothing materialized."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    device = q.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else q.dtype
    if softcap or dtype == torch.float16:
        logits = torch.matmul(q.reshape(b, kv, g * t, d), k.transpose(-1, -2)) * scale
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if mask is not None:
            logits = logits.view(b, kv, g, t, s).masked_fill(~mask[:, :, None], torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits.float(), dim=-1).to(q.dtype).view(b, kv, g * t, s)
        return torch.matmul(probs, v).view(b, h, t, d)
    if mask is None:
        bias = torch.zeros(1, 1, 1, dtype=dtype, device=q.device)
    else:
        bias = torch.zeros(mask.shape, dtype=dtype, device=q.device).masked_fill_(
            ~mask, torch.finfo(dtype).min
        )
        bias = bias[:, :, None].expand(b, kv, g, t, s).reshape(b * kv, g * t, s)
    logits = torch.baddbmm(
        bias, q.reshape(b * kv, g * t, d), k.reshape(b * kv, s, d).transpose(1, 2), alpha=scale
    )
    probs = torch.softmax(logits, dim=-1)
    return torch.bmm(probs, v.reshape(b * kv, s, d)).view(b, h, t, d)


class SharedKVLayer(nn.Module):
    """Mixed into a HF decoder layer class by ``shared_kv_class``: the layer's modules, our ``forward``.

    ``checkpoint_activations``: recompute the layer's body in backward instead of storing its activations
    (training only). ``keys_values_only``: the layer was reduced to what its keys/values need
    (``keep_keys_values_only``), so it can only run with ``keys_only=True``.
    """

    checkpoint_activations: bool = False
    keys_values_only: bool = False
    # set by apply_fsdp2: return the values contiguous, not as a view of the projection's output (FSDP2 warns on a
    # view, as an in-place op on it would skip its pre-backward hook); a copy ``attend`` makes anyway where it
    # reshapes the values
    contiguous_values: bool = False
    # set by prepare_inference (and "auto", measured, by train()); used outside training mode without a gradient
    inference_attention: str = "sdpa"

    @property
    def softcap(self) -> float | None:
        """The attention logit soft-capping of this layer (Gemma2), None without: only the explicit form has it."""
        return getattr(self.self_attn, "attn_logit_softcapping", None) or None

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: KeysValues | None = None,
        *,
        keys_only: bool = False,
    ) -> tuple[torch.Tensor | None, KeysValues]:
        """One decoder layer on hidden states ``h`` ``[B, T, hidden]`` with RoPE angles ``cos``/``sin`` ``[B, T, d]``.

        ``past`` = (keys, values) ``[B, KV, P, d]`` of other tokens to attend to besides ``h``'s own (the prefix,
        for the expert); boolean ``mask`` ``[B, 1, T, P + T]`` (True = may attend) covers both. Returns the new
        hidden states (None with ``keys_only``: the caller only needs this layer's keys/values, e.g. the backbone's
        last layer) and this layer's own (keys, values) ``[B, KV, T, d]``."""
        if self.keys_values_only and not keys_only:
            raise RuntimeError(
                f"{type(self).__name__}: this layer keeps only its key/value projections (the backbone's last "
                "layer); call it with keys_only=True"
            )
        if self.checkpoint_activations and self.training and torch.is_grad_enabled() and not keys_only:
            return checkpoint(self._layer, h, cos, sin, mask, past, keys_only, use_reentrant=False)
        return self._layer(h, cos, sin, mask, past, keys_only)

    def _layer(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: KeysValues | None,
        keys_only: bool,
    ) -> tuple[torch.Tensor | None, KeysValues]:
        attn = self.self_attn
        x = self.input_layernorm(h)
        k = _rope(_heads(x, attn.k_proj, attn.head_dim), cos, sin)
        v = _heads(x, attn.v_proj, attn.head_dim)
        if self.contiguous_values:
            v = v.contiguous()
        if keys_only:
            return None, (k, v)
        q = _rope(_heads(x, attn.q_proj, attn.head_dim), cos, sin)
        kk, vv = (
            (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)) if past is not None else (k, v)
        )
        a = self._attend(q, kk, vv, mask)
        if hasattr(self, "pre_feedforward_layernorm"):  # Gemma2: sandwich norms around attention and MLP
            h = h + self.post_attention_layernorm(a)
            h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        else:
            h = h + a
            h = h + self.mlp(self.post_attention_layernorm(h))
        return h, (k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` over ``k``/``v`` with boolean ``mask`` ``[B, 1, Tq, Tk]``, then the output projection:
        ``[B, Tq, hidden]``.

        SDPA, except where the explicit grouped form is needed (Gemma2's logit soft-capping: nothing to choose) or
        another kernel is faster (``choose_kernel``): bf16 training on the CPU, where the fastest of ``KERNELS`` is
        measured per machine (``_cpu_bf16_kernel``), and inference, which runs ``inference_attention``."""
        attn = self.self_attn
        softcap = self.softcap
        kernel = "explicit" if softcap else choose_kernel(self, q, k, v, mask, attn.scaling)
        out = attend(kernel, q, k, v, mask, attn.scaling, softcap)
        out = out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
        return attn.o_proj(out)

    def keep_keys_values_only(self) -> list[str]:
        """Delete every submodule that computing this layer's keys/values never uses (query and output
        projections, MLP, the norms after attention) and return the deleted parameters' names (relative to the
        layer). For the backbone's last layer, whose hidden-state output nobody reads: its other weights would
        never get a gradient (DDP without ``find_unused_parameters`` fails on them) and would be saved unused."""
        keep = {self: {"input_layernorm", "self_attn"}, self.self_attn: {"k_proj", "v_proj"}}
        dropped = []
        for module, prefix in ((self, ""), (self.self_attn, "self_attn.")):
            if module._parameters:
                raise TypeError(
                    f"{type(module).__name__} owns parameters directly; keys-only reduction unsupported"
                )
            for name, child in list(module.named_children()):
                if name not in keep[module]:
                    dropped += [f"{prefix}{name}.{n}" for n, _ in child.named_parameters()]
                    delattr(module, name)
        self.keys_values_only = True
        return dropped


_CLASSES: dict[type, type] = {}


def shared_kv_class(hf_class: type[nn.Module]) -> type[SharedKVLayer]:
    """``SharedKV<HFClass>``: ``hf_class`` (its ``__init__``, modules and parameter names) with ``SharedKVLayer``'s
    ``forward``. One class per HF class, made on first use (it is a subclass, the installed library is untouched)."""
    if issubclass(hf_class, SharedKVLayer):
        return hf_class
    if hf_class not in _CLASSES:
        cls = type(f"SharedKV{hf_class.__name__}", (SharedKVLayer, hf_class), {"__module__": __name__})
        globals()[cls.__name__] = cls  # found by name, so pickle works in a process that has built the class
        _CLASSES[hf_class] = cls
    return _CLASSES[hf_class]


def shared_kv(layer: nn.Module, *, checkpoint_activations: bool = False) -> SharedKVLayer:
    """``layer`` (a loaded HF decoder layer) re-classed in place as ``shared_kv_class(type(layer))``: same object,
    same parameters and state-dict keys."""
    layer.__class__ = shared_kv_class(type(layer))
    layer.checkpoint_activations = checkpoint_activations
    return layer


#: The attention implementation name ``use_vla_attention`` gives a vision tower (HF ``AttentionInterface``).
VISION_ATTENTION = "vla"


def vision_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """HF attention function ``"vla"`` of a vision tower's attention ``module``: ``query``/``key``/``value``
    ``[B, H, T, d]``, boolean ``attention_mask`` ``[B, 1, T, T]`` (True = may attend) or None -> output
    ``[B, T, H, d]`` and no weights, with the kernel ``choose_kernel`` picks (the module's ``inference_attention``,
    or a measured one). Dropout in training mode, or a float mask, is left to SDPA, as HF's ``"sdpa"`` does it."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if (dropout and module.training) or (attention_mask is not None and attention_mask.dtype != torch.bool):
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout if module.training else 0.0,
            scale=scale,
        )
    else:
        kernel = choose_kernel(module, query, key, value, attention_mask, scale)
        out = attend(kernel, query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


def full_image_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: object) -> None:
    """HF attention-mask function of ``VISION_ATTENTION``: no mask (every patch attends to every patch). The
    vision towers vla runs only ever see whole images (``VLMBackbone.pixels`` resizes every frame to the full square
    and no patch mask is passed), so HF's all-ones patch mask says nothing; under ``torch.compile`` SDPA's mask
    function could not tell and built a full ``[B, 1, T, T]`` mask, which the explicit form then expanded per head in
    every layer. Checked in eager mode: a padded image is an error here, not a silent full view; on an accelerator
    as a device-side assert (reading the mask would stall the host on every vision pass)."""
    if attention_mask is None or torch.compiler.is_compiling():
        return None
    message = (
        "vla's vision attention serves whole images only; got a padded patch mask (call the vision tower "
        "without one, as VLMBackbone does, or give it attn_implementation='sdpa')"
    )
    if attention_mask.device.type != "cpu":
        torch._assert_async(attention_mask.all(), message)
    elif not bool(attention_mask.all()):
        raise ValueError(message)
    return None


def use_vla_attention(vision: nn.Module) -> None:
    """Run the HF vision tower ``vision`` (a ``PreTrainedModel``) with ``vision_attention`` (registered with HF as
    ``VISION_ATTENTION``, with ``full_image_mask``); its attention modules take ``inference_attention`` like the
    language layers (``is_attention_module``). The saved config is unchanged (HF does not serialize the
    attention implementation)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VISION_ATTENTION, vision_attention)
    AttentionMaskInterface.register(VISION_ATTENTION, full_image_mask)
    vision.set_attn_implementation(VISION_ATTENTION)
    modules = [m for m in vision.modules() if all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj"))]
    if not modules:
        raise TypeError(f"{type(vision).__name__}: no attention module with q/k/v projections found")
    for m in modules:
        m.vla_vision_attention = True  # found by is_attention_module
        m.inference_attention = "sdpa"


def is_attention_module(module: nn.Module) -> bool:
    """A module whose ``inference_attention`` picks its kernel: a ``SharedKVLayer`` or a vision tower's attention
    (``use_vla_attention``)."""
    return isinstance(module, SharedKVLayer) or getattr(module, "vla_vision_attention", False)
