"""Tiny backbone presets (vla.models.tiny): built offline, loaded back with the Auto classes, run, reproducible."""

from __future__ import annotations

import ast
import importlib.util
import json
import string
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
)

from vla.models import tiny
from vla.models.tiny import (
    BENCH_SMOLVLM_SCALE,
    BENCH_SMOLVLM_TEXT,
    BENCH_SMOLVLM_VISION,
    PRESET_FILE,
    build_tokenizer,
    make_tiny_backbone,
    preset_config,
    preset_settings,
    tiny_backbone_path,
)

REPO = Path(__file__).resolve().parents[1]
PEER_BENCH = REPO.parent / "shared" / "peer" / "peer_lerobot_bench.py"
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
PROMPTS = ["pick up the red cup", "open the drawer and put the sponge in it"]


@pytest.fixture(scope="module")
def presets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_backbone(root / family, family) for family in tiny.FAMILIES}


def _camera_images(batch: int, cameras: int) -> list[list[Image.Image]]:
    """Non-square uint8 camera frames (the processors resize them to the preset's square size)."""
    rng = np.random.default_rng(0)
    return [
        [Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)) for _ in range(cameras)]
        for _ in range(batch)
    ]


def _processor_inputs(path: Path, family: str, images: list[list[Image.Image]]) -> dict[str, torch.Tensor]:
    """Model inputs for `images` + PROMPTS, built by the family's own processor code from the saved files."""
    if family != "smolvlm" or HAS_TORCHVISION:
        processor = AutoProcessor.from_pretrained(path)
        text = ["<image>" * len(imgs) + prompt for imgs, prompt in zip(images, PROMPTS)]
        return dict(processor(images=images, text=text, padding=True, return_tensors="pt"))
    # SmolVLMProcessor needs torchvision (its video half) in transformers 5; without it, compose its two halves:
    # the image processor from the saved files and SmolVLM's own prompt expansion.
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    seq = json.loads((path / "processor_config.json").read_text())["image_seq_len"]
    image_prompt = get_image_prompt_string(0, 0, seq, "<fake_token_around_image>", "<image>", "<global-img>")
    text = [image_prompt * len(imgs) + prompt for imgs, prompt in zip(images, PROMPTS)]
    inputs = dict(AutoTokenizer.from_pretrained(path)(text, padding=True, return_tensors="pt"))
    inputs.update(AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt"))
    return inputs


def _parts(model, family: str) -> dict[str, torch.nn.Module]:
    """The sub-modules the backbone drives by hand (vla.models.backbone), by family."""
    inner = model.model
    if family == "smolvlm":
        vision, projector, text = inner.vision_model, inner.connector, inner.text_model
    else:
        vision, projector, text = inner.vision_tower, inner.multi_modal_projector, inner.language_model
    return {
        "vision": vision,
        "projector": projector,
        "text": text,
        "embed": text.embed_tokens,
        "layers": text.layers,
    }


# ---- tokenizer -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["smolvlm", "paligemma"])
def test_tokenizer_is_deterministic_across_processes(tmp_path: Path, family: str) -> None:
    build_tokenizer(tmp_path / "a", family)
    build_tokenizer(tmp_path / "b", family)
    code = "import sys; from pathlib import Path; from vla.models.tiny import build_tokenizer; "
    code += "build_tokenizer(Path(sys.argv[1]), sys.argv[2])"
    env = {"PYTHONHASHSEED": "123", "HF_HUB_OFFLINE": "1", "PATH": ""}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c"), family], check=True, env=env, cwd=REPO)
    first = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert first == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert first == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_tokenizer_special_tokens_follow_the_real_families(tmp_path: Path) -> None:
    smol = build_tokenizer(tmp_path / "smol", "smolvlm")
    assert smol.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (smol.bos_token, smol.eos_token, smol.pad_token, smol.unk_token) == (
        "<|im_start|>",
        "<end_of_utterance>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert (smol.image_token, smol.fake_image_token, smol.global_image_token) == (
        "<image>",
        "<fake_token_around_image>",
        "<global-img>",
    )
    ids = smol("<fake_token_around_image><global-img><image><image>go").input_ids
    assert smol.convert_ids_to_tokens(ids[:4]) == [
        "<fake_token_around_image>",
        "<global-img>",
        "<image>",
        "<image>",
    ]

    gemma = build_tokenizer(tmp_path / "gemma", "paligemma")
    assert gemma.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<eos>", "<bos>", "<unk>"]
    assert gemma("pick up the cup").input_ids[0] == gemma.bos_token_id  # Gemma prepends <bos>
    assert gemma.convert_tokens_to_ids("<image>") == len(gemma) - 1  # after the loc/seg tokens, as on the hub
    loc = gemma.convert_tokens_to_ids(["<loc0000>", "<loc1023>", "<seg000>", "<seg127>"])
    assert [i - loc[0] for i in loc] == [0, 1023, 1024, 1151]  # 1024 <locNNNN>, then 128 <segNNN>

    for tok in (smol, gemma):
        assert len(tok) <= 2048
        text = string.printable + " Ünïcode ☃ 机器人"  # byte-level: every string encodes and decodes back
        assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


# ---- presets: build, load back offline, run ------------------------------------------------------------------
@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # inside PaliGemmaProcessor
def test_preset_loads_with_auto_classes_and_runs(presets: dict[str, Path], family: str) -> None:
    path = presets[family]
    info = json.loads((path / PRESET_FILE).read_text())
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    expected = (
        "SmolVLMForConditionalGeneration" if family == "smolvlm" else "PaliGemmaForConditionalGeneration"
    )
    assert type(model).__name__ == expected
    text_config = config.get_text_config()
    assert (
        text_config.model_type == {"smolvlm": "llama", "paligemma": "gemma", "paligemma2": "gemma2"}[family]
    )
    assert text_config.vocab_size == len(tokenizer) == info["vocab_size"]
    assert list(AutoImageProcessor.from_pretrained(path).image_mean) == [0.5, 0.5, 0.5]

    parts = _parts(model, family)
    assert len(parts["layers"]) == text_config.num_hidden_layers == 4
    assert parts["embed"].weight.shape == (len(tokenizer), 64)

    images = _camera_images(batch=2, cameras=2)
    inputs = _processor_inputs(path, family, images)
    n_image = info["image_tokens_per_image"]
    assert n_image == 16
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    assert ((inputs["input_ids"] == image_token_id).sum(-1) == 2 * n_image).all()
    with torch.no_grad():
        model(**inputs)  # warm-up
        start = time.perf_counter()
        out = model(**inputs)
        elapsed = time.perf_counter() - start
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    assert out.logits.shape == (*inputs["input_ids"].shape, len(tokenizer))
    assert torch.isfinite(out.logits).all()
    assert sum(f.numel() for f in features) == 2 * 2 * n_image * text_config.hidden_size
    assert elapsed < 2.0, f"tiny {family} forward took {elapsed:.2f} s (budget: well under 1 s on CPU)"


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    a = make_tiny_backbone(tmp_path / "a", "paligemma2", seed=3)
    b = make_tiny_backbone(tmp_path / "b", "paligemma2", seed=3)
    c = make_tiny_backbone(tmp_path / "c", "paligemma2", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    rng_before = torch.get_rng_state()
    make_tiny_backbone(tmp_path / "d", "smolvlm", seed=5)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG stream is untouched


def test_cache_is_idempotent_and_rebuilds_when_settings_change(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(tiny.TINY_DIR_ENV, str(tmp_path / "cache"))
    path = tiny_backbone_path("smolvlm")
    assert path == tmp_path / "cache" / "smolvlm-tiny-0"

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a complete preset was rebuilt")

    with monkeypatch.context() as m:
        m.setattr(tiny, "_write_preset", no_rebuild)
        assert tiny_backbone_path("smolvlm") == path
        assert make_tiny_backbone(path, "smolvlm") == path

    make_tiny_backbone(path, "smolvlm", text={"num_hidden_layers": 2})  # other settings: rebuilt in place
    assert AutoConfig.from_pretrained(path).text_config.num_hidden_layers == 2
    assert json.loads((path / PRESET_FILE).read_text())["overrides"] == {"text": {"num_hidden_layers": 2}}

    (path / "model.safetensors").unlink()  # incomplete: rebuilt
    make_tiny_backbone(path, "smolvlm", text={"num_hidden_layers": 2})
    assert (path / "model.safetensors").is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == ["smolvlm-tiny-0"]  # no temporary dirs left

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a preset")
    with pytest.raises(FileExistsError, match="not a tiny backbone preset"):
        make_tiny_backbone(foreign, "smolvlm")


def test_bad_arguments_name_the_allowed_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family must be one of smolvlm, paligemma, paligemma2"):
        preset_settings("llava")
    with pytest.raises(ValueError, match="size must be one of tiny, bench"):
        preset_settings("smolvlm", "huge")
    with pytest.raises(ValueError, match="no 'bench' preset for family 'paligemma'"):
        preset_settings("paligemma", "bench")
    with pytest.raises(ValueError, match="unknown override"):
        make_tiny_backbone(tmp_path / "x", "smolvlm", hidden_size=8)
    with pytest.raises(ValueError, match="vocab_size must be >="):
        build_tokenizer(tmp_path / "t", "paligemma", vocab_size=1200)


# ---- the benchmark preset mirrors the peer's SmolVLA backbone ---------------------------------------------------
def _peer_constants() -> dict[str, object]:
    """SMOLVLM_VISION / SMOLVLM_TEXT / SMOLVLM_SCALE as written in the peer's benchmark script."""
    if not PEER_BENCH.is_file():  # outside the team workspace: the numbers the peer used, frozen here
        return {
            "SMOLVLM_VISION": dict(
                hidden_size=384,
                intermediate_size=1536,
                num_hidden_layers=4,
                num_attention_heads=6,
                image_size=224,
                patch_size=16,
            ),
            "SMOLVLM_TEXT": dict(
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
            ),
            "SMOLVLM_SCALE": 2,
        }
    found = {}
    for node in ast.parse(PEER_BENCH.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if name in ("SMOLVLM_VISION", "SMOLVLM_TEXT"):
                found[name] = {kw.arg: ast.literal_eval(kw.value) for kw in value.keywords}
            elif name == "SMOLVLM_SCALE":
                found[name] = ast.literal_eval(value)
    assert set(found) == {"SMOLVLM_VISION", "SMOLVLM_TEXT", "SMOLVLM_SCALE"}, f"peer script changed: {found}"
    return found


def test_bench_preset_matches_the_peer_smolvla_backbone() -> None:
    peer = _peer_constants()
    assert peer["SMOLVLM_VISION"] == BENCH_SMOLVLM_VISION
    assert peer["SMOLVLM_TEXT"] == BENCH_SMOLVLM_TEXT
    assert peer["SMOLVLM_SCALE"] == BENCH_SMOLVLM_SCALE
    config = preset_config("smolvlm", "bench")
    for key, value in peer["SMOLVLM_VISION"].items():
        assert getattr(config.vision_config, key) == value, key
    for key, value in peer["SMOLVLM_TEXT"].items():
        actual = config.text_config.rope_parameters["rope_theta"] if key == "rope_theta" else None
        assert (actual if key == "rope_theta" else getattr(config.text_config, key)) == value, key
    assert config.scale_factor == peer["SMOLVLM_SCALE"]
    assert tiny.image_tokens_per_image("smolvlm", preset_settings("smolvlm", "bench")) == 49


@pytest.mark.slow
def test_bench_preset_builds_and_runs(tmp_path: Path) -> None:
    path = make_tiny_backbone(tmp_path / "bench", "smolvlm", size="bench")
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert (
        sum(p.numel() for p in model.parameters())
        == json.loads((path / PRESET_FILE).read_text())["num_parameters"]
    )
    inputs = _processor_inputs(path, "smolvlm", _camera_images(batch=2, cameras=2))
    assert inputs["pixel_values"].shape[-2:] == (224, 224)
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits.shape[-1] == 49280


# ---- configs/model presets -------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO / "configs" / "model").glob("*.yaml")))
def test_model_presets_agree_with_their_backbones(preset: str) -> None:
    from vla.models.config import load_model_config

    cfg = load_model_config(preset)
    backbone = cfg.backbone
    assert 1 <= cfg.expert.num_layers <= backbone.num_vlm_layers
    if backbone.pretrained.startswith("tiny:"):
        _, family, *size = backbone.pretrained.split(":")
        assert family == backbone.family
        settings = preset_settings(family, *size)
        assert backbone.image_size == settings["vision"]["image_size"]
        assert backbone.num_vlm_layers <= settings["text"]["num_hidden_layers"]


@pytest.mark.parametrize("family", ["smolvlm", "paligemma2"])
def test_first_n_layers_load_only_those_weights_and_bad_checkpoints_are_refused(
    family: str, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from vla.models.backbone import load_hf_vlm

    path = str(tiny_backbone_path(family))
    full, _ = load_hf_vlm(path, family)
    part, _ = load_hf_vlm(path, family, num_layers=2)
    assert part.config.text_config.num_hidden_layers == 2
    full_sd, part_sd = full.state_dict(), part.state_dict()
    assert len(part_sd) < len(full_sd)
    for k, v in part_sd.items():  # exactly the checkpoint's weights of what is kept
        assert torch.equal(v, full_sd[k]), k
    with pytest.raises(ValueError, match="has 4 language layers"):
        load_hf_vlm(path, family, num_layers=5)
    broken = tmp_path / "broken"  # a checkpoint with a tensor missing (e.g. an interrupted download)
    full.save_pretrained(broken)
    tiny_dir = Path(path)
    for f in tiny_dir.iterdir():
        if f.suffix in {".json", ".txt", ".model"} and not (broken / f.name).exists():
            (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(broken / "model.safetensors"))
    victim = next(k for k in weights if "layers.0." in k and "q_proj" in k)
    save_file({k: v for k, v in weights.items() if k != victim}, str(broken / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ValueError, match=r"does not match its config\.json"):
        load_hf_vlm(str(broken), family, num_layers=2)
    # a stray *vision* layer is not one of the language layers dropped on purpose
    vision = next(k for k in weights if "encoder.layers.0." in k)
    stray = {**weights, vision.replace("encoder.layers.0.", "encoder.layers.7."): weights[vision].clone()}
    save_file(stray, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected"):
        load_hf_vlm(str(broken), family, num_layers=2)
