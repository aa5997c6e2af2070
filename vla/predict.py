"""``vla model predict``: one checkpoint's action chunk on one stored frame, next to the actions the dataset recorded.

The sample goes through the training loader's own code (``build_source`` -> ``WindowDataset`` -> ``collate``)
with the *checkpoint's* preprocessing (image size, chunk length, observation history) and the *checkpoint's*
normalization stats (``model.norm_stats``), never the dataset's: this is the offline check that a trained model
does what its training data did (an offline replay error), and the place where a stats or preprocessing mismatch
between training and serving shows up first.

``predict_frame(...)`` returns the JSON contract of ``vla model predict --json``:

* ``actions``   ``[H, A]`` predicted chunk in the robot's units (unnormalized with the checkpoint's stats)
* ``recorded``  ``[H, A]`` the dataset's (standardized) actions of the same window; a row past the episode end
  (or past a gap the key map left) is ``null``, and ``recorded_is_pad`` ``[H]`` says which
* ``error``     ``{"per_dim": [A] mean absolute error over valid steps, "overall": mean over dims and valid steps,
  "valid_steps": n}`` (``null`` values when no step is valid)
* ``embodiment``, ``action_names`` ``[A]``, plus where it came from (checkpoint, dataset, split, episode, frame,
  prompt, seed, num_steps).

The flow's noise comes from a ``torch.Generator`` seeded with ``seed``: same seed, same chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from vla.config import DataConfig, StandardizeConfig
    from vla.data.windows import Source
    from vla.models.policies.flow_vla import FlowVLA


@dataclass(frozen=True)
class Preprocessing:
    """What the loader needs from the checkpoint to build a sample exactly as in training: image size, chunk
    length, observation history, whether (and with which clip) state/action were normalized, and the datasets
    normalized with their own ``"<embodiment>@<dataset>"`` stats instead of the embodiment's."""

    image_size: int
    chunk_length: int
    obs_history: int
    normalize: bool = True
    clip: float | None = None
    per_dataset: frozenset[str] = frozenset()
    # ``data.standardize`` and ``data.seed`` of training (None: a checkpoint from before they were recorded, or
    # not trained by `vla train`: the key map's defaults)
    standardize: dict[str, Any] | None = None
    data_seed: int = 0


def checkpoint_preprocessing(model: FlowVLA, embodiment: str) -> Preprocessing:
    """The checkpoint's preprocessing for ``embodiment``: ``model.preprocessing`` (``preprocessing.json``, written
    by ``vla train``) when the checkpoint has it, else the backbone's image size and the embodiment's chunk length
    with embodiment-wide stats."""
    saved: dict[str, Any] = getattr(model, "preprocessing", None) or {}
    # The chunk the model predicts for this embodiment: min(spec.chunk_length, model.chunk_length).
    horizon = int(model.chunk_lengths[model.embodiment_ids[embodiment]])
    stats_keys: dict[str, dict[str, str]] = saved.get("stats_keys") or {}
    own = frozenset(name for name, keys in stats_keys.items() if keys.get("action") == f"{embodiment}@{name}")
    return Preprocessing(
        image_size=int(saved.get("image_size") or model.backbone.image_size),
        chunk_length=min(int(saved.get("chunk_length") or horizon), horizon),
        obs_history=int(saved.get("obs_history") or 1),
        normalize=bool(saved.get("normalize", True)),
        clip=saved.get("clip"),
        per_dataset=own,
        standardize=saved.get("standardize"),
        data_seed=int(saved.get("data_seed") or 0),
    )


