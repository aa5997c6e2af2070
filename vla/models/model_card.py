"""The model card (README.md) of a checkpoint folder, and what it says about normalization stats.

Every number is read from what the checkpoint's ``config.json`` and embodiment specs hold; ``vla.models.hub``
writes the card with every ``save_pretrained``, and ``vla model info`` prints the stats summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import draccus

from vla import __version__

if TYPE_CHECKING:
    from vla.data.normalize import StatsFile
    from vla.models.policies.flow_vla import FlowVLA


def stats_coverage(stats: StatsFile | None, embodiments: list[str]) -> dict[str, bool]:
    """Per embodiment: whether ``stats`` holds both its state and action stats, under its own key or one of its
    per-dataset keys ``"<embodiment>@<dataset>"`` (what ``vla.policy.Policy`` can normalize with)."""
    have = stats.stats if stats is not None else {}

    def covered(name: str) -> bool:
        keys = [k for k in have if k == name or k.startswith(f"{name}@")]
        return any(all(f in have[k] for f in ("state", "action")) for k in keys)

    return {name: covered(name) for name in embodiments}


def stats_summary(stats: StatsFile | None, embodiments: list[str]) -> str:
    """One line on a checkpoint's normalization stats: which embodiments have them, which do not."""
    if stats is None:
        return "not included (no norm_stats.json: untrained checkpoint, or `vla model init` without --stats-from)"
    cover = stats_coverage(stats, embodiments)
    have = [n for n, ok in cover.items() if ok]
    missing = [n for n, ok in cover.items() if not ok]
    line = f"included (`norm_stats.json`) for {', '.join(have) or 'no embodiment of this model'}"
    if missing:
        line += (
            f"; no stats for {', '.join(missing)} (serving or evaluating those embodiments fails until a "
            "checkpoint trained on their data, or initialized with `--stats-from` a dataset of theirs, replaces it)"
        )
    return line


def model_card(model: FlowVLA) -> str:
    """A Markdown model card: what the model is, its embodiments and parameter counts, how to load it.

    Every number is read from the values ``config.json`` holds (``draccus.encode(model.cfg)``) and from the
    embodiment specs saved next to it, so the card and the config cannot disagree."""
    cfg = draccus.encode(model.cfg)
    chunk = int(cfg["chunk_length"])
    counts = model.parameter_counts()
    rows = "\n".join(f"| {k} | {v['total']:,} | {v['trainable']:,} |" for k, v in counts.items())
    cover = stats_coverage(model.norm_stats, [s.name for s in model.specs])
    emb = "\n".join(
        f"| {s.name} | {s.robot or '-'} | {s.state_dim} | {s.action_dim} | {min(s.chunk_length, chunk)} "
        f"| {s.control_hz:g} | {', '.join(s.cameras)} | {'yes' if cover[s.name] else '**none**'} |"
        for s in model.specs
    )
    backbone = cfg["backbone"]
    return f"""---
library_name: vla
tags: [robotics, vision-language-action, flow-matching, cross-embodiment]
---
# {cfg["policy"]} checkpoint

A vision-language-action model written by vla {__version__}: the first {model.backbone.num_layers} language layers of
the `{backbone["family"]}` backbone `{backbone["pretrained"]}` encode the camera images, the instruction
and an embodiment token; a flow-matching action expert ({model.expert.width} wide, {len(model.expert.layers)} layers)
attends to their keys/values and predicts action chunks through per-embodiment heads
({cfg["flow"]["num_steps"]} Euler steps by default).

Action chunk: `chunk_length: {chunk}` steps (`config.json`, `model.chunk_length`). An embodiment whose spec
sets a shorter default chunk uses that one: the *chunk* column is min(spec `chunk_length`, {chunk}).

## Embodiments

| name | robot | state dim | action dim | chunk | Hz | cameras | norm stats |
|---|---|---|---|---|---|---|---|
{emb}

## Parameters

| component | total | trainable |
|---|---|---|
{rows}

Normalization statistics: {stats_summary(model.norm_stats, [s.name for s in model.specs])}.

## Use

```python
from vla.policy import Policy

policy = Policy.from_checkpoint("path/to/this/folder")  # this checkpoint's own preprocessing and stats
chunk = policy.infer(observation)  # vla.types.Observation -> chunk.actions [H, A] in the robot's units
```
"""
