"""``vla eval gap``: does the simulator rank policies like the reference does?

Sim side: ``vla eval sim`` runs (``results.json``), one per policy (or checkpoint). Reference side, either

* a CSV of logged real success rates with columns ``policy,success_rate`` (optional ``task``; ``successes`` and
  ``episodes`` instead of ``success_rate`` also work), or
* other eval runs, e.g. the same policies under the held-out ``reality_proxy`` level standing in for reality.

Runs and rows are paired by policy name (the ``policy`` field of the run: a checkpoint path matches a CSV row by
its path or its folder name) and task when both name one. Writes ``OUT/gap.json`` (Pearson r, MMRV, Kendall τ,
the paired rates) and ``OUT/gap.png`` (sim vs. reference scatter).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from vla.eval.metrics import agreement
from vla.eval.rollout import RESULTS_FILE, load_results


def _key(policy: str, task: str | None) -> tuple[str, str | None]:
    return (Path(str(policy).rstrip("/")).name or str(policy), task or None)


def read_reference_csv(path: str | Path) -> dict[tuple[str, str | None], float]:
    """``{(policy name, task or None): success rate}`` from a CSV (see the module docstring)."""
    rows: dict[tuple[str, str | None], float] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        cols = set(reader.fieldnames or [])
        if "policy" not in cols or not ({"success_rate"} <= cols or {"successes", "episodes"} <= cols):
            raise ValueError(
                f"{path}: needs a 'policy' column and 'success_rate' (or 'successes' and 'episodes'); has {sorted(cols)}"
            )
        for i, row in enumerate(reader, start=2):
            try:
                rate = (float(row["success_rate"]) if row.get("success_rate") not in (None, "")
                        else float(row["successes"]) / float(row["episodes"]))  # fmt: skip
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"{path}:{i}: not a success rate: {row}") from None
            if not 0.0 <= rate <= 1.0:
                raise ValueError(
                    f"{path}:{i}: success_rate must be in [0, 1] (a fraction, not a percent), got {rate}"
                )
            rows[_key(row["policy"], row.get("task"))] = rate
    return rows


def read_runs(paths: list[str | Path]) -> dict[tuple[str, str | None], float]:
    out: dict[tuple[str, str | None], float] = {}
    for p in paths:
        res = load_results(p)
        if res.get("kind") == "sweep":
            raise ValueError(f"{p} is a sweep; pass its cells ({p}/runs/<cell>) as runs instead")
        out[_key(res["policy"], res.get("task"))] = float(res["success_rate"])
    return out


def gap(sim_runs: list[str | Path], reference: list[str | Path], out: str | Path) -> dict[str, Any]:
    """Pair the sim runs with the reference, compute the agreement metrics, write ``OUT/gap.json`` + ``gap.png``."""
    sim = read_runs(sim_runs)
    is_csv = len(reference) == 1 and Path(reference[0]).suffix.lower() == ".csv"
    ref = read_reference_csv(reference[0]) if is_csv else read_runs(reference)
    pairs = []
    for (policy, task), rate in sorted(sim.items()):
        match = ref.get((policy, task), ref.get((policy, None)))
        if match is None:
            raise ValueError(
                f"no reference success rate for policy {policy!r} (task {task!r}); reference has "
                f"{sorted(p for p, _ in ref)} — name the policy the same way in both"
            )
        pairs.append({"policy": policy, "task": task, "sim": rate, "real": match})
    result = {
        "kind": "gap",
        "reference": "csv" if is_csv else "runs",
        "reference_paths": [str(r) for r in reference],
        **agreement(sim=[p["sim"] for p in pairs], real=[p["real"] for p in pairs]),
        "pairs": pairs,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = [str(_plot(pairs, result, out).relative_to(out))]
    finite = {k: (None if isinstance(v, float) and v != v else v) for k, v in result.items()}  # nan -> null
    (out / "gap.json").write_text(json.dumps(finite, indent=1, allow_nan=False))
    return result


def _plot(pairs: list[dict[str, Any]], result: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 4), dpi=100)
    ax.plot([0, 1], [0, 1], color="0.7", ls="--", lw=1)
    ax.scatter([p["real"] for p in pairs], [p["sim"] for p in pairs])
    for p in pairs:
        ax.annotate(p["policy"], (p["real"], p["sim"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("reference success rate")
    ax.set_ylabel("sim success rate")
    title = f"r={result['pearson']:.2f}  MMRV={result['mmrv']:.3f}  tau={result['kendall_tau']:.2f}"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = out / "gap.png"
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["RESULTS_FILE", "gap", "read_reference_csv", "read_runs"]
