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

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vla.models.attention import check_window, decoder_layer
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
        layer_cls = type(backbone_layer)
        self.layers = nn.ModuleList(layer_cls(cfg, layer_idx=i) for i in range(num_layers))
        self.norm = type(backbone_layer.input_layernorm)(self.width, eps=cfg.rms_norm_eps)
        self.rotary = rotary  # shared with the backbone (same head_dim and theta): not a parameter owner
        self.gradient_checkpointing = gradient_checkpointing
        self.apply(self._init)

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, prefix: Prefix, suffix_valid: torch.Tensor) -> torch.Tensor:
        """``x`` suffix tokens ``[B, T, width]`` (state first, then actions), ``suffix_valid`` ``[B, T]``."""
        b, t, _ = x.shape
        check_window(self.config, prefix.valid.shape[1] + t, "prefix + [state, actions]")
        positions = prefix.length[:, None] + torch.arange(t, device=x.device)[None]
        cos, sin = self.rotary(x, positions)
        # [B, 1, T, P + T]: prefix part by validity; suffix part: state -> itself, actions -> state + valid actions
        suffix = suffix_valid[:, None, :].expand(b, t, t).clone()
        suffix[:, 0, 1:] = False
        eye = torch.eye(t, dtype=torch.bool, device=x.device)[None]
        mask = torch.cat([prefix.valid[:, None, :].expand(b, t, -1), suffix | eye], dim=-1).unsqueeze(1)
        h = x
        for i, layer in enumerate(self.layers):
            past = (prefix.keys[self.kv_index[i]], prefix.values[self.kv_index[i]])
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                h, _ = checkpoint(decoder_layer, layer, h, cos, sin, mask, past, use_reentrant=False)
            else:
                h, _ = decoder_layer(layer, h, cos, sin, mask, past)
        return self.norm(h)
