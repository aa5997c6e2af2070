"""``vla eval report``: one self-contained HTML page over eval outputs that opens offline (no network, no files
beside it): every plot is a PNG and every video an MP4 embedded as a ``data:`` URI, styles inline, no scripts.

Inputs are folders (or files) written by ``vla eval``: ``sim`` runs and ``sweep`` folders (``results.json``),
``gap`` folders (``gap.json``) and replay / Bridge replay reports (``*.json`` with ``kind`` ``replay`` or
``bridge_replay``). Sections: an overview plot and table of the sim runs (success with 95 % Wilson intervals),
per run its breakdown, timing, a few videos and its per-episode randomization records; the sweep tables and
plots; the agreement metrics; the replay divergences.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

MAX_VIDEOS_PER_RUN = 4


def _load(path: Path) -> list[dict[str, Any]]:
    """The eval outputs found at ``path``, each with ``_root`` (the folder its relative paths start from)."""
    files = (
        [path] if path.is_file() else [p for p in (path / "results.json", path / "gap.json") if p.is_file()]
    )
    if not files:
        raise FileNotFoundError(
            f"{path}: no eval output (results.json, gap.json or a replay .json); write one with `vla eval sim|sweep|gap|replay`"
        )
    out = []
    for f in files:
        obj = json.loads(f.read_text())
        obj["_root"] = f.parent
        obj.setdefault("kind", "sim" if "episodes_detail" in obj else "unknown")
        out.append(obj)
    return out


def _data_uri(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def _png_uri(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ci(ci: list[float]) -> str:
    return f"[{_pct(ci[0])}, {_pct(ci[1])}]"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _img(uri: str, alt: str) -> str:
    return f'<img src="{uri}" alt="{_esc(alt)}">'


def _overview_plot(runs: list[dict[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{Path(r['policy']).name}\n{r['task']} / {r['randomization']}" for r in runs]
    rate = [r["success_rate"] for r in runs]
    err = [[r["success_rate"] - r["ci95"][0] for r in runs], [r["ci95"][1] - r["success_rate"] for r in runs]]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(runs)), 3.2), dpi=100)
    ax.bar(range(len(runs)), rate, yerr=err, capsize=4, color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(runs)), labels, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success rate (95% CI)")
    fig.tight_layout()
    uri = _png_uri(fig)
    plt.close(fig)
    return _img(uri, "success rates of the sim runs")


def _sim_section(run: dict[str, Any]) -> str:
    root: Path = run["_root"]
    parts = [f"<h3>{_esc(run['policy'])} — {_esc(run['embodiment'])} / {_esc(run['task'])} "
             f"({_esc(run['randomization'])})</h3>"]  # fmt: skip
    t = run.get("timing", {})
    parts.append(
        f"<p>{run['successes']}/{run['episodes']} successes = <b>{_pct(run['success_rate'])}</b> "
        f"(95% Wilson {_ci(run['ci95'])}); seed {_esc(run.get('seed'))}; policy {t.get('policy_ms_per_call', 0):.1f} "
        f"ms/call, sim {t.get('sim_ms_per_step', 0):.1f} ms/step, {t.get('episodes_per_s', 0):.2f} episodes/s</p>"
    )
    rows = [[group, name, s["episodes"], s["successes"], _pct(s["success_rate"]), _ci(s["ci95"])]
            for group, by in run.get("breakdown", {}).items() for name, s in by.items()]  # fmt: skip
    parts.append(_table(["by", "value", "episodes", "successes", "success", "95% CI"], rows))
    videos = []
    for rel in run.get("videos", [])[:MAX_VIDEOS_PER_RUN]:
        path = root / rel
        if path.is_file():
            videos.append(f'<figure><video controls muted loop preload="auto" src="{_data_uri(path, "video/mp4")}">'
                          f"</video><figcaption>{_esc(Path(rel).stem)}</figcaption></figure>")  # fmt: skip
    if videos:
        parts.append('<div class="videos">' + "".join(videos) + "</div>")
    eps = run.get("episodes_detail", [])
    ep_rows = [
        [e["index"], e["seed"], "yes" if e["success"] else "no", e["steps"], e["instruction"]] for e in eps
    ]
    records = "".join(
        f"<details><summary>episode {e['index']} (seed {e['seed']}) randomization record</summary>"
        f"<pre>{_esc(json.dumps(e.get('randomization', {}), separators=(',', ':')))}</pre></details>"
        for e in eps
    )
    parts.append("<details><summary>episodes</summary>" + _table(["episode", "seed", "success", "steps",
                 "instruction"], ep_rows) + records + "</details>")  # fmt: skip
    return "\n".join(parts)


def _sweep_section(sw: dict[str, Any]) -> str:
    root: Path = sw["_root"]
    parts = [
        f"<h3>Robustness sweep: {_esc(sw['policy'])} — {_esc(sw['embodiment'])} / {_esc(sw['task'])}</h3>"
    ]
    levels = sorted({c["level"] for cells in sw["axes"].values() for c in cells},
                    key=lambda x: ["none", "low", "medium", "high"].index(x))  # fmt: skip
    rows = []
    for axis, cells in sw["axes"].items():
        by = {c["level"]: c for c in cells}
        rows.append(
            [axis]
            + [f"{_pct(by[lv]['success_rate'])} {_ci(by[lv]['ci95'])}" if lv in by else "" for lv in levels]
        )
    header = ["source", *levels]
    if "reality_proxy" in sw:
        p = sw["reality_proxy"]
        header.append("reality_proxy (all)")
        for r in rows:
            r.append(f"{_pct(p['success_rate'])} {_ci(p['ci95'])}")
    parts.append(_table(header, rows))
    parts.append('<div class="plots">' + "".join(
        _img(_data_uri(root / rel, "image/png"), rel) for rel in sw.get("plots", []) if (root / rel).is_file()
    ) + "</div>")  # fmt: skip
    return "\n".join(parts)


def _gap_section(g: dict[str, Any]) -> str:
    root: Path = g["_root"]
    fmt = lambda v: "undefined" if v is None else f"{v:.3f}"  # noqa: E731
    parts = [f"<h3>Sim vs. reference ({_esc(g['reference'])}: {_esc(', '.join(g['reference_paths']))})</h3>",
             _table(["policies", "Pearson r", "MMRV", "Kendall tau"],
                    [[g["policies"], fmt(g["pearson"]), fmt(g["mmrv"]), fmt(g["kendall_tau"])]]),
             _table(["policy", "task", "sim", "reference"],
                    [[p["policy"], p["task"], _pct(p["sim"]), _pct(p["real"])] for p in g["pairs"]])]  # fmt: skip
    parts += [
        _img(_data_uri(root / rel, "image/png"), rel) for rel in g.get("plots", []) if (root / rel).is_file()
    ]
    return "\n".join(parts)


def _replay_section(r: dict[str, Any]) -> str:
    if r["kind"] == "bridge_replay":
        s = r["summary"]
        return (f"<h3>Bridge (real WidowX) replayed on the sim WidowX</h3><p>{_esc(r['robot'])}</p>"
                + _table(["episodes", "mean", "final", "max", "orientation (mean)", "real arm travel",
                          "command chain vs log"],
                         [[s["episodes"], f"{1e3 * s['mean_m']:.1f} mm", f"{1e3 * s['final_m']:.1f} mm",
                           f"{1e3 * s['max_m']:.1f} mm", f"{s['rot_mean_rad']:.3f} rad", f"{1e3 * s['log_travel_m']:.1f} mm",
                           f"{1e3 * s['command_chain_mean_m']:.1f} mm"]]))  # fmt: skip
    s = r["summary"]
    return (f"<h3>Replay error ({_esc(r['units'])})</h3><p>parameters {_esc(r['params'])}</p>"
            + _table(["episodes", "mean", "final", "max"],
                     [[len(r["episodes"]), f"{s['mean']:.5f}", f"{s['final']:.5f}", f"{s['max']:.5f}"]]))  # fmt: skip


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;font-size:13px}
th{background:#f2f2f2}img{max-width:100%;margin:.3em}video{width:256px;image-rendering:pixelated}
figure{display:inline-block;margin:.3em}figcaption{font-size:12px}pre{white-space:pre-wrap;font-size:11px;
max-height:20em;overflow:auto;background:#f8f8f8}h3{margin-top:2em;border-bottom:1px solid #ddd}"""


