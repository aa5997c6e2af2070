"""Adapter checkpoints: a fine-tuned model stored as what changed plus a reference to the checkpoint it came from.

A LoRA (or frozen-backbone) fine-tune leaves the base model's weights untouched except the adapters and the
trainable tables, so its checkpoint folder holds only those::

    config.json           {"vla_format_version": ..., "model": <ModelConfig with every embodiment>,
                           "vla_adapter": {"base": <base folder>, "base_sha256": <its model.safetensors>,
                                           "base_embodiments": [...], "lora": {...} | null}}
    adapter.safetensors   the trainable tensors: LoRA A/B matrices, heads tables, embodiment tokens (, expert)
    embodiments/ norm_stats.json preprocessing.json README.md   as in any checkpoint

``from_pretrained`` on such a folder loads the base (checking its hash: a moved or changed base is a clear error,
never a silently different model), adds the new embodiments' slots, applies the LoRA settings and loads the
tensors. ``vla export --merge`` turns it into a plain folder (LoRA folded into the weights).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ADAPTER_FILE = "adapter.safetensors"
_HASH_CACHE: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file, cached per (path, size, mtime) within the process (a 2 GB base hashes in seconds)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASH_CACHE:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key]


def base_reference(
    base_dir: Path, base_embodiments: list[str], lora: dict[str, Any] | None
) -> dict[str, Any]:
    """The ``vla_adapter`` entry of a fine-tune of ``base_dir`` (a plain checkpoint folder)."""
    weights = base_dir / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(
            f"{base_dir}: no model.safetensors; fine-tune from a plain checkpoint folder (vla model init, a vla "
            "train step or run folder, or a merged export)"
        )
    return {
        "base": str(base_dir.resolve()),
        "base_sha256": file_sha256(weights),
        "base_embodiments": list(base_embodiments),
        "lora": lora,
    }


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable tensor of ``model`` by its state-dict name (what an adapter checkpoint stores)."""
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_adapter(out: Path, state: dict[str, torch.Tensor]) -> None:
    save_file({k: v.cpu() for k, v in state.items()}, str(out / ADAPTER_FILE))


def load_adapter_model(root: Path, meta: dict[str, Any], map_location: str | torch.device) -> Any:
    """Rebuild a fine-tuned model from its adapter folder ``root`` (``meta`` = its config.json)."""
    from vla.embodiments import EmbodimentSpec
    from vla.models.hub import from_pretrained

    ref = meta["vla_adapter"]
    base = Path(ref["base"])
    weights = base / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(
            f"{root}: its base checkpoint {base} is gone (moved or deleted). Put it back, or point "
            f"config.json's vla_adapter.base at its new folder"
        )
    digest = file_sha256(weights)
    if digest != ref["base_sha256"]:
        raise ValueError(
            f"{root}: its base checkpoint {base} changed since the fine-tune (model.safetensors sha256 {digest[:12]} "
            f"!= {ref['base_sha256'][:12]}); the adapters only make sense on the exact base they were trained on"
        )
    model = from_pretrained(base, map_location=map_location)
    if list(model.embodiment_ids) != ref["base_embodiments"]:
        raise ValueError(f"{root}: base {base} has embodiments {list(model.embodiment_ids)}, expected "
                         f"{ref['base_embodiments']}")  # fmt: skip
    names = meta["model"]["embodiments"]
    for name in names[len(ref["base_embodiments"]) :]:
        model.add_embodiment(EmbodimentSpec.from_yaml(root / "embodiments" / f"{name}.yaml"))
    if ref.get("lora"):
        from vla.models.lora import LoraSettings, apply_lora

        apply_lora(
            model, LoraSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in ref["lora"].items()})
        )
    state = load_file(str(root / ADAPTER_FILE), device=str(map_location))
    own = dict(model.named_parameters())
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise ValueError(
            f"{root / ADAPTER_FILE}: tensors {unknown[:5]} are not parameters of the rebuilt model"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"{root / ADAPTER_FILE}: {name} is {list(tensor.shape)}, the rebuilt model has "
                    f"{list(own[name].shape)}"
                )
            own[name].copy_(tensor)
    model.adapter_reference = ref
    return model


def read_meta(root: Path) -> dict[str, Any]:
    return json.loads((root / "config.json").read_text())
