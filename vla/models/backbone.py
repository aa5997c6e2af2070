"""The VLM backbone: a Hugging Face vision-language model turned into a *prefix encoder*.

It embeds the images of every present camera slot (absent slots are masked out, never attended), the prompt
tokens and a learned embodiment token into one prefix ``[B, P, D]``, runs the first ``num_vlm_layers`` language
layers over it with bidirectional attention among valid prefix tokens, and returns every layer's keys/values
``[B, KV, P, d]``: the action expert's layer ``i`` attends to them (π0-style), so the prefix is computed once per
observation and reused by every denoising step. The layers are the HF modules re-classed by
``vla.models.attention.shared_kv`` (called as modules, so FSDP2 shards them one by one); the last one keeps only its
key/value projections, the only part of it that is ever used (``unused_weights`` names what was dropped).

Loaded with ``from_pretrained`` from a hub id or a local directory (SmolVLM/Idefics3: SmolVLM2-256M/500M;
PaliGemma/PaliGemma2), or ``tiny:<family>[:<size>]`` for a small randomly initialised model of the same classes (the loading and its
checks: ``vla.models.hf_loading``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vla.models.attention import check_window, shared_kv, use_vla_attention
from vla.models.compiled import release
from vla.models.config import BackboneConfig
from vla.models.hf_loading import (  # re-exported: callers import these from vla.models.backbone too
    BACKBONE_CONFIG,
    REQUIRED_FILES,
    TOKENIZER_FILES,
    check_family,
    check_saved_backbone,
    keep_first_layers,
    load_hf_vlm,
    load_image_norm,
    resolve_pretrained,
)
from vla.types import IMAGE_SLOTS, to_device


@dataclass
class Prefix:
    """A computed prefix: per-layer ``keys``/``values`` ``[B, KV, P, d]``, ``valid`` ``[B, P]`` (token exists)
    and ``length`` ``[B]`` (number of valid tokens; the expert's positions continue from it)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    length: torch.Tensor


class VLMBackbone(nn.Module):
    """Prefix encoder over a HF VLM (see the module docstring). ``hidden_size`` is the language width D."""

    def __init__(self, cfg: BackboneConfig, *, model: nn.Module, tokenizer: object, source: str = "") -> None:
        super().__init__()
        self.cfg, self.tokenizer, self.source = cfg, tokenizer, source
        inner = model.model
        if cfg.family == "smolvlm":
            self.vision, self.projector, text = inner.vision_model, inner.connector, inner.text_model
        else:
            self.vision, self.projector, text = (
                inner.vision_tower,
                inner.multi_modal_projector,
                inner.language_model,
            )
        self.hf_config = model.config
        use_vla_attention(self.vision)  # its attention through our kernels (vla.models.attention)
        self.text_config = text.config
        total = len(text.layers)
        n = cfg.num_vlm_layers or total
        if n > total:
            raise ValueError(
                f"model.backbone.num_vlm_layers={n} but {source or 'the backbone'} has {total} language layers"
            )
        self.embed_tokens = text.embed_tokens
        # the layers past n, the final norm and the LM head are never used: not kept
        self.layers = nn.ModuleList(
            shared_kv(layer, checkpoint_activations=cfg.gradient_checkpointing)
            for layer in list(text.layers)[:n]
        )
        # only the last layer's keys/values are read (by the expert): its other weights are not kept either
        self.unused_weights: tuple[str, ...] = tuple(
            f"layers.{n - 1}.{name}" for name in self.layers[-1].keep_keys_values_only()
        )
        self.rotary = text.rotary_emb
        vcfg = self.hf_config.vision_config
        self.native_image_size = int(vcfg.image_size)
        self.image_size = cfg.image_size or self.native_image_size
        if self.image_size != self.native_image_size and cfg.family != "smolvlm":
            raise ValueError(
                f"model.backbone.image_size={self.image_size}: {cfg.family} vision towers have fixed position "
                f"embeddings for {self.native_image_size} px; use 0 or {self.native_image_size}"
            )
        # SmolVLM's tower takes a patch mask; vla passes an all-True one made on the pixels' device (HF builds it on
        # the host and copies it, a blocking copy that waits for the GPU, in every vision pass)
        self.mask_patch: int | None = None
        if cfg.family == "smolvlm":  # any size whose patch grid pixel-shuffles evenly into image tokens
            patch = vcfg.patch_size if isinstance(vcfg.patch_size, int) else vcfg.patch_size[0]
            self.mask_patch = int(patch)
            step = int(patch) * int(self.hf_config.scale_factor)
            if self.image_size % step:
                raise ValueError(
                    f"model.backbone.image_size={self.image_size}: SmolVLM needs a multiple of patch_size x "
                    f"scale_factor = {step} px (e.g. {max(step, self.image_size // step * step)}); 0 = native "
                    f"{self.native_image_size}"
                )
        mean, std = load_image_norm(source)
        self.register_buffer("pixel_mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        self.hidden_size = int(self.text_config.hidden_size)
        # serving replaces these with compiled versions (FlowVLA.prepare_inference); train() restores them
        self._encode_pixels: Callable[[torch.Tensor], torch.Tensor] = self.encode_pixels
        self._run_layers: Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]] = self.run_layers
        # training's compiled frozen parts (compile_frozen): what drop_compiled goes back to, and the submodules
        # they read, kept in eval mode (a train/eval switch would recompile them)
        self._frozen_compiled: dict[str, Callable[..., Any]] = {}
        self._frozen_eval: list[nn.Module] = []
        self.set_trainable()

    def compile_for_serving(self, compile_fn: Callable[[Callable], Callable]) -> None:
        """Use ``compile_fn(fn)`` versions of the vision tower + projector and of the language layers."""
        self._encode_pixels = compile_fn(self.encode_pixels)
        self._run_layers = compile_fn(self.run_layers)

    def drop_compiled(self) -> None:
        """Back to the eager functions, or to training's compiled frozen parts (FlowVLA drops serving's compiled
        graphs whenever weights may change; the parts ``compile_frozen`` compiled cannot change in training)."""
        kept = self._frozen_compiled
        for name in ("_encode_pixels", "_run_layers"):
            fn = getattr(self, name)
            if fn is not kept.get(name):
                release(fn)
        self._encode_pixels = kept.get("_encode_pixels", self.encode_pixels)
        self._run_layers = kept.get("_run_layers", self.run_layers)

    def frozen_parts(self) -> list[str]:
        """The parts that run without autograd in training and whose weights no optimizer can change: the vision
        tower + projector with ``freeze_vision`` (and no trainable parameter there, e.g. no LoRA adapter), the
        language layers when the whole backbone is frozen and they carry no trainable parameter."""
        parts = []
        vision = [*self.vision.parameters(), *self.projector.parameters()]
        if self.cfg.freeze_vision and not any(p.requires_grad for p in vision):
            parts.append("vision")
        if self.frozen and not any(p.requires_grad for p in self.layers.parameters()):
            parts.append("language")
        return parts

    def compile_frozen(self, compile_fn: Callable[..., Callable]) -> list[str]:
        """Training: run ``frozen_parts()`` as graphs compiled by ``compile_fn(fn, dynamic=..., batch_dynamic=...)``
        (frozen weights: vla.models.compiled), in eval mode (no dropout in a frozen part; a train/eval switch
        would recompile) until ``drop_frozen_compiled``. Batch and prompt length are dynamic dimensions from the
        first call, so a batch runs on the same graph whatever the shapes before it (a resumed run computes what
        the uninterrupted one did, bit for bit). Returns the parts compiled."""
        self.drop_frozen_compiled()
        parts = self.frozen_parts()
        if "vision" in parts:  # dynamic H/W do not trace (position-embedding buckets); the batch does
            fn = compile_fn(self.encode_pixels, dynamic=False, batch_dynamic=True)
            self._frozen_compiled["_encode_pixels"] = fn
            self._frozen_eval += [self.vision, self.projector]
        if "language" in parts:
            self._frozen_compiled["_run_layers"] = compile_fn(self.run_layers, dynamic=True)
            self._frozen_eval.append(self.layers)
        for module in self._frozen_eval:
            module.eval()
        self.drop_compiled()
        return parts

    def drop_frozen_compiled(self) -> None:
        """Back to eager for the parts ``compile_frozen`` compiled (their graphs freed; train/eval as the model)."""
        compiled, self._frozen_compiled = self._frozen_compiled, {}
        for fn in compiled.values():
            release(fn)
        self._frozen_eval = []
        self._encode_pixels, self._run_layers = self.encode_pixels, self.run_layers
        self.train(self.training)

    def train(self, mode: bool = True) -> VLMBackbone:
        if mode:  # compiled for serving with frozen weights: drop before weights can change
            self.drop_compiled()
        super().train(mode)
        for module in self._frozen_eval:
            module.eval()
        return self

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls, cfg: BackboneConfig, *, weights: bool = True, path: str | None = None
    ) -> VLMBackbone:
        if path is not None:
            check_saved_backbone(Path(path))
        src = path or resolve_pretrained(cfg.pretrained)
        model, tokenizer = load_hf_vlm(src, cfg.family, weights=weights, num_layers=cfg.num_vlm_layers)
        return cls(cfg, model=model, tokenizer=tokenizer, source=src)

    @classmethod
    def from_hf_config(
        cls, cfg: BackboneConfig, hf_config: object, *, tokenizer: object = None, source: str = ""
    ) -> VLMBackbone:
        """A randomly initialised backbone of ``hf_config``'s classes (a copy is cut to ``cfg.num_vlm_layers``);
        under ``vla.models.meta.empty_weights()`` nothing is initialised: the weights are on the meta device."""
        import copy

        from transformers import AutoModelForImageTextToText

        config = copy.deepcopy(hf_config)
        check_family(config, cfg.family, source or "the given HF config")
        keep_first_layers(config, cfg.num_vlm_layers, source or "the given HF config")
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        return cls(cfg, model=model, tokenizer=tokenizer, source=source)

    def set_trainable(self) -> None:
        """Apply ``freeze_vision`` / ``freeze_language``."""
        for m in (self.vision, self.projector):
            m.requires_grad_(not self.cfg.freeze_vision)
        for m in (self.embed_tokens, self.layers):
            m.requires_grad_(not self.cfg.freeze_language)

    @property
    def frozen(self) -> bool:
        return self.cfg.freeze_vision and self.cfg.freeze_language

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def save_assets(self, out: Path) -> None:
        """Write what rebuilds this backbone without downloading: its HF config, tokenizer and image norm."""
        out.mkdir(parents=True, exist_ok=True)
        self.hf_config.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        (out / "vla_image_norm.json").write_text(
            json.dumps({"mean": self.pixel_mean.flatten().tolist(), "std": self.pixel_std.flatten().tolist()})
        )

    # ---- prefix ----------------------------------------------------------------------------------------------
    def tokenize(self, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask ``[B, L]`` (L <= max_prompt_tokens, padded to the batch's longest)."""
        enc = self.tokenizer(
            [p if p else " " for p in prompts],
            padding="longest",
            truncation=True,
            max_length=self.cfg.max_prompt_tokens,
            return_tensors="pt",
        )
        return to_device(enc["input_ids"], device), to_device(enc["attention_mask"], device).bool()

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalized pixels ``[N, 3, S, S]`` -> image tokens ``[N, n_tok, D]`` (vision tower, projector)."""
        kwargs = {}
        if self.mask_patch:
            n, _, h, w = pixels.shape
            grid = (n, h // self.mask_patch, w // self.mask_patch)
            kwargs["patch_attention_mask"] = torch.ones(grid, dtype=torch.bool, device=pixels.device)
        return self.projector(self.vision(pixel_values=pixels, **kwargs).last_hidden_state)

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, H, W, 3]`` -> the vision tower's input ``[N, 3, S, S]`` (resized, normalized).

        Resized in float32 on the 0-255 values (antialiasing has no bf16 kernel), then normalized in one pass over
        the channels-last pixels, ``x * (1 / (255 std)) - mean / std`` (the same as ``(x / 255 - mean) / std``:
        resizing is linear, its weights sum to 1). The result is a channels-last ``[N, 3, S, S]`` view, the patch
        convolution's faster input (bf16 on a "Zen 4" EPYC: 7.5 against 10.1 ms for 16 images at 224 px); the
        former three passes over a permuted view took 11 ms in bf16 for those 16 images, this 1-2 ms."""
        x = images.float()
        if x.shape[1:3] != (self.image_size, self.image_size):
            x = F.interpolate(
                x.permute(0, 3, 1, 2),
                size=(self.image_size, self.image_size),
                mode="bilinear",
                antialias=True,
                align_corners=False,
            ).permute(0, 2, 3, 1)
        mean, std = self.pixel_mean.float().flatten(), self.pixel_std.float().flatten()
        scale, shift = 1 / (255 * std), -mean / std
        return torch.addcmul(shift, x, scale).permute(0, 3, 1, 2).to(self.pixel_mean.dtype)

    def embed_prefix(
        self,
        images: dict[str, torch.Tensor],
        image_mask: dict[str, torch.Tensor],
        prompts: list[str],
        embodiment_token: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix tokens ``[B, P, D]`` and validity ``[B, P]``: image tokens of each slot (slot order of
        ``IMAGE_SLOTS``; the last frame of the history), prompt tokens, then the embodiment token ``[B, D]``."""
        device = embodiment_token.device
        b = embodiment_token.shape[0]
        parts, valid = [], []
        slots, pixels = [], []
        for slot in [s for s in IMAGE_SLOTS if s in images]:
            mask = image_mask[slot]  # read where the loader put it (the host): no wait on the device
            frames = images[slot][:, -1]  # [B, H, W, 3], on the loader's device (CPU or the model's)
            rows = mask.nonzero().flatten()
            if len(rows) == 0:
                continue
            # vision only for samples that have this camera; select on the frames' device, then move only those
            slots.append((to_device(mask, device), to_device(rows, device)))
            if len(rows) < b:  # else every frame as it is (a pinned batch's frames copy asynchronously)
                frames = frames.index_select(0, rows.to(frames.device))
            pixels.append(self.pixels(to_device(frames, device)))
        if pixels:  # every present image of every slot through the vision tower in one batch
            with torch.set_grad_enabled(torch.is_grad_enabled() and not self.cfg.freeze_vision):
                tokens = self._encode_pixels(torch.cat(pixels)).split([len(r) for _, r in slots])
            for (present, rows), tok in zip(slots, tokens, strict=True):
                parts.append(tok.new_zeros(b, *tok.shape[1:]).index_copy(0, rows, tok))
                valid.append(present[:, None].expand(-1, tok.shape[1]))
        ids, mask = self.tokenize(prompts, device)
        parts.append(self.embed_tokens(ids).to(embodiment_token.dtype))
        valid.append(mask)
        parts.append(embodiment_token[:, None])
        valid.append(torch.ones(b, 1, dtype=torch.bool, device=device))
        return torch.cat(parts, dim=1), torch.cat(valid, dim=1)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> Prefix:
        """Run the language layers over the prefix and collect every layer's keys/values (the last layer computes
        only those: nothing reads its hidden states).

        Attention is bidirectional among valid tokens, except that the last token (the embodiment token of
        ``embed_prefix``) is a summary token: it attends to every valid token, but no other token attends to it.
        Images and prompt are therefore encoded exactly as the pretrained VLM encodes them, and with a frozen
        backbone the token still learns cheaply (``refresh_summary_token``)."""
        check_window(self.text_config, tokens.shape[1], "the prefix")
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        cos, sin = self.rotary(tokens, positions)
        p = tokens.shape[1]
        # a padded query row attends to itself only (keeps softmax finite); nobody attends to padding
        mask = valid[:, None, :] | torch.eye(p, dtype=torch.bool, device=valid.device)[None]
        mask[:, :-1, -1] = False  # the summary token is seen by nobody but itself
        mask = mask.unsqueeze(1)
        keys, values = self._run_layers(tokens, cos, sin, mask)
        return Prefix(keys=keys, values=values, valid=valid, length=valid.sum(-1))

    def refresh_summary_token(self, prefix: Prefix, token: torch.Tensor) -> Prefix:
        """``prefix`` with its last token's keys/values recomputed from ``token`` ``[B, D]`` (with autograd).

        No other token attends to the summary token, so their keys/values (computed without autograd when the
        backbone is frozen) are unchanged; this runs one token per sample through the layers, so a frozen backbone
        still trains the embodiment token at almost no cost."""
        n = len(self.layers)
        positions = (prefix.length - 1)[:, None]  # the summary token is the last valid token
        h = token[:, None].to(prefix.keys[0].dtype)
        cos, sin = self.rotary(h, positions)
        mask = prefix.valid[:, None, None, :]  # [B, 1, 1, P]: every valid prefix token, itself included
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            past = (prefix.keys[i][:, :, :-1], prefix.values[i][:, :, :-1])
            h, (k, v) = layer(h, cos, sin, mask, past, keys_only=i == n - 1)
            keys.append(torch.cat([past[0], k], dim=2))
            values.append(torch.cat([past[1], v], dim=2))
        return Prefix(keys=keys, values=values, valid=prefix.valid, length=prefix.length)

    def run_layers(
        self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The language layers over prefix tokens ``[B, P, D]``: every layer's keys and values ``[B, KV, P, d]``."""
        keys, values = [], []
        h = tokens
        for i, layer in enumerate(self.layers):
            h, (k, v) = layer(h, cos, sin, mask, keys_only=i == len(self.layers) - 1)
            keys.append(k)
            values.append(v)
        return keys, values


__all__ = [
    "BACKBONE_CONFIG",
    "REQUIRED_FILES",
    "TOKENIZER_FILES",
    "Prefix",
    "VLMBackbone",
    "check_family",
    "check_saved_backbone",
    "keep_first_layers",
    "load_hf_vlm",
    "resolve_pretrained",
]