def build_report(inputs: list[str | Path], out: str | Path, *, title: str = "vla eval report") -> Path:
    """Write the HTML page for ``inputs`` to ``out``; returns its path."""
    items = [obj for p in inputs for obj in _load(Path(p))]
    sims = [o for o in items if o["kind"] == "sim"]
    sections = [f"<h1>{_esc(title)}</h1>"]
    if sims:
        sections.append("<h2>Closed-loop success</h2>" + _overview_plot(sims))
        sections.append(_table(["policy", "embodiment", "task", "randomization", "episodes", "success", "95% CI"],
                               [[r["policy"], r["embodiment"], r["task"], r["randomization"], r["episodes"],
                                 _pct(r["success_rate"]), _ci(r["ci95"])] for r in sims]))  # fmt: skip
        sections += [_sim_section(r) for r in sims]
    sweeps = [o for o in items if o["kind"] == "sweep"]
    if sweeps:
        sections.append("<h2>Robustness per randomization source</h2>")
        sections += [_sweep_section(s) for s in sweeps]
    gaps = [o for o in items if o["kind"] == "gap"]
    if gaps:
        sections.append("<h2>Reality gap: agreement of rankings</h2>")
        sections += [_gap_section(g) for g in gaps]
    replays = [o for o in items if o["kind"] in ("replay", "bridge_replay")]
    if replays:
        sections.append("<h2>Replay error against logs</h2>")
        sections += [_replay_section(r) for r in replays]
    unknown = [
        str(o["_root"]) for o in items if o["kind"] not in ("sim", "sweep", "gap", "replay", "bridge_replay")
    ]
    if unknown:
        raise ValueError(f"not an eval output: {unknown}")
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
            f"<style>{STYLE}</style></head><body>{''.join(sections)}</body></html>")  # fmt: skip
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out


__all__ = ["build_report"]
