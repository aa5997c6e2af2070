#!/usr/bin/env python3
"""Run every benchmark (each its own script and JSON under ``benchmarks/results/``), then summarize the newest result
of each into one JSON and one markdown table: our number beside the peer's (LeRobot 0.6.1) where one was measured,
the ratio, the CPU and date of the run, and the machine's limits (the matmul peaks) that bound them.

    .venv/bin/python benchmarks/run_all.py                   # every benchmark, then the summary (hours on 2 cores)
    .venv/bin/python benchmarks/run_all.py --only train,serve --skip-peer
    .venv/bin/python benchmarks/run_all.py --summary-only    # re-summarize the results already in benchmarks/results

A benchmark that fails is recorded (exit code, the tail of its output) and the others still run; the exit code is
non-zero when any failed. The summary goes to ``benchmarks/results/summary.json`` and ``benchmarks/results/SUMMARY.md``
(the README links to the latter). The peer runs only where its venv exists (``../shared/peer/``); rows without it
say so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# name -> (script, extra arguments of a full run, whether it runs a peer side that --skip-peer turns off)
BENCHMARKS: dict[str, tuple[str, list[str], bool]] = {
    "data_loader": ("data_loader.py", [], True),
    "loader_startup": ("loader_startup.py", [], False),
    "sim_generation": ("sim_generation.py", [], False),
    "model": ("model.py", [], True),
    "attention": ("attention.py", [], False),
    "train": ("train.py", [], True),
    "finetune": ("finetune.py", [], True),
    "eval": ("eval.py", [], False),
    "serve": ("serve.py", [], True),
}

Row = dict[str, Any]


def _get(d: Any, *path: str) -> Any:
    """``d[path[0]][path[1]]...`` or None where any step is missing (older result files lack newer fields)."""
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _median(x: Any) -> float | None:
    """A ``{"n", "min", "median", "max"}`` summary's median, or the number itself."""
    return x.get("median") if isinstance(x, dict) else x


def _row(
    what: str,
    unit: str,
    ours: Any,
    peer: Any = None,
    better: str = "higher",
    note: str = "",
    ratio: Any = None,
) -> Row:
    """One line of the table. ``ratio`` is how many times better ours is (``better``: which direction is better);
    given, it is the script's own (e.g. a median of side-by-side ratios), else ours over the peer's."""
    if not isinstance(ratio, int | float):
        ratio = None
        if isinstance(ours, int | float) and isinstance(peer, int | float) and ours and peer:
            ratio = ours / peer if better == "higher" else peer / ours
    return {"what": what, "unit": unit, "ours": ours, "peer": peer, "times_better": ratio, "note": note}


def _data_loader(r: dict) -> list[Row]:
    ours = _median(_get(r, "ours", "lerobot_v3_w0_cache0mb", "samples_per_s_epoch"))
    peer = _median(_get(r, "peer_lerobot", "data_torchcodec_w0", "samples_per_s_epoch"))
    ours2 = _median(_get(r, "ours", "lerobot_v3_w2_cache0mb", "samples_per_s_epoch"))
    peer2 = _median(_get(r, "peer_lerobot", "data_torchcodec_w2", "samples_per_s_epoch"))
    return [
        _row("LeRobot v3 loading, 0 workers", "samples/s", ours, peer, note="LeRobotDataset + torchcodec"),
        _row("LeRobot v3 loading, 2 workers", "samples/s", ours2, peer2, note="LeRobotDataset + torchcodec"),
    ]


def _model(r: dict) -> list[Row]:
    rows = []
    for ours_key, peer_key, what in (
        ("train_b8_fp32", "smolvla_train_b8_fp32", "train step, batch 8, fp32"),
        ("train_b8_bf16", "smolvla_train_b8_bf16", "train step, batch 8, bf16 autocast"),
        ("infer_b1_fp32", "smolvla_infer_b1_fp32", "one action chunk, fp32"),
        ("infer_b1_fp32_compiled", "smolvla_infer_b1_fp32_compiled", "one chunk, compiled fp32"),
    ):
        key = "s_per_step" if ours_key.startswith("train") else "s_per_chunk"
        ours = _median(_get(r, "ours", ours_key, key))
        peer = _median(_get(r, "peer_lerobot", peer_key, key))
        rows.append(_row(what, "s", ours, peer, better="lower", note="SmolVLA, same config"))
    return rows


