"""``vla eval sweep``: success vs. the severity of one reality-gap source at a time.

For each axis (``dynamics``, ``perception``, ``actuation``, ``system``) and level index (0 = ``none``, 1 = ``low``,
2 = ``medium``, 3 = ``high``) the sweep writes a preset whose section ``axis`` takes that level's ranges and every
other section stays at ``none`` (``RUN/presets/<axis>_<level>.yaml``, so each run can be re-made alone), and runs
``vla eval sim`` with it (same seeds for every cell: paired). Level 0 is the nominal world for every axis and runs
once. The held-out ``reality_proxy`` level (all sources at once, outside ``high``) is its own column.

Output: ``RUN/runs/<cell>/results.json`` per cell, ``RUN/results.json`` with the table, one PNG per axis
(``RUN/sweep_<axis>.png``: success rate and 95 % interval per level, reality_proxy as a band).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import yaml

from vla.eval.rollout import EvalConfig, evaluate, write_results

AXES = ("dynamics", "perception", "actuation", "system")
LEVEL_NAMES = ("none", "low", "medium", "high")
HELD_OUT = "reality_proxy"


def parse_axes(text: str) -> list[str]:
    axes = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in axes if a not in AXES]
    if bad or not axes:
        raise ValueError(f"--axes: unknown {bad or text!r}; choose from {','.join(AXES)}")
    return axes


def parse_levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--levels: expected comma-separated integers 0..3, got {text!r}") from None
    if not levels or any(not 0 <= x < len(LEVEL_NAMES) for x in levels):
        raise ValueError(f"--levels: expected integers in 0..3 (0=none .. 3=high), got {text!r}")
    return levels


def axis_preset(axis: str, level: int, folder: Path) -> Path:
    """Write (and return) the preset with ``axis`` at ``LEVEL_NAMES[level]`` and every other source at none."""
    from vla.config import read_preset
    from vla.sim.randomization import load_randomization

    name = LEVEL_NAMES[level]
    data = dict(read_preset("sim", "none"))
    if level > 0:
        data[axis] = read_preset("sim", name)[axis]
    if level > 0:
        data["name"] = f"{axis}={name}"
        data["description"] = f"sweep cell: {axis} at {name}, every other source at none"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{axis}_{level}.yaml" if level > 0 else folder / "none.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_randomization(path)  # fails here, naming the field, if the composition is invalid
    return path


def _cell(res: dict[str, Any], level: str, run: str) -> dict[str, Any]:
    keys = ("episodes", "successes", "success_rate", "ci95")
    return {"level": level, **{k: res[k] for k in keys}, "run": run}


def sweep(base: EvalConfig, axes: list[str], levels: list[int], *, held_out: bool = True,
          progress_bar: bool = True) -> dict[str, Any]:  # fmt: skip
    """Run the cells of ``axes`` x ``levels`` (+ ``reality_proxy``) with ``base``'s policy and settings into
    ``base.out``; returns (and writes as ``results.json``) the sweep table."""
    out = Path(base.out)
    presets = out / "presets"
    done: dict[str, dict[str, Any]] = {}

    def run(cell: str, randomization: str) -> dict[str, Any]:
        if cell not in done:
            cfg = replace(base, out=str(out / "runs" / cell), randomization=randomization)
            done[cell] = evaluate(cfg, progress_bar=progress_bar)
        return done[cell]

    table: dict[str, list[dict[str, Any]]] = {}
    for axis in axes:
        table[axis] = []
        for level in levels:
            cell = f"{axis}_{level}" if level > 0 else "none"
            res = run(cell, str(axis_preset(axis, level, presets)))
            table[axis].append(_cell(res, LEVEL_NAMES[level], f"runs/{cell}"))
    result: dict[str, Any] = {
        "kind": "sweep",
        "policy": base.policy,
        "embodiment": next(iter(done.values()))["embodiment"],
        "task": base.task,
        "episodes_per_cell": base.episodes,
        "axes": table,
        "config": asdict(base),
    }
    if held_out:
        result[HELD_OUT] = _cell(run(HELD_OUT, HELD_OUT), HELD_OUT, f"runs/{HELD_OUT}")
    result["plots"] = [str(plot_axis(result, axis, out).relative_to(out)) for axis in axes]
    write_results(out, result)
    return result


def plot_axis(result: dict[str, Any], axis: str, out: Path) -> Path:
    """``out/sweep_<axis>.png``: success rate vs. level with 95 % Wilson intervals; reality_proxy as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["axes"][axis]
    x = list(range(len(cells)))
    rate = [c["success_rate"] for c in cells]
    err = [
        [c["success_rate"] - c["ci95"][0] for c in cells],
        [c["ci95"][1] - c["success_rate"] for c in cells],
    ]
    fig, ax = plt.subplots(figsize=(4.8, 3.2), dpi=100)
    ax.errorbar(x, rate, yerr=err, marker="o", capsize=4, label=f"{axis} only")
    proxy = result.get(HELD_OUT)
    if proxy is not None:
        ax.axhspan(*proxy["ci95"], color="tab:red", alpha=0.15)
        ax.axhline(proxy["success_rate"], color="tab:red", ls="--", label="reality_proxy (all sources)")
    ax.set_xticks(x, [c["level"] for c in cells])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(f"{axis} randomization level")
    ax.set_ylabel("success rate (95% CI)")
    ax.set_title(f"{Path(result['policy']).name}: {result['embodiment']}/{result['task']}", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path = out / f"sweep_{axis}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["AXES", "LEVEL_NAMES", "axis_preset", "parse_axes", "parse_levels", "plot_axis", "sweep"]
