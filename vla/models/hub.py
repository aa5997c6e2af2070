"""Checkpoint directories in the Hugging Face style: ``save_pretrained(model, dir)`` / ``from_pretrained(dir)``.

Layout (``vla_format_version`` 3)::

    config.json            {"vla_format_version": 3, "policy": ..., "model": <ModelConfig>}
    model.safetensors      every parameter (backbone included; only the language weights used are kept)
    backbone/              the HF backbone's config.json + tokenizer files + image normalization
    embodiments/<name>.yaml  one spec per embodiment slot, in table order (config.model.embodiments)
    norm_stats.json        the normalization stats the model was trained with (when known)
    preprocessing.json     ``model.preprocessing``: how the training data was prepared (when known)
    README.md              a generated model card (``vla.models.model_card``)

Everything needed to rebuild the model is in the folder: loading never downloads, and the model is built on the
meta device and given the file's tensors (no random initialisation first). A hub id works too when the repository
is in the local Hugging Face cache (``huggingface_hub.snapshot_download``).

Writing is atomic: the folder is built under a hidden temporary name next to its destination, then swapped with an
existing folder in one atomic exchange (``_publish``), and the old one deleted: a kill at any moment leaves the old
or the new checkpoint complete at the destination. The hidden ``.<name>.tmp-*`` / ``.<name>.old-*`` siblings a
killed write leaves (gigabytes each for a large model) are removed by the next write to the same place (one writer
per destination at a time).

An untrained folder (``vla model init``) is written by ``vla.models.model_init``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import draccus
import torch
from safetensors.torch import save_file, save_model

from vla import __version__
from vla.config import ConfigError
from vla.embodiments import EmbodimentSpec
from vla.faults import kill_point
from vla.models.backbone import VLMBackbone
from vla.models.config import ModelConfig, load_model_config
from vla.models.meta import empty_weights, load_weights
from vla.models.model_card import model_card, stats_coverage, stats_summary
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
    _restore_aside(out)
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
        kill_point("hub.staged")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Put the finished folder ``tmp`` at ``out`` so that a kill at any moment leaves a complete checkpoint there.

    An existing ``out`` is swapped with ``tmp`` in one atomic exchange (Linux ``renameat2(RENAME_EXCHANGE)``), so
    ``out`` is the old folder until the instant it is the new one; the old one, now under the hidden name, is deleted
    afterwards. Where the exchange is unavailable the old folder is renamed aside to a hidden ``.<name>.old-*``
    sibling first; a kill between the two renames leaves it there, and the next write to ``out`` renames it back
    before anything else (``_restore_aside``)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if swap_folders(tmp, out):
        kill_point("hub.swapped")
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old)  # onto the empty directory just made: an atomic rename on POSIX
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    kill_point("hub.swapped")
    shutil.rmtree(old, ignore_errors=True)


def swap_folders(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` atomically (at every instant each name holds one of the two complete
    folders); False, with nothing done, where the OS or filesystem cannot."""
    if sys.platform != "linux":
        return False
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if rename is None:
        return False
    rename.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
    if rename(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. a filesystem without exchange support
        return False
    raise OSError(err, os.strerror(err), str(b))


def _restore_aside(out: Path) -> None:
    """A kill between ``_publish``'s two fallback renames leaves no ``out`` and the previous checkpoint as a hidden
    ``.<name>.old-*`` sibling: rename it back (it is complete)."""
    if out.exists():
        return
    aside = sorted(p for p in _leftovers(out) if ".old-" in p.name)
    if aside:
        os.replace(aside[-1], out)


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
    try:
        meta = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{cfg_file}: not valid JSON ({e}); restore it or re-save the checkpoint") from None
    if not isinstance(meta, dict):
        raise ValueError(
            f"{cfg_file}: a JSON {type(meta).__name__} where a vla checkpoint config (an object) belongs; restore "
            "it or re-save the checkpoint"
        )
    version = meta.get("vla_format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"{cfg_file}: vla_format_version {version!r} is not an integer; restore it")
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
        model.norm_stats = load_norm_stats(root)
        model.preprocessing = load_preprocessing(root, model)
        return model
    try:
        cfg: ModelConfig = load_model_config(meta["model"])
    except KeyError:
        raise ValueError(f"{cfg_file}: no 'model' section; restore it or re-save the checkpoint") from None
    except ConfigError as e:  # a field that does not parse: name the file it is in
        raise ConfigError(f"{cfg_file}: {e}; restore it or re-save the checkpoint") from None
    specs = []
    for name in cfg.embodiments:
        f = root / "embodiments" / f"{name}.yaml"
        if not f.is_file():
            raise FileNotFoundError(f"{root}: embodiment spec {f.name} listed in config.json is missing")
        specs.append(EmbodimentSpec.from_yaml(f))
    stats = load_norm_stats(root)
    with empty_weights():  # the weights come from the file: no random initialisation first
        backbone = VLMBackbone.from_config(cfg.backbone, weights=False, path=str(root / "backbone"))
        model = POLICIES.get(cfg.policy)(cfg, specs, backbone=backbone, norm_stats=stats)
    unused = [f"backbone.{name}" for name in backbone.unused_weights] if version == 2 else []
    load_weights(model, root / "model.safetensors", device=map_location, ignore=unused)
    model.preprocessing = load_preprocessing(root, model)
    return model.to(map_location)


def load_preprocessing(root: Path, model: torch.nn.Module) -> dict[str, Any] | None:
    """The checkpoint folder's ``preprocessing.json`` (None when it has none), checked the way every reader uses it
    (``vla.predict.checkpoint_preprocessing`` for each embodiment): a damaged file is an error naming it here,
    not a bare JSON or ``int()`` message later."""
    pre = root / PREPROCESSING
    if not pre.is_file():
        return None
    fix = "restore it or re-save the checkpoint"
    try:
        saved = json.loads(pre.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{pre}: not valid JSON ({e}); {fix}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{pre}: a JSON {type(saved).__name__} where an object belongs; {fix}")
    from vla.predict import checkpoint_preprocessing

    previous = getattr(model, "preprocessing", None)
    model.preprocessing = saved
    try:
        for name in model.embodiment_ids:
            checkpoint_preprocessing(model, name)
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{pre}: a field does not parse ({type(e).__name__}: {e}); {fix}") from None
    finally:
        model.preprocessing = previous
    return saved


def load_norm_stats(root: Path) -> StatsFile | None:
    """The checkpoint folder's ``norm_stats.json`` (None when it has none)."""
    if not (root / "norm_stats.json").is_file():
        return None
    from vla.data.normalize import StatsFile

    return StatsFile.load(root / "norm_stats.json")


__all__ = [
    "FORMAT_VERSION",
    "PREPROCESSING",
    "READS",
    "from_pretrained",
    "load_norm_stats",
    "model_card",
    "save_pretrained",
    "stats_coverage",
    "stats_summary",
    "swap_folders",
]