def _train(r: dict) -> list[Row]:
    """fp32 eager first; then bf16 autocast and the compiled frozen backbone where the result has them."""
    rows = []
    for ours_key, what in (
        ("fp32", "fp32"),
        ("bf16", "bf16 autocast"),
        ("fp32_compiled", "fp32, frozen backbone compiled"),
        ("bf16_compiled", "bf16 autocast, frozen backbone compiled"),
    ):
        ours = _get(r, "ours", ours_key, "samples_per_s")
        if ours is None and ours_key != "fp32":
            continue
        peer = _get(r, "peer_lerobot", ours_key.split("_")[0], "samples_per_s")
        mfu = _get(r, "ours", ours_key, "mfu", "samples_per_s", "mfu")
        note = "vla train vs lerobot-train" + (f"; our MFU {mfu:.0%}" if isinstance(mfu, float) else "")
        rounds = _get(r, "setting", "rounds") or 1
        ratio = None
        if (
            rounds > 1
        ):  # the script's median of within-round ratios; ours/peer shown are each side's median round
            ratio = _get(
                r, "speedup", "samples_per_s", f"ours_{ours_key}_vs_lerobot_{ours_key.split('_')[0]}"
            )
            note += f"; x = median of {rounds} side-by-side rounds"
        rows.append(_row(f"training end to end (files to optimizer step), {what}", "samples/s", ours, peer,
                         note=note, ratio=ratio))  # fmt: skip
    return rows


def _finetune(r: dict) -> list[Row]:
    peer = _get(r, "peer_lerobot", "fp32", "samples_per_s_median_step")
    rows = []
    for mode in ("finetune_lora", "finetune_frozen_backbone"):
        ours = _get(r, "ours", mode, "samples_per_s_median_step")
        frac = _get(r, "ours", mode, "adapter_fraction_of_full_model")
        note = (
            f"checkpoint {frac:.1%} of the model"
            if isinstance(frac, float)
            else "SmolVLA expert-only training"
        )
        rows.append(
            _row(f"fine-tuning, {mode.removeprefix('finetune_')}", "samples/s", ours, peer, note=note)
        )
    return rows


def _serve(r: dict) -> list[Row]:
    mode = _get(r, "serving_mode", "micro_batched", "mode")  # the server's own choice (--dtype auto)
    if mode is None and _get(r, "config", "dtype"):
        mode = f"{r['config']['dtype']} {'compiled' if _get(r, 'config', 'compile') else 'eager'}"
    return [
        _row("serving: protocol overhead per request, p99", "ms", _get(r, "protocol_overhead_ms", "p99"),
             better="lower", note="target 5 ms"),
        _row("serving: micro-batching gain at 8 clients", "x", _get(r, "speedup_8_clients"),
             note="target 2x" + (f"; {mode}" if mode else "") + _rounds(r) + _bound(r)),
        _row("serving: one request end to end, p50", "ms", _get(r, "latency", "end_to_end", "p50_ms"),
             _get(r, "peer_lerobot", "end_to_end_ms", "p50"), better="lower",
             note="vla serve (WebSocket) vs LeRobot's gRPC policy server, same model config"),
        _row("serving: protocol overhead per request, p50", "ms", _get(r, "latency", "overhead", "p50_ms"),
             _get(r, "peer_lerobot", "overhead_per_request_ms", "p50"), better="lower",
             note="end to end minus the server's own compute time of the same request"),
    ]  # fmt: skip


def _rounds(r: dict) -> str:
    """An interleaved serving result's rounds (``benchmarks/serve.py --interleave R``) as a note."""
    ratios = _get(r, "speedup_8_clients_rounds")
    if not ratios:
        return ""
    return f"; median of {len(ratios)} interleaved rounds ({_fmt(min(ratios))}-{_fmt(max(ratios))}x)"


