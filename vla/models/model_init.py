"""``vla model init``: an untrained checkpoint folder of a model config for the given embodiments."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vla.models.config import load_model_config
from vla.models.hub import save_pretrained
from vla.models.model_card import stats_coverage
from vla.models.policies import POLICIES

if TYPE_CHECKING:
    from vla.data.normalize import StatsFile


def init_checkpoint(
    config: str | Path,
    out_dir: str | Path,
    *,
    embodiments: list[str] | None = None,
    stats: StatsFile | None = None,
    overrides: list[str] | None = None,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """``vla model init``: an untrained checkpoint of ``config`` for the given embodiments (default: the config's).

    ``out_dir`` must not exist (or be an empty folder) unless ``overwrite``. ``stats`` must cover every embodiment
    (state and action): a checkpoint whose embodiments lack stats could not normalize their observations."""
    from vla.embodiments import get_embodiment

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise FileExistsError(
                f"{out} exists{' and is not empty' if out.is_dir() else ''}; pass --overwrite to replace it, or "
                "choose another --out"
            )
        if not (out / "config.json").is_file():
            raise FileExistsError(
                f"{out} exists but is not a vla checkpoint; --overwrite only replaces a checkpoint, choose another --out"
            )
    cfg = load_model_config(config, overrides)
    names = embodiments or list(cfg.embodiments)
    if not names:
        raise ValueError(
            "no embodiments: pass --embodiment NAME (repeatable) or set model.embodiments in the config"
        )
    if stats is not None and (missing := [n for n, ok in stats_coverage(stats, names).items() if not ok]):
        where = f" in {stats.path}" if stats.path else ""
        have = sorted(k for k in stats.stats if "@" not in k)
        raise ValueError(
            f"no normalization stats for {', '.join(missing)}{where} (it has: {', '.join(have) or 'none'}); pass "
            f"--stats-from a dataset of {', '.join(missing)}, or drop --stats-from (or those --embodiment names)"
        )
    torch.manual_seed(seed)
    model = POLICIES.get(cfg.policy)(cfg, [get_embodiment(n) for n in names], norm_stats=stats)
    return save_pretrained(model, out)
