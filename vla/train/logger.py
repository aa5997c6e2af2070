"""What rank 0 reports while training: a progress line (tqdm on a terminal, plain lines otherwise), one JSON object
per logged step in ``<run-dir>/metrics.jsonl`` (always), and Weights & Biases when asked (offline unless logged
in; the run config and norm stats as artifacts)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vla.train.config import LoggingConfig

log = logging.getLogger(__name__)


def _set_aside_rolled_back(run_dir: Path, step: int) -> None:
    """A (re)started run goes on from its checkpoint at ``step`` (0: none yet): rows of ``metrics.jsonl`` logged
    after it (by a launch killed before its next checkpoint) describe steps that are trained again, and would appear
    twice in a plot. They move to ``metrics.rolled_back.jsonl`` (appended, nothing is lost); the rest is rewritten
    atomically."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    keep, moved = [], []
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):  # a line torn by the kill: set aside with the rest
            row_step = step + 1
        (moved if not isinstance(row_step, int) or row_step > step else keep).append(line + "\n")
    if not moved:
        return
    with (run_dir / "metrics.rolled_back.jsonl").open("a") as f:
        f.writelines(moved)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)
    log.info("metrics.jsonl: %d row(s) after step %d (rolled back by the resume) moved to %s", len(moved), step,
             "metrics.rolled_back.jsonl")  # fmt: skip


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class MetricsLogger:
    """Rank 0's sink for step metrics. On other ranks every method is a no-op."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        config: dict[str, Any],
    ) -> None:
        self.cfg, self.enabled, self.total = cfg, enabled, total_steps
        self.start_step, self.t0 = start_step, time.perf_counter()
        self._file = None
        self._bar = None
        self._wandb = None
        if not enabled:
            return
        # also at step 0: a launch killed before its first checkpoint logged steps the next one trains again
        _set_aside_rolled_back(run_dir, start_step)
        self._file = (run_dir / "metrics.jsonl").open("a", buffering=1)
        if cfg.progress and sys.stderr.isatty():
            self._bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )
        if cfg.wandb:
            self._wandb = _init_wandb(cfg, run_dir, config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.perf_counter() - self.t0, 3), **metrics}
        self._file.write(_json_line(row))
        self._to_wandb(
            lambda w: w.log({k: v for k, v in row.items() if isinstance(v, int | float)}, step=step)
        )
        # from the steps' own time (the row's window), not the time since launch, which counts start-up
        step_time = metrics.get("step_time_s")
        if step_time is None:
            done = step - self.start_step
            step_time = row["time"] / done if done > 0 else 0.0
        eta = (self.total - step) * step_time
        summary = {
            "loss": f"{metrics.get('loss', float('nan')):.4f}",
            "lr": f"{metrics.get('lr', 0.0):.2e}",
            "samples/s": f"{metrics.get('samples_per_s', 0.0):.1f}",
            "wait": f"{100 * metrics.get('data_wait_frac', 0.0):.0f}%",
        }
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(summary, refresh=True)
        elif self.cfg.progress:
            parts = " ".join(f"{k} {v}" for k, v in summary.items())
            print(f"step {step}/{self.total} {parts} eta {_fmt_eta(eta)}", flush=True)

    def event(self, step: int, message: str, **fields: Any) -> None:
        """A one-off line (checkpoint written, validation loss) on the console and in metrics.jsonl."""
        if not self.enabled:
            return
        self._file.write(_json_line({"step": step, "event": message, **fields}))
        if fields:
            self._to_wandb(
                lambda w: w.log({k: v for k, v in fields.items() if isinstance(v, int | float)}, step=step)
            )
        text = f"step {step}: {message}" + "".join(f" {k}={v}" for k, v in fields.items())
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def artifact(self, name: str, kind: str, path: Path) -> None:
        """Attach a file to the wandb run (config, norm stats)."""
        if self._wandb is None or not path.is_file():
            return
        import wandb

        def log_artifact(w: Any) -> None:
            art = wandb.Artifact(name, type=kind)
            art.add_file(str(path))
            w.log_artifact(art)

        self._to_wandb(log_artifact)

    def _to_wandb(self, call: Callable[[Any], object]) -> None:
        """``call(run)`` on the wandb run, if any; a failure (its service process killed by a job-wide signal, a lost
        connection) turns wandb off for the rest of the run with one warning: it never stops training, and
        ``metrics.jsonl`` keeps every row."""
        if self._wandb is None:
            return
        try:
            call(self._wandb)
        except Exception as e:
            log.warning(
                "wandb failed (%s: %s); logging to metrics.jsonl only from now on", type(e).__name__, e
            )
            self._wandb = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        self._to_wandb(lambda w: w.finish())


def _init_wandb(cfg: LoggingConfig, run_dir: Path, config: dict[str, Any]) -> Any:
    """A wandb run that resumes with the training run (its id kept in the run folder); offline unless the user is
    logged in or set ``WANDB_MODE`` themselves."""
    import wandb

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        mode = "online" if (os.environ.get("WANDB_API_KEY") or _netrc_has_wandb()) else "offline"
    return wandb.init(
        project=cfg.wandb_project,
        name=run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        config=config,
        mode=mode,
    )


def _netrc_has_wandb() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")


def _json_line(row: dict[str, Any]) -> str:
    """One metrics.jsonl line of strict JSON: a non-finite number (a diverged loss) is written as null, not as the
    bare ``NaN`` that ``json.dumps`` writes and strict JSON readers (jq, JavaScript, pandas' ujson) refuse."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"
