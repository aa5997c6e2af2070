"""The action expert: a smaller transformer of the backbone's own decoder-layer class (Llama or Gemma layers,
narrower) over the suffix tokens ``[state, H noisy actions]``. Its layer ``i`` attends to the backbone's layer-``i``
prefix keys/values plus the suffix's own (π0 / SmolVLA), with a mask so that

* prefix tokens never attend to suffix tokens (the prefix is computed before and without them),
* the state token attends to the prefix and itself,
* action tokens attend to the prefix, the state and every valid action token of their chunk.

Queries, keys and values keep the backbone's head layout (heads, KV heads, head_dim), so prefix and suffix keys
concatenate; only the residual width differs (``width_ratio`` x the backbone's).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from vla.models.attention import check_window, shared_kv_class
from vla.models.backbone import Prefix


def _round(x: float, multiple: int = 8) -> int:
    return max(multiple, round(x / multiple) * multiple)


class ActionExpert(nn.Module):
    """Suffix transformer; ``width`` is its residual width. ``forward`` maps ``[B, T, width]`` -> ``[B, T, width]``."""

    def __init__(
        self,
        backbone_layer: nn.Module,
        text_config: object,
        rotary: nn.Module,
        *,
        num_layers: int,
        backbone_layers: int,
        width_ratio: float,
        mlp_ratio: float,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= num_layers <= backbone_layers:
            raise ValueError(
                f"model.expert.num_layers must be in [1, {backbone_layers}] (backbone layers used), got {num_layers}"
            )
        # expert layer i reads the keys/values of backbone layer kv_index[i] (evenly spread, always the last one)
        self.kv_index = [(i + 1) * backbone_layers // num_layers - 1 for i in range(num_layers)]
        cfg = copy.deepcopy(text_config)
        self.width = _round(cfg.hidden_size * width_ratio)
        cfg.hidden_size = self.width
        cfg.intermediate_size = _round(self.width * mlp_ratio)
        cfg.num_hidden_layers = num_layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types)[:num_layers]
        if getattr(cfg, "head_dim", None) is None:  # keep the backbone's head size: keys must concatenate
            cfg.head_dim = text_config.hidden_size // text_config.num_attention_heads
        self.config = cfg
        layer_cls = shared_kv_class(type(backbone_layer))  # called as modules: FSDP2 shards them one by one
        self.layers = nn.ModuleList(layer_cls(cfg, layer_idx=i) for i in range(num_layers))
        for layer in self.layers:
            layer.checkpoint_activations = gradient_checkpointing
        self.norm = type(backbone_layer.input_layernorm)(self.width, eps=cfg.rms_norm_eps)
        self.rotary = rotary  # shared with the backbone (same head_dim and theta): not a parameter owner
        self.apply(self._init)

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def context(self, prefix: Prefix) -> SuffixContext:
        """What every expert pass over this observation attends to besides its own tokens: the prefix."""
        past = [(prefix.keys[j], prefix.values[j]) for j in self.kv_index]
        return SuffixContext(past=past, valid=prefix.valid, start=prefix.length)

    def extend(self, ctx: SuffixContext, state: torch.Tensor) -> SuffixContext:
        """Run the state token(s) ``[B, S, width]`` once and append their per-layer keys/values to ``ctx``.

        The state token attends to the prefix and itself only, so its keys/values are the same at every flow
        step: ``sample_actions`` computes them once and each Euler step runs only the action tokens (exactly the
        joint ``[state, actions]`` pass of ``forward``, with the state rows left out)."""
        b, s, _ = state.shape
        plan = self.plan(ctx, state.new_ones(b, s, dtype=torch.bool), isolate_first=False)
        past = []
        h = state
        for i, layer in enumerate(self.layers):
            last = i == len(self.layers) - 1
            h, (k, v) = layer(h, plan.cos, plan.sin, plan.mask, plan.past[i], keys_only=last)
            past.append((torch.cat([ctx.past[i][0], k], dim=2), torch.cat([ctx.past[i][1], v], dim=2)))
        valid = torch.cat([ctx.valid, ctx.valid.new_ones(b, s)], dim=1)
        return SuffixContext(past=past, valid=valid, start=ctx.start + s)

    def plan(self, ctx: SuffixContext, suffix_valid: torch.Tensor, *, isolate_first: bool) -> ExpertPlan:
        """RoPE angles and the attention mask of a suffix ``[B, T]`` over ``ctx`` (computed once, reused by every
        flow step). ``isolate_first``: token 0 (the state) sees the context and itself only."""
        b, t = suffix_valid.shape
        check_window(self.config, ctx.valid.shape[1] + t, "prefix + [state, actions]")
        positions = ctx.start[:, None] + torch.arange(t, device=suffix_valid.device)[None]
        cos, sin = self.rotary(ctx.past[0][0], positions)  # in the keys' dtype
        suffix = suffix_valid[:, None, :].expand(b, t, t).clone()
        if isolate_first:
            suffix[:, 0, 1:] = False
        eye = torch.eye(t, dtype=torch.bool, device=suffix_valid.device)[None]
        mask = torch.cat([ctx.valid[:, None, :].expand(b, t, -1), suffix | eye], dim=-1).unsqueeze(1)
        return ExpertPlan(cos=cos, sin=sin, mask=mask, past=ctx.past)

    def run(self, x: torch.Tensor, plan: ExpertPlan) -> torch.Tensor:
        """The expert layers over suffix tokens ``x`` ``[B, T, width]`` -> ``[B, T, width]`` (normed)."""
        h = x
        for i, layer in enumerate(self.layers):
            h, _ = layer(h, plan.cos, plan.sin, plan.mask, plan.past[i])
        return self.norm(h)

    def forward(self, x: torch.Tensor, prefix: Prefix, suffix_valid: torch.Tensor) -> torch.Tensor:
        """``x`` suffix tokens ``[B, T, width]`` (state first, then actions), ``suffix_valid`` ``[B, T]``: the joint
        pass training uses (``sample_actions`` caches the state with ``extend`` instead)."""
        return self.run(x, self.plan(self.context(prefix), suffix_valid, isolate_first=True))


@dataclass
class SuffixContext:
    """Keys/values a suffix attends to besides its own: ``past[i]`` = (keys, values) ``[B, KV, P, d]`` for expert
    layer ``i``, ``valid`` ``[B, P]``, ``start`` ``[B]`` = position of the suffix's first token."""

    past: list[tuple[torch.Tensor, torch.Tensor]]
    valid: torch.Tensor
    start: torch.Tensor


@dataclass
class ExpertPlan:
    """Per-observation constants of an expert pass: RoPE ``cos``/``sin`` ``[B, T, d]``, boolean ``mask``
    ``[B, 1, T, P + T]`` and the per-layer ``past`` keys/values."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor
    past: list[tuple[torch.Tensor, torch.Tensor]]
