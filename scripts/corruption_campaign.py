#!/usr/bin/env python3
"""Corruption and kill campaign: damaged copies of small datasets and a tiny checkpoint through every user-facing
reading command, and SIGKILLs of every writing command followed by a re-run of the same command.

Part 1 (``scripts/corruption_cases.py`` lists the cases): each damaged copy goes through ``vla data info``,
``vla data show`` (the damaged episode), ``vla data validate``, ``vla data stats`` and one loader epoch
(``build_loader``); a damaged checkpoint through ``vla model info`` and ``Policy.from_checkpoint``. Each command
runs in a child forked from this (already imported) process, so a run costs no interpreter start-up; the child's
stdout/stderr are files, an uncaught exception prints its traceback as the interpreter would, and a child past
``--timeout`` is killed (``hang``). Each outcome is one of

* ``clear_error``    non-zero exit, no traceback, the message names the damaged dataset/checkpoint (a path under
                     it) or the case's field;
* ``unclear_error``  non-zero exit, no traceback, the message names none of them (a raw library message);
* ``traceback``      a Python traceback (an exception our code does not handle: a bug, not a data error);
* ``ok_reported``    ``validate`` exits 1 listing problems naming the dataset, or another command exits 0 with
                     output that differs from the clean copy's and a warning on stderr or a problem field set in
                     its JSON (``REPORT_FIELDS``: ``incomplete``, ``key_map_problem``, ``data_problem``, ...);
* ``unaffected``     exit 0 with output identical to the clean copy's (the command does not read what was damaged);
* ``correct``        exit 0 with an output unlike the clean copy's that the case states is right (``Case.correct``:
                     ``show`` printing a stored NaN, ``info`` the fps info.json declares, ...);
* ``silent``         exit 0 on damaged data with output that differs from the clean copy's and no warning, a
                     loader batch with a non-finite value, or ``validate`` exiting 0;
* ``hang``           killed at the timeout.

Output is compared after replacing the dataset's path with ``<ROOT>``. Part 2: ``vla sim generate``,
``vla data convert`` (LeRobot and RLDS sources), ``vla data merge`` and a checkpoint write (``vla model init
--overwrite`` over an existing checkpoint) are each run once uninterrupted, then SIGKILLed at seeded kill points
of ``vla.faults`` (inside a dataset commit, between checkpoint folder renames, ...) and at seeded random moments,
and re-run: the re-run must exit 0 and give the uninterrupted run's files byte for byte; in between, ``vla data
info`` must say the dataset is incomplete (or name the command that finishes it), and a killed checkpoint write
must leave the old or the new checkpoint complete.

    nice -n 10 .venv/bin/python scripts/corruption_campaign.py [--only SUBSTR] [--no-kill] [--out FILE.json]

Writes ``benchmarks/results/corruption_campaign_<date>.json`` (per-case rows, totals) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE), str(REPO / "benchmarks")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ["VLA_NO_INDEX_CACHE"] = "1"  # damaged copies are made after writing: never a stale index
os.environ.pop("VLA_DEBUG", None)

# what the commands import lazily, imported once here so that each forked child does not pay for it again
import av  # noqa: E402, F401
import corruption_cases as cc  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402, F401
from corruption_kills import copy_of, run_kills  # noqa: E402
from forked import Run, cli, in_child  # noqa: E402
from harness import cpu_model  # noqa: E402

import vla.data.convert  # noqa: E402
import vla.data.inspect  # noqa: E402
import vla.data.loader  # noqa: E402
import vla.data.merge  # noqa: E402
import vla.data.stats  # noqa: E402
import vla.data.validate  # noqa: E402
import vla.models.hub  # noqa: E402
import vla.models.model_init  # noqa: E402
import vla.policy  # noqa: E402
import vla.sim.generate  # noqa: E402, F401
from vla.cli import main as vla_main  # noqa: E402

DATA_COMMANDS = ("info", "show", "validate", "stats", "loader")
CKPT_COMMANDS = ("model_info", "policy_load")
CLASSES = (
    "clear_error",
    "unclear_error",
    "traceback",
    "silent",
    "ok_reported",
    "correct",
    "unaffected",
    "hang",
)
#: exceptions that are bugs in our code when they escape, whatever the data
BUG_TYPES = (TypeError, AttributeError, NameError, AssertionError, ZeroDivisionError, UnboundLocalError)


def loader_epoch(root: Path) -> int:
    """One epoch of ``build_loader`` over ``root``; prints what a silent change would alter (samples, prompts,
    sums of the float tensors, non-finite count). An exception is reported by type and message (and traceback
    for the types that are bugs), as a training run would show it."""

    from vla.config import DataConfig
    from vla.data.loader import build_loader

    cfg = DataConfig(datasets=(str(root),), batch_size=2, normalize=False, image_size=0, chunk_length=2,
                     shuffle=False)  # fmt: skip
    try:
        samples, prompts, sums, nonfinite = 0, set(), Counter(), 0
        for b in build_loader(cfg):
            samples += len(b.prompt)
            prompts.update(b.prompt)
            for name, t in [("state", b.state), ("actions", b.actions)] + [(f"img.{k}", v) for k, v in b.images.items()]:  # fmt: skip
                t = t.double()
                nonfinite += int((~torch.isfinite(t)).sum())
                sums[name] += float(torch.nan_to_num(t, 0.0, 0.0, 0.0).sum())
    except BUG_TYPES:
        raise
    except Exception as e:
        print(f"error: {type(e).__module__}.{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"samples": samples, "prompts": sorted(prompts), "sums": {k: round(v, 3) for k, v in sorted(sums.items())},
                      "nonfinite": nonfinite}))  # fmt: skip
    return 0


def policy_load(root: Path) -> int:
    from vla.policy import Policy

    try:
        policy = Policy.from_checkpoint(root)
    except BUG_TYPES:
        raise
    except Exception as e:
        print(f"error: {type(e).__module__}.{type(e).__name__}: {e}", file=sys.stderr)
        return 2

    bad = [
        k
        for k, v in policy.model.state_dict().items()
        if v.is_floating_point() and not torch.isfinite(v).all()
    ]
    print(json.dumps({"embodiments": sorted(policy.embodiments) if hasattr(policy, "embodiments") else None,
                      "nonfinite_weights": bad}))  # fmt: skip
    return 0


def command(
    name: str, root: Path, show: tuple[int, int], scratch: Path
) -> tuple[Callable[[], int], Path | None]:
    """The callable of command ``name`` on ``root``, and the file it writes its result to (stats)."""
    if name == "stats":
        out = scratch / "stats.json"
        return cli("data", "stats", root, "--out", out), out
    return {
        "info": cli("data", "info", root, "--json"),
        "show": cli("data", "show", root, "--episode", show[0], "--frame", show[1], "--json"),
        "validate": cli("data", "validate", root, "--json"),
        "loader": lambda: loader_epoch(root),
        "model_info": cli("model", "info", root, "--json"),
        "policy_load": lambda: policy_load(root),
    }[name], None


# ---- classification ----------------------------------------------------------------------------------------
def normalized(run: Run, root: Path, written: Path | None) -> str:
    text = run.out
    if written is not None:
        text = text.replace(str(written), "<STATS>")
        if written.is_file():  # the stats file, without the moment it was written
            stats = json.loads(written.read_text())
            stats.pop("created_at", None)
            text += json.dumps(stats, sort_keys=True)
    return text.replace(str(root), "<ROOT>")


def classify(name: str, run: Run, root: Path, case: cc.Case, clean_out: str, output: str) -> tuple[str, str]:
    """(class, the line that decided it)."""
    if run.hang:
        return "hang", f"killed after {run.seconds:.0f} s"
    if "Traceback (most recent call last)" in run.err:
        return "traceback", run.err.strip().splitlines()[-1][:300]
    lines = [ln for ln in run.err.strip().splitlines() if ln.strip()]
    if name == "validate" and run.rc == 1:
        found = json.loads(run.out or "[]")
        named = [
            p for p in found if str(root) in json.dumps(p) or any(n in json.dumps(p) for n in case.names)
        ]
        return ("ok_reported" if named else "unclear_error"), (
            json.dumps(found[0])[:300] if found else run.err[-300:]
        )
    if run.rc != 0:
        msg = next((ln for ln in lines if ln.startswith("error:")), lines[-1] if lines else f"exit {run.rc}")
        names_it = str(root) in msg or any(n in msg for n in case.names)
        return ("clear_error" if names_it else "unclear_error"), msg[:400]
    right = [why for commands, why in case.correct if name in commands]
    if name == "validate":
        return ("correct", right[0]) if right else ("silent", "validate exits 0: " + run.out[:200])
    if name == "loader" and json.loads(run.out).get("nonfinite"):
        return "silent", "a batch holds non-finite values: " + run.out[-200:]
    if name == "policy_load" and json.loads(run.out).get("nonfinite_weights"):
        return "silent", "loaded non-finite weights: " + run.out[-200:]
    if output == clean_out:
        return "unaffected", "output identical to the clean copy's"
    warnings = [ln for ln in lines if "warn" in ln.lower() or "incomplete" in ln.lower()]
    if warnings:
        return "ok_reported", warnings[0][:300]
    if reported := reports(run.out, clean_out):
        return "ok_reported", reported[:300]
    if right:
        return "correct", right[0]
    return "silent", "output differs from the clean copy's, no warning: " + first_difference(
        clean_out, output
    )


#: fields of ``vla data info/show --json`` and ``vla model info --json`` that report a problem when set
REPORT_FIELDS = ("incomplete", "key_map_problem", "data_problem", "standardized_note", "serving_problem")


def reports(out: str, clean_out: str) -> str:
    """The first problem-reporting field set in a JSON output and not in the clean copy's, as ``field: value``
    ("" when none)."""

    def fields(text: str) -> dict[str, Any]:
        try:
            parsed = json.loads(text.splitlines()[0]) if text.strip() else {}
        except ValueError:
            return {}
        return {k: parsed.get(k) for k in REPORT_FIELDS} if isinstance(parsed, dict) else {}

    now, clean = fields(out), fields(clean_out)
    found = [f"{k}: {v}" for k, v in now.items() if v and clean.get(k) != v]
    return found[0] if found else ""


def first_difference(a: str, b: str) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"clean {a[max(0, i - 60) : i + 60]!r} vs damaged {b[max(0, i - 60) : i + 60]!r}"


# ---- part 1: damaged inputs ---------------------------------------------------------------------------------
def build_clean(work: Path, timeout: float) -> dict[str, Path]:
    """The clean inputs, each written in a child (no torch/MuJoCo state in this process before forking)."""
    paths = {"png": work / "clean" / "png" / "widowx_set", "v21": work / "clean" / "v21" / "widowx_v21",
             "video": work / "clean" / "video" / "widowx_video",
             "rlds2": work / "clean" / "rlds2" / "bridge_dataset" / "1.0.0",
             "sim": work / "clean" / "sim" / "panda_reach", "rlds": work / "clean" / "rlds" / "bridge_dataset" / "1.0.0",
             "ckpt": work / "clean" / "ckpt" / "model"}  # fmt: skip
    makers: dict[str, Callable[[], object]] = {
        "png": lambda: cc.make_png(paths["png"]),
        "v21": lambda: cc.make_v21(paths["v21"]),
        "rlds2": lambda: cc.make_rlds(work / "clean" / "rlds2", shards=2),
        "video": lambda: cc.make_video(paths["video"]),
        "sim": lambda: cc.make_sim(paths["sim"]),
        "rlds": lambda: cc.make_rlds(work / "clean" / "rlds"),
        "ckpt": lambda: vla_main(cc.ckpt_argv(paths["ckpt"], paths["sim"])),
    }
    for name, make in makers.items():
        run = in_child(lambda make=make: (make(), 0)[1], timeout * 4)
        if run.rc != 0:
            raise RuntimeError(f"writing the clean {name} input failed: {run.err[-2000:]}")
    return paths


def run_cases(
    work: Path, clean: dict[str, Path], cases: list[cc.Case], timeout: float
) -> list[dict[str, Any]]:
    commands = {b: (CKPT_COMMANDS if b == "ckpt" else DATA_COMMANDS) for b in clean}
    clean_out: dict[tuple[str, str, tuple[int, int]], str] = {}
    rows = []
    for case in cases:
        for name in commands[case.base]:
            key = (case.base, name, case.show)
            if key not in clean_out:  # the clean copy's output, from a copy at a path of the same shape
                root = copy_of(
                    clean[case.base],
                    work / "clean_runs" / f"{case.base}-{name}-{case.show[0]}-{case.show[1]}",
                )
                fn, written = command(name, root, case.show, root.parent)
                run = in_child(fn, timeout)
                if run.rc not in (0,):
                    raise RuntimeError(f"{name} on the clean {case.base} input failed: {run.err[-2000:]}")
                clean_out[key] = normalized(run, root, written)
            root = copy_of(clean[case.base], work / "cases" / case.name / name)
            try:
                case.damage(root)
            except Exception as e:
                raise RuntimeError(f"case {case.name}: damaging the copy failed: {e!r}") from e
            fn, written = command(name, root, case.show, root.parent)
            run = in_child(fn, timeout)
            cls, why = classify(name, run, root, case, clean_out[key], normalized(run, root, written))
            rows.append({"case": case.name, "input": case.base, "damage": case.what, "listed_before": case.listed,
                         "command": name, "class": cls, "exit": run.rc, "seconds": round(run.seconds, 2),
                         "message": why.replace(str(root), "<ROOT>")})  # fmt: skip
            print(f"  {case.name:34s} {name:12s} {cls:14s} {rows[-1]['message'][:110]}", flush=True)
    return rows


# ---- report ----------------------------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    by_case: dict[str, dict[str, str]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["command"]] = r["class"]
    short = {"clear_error": "clear", "unclear_error": "UNCLEAR", "traceback": "TRACEBACK", "silent": "SILENT",
             "ok_reported": "reported", "correct": "correct", "unaffected": "-", "hang": "HANG"}  # fmt: skip
    cols = DATA_COMMANDS + CKPT_COMMANDS
    lines = [f"{'case':36s}" + "".join(f"{c:>12s}" for c in cols)]
    for case, got in by_case.items():
        lines.append(f"{case:36s}" + "".join(f"{short[got[c]] if c in got else '':>12s}" for c in cols))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--no-kill", action="store_true", help="skip part 2 (kills)")
    ap.add_argument("--no-cases", action="store_true", help="skip part 1 (damaged inputs)")
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds before a command counts as hung")
    ap.add_argument(
        "--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)"
    )
    ap.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results" / f"corruption_campaign_{datetime.date.today()}.json"),
    )
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="vla-corruption-"))
    start = time.monotonic()
    try:
        print(f"clean inputs in {work}", flush=True)
        clean = build_clean(work, args.timeout)
        cases = [c for c in cc.CASES if args.only in c.name]
        rows = [] if args.no_cases else run_cases(work, clean, cases, args.timeout)
        kills = [] if args.no_kill else run_kills(work, clean, args.timeout)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    totals = {c: sum(r["class"] == c for r in rows) for c in CLASSES}
    result = {
        "benchmark": "corruption_campaign", "date": str(datetime.date.today()), "cpu": cpu_model(),
        "root": os.geteuid() == 0,  # as root, permission bits are not enforced: mode-0 files are read anyway
        "seconds": round(time.monotonic() - start, 1), "cases": len({r["case"] for r in rows}),
        "cases_not_listed_before": len({r["case"] for r in rows if not r["listed_before"]}),
        "runs": len(rows), "totals": totals,
        "kills": {"runs": len(kills), "landed": sum(k["killed"] for k in kills),
                  "landed_and_recovered": sum(k["killed"] and k["recovered"] for k in kills),
                  "recovered": sum(k["recovered"] for k in kills),
                  "not_recovered": [k for k in kills if not k["recovered"]]},
        "rows": rows, "kill_rows": kills,
    }  # fmt: skip
    print(table(rows))
    print(json.dumps({k: result[k] for k in ("cases", "runs", "totals", "seconds")}))
    print(json.dumps({k: v for k, v in result["kills"].items() if k != "not_recovered"}), "not recovered:",
          [(k["command"], k["kill"]) for k in result["kills"]["not_recovered"]])  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {args.out}")
    bad = totals["silent"] + totals["traceback"] + totals["unclear_error"] + totals["hang"]
    return 1 if bad or result["kills"]["not_recovered"] else 0


if __name__ == "__main__":
    sys.exit(main())