def _bound(r: dict) -> str:
    """The serving result's batching bound as a note: the gain inside the model and the ceiling at the peak."""
    gain, ceiling = _get(r, "batching_bound", "inside_model_gain_8"), _get(r, "batching_bound", "ceiling")
    if gain is None or ceiling is None:
        return ""
    note = f"; inside the model {_fmt(gain)}x, ceiling at the matmul peak {_fmt(ceiling)}x"
    linear = _get(r, "op_breakdown", "8", "linear_fraction_of_peak")
    if linear is not None:  # where batch 8's time goes (benchmarks/serve.py's op_breakdown)
        eight = r["op_breakdown"]["8"]
        note += (
            f"; batch 8's linear layers at {linear:.0%} of the peak, {_fmt(eight['linear_ms_per_chunk'])} of "
            f"{_fmt(eight['wall_ms_per_chunk'])} ms per chunk"
        )
    return note


def _eval(r: dict) -> list[Row]:
    return [
        _row(f"closed-loop eval, {name}", "episodes/s", _get(r, "runs", f"{name}/workers_1", "episodes_per_s_steady"),
             note="1 worker, steady state")
        for name in ("expert", "tiny_smolvlm", "bench_smolvla")
    ]  # fmt: skip


def _sim_generation(r: dict) -> list[Row]:
    return [
        _row("sim demonstrations, 2 workers", "frames/s", _get(r, "generate", "workers_2", "frames_per_s"))
    ]


def _loader_startup(r: dict) -> list[Row]:
    return [
        _row("loader start-up, warm index (2000 DROID-like episodes)", "s",
             _median(_get(r, "warm", "build_loader", "seconds")), better="lower", note=f"cold {_fmt(_get(r, 'cold', 'seconds'))} s"),
    ]  # fmt: skip


def _attention(r: dict) -> list[Row]:
    rows = []
    # the expert is what a frozen-backbone step trains ("expert" in results from before its two passes were split)
    for part in ("expert_chunk", "embodiment_token", "expert", "backbone"):
        ms = _get(r, "results", f"{part}_bf16", "median_ms") or {}
        if not ms:
            continue
        note = (
            ", ".join(f"{k} {_fmt(v)} ms" for k, v in ms.items())
            + "; training measures each and keeps the fastest"
        )
        rows.append(_row(f"bf16 attention fwd+bwd, {part} shapes, the kernel kept", "ms", min(ms.values()),
                         better="lower", note=note))  # fmt: skip
    ms = _get(r, "inference", "expert_chunk_b8_bf16", "median_ms") or {}
    if ms:
        note = ", ".join(f"{k} {_fmt(v)} ms" for k, v in ms.items()) + "; vla serve measures both"
        rows.append(_row("bf16 attention forward (serving), expert chunk, batch 8, the faster kernel", "ms",
                         min(ms.values()), better="lower", note=note))  # fmt: skip
    return rows


EXTRACT: dict[str, Callable[[dict], list[Row]]] = {
    "data_loader": _data_loader,
    "loader_startup": _loader_startup,
    "sim_generation": _sim_generation,
    "model": _model,
    "attention": _attention,
    "train": _train,
    "finetune": _finetune,
    "eval": _eval,
    "serve": _serve,
}


def _result_files(name: str, results: Path) -> list[Path]:
    """``<name>_<YYYY-MM-DD>[_<cpu>].json``, oldest first (dates sort as text)."""
    return sorted(p for p in results.glob(f"{name}_*.json") if p.stem.removeprefix(f"{name}_")[:4].isdigit())


def _cpu_of(r: dict[str, Any]) -> str:
    """The CPU a result recorded (older files: under ``cpu`` or the peer's section), as ``cpu_label`` names it."""
    model = r.get("cpu_model") or r.get("cpu") or _get(r, "peer_lerobot", "cpu_model") or "not recorded"
    return cpu_label(model, r.get("cpu_features"))


