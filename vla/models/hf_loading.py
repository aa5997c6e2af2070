"""Loading a Hugging Face VLM for ``vla.models.backbone``: hub ids, local folders and ``tiny:`` presets, the
checks on a checkpoint's saved ``backbone/`` folder, the first-N-layers cut, the family check, and the pixel
normalization its image processor declares."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn


def resolve_pretrained(name: str) -> str:
    """A hub id / local directory as given, or the local directory of a ``tiny:<family>[:<size>]`` preset."""
    if name.startswith("tiny:"):
        from vla.models.tiny import tiny_backbone_path

        parts = name.split(":")
        return str(tiny_backbone_path(parts[1], parts[2] if len(parts) > 2 else "tiny"))
    return name


#: Files a checkpoint's ``backbone/`` folder needs (``VLMBackbone.save``); a fast tokenizer's ``tokenizer.json``
#: or a SentencePiece ``tokenizer.model`` (without either, transformers asks for sentencepiece to convert one).
BACKBONE_CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
#: Also written by every ``VLMBackbone.save``: without them the tokenizer's special tokens and the pixel
#: normalization would silently fall back to defaults.
REQUIRED_FILES = ("tokenizer_config.json", "vla_image_norm.json")


def check_saved_backbone(folder: Path) -> None:
    """A checkpoint's saved backbone folder must hold its HF config and tokenizer: say which file is missing,
    instead of letting transformers read a missing folder as a hub id or ask for sentencepiece."""
    fix = "restore it from the original checkpoint (save_pretrained writes it) or re-save the checkpoint"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: the checkpoint's backbone folder is missing; {fix}")
    if not (folder / BACKBONE_CONFIG).is_file():
        raise FileNotFoundError(f"{folder / BACKBONE_CONFIG}: the backbone's config is missing; {fix}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder / TOKENIZER_FILES[0]}: the backbone's tokenizer is missing (no {' or '.join(TOKENIZER_FILES)} "
            f"in {folder}); {fix}"
        )
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: missing from the checkpoint's backbone folder; {fix}")
    for name in (BACKBONE_CONFIG, TOKENIZER_FILES[0], *REQUIRED_FILES):
        if (folder / name).is_file():
            try:
                json.loads((folder / name).read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
                raise ValueError(
                    f"{folder / name}: not valid JSON ({e}); the file is damaged, {fix}"
                ) from None


def load_hf_vlm(
    path: str, family: str, *, weights: bool = True, num_layers: int = 0
) -> tuple[nn.Module, object]:
    """The HF model (weights from ``path``, or random init from its config when ``weights`` is False) and its
    tokenizer. ``num_layers`` > 0 builds only the first that many language layers, so the others' weights are
    never materialized (SmolVLA-style use of the first N layers of a large VLM costs only what it keeps)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise OSError(
            f"cannot load the {family} backbone from {path!r}: {e}. Use a local directory with config.json and the "
            "tokenizer files, a hub id that is in your Hugging Face cache (downloads need network access), or "
            "'tiny:<family>' for a small local test model."
        ) from e
    check_family(config, family, path)
    keep_first_layers(config, num_layers, path)
    if weights:
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the dropped layers' weights are unused on purpose; checked below
        try:
            model, info = AutoModelForImageTextToText.from_pretrained(
                path, config=config, dtype=torch.float32, output_loading_info=True
            )
        finally:
            hf_logging.set_verbosity(verbosity)
        kept = re.compile(r"(?:text_model|language_model)\.(?:model\.)?layers\.(\d+)\.")  # LM layers
        dropped = [
            k for k in info["unexpected_keys"] if (m := kept.search(k)) and int(m.group(1)) >= num_layers > 0
        ]
        other = sorted(set(info["unexpected_keys"]) - set(dropped))
        missing = sorted(k for k in info["missing_keys"] if "lm_head" not in k)
        if missing or other:
            raise ValueError(
                f"{path}: the {family} checkpoint does not match its config.json (missing {missing[:5]}, "
                f"unexpected {other[:5]}); is model.backbone.family right and the download complete?"
            )
    else:  # float32 like the weights path: from_config would follow config.dtype (bfloat16 in many hub configs)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model, tokenizer


def keep_first_layers(config: object, num_layers: int, where: str) -> None:
    """Cut a HF VLM config (in place) to its first ``num_layers`` language layers (0 = all)."""
    text = config.text_config
    if num_layers > text.num_hidden_layers:
        raise ValueError(
            f"model.backbone.num_vlm_layers={num_layers} but {where} has {text.num_hidden_layers} language layers"
        )
    if 0 < num_layers < text.num_hidden_layers:
        text.num_hidden_layers = num_layers
        if getattr(text, "layer_types", None):
            text.layer_types = list(text.layer_types)[:num_layers]


def check_family(config: object, family: str, where: str) -> None:
    """``model.backbone.family`` must name the HF config's classes (SmolVLM, PaliGemma+Gemma, PaliGemma+Gemma2)."""
    got = (config.model_type, getattr(config.text_config, "model_type", None))
    want = {
        "smolvlm": ("smolvlm", "llama"),
        "paligemma": ("paligemma", "gemma"),
        "paligemma2": ("paligemma", "gemma2"),
    }
    if got != want[family]:
        fits = [f for f, types in want.items() if types == got]
        fix = f"set model.backbone.family to {fits[0]!r}" if fits else "it is not a supported backbone"
        raise ValueError(
            f"model.backbone.family={family!r} but {where} is a {got[0]} model with a {got[1]} text model; {fix}"
        )


def load_image_norm(source: str) -> tuple[list[float], list[float]]:
    """Pixel mean/std from the checkpoint's image-processor config (SigLIP-style 0.5/0.5 when absent)."""
    for name in ("vla_image_norm.json", "preprocessor_config.json", "processor_config.json"):
        p = Path(source) / name
        if p.is_file():
            d = json.loads(p.read_text())
            d = d.get("image_processor", d)
            mean, std = d.get("mean", d.get("image_mean")), d.get("std", d.get("image_std"))
            if mean and std:
                return [float(x) for x in mean], [float(x) for x in std]
    return [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