def predict_frame(
    checkpoint: str | Path,
    dataset: str | Path,
    *,
    episode: int,
    frame: int,
    split: str | None = None,
    seed: int = 0,
    num_steps: int | None = None,
) -> dict[str, Any]:
    """Predict the action chunk at raw frame ``frame`` of ``episode`` and compare it with the recorded actions."""
    from vla.data.readers import open_dataset
    from vla.data.standardize import keymap_for
    from vla.models.hub import from_pretrained
    from vla.models.run_dir import resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    model = from_pretrained(ckpt).eval()
    register_checkpoint_specs(model, ckpt)
    reader = open_dataset(dataset)
    split = _check_split(reader, split)
    _check_episode_frame(reader, split, episode, frame)
    keymap = keymap_for(reader)
    if keymap is None:  # build_source names the reason and the fix
        _source(reader, split)
    embodiment = keymap.embodiment
    _check_embodiment(model, ckpt, embodiment, reader.path)
    pre = checkpoint_preprocessing(model, embodiment)
    source = _source(reader, split, pre)  # the episodes as training standardized them
    if episode in source.unreadable:  # only the asked-for episode matters: the others may be damaged
        from vla.data.readers.base import DatasetFormatError

        raise DatasetFormatError(
            f"{reader.path} split {split!r} episode {episode} cannot be read: {source.unreadable[episode]}. "
            "Repair or re-export the dataset, or pick another episode"
        )
    if pre.normalize:
        _check_stats(model, ckpt, embodiment, reader.path)
    cfg = _data_config(reader.path, split, pre)
    sample, recorded, is_pad = _window(model, source, cfg, pre, episode, frame)

    from vla.data.collate import collate
    from vla.data.normalize import Unnormalizer

    batch = collate([sample], model.embodiment_ids)
    spec = model.spec(embodiment)
    generator = torch.Generator().manual_seed(seed)
    predicted = model.sample_actions(batch, num_steps=num_steps, generator=generator)  # [1, H_max, A_max]
    actions = predicted[0, : pre.chunk_length, : spec.action_dim].double().numpy()  # [H, A]
    if pre.normalize:  # model units -> the robot's
        dataset_key = source.name if source.name in pre.per_dataset else None
        actions = Unnormalizer.from_spec(model.norm_stats, spec, "action", dataset=dataset_key)(actions)
    return {
        "checkpoint": str(ckpt),
        "dataset": str(reader.path),
        "split": split,
        "episode": episode,
        "frame": frame,
        "embodiment": embodiment,
        "prompt": sample["prompt"],
        "seed": seed,
        "num_steps": num_steps or model.cfg.flow.num_steps,
        "action_names": spec.action_names(),
        "actions": actions.tolist(),
        "recorded": [None if pad else row.tolist() for row, pad in zip(recorded, is_pad)],
        "recorded_is_pad": is_pad.tolist(),
        "error": _errors(actions, recorded, is_pad),
    }


def register_checkpoint_specs(model: FlowVLA, ckpt: Path) -> None:
    """Make the checkpoint's robots known to this process (a fine-tuned robot from a spec file no config holds), so
    its dataset's ``robot_type`` resolves; a built-in spec of the same name must be the same spec."""
    from vla.embodiments import register_embodiment

    for spec in model.specs:
        register_embodiment(spec, where=f"{ckpt}/embodiments/{spec.name}.yaml")


# ---- steps -----------------------------------------------------------------------------------------------------
def _check_split(reader: Any, split: str | None) -> str:
    splits = reader.splits()
    split = split or ("train" if "train" in splits else splits[0])
    if split not in splits:
        raise ValueError(f"{reader.path}: no split {split!r}; available: {splits} (pass --split)")
    return split


def _check_episode_frame(reader: Any, split: str, episode: int, frame: int) -> None:
    n = reader.num_episodes(split)
    if not 0 <= episode < n:
        raise IndexError(
            f"{reader.path}: --episode {episode} out of range; split {split!r} has {n} episodes (0..{n - 1})"
        )
    length = reader.episode_length(split, episode)
    if not 0 <= frame < length:
        raise IndexError(
            f"{reader.path}: --frame {frame} out of range; {split} episode {episode} has {length} frames "
            f"(0..{length - 1})"
        )


def _source(reader: Any, split: str, pre: Preprocessing | None = None) -> Source:
    """The split as training standardized it (``pre``'s recorded options; the key map's defaults without them).
    Unreadable episodes are listed in ``Source.unreadable``, not an error: one frame of one episode is read."""
    from vla.data.windows import build_source, standardize_options

    if pre is None or pre.standardize is None:
        return build_source(reader, split, on_bad_sample="skip")  # the key map's defaults
    options = standardize_options(_data_config(reader.path, split, pre))
    return build_source(reader, split, options=options, on_bad_sample="skip")


def _standardize_config(pre: Preprocessing) -> StandardizeConfig:
    """Training's recorded ``data.standardize`` (fields a newer version recorded and this one lacks are left)."""
    from vla.config import StandardizeConfig

    known = {f.name for f in fields(StandardizeConfig)}
    return StandardizeConfig(**{k: v for k, v in (pre.standardize or {}).items() if k in known})


def _check_embodiment(model: FlowVLA, ckpt: Path, embodiment: str, dataset: Path) -> None:
    if embodiment not in model.embodiment_ids:
        raise ValueError(
            f"{dataset} is embodiment {embodiment!r}, but checkpoint {ckpt} has embodiments "
            f"{sorted(model.embodiment_ids)}. Fine-tune it on this dataset first, which adds the embodiment "
            f"('vla finetune {ckpt} --embodiment {embodiment} --run-dir RUN --set data.datasets=[{dataset}]'), "
            "or pass a dataset of one of its embodiments."
        )


