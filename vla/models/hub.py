"""Checkpoint directories in the Hugging Face style: ``save_pretrained(model, dir)`` / ``from_pretrained(dir)``.

Layout (``vla_format_version`` 3)::

    config.json            {"vla_format_version": 3, "policy": ..., "model": <ModelConfig>}
    model.safetensors      every parameter (backbone included; only the language weights used are kept)
    backbone/              the HF backbone's config.json + tokenizer files + image normalization
    embodiments/<name>.yaml  one spec per embodiment slot, in table order (config.model.embodiments)
    norm_stats.json        the normalization stats the model was trained with (when known)
    preprocessing.json     ``model.preprocessing``: how the training data was prepared (when known)
    README.md              a generated model card

Everything needed to rebuild the model is in the folder: loading never downloads, and the model is built on the
meta device and given the file's tensors (no random initialisation first). A hub id works too when the repository
is in the local Hugging Face cache (``huggingface_hub.snapshot_download``).

Writing is atomic: the folder is built under a hidden temporary name next to its destination; an existing folder
is renamed aside, the new one renamed in, then the old one deleted. The hidden ``.<name>.tmp-*`` / ``.<name>.old-*``
siblings a killed write leaves are removed by the next write to the same place (one writer per destination at a
time).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import draccus
import torch
from safetensors.torch import save_file, save_model

from vla import __version__
from vla.embodiments import EmbodimentSpec
from vla.models.backbone import VLMBackbone
from vla.models.config import ModelConfig, load_model_config
from vla.models.meta import empty_weights, load_weights
from vla.models.policies import POLICIES

if TYPE_CHECKING:
    from vla.data.normalize import StatsFile
    from vla.models.policies.flow_vla import FlowVLA

#: 2: the embodiment token became a summary token (no other prefix token attends to it). Version-1 weights were
#: trained with every prefix token seeing it, so this vla would compute something else with them: refused.
#: 3: the backbone's last language layer keeps only its key/value projections (and its input norm); version-2 files
#: also hold its other weights, which were never used: they are skipped on load.
FORMAT_VERSION = 3
READS = (2, 3)
PREPROCESSING = "preprocessing.json"


def save_pretrained(
    model: FlowVLA,
    out_dir: str | Path,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    adapter: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` to ``out_dir`` atomically (see the module docstring). ``state_dict``: the weights to write
    instead of the model's own (e.g. the full weights gathered from an FSDP2-sharded model). ``adapter``: write an
    adapter folder instead (``vla.models.adapters``: the trainable tensors plus this reference to the base)."""
    out = Path(out_dir)
    if adapter is None and any(".lora_" in name for name, _ in model.named_parameters()):
        raise ValueError(
            f"save_pretrained({out}): the model carries LoRA adapters; vla.models.lora.merge_lora(model) first (a "
            "plain folder), or save it as an adapter checkpoint (adapter=...)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    preprocessing = _check_preprocessing(getattr(model, "preprocessing", None))
    for stale in _leftovers(out):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        cfg = {
            "vla_format_version": FORMAT_VERSION,
            "vla_version": __version__,
            "policy": model.cfg.policy,
            "model": draccus.encode(model.cfg),
        }
        if adapter is not None:
            cfg["vla_adapter"] = adapter
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if adapter is not None:
            from vla.models.adapters import save_adapter, trainable_state

            save_adapter(tmp, trainable_state(model))
        elif state_dict is None:
            save_model(model, str(tmp / "model.safetensors"))
        else:
            save_file(
                {k: v.detach().contiguous() for k, v in state_dict.items()}, str(tmp / "model.safetensors")
            )
        model.backbone.save_assets(tmp / "backbone")
        (tmp / "embodiments").mkdir()
        for spec in model.specs:
            spec.to_yaml(tmp / "embodiments" / f"{spec.name}.yaml")
        if model.norm_stats is not None:
            model.norm_stats.save(tmp / "norm_stats.json")
        if preprocessing is not None:
            (tmp / PREPROCESSING).write_text(preprocessing)
        (tmp / "README.md").write_text(model_card(model))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out``. An existing ``out`` is renamed aside first and deleted only
    once the new one is in place, so a kill at any moment leaves a complete folder: ``out`` (old or new) or, between
    the two renames, the old one aside as a hidden ``.<name>.old-*`` sibling."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old)  # onto the empty directory just made: an atomic rename on POSIX
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _leftovers(out: Path) -> list[Path]:
    """Hidden ``.<name>.tmp-*`` / ``.<name>.old-*`` siblings of ``out`` (``tempfile.mkdtemp`` names) left by a killed
    ``save_pretrained`` to ``out``."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(?:tmp|old)-[a-z0-9_]{{8}}")
    return [p for p in out.parent.iterdir() if p.is_dir() and pattern.fullmatch(p.name)]


def _check_preprocessing(preprocessing: object) -> str | None:
    """``model.preprocessing`` as the JSON text to write (None: nothing to write)."""
    if preprocessing is None:
        return None
    if not isinstance(preprocessing, dict):
        raise TypeError(
            f"model.preprocessing must be a dict (or None), got {type(preprocessing).__name__}; it is saved as "
            f"{PREPROCESSING}"
        )
    try:
        return json.dumps(preprocessing, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"model.preprocessing must be JSON-serializable (str keys; str/number/bool/None/list/dict values, "
            f"finite numbers) to be saved as {PREPROCESSING}: {e}"
        ) from e


def _local_dir(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path)))
    except Exception as e:
        raise FileNotFoundError(
            f"{path}: not a local checkpoint folder, and not a hub repository available offline ({e}). "
            "Pass the folder written by save_pretrained / `vla model init`."
        ) from e


def from_pretrained(path: str | Path, *, map_location: str | torch.device = "cpu") -> FlowVLA:
    """Rebuild a model saved by ``save_pretrained`` (architecture from the folder, weights from safetensors).
    ``path``: a checkpoint folder, a training step folder, a run folder (its newest complete step) or a hub id."""
    from vla.models.run_dir import resolve_checkpoint

    root = resolve_checkpoint(_local_dir(path))
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{root}: no config.json; this is not a vla checkpoint folder")
    meta = json.loads(cfg_file.read_text())
    version = int(meta.get("vla_format_version", 0))
    if version == 1:
        raise ValueError(
            f"{cfg_file}: vla_format_version 1 was written before the embodiment token became a summary token "
            "(format 2); its weights would compute different actions here. Re-train or fine-tune with this vla, or "
            "load it with the vla version that wrote it."
        )
    if version not in READS:
        raise ValueError(
            f"{cfg_file}: vla_format_version {version} is not supported by this vla (reads {list(READS)})"
        )
    if "vla_adapter" in meta:  # a fine-tune stored as what changed: base + adapters
        from vla.models.adapters import load_adapter_model

        model = load_adapter_model(root, meta, map_location)
        model.norm_stats = _load_stats(root)
        pre = root / PREPROCESSING
        model.preprocessing = json.loads(pre.read_text()) if pre.is_file() else None
        return model
    cfg: ModelConfig = load_model_config(meta["model"])
    specs = []
    for name in cfg.embodiments:
        f = root / "embodiments" / f"{name}.yaml"
        if not f.is_file():
            raise FileNotFoundError(f"{root}: embodiment spec {f.name} listed in config.json is missing")
        specs.append(EmbodimentSpec.from_yaml(f))
    stats = _load_stats(root)
    with empty_weights():  # the weights come from the file: no random initialisation first
        backbone = VLMBackbone.from_config(cfg.backbone, weights=False, path=str(root / "backbone"))
        model = POLICIES.get(cfg.policy)(cfg, specs, backbone=backbone, norm_stats=stats)
    unused = [f"backbone.{name}" for name in backbone.unused_weights] if version == 2 else []
    load_weights(model, root / "model.safetensors", device=map_location, ignore=unused)
    pre = root / PREPROCESSING
    model.preprocessing = json.loads(pre.read_text()) if pre.is_file() else None
    return model.to(map_location)


def _load_stats(root: Path) -> StatsFile | None:
    if not (root / "norm_stats.json").is_file():
        return None
    from vla.data.normalize import StatsFile

    return StatsFile.load(root / "norm_stats.json")


def model_card(model: FlowVLA) -> str:
    """A Markdown model card: what the model is, its embodiments and parameter counts, how to load it."""
    counts = model.parameter_counts()
    rows = "\n".join(f"| {k} | {v['total']:,} | {v['trainable']:,} |" for k, v in counts.items())
    emb = "\n".join(
        f"| {s.name} | {s.robot or '-'} | {s.state_dim} | {s.action_dim} | {min(s.chunk_length, model.cfg.chunk_length)} "
        f"| {s.control_hz:g} | {', '.join(s.cameras)} |"
        for s in model.specs
    )
    stats = (
        "included (`norm_stats.json`)"
        if model.norm_stats is not None
        else "not included (untrained checkpoint)"
    )
    return f"""---
library_name: vla
tags: [robotics, vision-language-action, flow-matching, cross-embodiment]
---
# {model.cfg.policy} checkpoint

A vision-language-action model written by vla {__version__}: the first {model.backbone.num_layers} language layers of
the `{model.cfg.backbone.family}` backbone `{model.cfg.backbone.pretrained}` encode the camera images, the instruction
and an embodiment token; a flow-matching action expert ({model.expert.width} wide, {len(model.expert.layers)} layers)
attends to their keys/values and predicts action chunks through per-embodiment heads
({model.cfg.flow.num_steps} Euler steps by default).

## Embodiments

| name | robot | state dim | action dim | chunk | Hz | cameras |
|---|---|---|---|---|---|---|
{emb}

## Parameters

| component | total | trainable |
|---|---|---|
{rows}

Normalization statistics: {stats}.

## Use

```python
from vla.models.hub import from_pretrained
model = from_pretrained("path/to/this/folder")
actions = model.sample_actions(batch)  # batch: vla.types.Batch with images, state, prompt, embodiment_id
```
"""


def init_checkpoint(
    config: str | Path,
    out_dir: str | Path,
    *,
    embodiments: list[str] | None = None,
    stats: StatsFile | None = None,
    overrides: list[str] | None = None,
    seed: int = 0,
) -> Path:
    """``vla model init``: an untrained checkpoint of ``config`` for the given embodiments (default: the config's)."""
    from vla.embodiments import get_embodiment

    cfg = load_model_config(config, overrides)
    names = embodiments or list(cfg.embodiments)
    if not names:
        raise ValueError(
            "no embodiments: pass --embodiment NAME (repeatable) or set model.embodiments in the config"
        )
    torch.manual_seed(seed)
    model = POLICIES.get(cfg.policy)(cfg, [get_embodiment(n) for n in names], norm_stats=stats)
    return save_pretrained(model, out_dir)
