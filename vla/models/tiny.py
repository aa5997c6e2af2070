"""Tiny, randomly initialised VLM backbones of the real Hugging Face classes, saved like hub checkpoints.

Tests, the demo and the SmolVLA-shaped benchmark need a backbone without hub access. `make_tiny_backbone` writes
a directory laid out exactly like a hub checkpoint (config.json, model.safetensors, tokenizer, processor), so the
model loads it through the same `from_pretrained(path)` code the real weights take:

    smolvlm     SmolVLMForConditionalGeneration: SigLIP-style vision, pixel-shuffle connector, Llama text model
    paligemma   PaliGemmaForConditionalGeneration: SigLIP vision, linear projector, Gemma text model (as π0)
    paligemma2  the same classes with a Gemma2 text model

Sizes: `tiny` (unit tests and the demo: a forward takes milliseconds on CPU) and `bench` (SmolVLM only): the
reduced SmolVLM that ../shared/peer/peer_lerobot_bench.py builds LeRobot's SmolVLA with, so both frameworks are
timed on the same backbone. The tokenizer is a small byte-level BPE trained here on templated robot instructions,
with the special tokens of the real family (the `bench` embedding still has the full 49,280 rows).

    path = tiny_backbone_path("smolvlm", "bench")   # ~/.cache/vla/tiny/smolvlm-bench-0, built on first use
    AutoModelForImageTextToText.from_pretrained(path); AutoTokenizer.from_pretrained(path)

configs/model/*.yaml name them `tiny:<family>[:<size>]` (vla.models.backbone.resolve_pretrained).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedConfig, PreTrainedTokenizerFast

FAMILIES = ("smolvlm", "paligemma", "paligemma2")
SIZES = ("tiny", "bench")
TINY_DIR_ENV = "VLA_TINY_CACHE"
PRESET_FILE = "vla_tiny_preset.json"  # written last: its presence marks a complete preset
FORMAT_VERSION = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "processor_config.json")

# The SmolVLA benchmark backbone, copied from ../shared/peer/peer_lerobot_bench.py (SMOLVLM_VISION, SMOLVLM_TEXT,
# SMOLVLM_SCALE); tests/test_tiny_backbones.py parses that script and checks these are equal.
BENCH_SMOLVLM_VISION = dict(
    hidden_size=384,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=6,
    image_size=224,
    patch_size=16,
)
BENCH_SMOLVLM_TEXT = dict(
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49280,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=False,
)
BENCH_SMOLVLM_SCALE = 2  # pixel shuffle: (224 / 16)^2 / 2^2 = 49 image tokens per camera

_TINY_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
)
_TINY_SIGLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64
)
_PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    # 64 px / patch 8 = 64 patches, pixel shuffle 2 -> 16 image tokens per camera.
    ("smolvlm", "tiny"): dict(
        vision=dict(_TINY_SIGLIP, patch_size=8),
        text=dict(
            _TINY_TEXT, model_type="llama", rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False
        ),
        scale_factor=2,
    ),
    ("smolvlm", "bench"): dict(
        vision=BENCH_SMOLVLM_VISION, text=BENCH_SMOLVLM_TEXT, scale_factor=BENCH_SMOLVLM_SCALE
    ),
    # 64 px / patch 16 = 16 image tokens per camera (PaliGemma feeds every SigLIP patch to the text model).
    ("paligemma", "tiny"): dict(
        vision=dict(_TINY_SIGLIP, model_type="siglip_vision_model", patch_size=16, vision_use_head=False),
        text=dict(_TINY_TEXT, model_type="gemma", hidden_activation="gelu_pytorch_tanh"),
    ),
    # Gemma2 extras as in paligemma2-3b-pt-224 (query scale = head_dim, soft-capping 50/30, 4096-token window).
    ("paligemma2", "tiny"): dict(
        vision=dict(_TINY_SIGLIP, model_type="siglip_vision_model", patch_size=16, vision_use_head=False),
        text=dict(
            _TINY_TEXT,
            model_type="gemma2",
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=16,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),
}
_OVERRIDE_KEYS = ("vision", "text", "scale_factor", "tokenizer_vocab_size")

# ---------------------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------------------
# SmolVLM (SmolLM2 vocabulary): ids 0-2 are <|endoftext|> <|im_start|> <|im_end|>; the image tokens come after the
# text vocabulary. bos = <|im_start|>, eos = <end_of_utterance>, pad = <|im_end|>, unk = <|endoftext|>.
_SMOLVLM_BASE = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_SMOLVLM_ADDED = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),  # image-splitting tiles
]
# Gemma: <pad> <eos> <bos> <unk> <mask> are ids 0-4; PaliGemma appends 1024 <locNNNN>, 128 <segNNN> and <image>.
_GEMMA_BASE = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
_PALIGEMMA_EXTRA = [f"<loc{i:04d}>" for i in range(1024)] + [f"<seg{i:03d}>" for i in range(128)]

_VERBS = (
    "pick up", "put", "push", "pull", "open", "close", "move", "place",
    "stack", "lift", "rotate", "slide", "grasp", "wipe", "pour", "fold",
)  # fmt: skip
_OBJECTS = (
    "block", "cube", "cup", "mug", "bowl", "plate", "sponge", "towel", "drawer",
    "lid", "spoon", "bottle", "can", "carrot", "banana", "apple", "marker", "cloth",
)  # fmt: skip
_COLORS = ("red", "green", "blue", "yellow", "black", "white", "orange", "purple", "pink", "gray")
_LOCATIONS = (
    "on the table", "in the drawer", "into the bowl", "on the plate", "to the left", "to the right",
    "in the sink", "on the shelf", "next to the cup", "onto the tray", "in the basket", "off the counter",
)  # fmt: skip


def instruction_corpus() -> list[str]:
    """The embedded training text: 864 templated robot instructions plus the printable ASCII alphabet."""
    lines = []
    for i, (verb, obj) in enumerate(itertools.product(_VERBS, _OBJECTS)):
        color, location = _COLORS[i % len(_COLORS)], _LOCATIONS[(i * 5) % len(_LOCATIONS)]
        lines.append(f"{verb} the {color} {obj} {location}")
        lines.append(f"{verb.capitalize()} the {obj} {location}, then stop.")
        lines.append(f"please {verb} the {obj} and put it {location}")
    lines.append(string.printable)
    return lines


def _train_tokenizer(family: str, vocab_size: int) -> PreTrainedTokenizerFast:
    smol = _check_family(family) == "smolvlm"
    base, added = (_SMOLVLM_BASE, _SMOLVLM_ADDED) if smol else (_GEMMA_BASE, [*_PALIGEMMA_EXTRA, "<image>"])
    bpe_size = vocab_size - len(added)
    minimum = len(base) + 256 + 64  # specials + the 256 byte symbols + a few merges
    if bpe_size < minimum:
        raise ValueError(
            f"vocab_size must be >= {minimum + len(added)} for family {family!r}, got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        special_tokens=base,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    tok.train_from_iterator(instruction_corpus(), trainer=trainer)
    if smol:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|im_start|>",
            eos_token="<end_of_utterance>",
            pad_token="<|im_end|>",
            unk_token="<|endoftext|>",
            model_max_length=8192,
            extra_special_tokens={
                "fake_image_token": "<fake_token_around_image>",
                "image_token": "<image>",
                "global_image_token": "<global-img>",
                "end_of_utterance_token": "<end_of_utterance>",
            },
        )
    tok.add_tokens([AddedToken(t, normalized=False) for t in _PALIGEMMA_EXTRA])
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    # Gemma prepends <bos>; token type 1 marks the suffix (PaliGemmaProcessor builds labels from it).
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A:0", pair="<bos> $A:0 $B:1", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        model_max_length=8192,
        extra_special_tokens={"image_token": "<image>"},
    )


def build_tokenizer(out_dir: Path, family: str, vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train the family's small byte-level BPE tokenizer (deterministic) and `save_pretrained` it to `out_dir`.

    `vocab_size` is the total size including special/added tokens (PaliGemma's 1152 location/segmentation
    tokens count too); the corpus may exhaust merges earlier, so `len(tokenizer) <= vocab_size`.
    """
    tokenizer = _train_tokenizer(family, vocab_size)
    tokenizer.save_pretrained(Path(out_dir))
    return tokenizer