def _check_stats(model: FlowVLA, ckpt: Path, embodiment: str, dataset: Path) -> None:
    """The checkpoint must carry the stats that turn its outputs into the embodiment's units."""
    from vla.data.norm_stats import StatsError

    fix = (
        f"Run 'vla data stats {dataset}' and write the checkpoint with them ('vla model init <config> "
        f"--embodiment {embodiment} --stats-from {dataset}'); 'vla train' and 'vla finetune' save the stats they "
        "trained with."
    )
    if model.norm_stats is None:
        raise ValueError(
            f"checkpoint {ckpt} has no normalization stats (no norm_stats.json), so its outputs cannot be turned "
            f"into {embodiment!r} units. {fix}"
        )
    for field in ("state", "action"):
        try:
            model.norm_stats.get(embodiment, field)
        except StatsError:
            raise ValueError(
                f"checkpoint {ckpt}: its norm_stats.json has no stats for '{embodiment}/{field}' (it has "
                f"{sorted(model.norm_stats.stats)}). {fix}"
            ) from None


def _data_config(path: Path, split: str, pre: Preprocessing) -> DataConfig:
    from vla.config import DataConfig

    return DataConfig(
        datasets=(str(path),),
        split=split,
        chunk_length=pre.chunk_length,
        image_size=pre.image_size,
        obs_history=pre.obs_history,
        batch_size=1,
        shuffle=False,
        standardize=_standardize_config(pre),
        seed=pre.data_seed,
    )


def _window(
    model: FlowVLA, source: Source, cfg: DataConfig, pre: Preprocessing, episode: int, frame: int
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The sample at raw ``frame`` as the model sees it (normalized with the checkpoint's stats) and the same
    window's recorded actions ``[H, A]`` in the dataset's units with its padding mask ``[H]``, both through
    ``WindowDataset``."""
    from vla.data.normalize import make_normalize_fn
    from vla.data.windows import WindowDataset

    embodiment = source.keymap.embodiment
    normalize = None
    if pre.normalize:
        specs = {embodiment: model.spec(embodiment)}
        normalize = make_normalize_fn(model.norm_stats, specs, clip=pre.clip, per_dataset=pre.per_dataset)
    normalized = WindowDataset([source], cfg, normalize=normalize, train=False)
    raw = WindowDataset([source], cfg, normalize=None, train=False)
    std = raw.episode(0, episode)
    kept = np.flatnonzero(std.frames == frame)
    if len(kept) == 0:
        reason = std.metadata.get("drop_reasons", {}).get(frame, "dropped by standardization")
        first = f"; kept frames run {int(std.frames[0])}..{int(std.frames[-1])}" if len(std.frames) else ""
        raise IndexError(
            f"{source.reader.path}: {source.split} episode {episode} frame {frame} is not a training sample "
            f"({reason}){first}; pick another --frame"
        )
    index = int(source.lengths[:episode].sum()) + int(kept[0])
    window = raw[index]
    return normalized[index], window["actions"].astype(np.float64), np.asarray(window["action_is_pad"])


def _errors(actions: np.ndarray, recorded: np.ndarray, is_pad: np.ndarray) -> dict[str, Any]:
    """Per-dim and overall mean absolute error over the window's valid (non-padded) steps."""
    valid = ~is_pad
    if not valid.any():
        return {"per_dim": [None] * actions.shape[1], "overall": None, "valid_steps": 0}
    err = np.abs(actions[valid] - recorded[valid])  # [n_valid, A]
    return {
        "per_dim": [_finite(v) for v in err.mean(axis=0)],
        "overall": _finite(err.mean()),
        "valid_steps": int(valid.sum()),
    }


def _finite(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def format_prediction(out: dict[str, Any]) -> str:
    """The human-readable view of ``predict_frame``'s result: predicted and recorded chunks side by side."""
    names = out["action_names"]
    width = max(9, *(len(n) + 1 for n in names))
    head = "".join(f"{n:>{width}}" for n in names)
    lines = [
        f"{out['checkpoint']} on {out['dataset']} ({out['split']} episode {out['episode']} frame {out['frame']})",
        f"embodiment {out['embodiment']}, prompt {out['prompt']!r}, seed {out['seed']}, "
        f"{out['num_steps']} flow steps",
        f"{'step':<6}{'':<10}{head}",
    ]
    for t, (pred, rec) in enumerate(zip(out["actions"], out["recorded"])):
        lines.append(f"{t:<6}{'predicted':<10}" + "".join(f"{v:>{width}.4f}" for v in pred))
        rec_text = "".join(f"{v:>{width}.4f}" for v in rec) if rec is not None else "  (past episode end)"
        lines.append(f"{'':<6}{'recorded':<10}" + rec_text)
    err = out["error"]
    per_dim = "".join(f"{v:>{width}.4f}" if v is not None else f"{'-':>{width}}" for v in err["per_dim"])
    lines.append(f"{'MAE':<16}{per_dim}")
    overall = f"{err['overall']:.4f}" if err["overall"] is not None else "-"
    lines.append(f"overall MAE {overall} over {err['valid_steps']} valid step(s)")
    return "\n".join(lines)