def cpu_label(model: str, features: dict[str, Any] | None) -> str:
    """lscpu's model name, plus CPU family and model where the result recorded them (``harness.cpu_features``):
    "AMD EPYC" names both an AVX2-only Zen 1 (family 23) and an AVX-512 BF16 EPYC, several-fold apart, so their
    results are kept apart. Results from before ``cpu_features`` keep the bare name."""
    if features and features.get("family") is not None:
        return f"{model} (family {features['family']} model {features.get('model')})"
    return model


def _started(name: str, path: Path, r: dict[str, Any]) -> str:
    """When a result was measured, as sortable UTC text ``YYYY-MM-DDTHH:MM:SS``: its recorded ``started`` time (ISO
    8601; one without an offset is taken as UTC, the clock of the machines these run on), else midnight of the day
    in its file name, so it counts as older than a same-day result that recorded its time (results that tie are
    ordered by file name)."""
    try:
        t = datetime.fromisoformat(str(r.get("started") or "").replace("Z", "+00:00"))
    except ValueError:
        return f"{path.stem.removeprefix(f'{name}_')[:10]}T00:00:00"
    if t.tzinfo is not None:
        t = t.astimezone(UTC).replace(tzinfo=None)
    return t.isoformat(timespec="seconds")


def cpu_slug(cpu_model: str) -> str:
    """``"AMD EPYC"`` -> ``"amd-epyc"``: the suffix that keeps one day's results of two CPU families apart."""
    return "-".join("".join(c if c.isalnum() else " " for c in cpu_model.lower()).split()) or "unknown-cpu"


def _entry(
    name: str, path: Path, r: dict[str, Any], extract: Callable[[dict], list[dict[str, Any]]]
) -> dict[str, Any]:
    return {
        "file": path.name,
        "cpu_model": _cpu_of(r),
        "started": r.get("started") or path.stem.removeprefix(f"{name}_")[:10],
        "matmul_peak_tflops": r.get("matmul_peak"),
        "rows": extract(r),
    }


def summarize(results: Path = RESULTS, runs: dict[str, dict] | None = None) -> dict[str, Any]:
    """Headline rows of the newest result of every benchmark, plus the machines they ran on and their limits.

    Kernels and ratios differ between CPU families, so a newer result on one CPU does not replace the newest on
    another: ``other_cpus`` holds, newest first, the newest result of every other CPU model found."""
    out: dict[str, Any] = {"summarized": date.today().isoformat(), "benchmarks": {}}
    for name, extract in EXTRACT.items():
        entry: dict[str, Any] = {"run": (runs or {}).get(name)}
        readable: list[tuple[str, str, Path, dict[str, Any]]] = []
        for path in _result_files(name, results):
            try:
                r = json.loads(path.read_text())
            except (ValueError, OSError):  # an interrupted write: skip it (its CPU's older result stands)
                continue
            if isinstance(r, dict) and r:
                readable.append((_started(name, path, r), path.name, path, r))
        newest_per_cpu: dict[str, tuple[Path, dict[str, Any]]] = {}
        for _, _, path, r in sorted(readable, key=lambda x: x[:2], reverse=True):
            newest_per_cpu.setdefault(_cpu_of(r), (path, r))
        if not newest_per_cpu:
            entry |= {"file": None, "rows": [], "missing": f"no {name}_<date>.json in {results}"}
        else:
            first, *others = newest_per_cpu.values()
            entry |= _entry(name, *first, extract)
            entry["other_cpus"] = [_entry(name, path, r, extract) for path, r in others]
        out["benchmarks"][name] = entry
    return out