# ---------------------------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------------------------
def _check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    return family


def preset_settings(family: str, size: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """The merged settings of a preset: `vision`, `text` (sub-config kwargs), `scale_factor`, `tokenizer_vocab_size`.

    `overrides` may set `vision={...}` / `text={...}` (merged key by key), `scale_factor` (SmolVLM pixel shuffle)
    and `tokenizer_vocab_size`.
    """
    _check_family(family)
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if (family, size) not in _PRESETS:
        have = [s for f, s in _PRESETS if f == family]
        raise ValueError(f"no {size!r} preset for family {family!r}; it has: {', '.join(have)}")
    unknown = sorted(set(overrides) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"unknown override(s) {unknown}; allowed: {', '.join(_OVERRIDE_KEYS)}")
    if family != "smolvlm" and "scale_factor" in overrides:
        raise ValueError(f"scale_factor applies to the smolvlm family only, not {family!r}")
    preset = _PRESETS[(family, size)]
    settings = {
        "vision": {**preset["vision"], **overrides.get("vision", {})},
        "text": {**preset["text"], **overrides.get("text", {})},
        "tokenizer_vocab_size": overrides.get("tokenizer_vocab_size", 2048),
    }
    if family == "smolvlm":
        settings["scale_factor"] = overrides.get("scale_factor", preset["scale_factor"])
    vision = settings["vision"]
    if vision["image_size"] % vision["patch_size"]:
        raise ValueError(f"vision.image_size {vision['image_size']} is not a multiple of patch_size")
    return settings


def image_tokens_per_image(family: str, settings: dict[str, Any]) -> int:
    """Number of `<image>` tokens one camera image becomes in the text sequence."""
    vision = settings["vision"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    return patches // settings["scale_factor"] ** 2 if family == "smolvlm" else patches


def _hf_config(family: str, settings: dict[str, Any], tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    from transformers import PaliGemmaConfig, SmolVLMConfig

    text = dict(settings["text"])
    text.setdefault("vocab_size", len(tokenizer))
    if text["vocab_size"] < len(tokenizer):
        raise ValueError(f"text.vocab_size {text['vocab_size']} < tokenizer size {len(tokenizer)}")
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    ids = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    text["pad_token_id"], text["bos_token_id"], text["eos_token_id"] = ids
    if family == "smolvlm":
        return SmolVLMConfig(
            vision_config=dict(settings["vision"]),
            text_config=text,
            scale_factor=settings["scale_factor"],
            image_token_id=image_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=text.get("tie_word_embeddings", False),
        )
    return PaliGemmaConfig(
        vision_config=dict(settings["vision"]),
        text_config=text,
        image_token_index=image_token_id,
        vocab_size=text["vocab_size"],
        projection_dim=text["hidden_size"],  # the projector maps straight to the text width
        hidden_size=text["hidden_size"],
        pad_token_id=tokenizer.pad_token_id,
    )


def preset_config(family: str, size: str = "tiny", **overrides: Any) -> PreTrainedConfig:
    """The Hugging Face config a preset would be saved with, without building weights (fast)."""
    settings = preset_settings(family, size, **overrides)
    return _hf_config(family, settings, _train_tokenizer(family, settings["tokenizer_vocab_size"]))


def _save_processor(
    out: Path, family: str, settings: dict[str, Any], tokenizer: PreTrainedTokenizerFast
) -> None:
    """Write the family's processor files (processor_config.json + tokenizer), as `Processor.save_pretrained`."""
    side = settings["vision"]["image_size"]
    seq = image_tokens_per_image(family, settings)
    if family != "smolvlm":
        from transformers import PaliGemmaProcessor, SiglipImageProcessorPil

        image_processor = SiglipImageProcessorPil(
            size={"height": side, "width": side}, image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=3
        )
        image_processor.image_seq_length = seq  # PaliGemmaProcessor reads it; the hub files carry it too
        PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
        # The processor switched the tokenizer's <bos> off (it inserts <bos> itself); the hub tokenizer keeps it on
        # for plain AutoTokenizer use, and so do we.
        tokenizer.add_bos_token = True
        tokenizer.save_pretrained(out)
        return
    # SmolVLMProcessor cannot be *constructed* without torchvision in transformers 5 (its video processor is
    # torchvision-only), so write the files its save_pretrained writes: the sub-processors' own to_dict() nested in
    # processor_config.json, and the tokenizer. Loading them (AutoProcessor) needs torchvision like the real hub
    # checkpoint does; AutoTokenizer and AutoImageProcessor (PIL backend) do not.
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    edge = {"longest_edge": side}
    image_processor = SmolVLMImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)
    video_processor = SmolVLMVideoProcessor(size=edge, max_image_size=edge)
    processor = {
        "image_processor": json.loads(image_processor.to_json_string()),
        "video_processor": json.loads(video_processor.to_json_string()),
        "image_seq_len": seq,
        "processor_class": "SmolVLMProcessor",
    }
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")
    tokenizer._set_processor_class("SmolVLMProcessor")
    tokenizer.save_pretrained(out)


def _record(family: str, size: str, seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
    # JSON round trip so tuples/lists compare equal to what the file holds.
    return json.loads(
        json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "family": family,
                "size": size,
                "seed": seed,
                "overrides": overrides,
            }
        )
    )


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / PRESET_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(path: Path, record: dict[str, Any]) -> bool:
    stored = _read_record(path)
    if stored is None or any(stored.get(k) != v for k, v in record.items()):
        return False
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _write_preset(out: Path, family: str, settings: dict[str, Any], seed: int) -> dict[str, Any]:
    from transformers import PaliGemmaForConditionalGeneration, SmolVLMForConditionalGeneration

    tokenizer = _train_tokenizer(family, settings["tokenizer_vocab_size"])
    config = _hf_config(family, settings, tokenizer)
    model_class = (
        SmolVLMForConditionalGeneration if family == "smolvlm" else PaliGemmaForConditionalGeneration
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = model_class(config)
    model.save_pretrained(out)
    _save_processor(out, family, settings, tokenizer)
    return {
        "image_size": settings["vision"]["image_size"],
        "image_tokens_per_image": image_tokens_per_image(family, settings),
        "vocab_size": config.get_text_config().vocab_size,
        "tokenizer_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def make_tiny_backbone(
    out_dir: str | Path, family: str = "smolvlm", *, size: str = "tiny", seed: int = 0, **overrides: Any
) -> Path:
    """Write a randomly initialised `family` backbone (weights, tokenizer, processor) to `out_dir`; return it.

    The same `seed` gives identical weights. If `out_dir` already holds a complete preset with the same
    family/size/seed/overrides (recorded in `vla_tiny_preset.json`, written last), it is returned as is.
    The directory is built next to `out_dir` and renamed into place, so a crash never leaves a half preset.
    """
    out_dir = Path(out_dir).expanduser()
    settings = preset_settings(family, size, **overrides)
    record = _record(family, size, seed, overrides)
    if _is_complete(out_dir, record):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and _read_record(out_dir) is None:
        raise FileExistsError(
            f"{out_dir} exists and is not a tiny backbone preset; pass an empty or new directory"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        info = _write_preset(tmp, family, settings, seed)
        import transformers

        info["transformers_version"] = transformers.__version__
        (tmp / PRESET_FILE).write_text(json.dumps({**record, **info}, indent=2, sort_keys=True) + "\n")
        if _is_complete(
            out_dir, record
        ):  # a concurrent builder (another rank) finished first: keep its copy,
            return out_dir  # never delete a complete preset that other processes may be reading
        if out_dir.exists():  # an older or different preset (checked above): replace it
            shutil.rmtree(out_dir)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not _is_complete(out_dir, record):  # a concurrent builder won the race with the same preset
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def tiny_cache_dir() -> Path:
    """Root of the preset cache: `$VLA_TINY_CACHE`, else `~/.cache/vla/tiny`."""
    return Path(os.environ.get(TINY_DIR_ENV) or "~/.cache/vla/tiny").expanduser()


def tiny_backbone_path(family: str, size: str = "tiny", seed: int = 0) -> Path:
    """The cached preset `<cache>/<family>-<size>-<seed>`, built on first use."""
    return make_tiny_backbone(tiny_cache_dir() / f"{family}-{size}-{seed}", family, size=size, seed=seed)
