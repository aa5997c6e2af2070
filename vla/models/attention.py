"""Driving a Hugging Face decoder layer by hand, so prefix and action-expert tokens can share keys/values.

Both the backbone's prefix pass and the expert's pass run the *same* HF layer modules (norms, q/k/v/o
projections, MLP) through ``decoder_layer``; only the keys/values and the attention mask differ. Works for the
Llama family (SmolVLM's text model), Gemma (PaliGemma) and Gemma2 (PaliGemma2: extra sandwich norms, attention
logit soft-capping). Attention is SDPA (grouped-query without repeating K/V) unless soft-capping needs the
explicit form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


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


def qkv(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Queries ``[B, H, T, d]`` and RoPE-rotated keys / values ``[B, KV, T, d]`` of a normed input ``x``."""
    attn = layer.self_attn
    d = attn.head_dim
    q, k, v = _heads(x, attn.q_proj, d), _heads(x, attn.k_proj, d), _heads(x, attn.v_proj, d)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def attend(
    layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention of ``q`` over ``k``/``v`` with boolean ``mask`` ``[B, 1, Tq, Tk]`` (True = may attend), then
    the output projection: ``[B, Tq, hidden]``.

    SDPA, except where the explicit grouped form is needed (Gemma2's logit soft-capping) or faster: bf16 training
    on CPU, where SDPA's flash backward costs ~3x the explicit form at the expert's shapes."""
    attn = layer.self_attn
    softcap = getattr(attn, "attn_logit_softcapping", None)
    explicit = softcap or (
        q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad and _bf16_cpu(q)
    )
    if explicit:
        out = grouped_attention(q, k, v, mask, attn.scaling, softcap)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1]
        )
    out = out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    return attn.o_proj(out)


def _bf16_cpu(x: torch.Tensor) -> bool:
    """True when attention on CPU runs in bfloat16 (bf16 tensors, or bf16 autocast casting them)."""
    return x.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    )


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Explicit attention ``[B, H, Tq, d]`` for grouped-query heads without repeating K/V: the ``H / KV`` query
    heads of each KV head are stacked along the query axis (HF's head order: query head ``h`` reads KV head
    ``h // (H / KV)``). Softmax in float32, as HF's eager attention."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    logits = torch.matmul(q.reshape(b, kv, (h // kv) * t, d), k.transpose(-1, -2)) * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.view(b, kv, h // kv, t, s).masked_fill(~mask[:, :, None], torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits.float(), dim=-1).to(q.dtype).view(b, kv, (h // kv) * t, s)
    return torch.matmul(probs, v).view(b, h, t, d)


def decoder_layer(
    layer: nn.Module,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    past: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    keys_only: bool = False,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
    """One decoder layer on hidden states ``h`` ``[B, T, hidden]``.

    ``past`` = (keys, values) ``[B, KV, P, d]`` of other tokens to attend to besides ``h``'s own (the prefix,
    for the expert); ``mask`` ``[B, 1, T, P + T]`` covers both. Returns the new hidden states (None with
    ``keys_only``: the caller only needs this layer's keys/values, e.g. the backbone's last layer) and this
    layer's own (keys, values) ``[B, KV, T, d]``.
    """
    x = layer.input_layernorm(h)
    q, k, v = qkv(layer, x, cos, sin)
    if keys_only:
        return None, (k, v)
    kk, vv = (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)) if past is not None else (k, v)
    a = attend(layer, q, kk, vv, mask)
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma2: sandwich norms around attention and MLP
        h = h + layer.post_attention_layernorm(a)
        h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
    else:
        h = h + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, (k, v)