def _fmt(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return str(x)


def markdown(summary: dict[str, Any]) -> str:
    """The summary as the markdown page the README links to."""
    lines = [
        "# Benchmark summary",
        "",
        f"Newest result of every benchmark in this folder, summarized {summary['summarized']} by "
        "`benchmarks/run_all.py`. Peer: LeRobot 0.6.1 at the same setting (see each script's docstring). "
        "`×` = how many times better ours is (higher throughput or lower time). CPU model as `lscpu` reports it.",
        "",
        "| benchmark | measurement | unit | vla | LeRobot | × | note | CPU, date |",
        "|---|---|---|---|---|---|---|---|",
    ]
    limits = []
    for name, entry in summary["benchmarks"].items():
        if not entry["rows"]:
            lines.append(f"| {name} | {entry.get('missing', 'no rows')} | | | | | | |")
            continue
        for result in (entry, *entry.get("other_cpus", [])):
            where = f"{result['cpu_model']}, {str(result['started'])[:10]}"
            for row in result["rows"]:
                ratio = f"{row['times_better']:.2f}" if row["times_better"] else "—"
                lines.append(
                    f"| {name} | {row['what']} | {row['unit']} | {_fmt(row['ours'])} | {_fmt(row['peer'])} "
                    f"| {ratio} | {row['note']} | {where} |"
                )
            if peak := result.get("matmul_peak_tflops"):
                limits.append(
                    f"- {name} ({where}): matmul peak fp32 {_fmt(peak.get('fp32_tflops'))} TFLOP/s, "
                    f"bf16 {_fmt(peak.get('bf16_tflops'))} TFLOP/s"
                )
    if limits:
        lines += ["", "Machine limits measured in the same runs:", "", *limits]
    failed = [f"- {n}: exit {e['run']['returncode']}" for n, e in summary["benchmarks"].items()
              if e.get("run") and e["run"]["returncode"] != 0]  # fmt: skip
    if failed:
        lines += ["", "Failed in the last `run_all.py` (the rows above are older results):", "", *failed]
    return "\n".join(lines) + "\n"


def result_path(name: str, day: str, cpu_model: str, results: Path = RESULTS) -> Path:
    """``results/<name>_<day>.json``, or ``<name>_<day>_<cpu>.json`` where that day's file is another CPU's result
    (a rerun on the same CPU replaces its own file; another CPU's is kept)."""
    plain = results / f"{name}_{day}.json"
    if plain.exists():
        try:
            r = json.loads(plain.read_text())
            other = isinstance(r, dict) and bool(r) and _cpu_of(r) != cpu_model
        except (ValueError, OSError):  # unreadable: replaced, as before
            other = False
        if other:
            return results / f"{name}_{day}_{cpu_slug(cpu_model)}.json"
    return plain


def run_benchmark(name: str, skip_peer: bool, day: str, results: Path = RESULTS) -> dict[str, Any]:
    """Run one benchmark script into ``result_path``; its exit code, wall time and output tail."""
    from harness import cpu_features, cpu_model

    script, extra, has_peer = BENCHMARKS[name]
    out = result_path(name, day, cpu_label(cpu_model(), cpu_features()), results)
    cmd = [sys.executable, str(HERE / script), *extra, "--out", str(out)]
    if skip_peer and has_peer:
        cmd.append("--skip-peer")
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent)
    res = {"command": cmd[1:], "returncode": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    if proc.returncode != 0:
        res["output_tail"] = (proc.stdout + proc.stderr)[-2000:]
        print(f"{name} failed (exit {proc.returncode}):\n{res['output_tail']}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    ap.add_argument("--skip-peer", action="store_true", help="our side only (no LeRobot venv needed)")
    ap.add_argument("--summary-only", action="store_true", help="run nothing; summarize the existing results")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    if unknown := sorted(set(names) - set(BENCHMARKS)):
        ap.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    args.results.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    if not args.summary_only:
        day = date.today().isoformat()
        for name in names:
            runs[name] = run_benchmark(name, args.skip_peer, day, args.results)
    summary = summarize(args.results, runs)
    (args.results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.results / "SUMMARY.md").write_text(markdown(summary))
    print(markdown(summary))
    print(f"written {args.results / 'summary.json'} and {args.results / 'SUMMARY.md'}")
    return 1 if any(r["returncode"] != 0 for r in runs.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
