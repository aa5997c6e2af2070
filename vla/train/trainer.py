"""The training loop behind ``vla train`` (and ``vla finetune``): one loop for every scale.

    data (build_loader: rank-sharded, resumable) -> FlowVLA (embodiment table from the data) -> DDP / FSDP2
    -> AdamW (per-component learning rates, warmup + cosine) -> checkpoints (vla.train.checkpoint) + metrics

The loss of an optimizer step is the masked flow-matching MSE over *every* sample of the global batch (all
processes, all micro-batches): each process scales its summed error by ``world / total weight`` so that the
gradient average DDP/FSDP take is exactly that mean. Flow noise and time are drawn per sample from
(seed, step, dataset, episode, frame), so a sample's loss does not depend on the process or micro-batch it lands
in: 2 processes x batch 4 compute the same step as 1 process x batch 8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import resource
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from vla.data.loader import LoaderPositionError, VLALoader, build_loader
from vla.models.attention import (
    cpu_bf16_kernel_choices,
    env_kernel,
    reset_cpu_bf16_kernels,
    restore_cpu_bf16_kernels,
)
from vla.models.backbone import resolve_pretrained
from vla.models.compiled import frozen_compile
from vla.models.run_dir import CHECKPOINTS, check_run_dir_target, complete_steps, latest_complete
from vla.train import checkpoint as ckpt
from vla.train.config import (
    AUTO_COMPILE_MARGIN,
    AUTO_COMPILE_MIN_STEPS,
    TrainConfig,
    config_dict,
    diff_configs,
)
from vla.train.distributed import Runtime
from vla.train.logger import MetricsLogger
from vla.train.model_setup import build_model, held_in_float32, hold_frozen_in_bf16
from vla.train.optim import apply_settings, build_optimizer, build_scheduler, lr_multiplier
from vla.train.optim import settings as optimizer_settings
from vla.train.stop import StopRequests, mark_launch
from vla.types import Batch, to_device

log = logging.getLogger(__name__)

#: the "step" whose flow noise validation uses (fixed, and never a training step: those stay below 10**7)
_VALIDATION_STEP = 2**32


class TrainingDivergedError(RuntimeError):
    """A step's loss or gradient norm was not finite: the step is not applied and the run stops (every rank at the
    same step) before a checkpoint of NaN weights could be written, or ``train.keep_last`` prune the good ones."""

    def __init__(self, step: int, loss: float, grad_norm: float, message: str | None = None) -> None:
        super().__init__(message or f"step {step}: loss {loss}, gradient norm {grad_norm}")
        self.step, self.loss, self.grad_norm = step, loss, grad_norm

    def explained(self, last: Path | None, groups: list[dict[str, Any]]) -> TrainingDivergedError:
        kept = f"the newest checkpoint, {last}, is intact" if last else "no checkpoint was written yet"
        lrs = ", ".join(f"{g['name']} {g['lr']:.2e}" for g in groups)
        return TrainingDivergedError(
            self.step,
            self.loss,
            self.grad_norm,
            f"training diverged at step {self.step}: loss {self.loss}, gradient norm {self.grad_norm}. The step was "
            f"not applied and no checkpoint is written; {kept}. Lower optim.lr (learning rates now: {lrs}), "
            "raise optim.warmup_steps or set train.grad_clip, check the data for NaN/inf (vla data validate), "
            "then re-run the same command to resume from the newest checkpoint",
        )


class ResumeError(ValueError):
    """The run folder holds a run this config cannot continue; the message names each field, old -> new."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    last_checkpoint: Path | None
    final_loss: float | None
    # why the run stopped before train.steps (vla.train.stop: "SIGTERM", the STOP file), None when it did not
    stopped: str | None = None


class _Window:
    """The steps since the last logged row: their times (step, data wait) and running sums of their loss metrics
    (``loss``, ``loss/<embodiment>``, ``loss_dataset/<name>``); an embodiment or dataset absent from some steps'
    batches is averaged over the steps it was in."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []  # (step time, data wait) per step
        self.sums: dict[str, list[float]] = {}

    def add(self, metrics: dict[str, Any], step_time: float, wait: float) -> None:
        self.times.append((step_time, wait))
        for k, v in metrics.items():
            if k == "loss" or k.startswith(("loss/", "loss_dataset/")):
                acc = self.sums.setdefault(k, [0.0, 0])
                acc[0] += float(v)
                acc[1] += 1

    def take(self) -> tuple[dict[str, float], float, float]:
        """(mean of each loss metric, mean step time, mean data wait), and a new window."""
        n = len(self.times)
        mean_t, mean_w = (sum(t[i] for t in self.times) / n for i in (0, 1))
        means = {k: total / count for k, (total, count) in self.sums.items()}
        self.times, self.sums = [], {}
        return means, mean_t, mean_w


def _sums_by(values: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-group sums ``[R, groups]`` of ``values`` ``[R, B]`` by ``group`` ``[B]`` (ids in ``[0, groups)``), as a
    masked sum: the same result every run on CUDA too (``index_add_`` adds with atomics there, in any order)."""
    onehot = group[None, :] == torch.arange(groups, device=group.device)[:, None]  # [groups, B]
    return (values[:, None, :] * onehot).sum(-1)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Trainer:
    """Builds everything a ``TrainConfig`` describes in ``run_dir`` (resuming it when it holds a checkpoint) and
    runs ``train.steps`` optimizer steps."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: str | Path,
        *,
        init_from: str | Path | None = None,
        require_embodiment: str | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        env_kernel()  # a bad VLA_CPU_BF16_ATTENTION fails now, not at the first bf16 step
        self.rt = runtime or Runtime.start(cfg.distributed)
        self.rt.set_tf32(cfg.train.tf32)
        self.config = config_dict(cfg)
        self.resume_from = self._check_run_dir()
        if self.resume_from is None:
            # Python's and numpy's global RNGs seeded too (torch's is by the model's init): what user code draws
            # from them (a custom transform) repeats with train.seed; a resumed run restores them from its checkpoint
            random.seed(cfg.train.seed)
            np.random.seed(cfg.train.seed % 2**32)
        self.loader = build_loader(
            cfg.data, rank=self.rt.rank, world_size=self.rt.world_size, train=True, **self._rehearsal()
        )
        self.loader.pin_memory = self.rt.device.type == "cuda"
        self._keep_run_stats(self.loader)
        if require_embodiment is not None and require_embodiment not in self.loader.embodiment_ids:
            raise ValueError(
                f"--embodiment {require_embodiment!r}: the data ({', '.join(str(d) for d in cfg.data.datasets)}) "
                f"maps to {sorted(self.loader.embodiment_ids)}, not to it; check the dataset's robot_type or the spec"
            )
        init_from = init_from or cfg.finetune.init
        if (
            self.rt.is_main
        ):  # rank 0 materializes a local backbone folder (tiny preset) before the others read it
            resolve_pretrained(cfg.model.backbone.pretrained)
        self.rt.barrier()
        self.model = build_model(
            cfg, self.loader, init_from=self.resume_from or init_from, seed=cfg.train.seed
        )
        self.data_embodiments = sorted(self.loader.embodiment_ids)
        # the embodiments fine-tuning adapts: those of data.datasets (rehearsed base robots keep their slots)
        own = self.loader.dataset.sources[: len(cfg.data.datasets)] if cfg.data.datasets else []
        self.tuned_embodiments = sorted({s.keymap.embodiment for s in own}) or self.data_embodiments
        self.loader.embodiment_ids.clear()
        self.loader.embodiment_ids.update(self.model.embodiment_ids)
        no_decay = self._prepare_finetune()
        if cfg.train.precision == "bf16" and self.rt.device.type == "cpu" and self.rt.is_main:
            from vla.runtime import cpu_bf16_slowdown, cpu_emulates_bf16

            if cpu_emulates_bf16():
                log.warning(
                    "train.precision=bf16 on a CPU without bf16 units: a bf16 matmul takes %.0fx the time of fp32 "
                    "here, so every step will be far slower than with --set train.precision=fp32",
                    cpu_bf16_slowdown(),
                )
        if cfg.train.precision == "bf16" and self.rt.device.type == "cuda" and self.rt.is_main:
            major, minor = torch.cuda.get_device_capability(self.rt.device)
            if major < 8:  # torch.cuda.is_bf16_supported() says True there: emulated
                log.warning(
                    "train.precision=bf16 on %s (compute capability %d.%d) has no bf16 tensor cores (they start "
                    "with Ampere, 8.0): bf16 is emulated and slow; --set train.precision=fp32 is faster there",
                    torch.cuda.get_device_name(self.rt.device),
                    major,
                    minor,
                )
        # bf16 autocast rounds frozen weights at every call: round them once (the same numbers; FSDP2 shards need
        # one dtype per layer and keeps its own mixed-precision policy)
        hold = cfg.train.precision == "bf16" and cfg.train.frozen_bf16 and self.rt.strategy != "fsdp2"
        self.held_bf16 = hold_frozen_in_bf16(self.model) if hold else []
        self.wrapped = self.rt.wrap(self.model, cfg.train.precision)
        self.optimizer = build_optimizer(self.model.named_parameters(), cfg.optim, no_decay)
        self.table_version = getattr(self.model, "table_version", 0)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.ema = self._init_ema()
        self.step, self.samples_seen = 0, 0
        # train.compile's decision (_decide_compile, before the first step) and a resumed run's recorded one
        self.compile_decision: dict[str, Any] | None = None
        self.pinned_compile: bool | None = None
        self.datasets = sorted({s.name for s in self.loader.dataset.sources})
        # a fresh run measures (not reusing another run's measurements in this process); a resumed one takes its
        # checkpoint's kernels (_resume)
        reset_cpu_bf16_kernels()
        if self.resume_from is not None:
            self._resume(self.resume_from)
        self.val_loader = self._build_val_loader()

    # ---- fine-tuning -------------------------------------------------------------------------------------------
    def _prepare_finetune(self) -> list[str]:
        """Freeze / wrap for ``finetune.mode`` and remember the base the adapter checkpoints refer to."""
        ft = self.cfg.finetune
        self.adapter_ref = None
        if ft.mode == "none":
            return []
        if ft.mode != "full" and self.rt.strategy == "fsdp2":
            raise ValueError(
                f"finetune.mode={ft.mode!r} runs with DDP or one process; FSDP2 fine-tuning is finetune.mode=full"
            )
        from vla.models.adapters import base_reference
        from vla.models.run_dir import resolve_checkpoint
        from vla.train.finetune import prepare_finetune

        torch.manual_seed(self.cfg.train.seed)  # LoRA's A matrices are drawn here: same seed, same run
        no_decay = prepare_finetune(self.model, ft, self.tuned_embodiments)
        if ft.mode != "full":
            previous = getattr(self.model, "adapter_reference", None)  # resuming: the original base's names
            base = previous["base_embodiments"] if previous else self.model.base_embodiments
            lora = dataclasses.asdict(ft.lora) if ft.mode == "lora" else None
            self.adapter_ref = base_reference(resolve_checkpoint(ft.init), base, lora)
        return no_decay

    def _rehearsal(self) -> dict[str, Any]:
        """``build_loader``'s rehearsal arguments: the replayed mixture and the base checkpoint's stats."""
        ft = self.cfg.finetune
        if ft.mode == "none" or not ft.rehearsal.mixture:
            return {}
        from vla.models.hub import PREPROCESSING, load_norm_stats
        from vla.models.run_dir import resolve_checkpoint

        assert ft.init is not None  # FinetuneConfig requires it
        base = resolve_checkpoint(ft.init)
        pre = json.loads((base / PREPROCESSING).read_text()) if (base / PREPROCESSING).is_file() else {}
        return {
            "rehearsal": ft.rehearsal,
            "base_stats": load_norm_stats(base),
            "base_stats_keys": pre.get("stats_keys") or {},
        }

    # ---- run folder and resume ---------------------------------------------------------------------------
    def _keep_run_stats(self, loader: VLALoader, *, warn: bool = True) -> None:
        """A resumed run normalizes with the stats it started with (its checkpoint's norm_stats.json, under the
        keys its preprocessing.json names), as openpi's does, not with what the datasets' stats files hold now: its
        weights were trained on them and its checkpoints hand them to serving. The model takes them from the loader
        (``build_model``); fine-tuning from a checkpoint (not a resume) keeps taking the data's. Entries whose
        stats differ in the data now are named in a warning (``warn``)."""
        if self.resume_from is None:
            return
        from vla.models.hub import PREPROCESSING, load_norm_stats

        stats = load_norm_stats(self.resume_from)
        if stats is None:  # a run without normalization
            return
        pre_file = self.resume_from / PREPROCESSING
        pre = json.loads(pre_file.read_text()) if pre_file.is_file() else {}
        try:
            changed = loader.use_stats(stats, pre.get("stats_keys") or {})
        except ValueError as e:  # the datasets changed: the resume checks that follow name what and refuse
            if warn and self.rt.is_main:
                log.warning("resuming %s: cannot keep the run's norm stats (%s)", self.resume_from, e)
            return
        if changed and warn and self.rt.is_main:
            log.warning(
                "resuming %s: the data's norm stats differ from the run's for %s; the run keeps normalizing with "
                "its own (its checkpoint's). To train with the new stats, start a new run (or fine-tune from this "
                "one)",
                self.resume_from,
                ", ".join(changed),
            )

    def _check_run_dir(self) -> Path | None:
        """Create the run folder, or validate the config against the run it holds. Returns the checkpoint to
        resume from (its newest complete step) or None."""
        cfg_file = self.run_dir / "config.yaml"
        if self.rt.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.clean_partials(self.run_dir)
        self.rt.barrier()
        latest = latest_complete(self.run_dir)
        if latest is None:
            if self.rt.is_main:
                cfg_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
            return None
        with _damaged_checkpoint(latest):
            saved = yaml.safe_load((latest / ckpt.TRAIN_STATE / "config.yaml").read_text())
            meta = ckpt.read_trainer_meta(latest)
            if not isinstance(saved, dict) or not isinstance(saved.get("train"), dict):
                raise ValueError(f"{ckpt.TRAIN_STATE}/config.yaml holds no run configuration")
        bad, ok = diff_configs(saved, self.config)
        batch = self.global_batch
        if meta["global_batch"] != batch:
            bad.append(
                f"global batch (data.batch_size x processes x train.grad_accum): {meta['global_batch']} -> {batch}"
            )
        if bad:
            raise ResumeError(
                f"{self.run_dir} holds a run ({latest.name}) that these settings cannot continue:\n  "
                + "\n  ".join(bad)
                + "\nUse a new --run-dir for a new run, or restore these settings to resume."
            )
        if ok and self.rt.is_main:
            log.warning("resuming %s with changed settings:\n  %s", latest, "\n  ".join(ok))
            cfg_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
            # retention changed: name the kept checkpoints the next save deletes (milestones of keep_every)
            now = set(ckpt.pruned_by(self.run_dir, self.cfg.train.keep_last, self.cfg.checkpoint.keep_every))
            old = saved.get("checkpoint", {}).get("keep_every", 0), saved["train"].get("keep_last", 1)
            doomed = sorted(now - set(ckpt.pruned_by(self.run_dir, old[1], old[0])))
            if doomed:
                log.warning(
                    "with the changed train.keep_last/checkpoint.keep_every the next checkpoint deletes %s, kept "
                    "until now; restore the settings, or copy them elsewhere first, to keep them",
                    ", ".join(p.name for p in doomed),
                )
        return latest

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.rt.world_size * self.cfg.train.grad_accum

    def _app_state(self) -> dict[str, Any]:
        msd, osd = self.rt.state_dicts(self.wrapped, self.optimizer)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        if self.ema is not None:
            state["ema"] = self.ema
        return state

    def _resume(self, folder: Path) -> None:
        with _damaged_checkpoint(folder):
            meta = ckpt.read_trainer_meta(folder)
        names = list(self.model.embodiment_ids)
        if meta["embodiments"] != names:
            raise ResumeError(
                f"{folder}: the run's embodiment table {meta['embodiments']} differs from the data's {names} "
                "(the data mixture changed); use a new --run-dir"
            )
        saved_mix, mix = meta.get("mixture"), self._mixture_probs()
        if saved_mix is not None and saved_mix != mix:  # checkpoints from before the record: not checked
            raise ResumeError(
                f"{folder}: the run's data mixture differs from this one (dataset: sampling probability, old -> "
                "new):\n  "
                + "\n  ".join(
                    f"{n}: {saved_mix.get(n)} -> {(mix or {}).get(n)}"
                    for n in sorted(set(saved_mix) | set(mix or {}))
                    if saved_mix.get(n) != (mix or {}).get(n)
                )
                + "\nRestore the mixture (its YAML, data.sim_fraction, data.balance_by_size, the datasets) to resume, "
                "or use a new --run-dir"
            )
        state = self._app_state()
        with _damaged_checkpoint(folder):
            start_ema = self.ema is not None and not ckpt.has_train_state_key(folder, "ema")
        if start_ema:  # EMA switched on at resume: it starts from the resumed weights below
            del state["ema"]
        # this run's optim.* as built, before loading overwrites them
        fresh = optimizer_settings(self.optimizer)
        with _damaged_checkpoint(folder):
            ckpt.load_train_state(folder, state)
        self.rt.load_state_dicts(self.wrapped, self.optimizer, state["model"], state["optim"])
        self.scheduler.load_state_dict(meta["scheduler"])
        # the checkpoint restored the run's old rates and decay: a changed optim.* setting takes effect now
        apply_settings(self.optimizer, self.scheduler, fresh, self.cfg.optim, self.cfg.train.steps)
        if start_ema:
            self.ema = self._init_ema()
            if self.rt.is_main:
                log.warning(
                    "%s has no EMA weights: EMA (decay %s) starts from its weights",
                    folder,
                    self.cfg.ema.decay,
                )
        self.step, self.samples_seen = int(meta["step"]), int(meta["samples_seen"])
        # the run's kernels (bitwise resume): this rank's own record when the world size is the same (ranks measure
        # apart and may differ), else rank 0's (trainer.json)
        own = (
            ckpt.read_rank_attention(folder, self.rt.rank)
            if meta["world_size"] == self.rt.world_size
            else None
        )
        restore_cpu_bf16_kernels(own if own is not None else meta.get("cpu_bf16_attention") or {})
        # the run's graphs, not a new measurement (bitwise resume); checkpoints from before train.compile: eager
        self.pinned_compile = bool((meta.get("compile_frozen") or {}).get("compiled", False))
        # this rank's own files: a damaged one fails here alone, so the ranks agree before any goes on into a
        # collective that the failed one would never join (a hang until distributed.timeout_minutes)
        failure: ResumeError | None = None
        try:
            with _damaged_checkpoint(folder):
                loader_state, rng = ckpt.read_rank_state(folder, self.rt.rank)
        except ResumeError as e:
            failure = e
        if not self.rt.all_true(failure is None):
            raise failure or ResumeError(
                f"{folder}: another process's loader or RNG state cannot be read (its own error names the file); "
                "move the checkpoint aside as it says to resume from the one before"
            )
        why = None
        if meta["world_size"] != self.rt.world_size or loader_state is None:
            why = f"was written by {meta['world_size']} process(es), this run has {self.rt.world_size}"
        else:
            try:
                self.loader.load_state_dict(loader_state)
            except LoaderPositionError as e:  # another data.batch_size (train.grad_accum traded for it)
                why = f"cannot continue its data position: {e}"
        if why is not None:
            self.loader.epoch = int(meta["epoch"]) + 1
            if self.rt.is_main:
                log.warning(
                    "%s %s: the data order restarts at epoch %d (weights, optimizer and schedule resume exactly)",
                    folder,
                    why,
                    self.loader.epoch,
                )
        if rng is not None:
            ckpt.set_rng_state(rng, self.rt.device)
        if self.rt.is_main:
            log.warning("resumed from %s (step %d)", folder, self.step)

    def _mixture_probs(self) -> dict[str, float] | None:
        """The training loader's sampling probability per dataset name (a mixture), or None (no mixture)."""
        stream = getattr(getattr(self.loader, "order", None), "stream", None)
        if stream is None:
            return None
        return {n: float(p) for n, p in zip(stream.names, stream.probs, strict=True)}

    # ---- EMA ----------------------------------------------------------------------------------------------
    def _init_ema(self) -> dict[str, torch.Tensor] | None:
        if not self.cfg.ema.decay:
            return None
        return {n: p.detach().clone().float() for n, p in self.model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def _update_ema(self) -> None:
        if self.ema is None:
            return
        decay = self.cfg.ema.decay
        pairs = [(self.ema[n], p.detach().float()) for n, p in self.model.named_parameters() if n in self.ema]
        # one multi-tensor kernel per tensor type (FSDP2's DTensors and any plain parameters apart: foreach ops
        # take one kind) instead of a launch and dispatch per parameter; the same arithmetic
        for kind in {type(e) for e, _ in pairs}:
            same = [(e, p) for e, p in pairs if type(e) is kind]
            torch._foreach_lerp_([e for e, _ in same], [p for _, p in same], 1 - decay)

    @contextlib.contextmanager
    def _ema_weights(self):
        """Temporarily load the EMA weights into the model (for the checkpoint's top-level weights)."""
        if self.ema is None:
            yield
            return
        params = dict(self.model.named_parameters())
        backup = {n: params[n].detach().clone() for n in self.ema}
        with torch.no_grad():
            for n, v in self.ema.items():
                params[n].copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, v in backup.items():
                    params[n].copy_(v)

    # ---- data ---------------------------------------------------------------------------------------------
    def _build_val_loader(self) -> VLALoader | None:
        tc = self.cfg.train
        if not tc.val_every:
            return None
        from vla.config import AugmentConfig

        held_out = self.cfg.data.val_episodes > 0  # the held-out episodes, else the val_split
        data = dataclasses.replace(
            self.cfg.data,
            split=self.cfg.data.split if held_out else tc.val_split,
            shuffle=False,
            augment=AugmentConfig(enabled=False),
        )
        try:
            val = build_loader(
                data,
                rank=self.rt.rank,
                world_size=self.rt.world_size,
                train=False,
                embodiment_ids=self.model.embodiment_ids,
                held_out=held_out,
                **self._rehearsal(),
            )
        except ValueError as e:
            if held_out:
                raise
            if self.rt.is_main:
                log.warning(
                    "validation off: no usable %r split (%s); data.val_episodes=N holds out episodes instead",
                    tc.val_split,
                    e,
                )
            return None
        self._keep_run_stats(val, warn=False)  # the training loader's warning named the changes
        val.pin_memory = self.loader.pin_memory
        # read for a few batches every train.val_every steps: workers kept between reads would hold memory idle
        val.persistent_workers = False
        return val

    def _batches(self):
        """Batches forever: the loader's epochs one after another (the loader tracks epoch and position)."""
        while True:
            yield from self.loader

    def _flow_inputs(self, batch: Batch, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample flow time ``[B]`` and noise ``[B, H, A_max]`` seeded by (seed, step, dataset, episode, frame)."""
        ts, noises = [], []
        h = batch.actions.shape[1]
        meta = batch.meta
        for i in range(batch.batch_size):
            key = [
                self.cfg.train.seed,
                step,
                zlib.crc32(str(meta["dataset"][i]).encode()),
                int(meta["episode"][i]),
                int(meta["frame"][i]),
            ]
            seed = int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0] >> np.uint64(1))
            t, noise = self.model.draw_flow_inputs(1, h, torch.Generator().manual_seed(seed))
            ts.append(t)
            noises.append(noise)
        return torch.cat(ts), torch.cat(noises)

    def _weight(self, batch: Batch) -> torch.Tensor:
        """Number of (step, dim) entries the loss averages over in ``batch`` (the model's masks, without a forward)."""
        # on the host: no wait on the device
        lengths = self.model.host_chunk_lengths()[batch.embodiment_id.cpu()]
        h = batch.actions.shape[1]
        steps = (torch.arange(h)[None] < lengths[:, None]) & ~batch.action_is_pad.cpu()
        return (steps.sum(1) * batch.action_mask.sum(1)).sum().float()

    # ---- the loop -----------------------------------------------------------------------------------------
    def _decide_compile(self, batch: Batch) -> dict[str, Any]:
        """``train.compile``: compile the backbone's frozen parts or not (see ``LoopConfig``), before the first step.
        ``auto`` times the frozen prefix (no autograd, the run's precision) on ``batch``, eager then compiled, and
        keeps the graphs when they are at least ``AUTO_COMPILE_MARGIN`` faster; a compile that fails leaves the run
        eager (with ``always``: an error). Every rank takes the decision of the summed times and failures. The RNG
        state is left as it was."""
        cfg, backbone = self.cfg.train, self.model.backbone
        parts = backbone.frozen_parts()
        out: dict[str, Any] = {"parts": parts, "mode": cfg.compile, "compiled": False}
        if not parts:
            return {**out, "reason": "nothing frozen"}
        if self.rt.strategy == "fsdp2":
            if cfg.compile == "always":
                log.warning("train.compile=always: not under FSDP2 (sharded weights); the run stays eager")
            return {**out, "reason": "FSDP2"}
        if self.pinned_compile is not None and cfg.compile == "auto":  # an explicit setting wins
            if self.pinned_compile:
                self._time_prefix(batch, repeats=0)  # eager first: kernels the record lacks are measured here
                backbone.compile_frozen(frozen_compile)
            return {**out, "compiled": self.pinned_compile, "reason": "the resumed checkpoint's choice"}
        remaining = cfg.steps - self.step
        if cfg.compile == "never":
            return {**out, "reason": "train.compile=never"}
        if cfg.compile == "auto" and remaining < AUTO_COMPILE_MIN_STEPS:
            return {**out, "reason": f"{remaining} steps < {AUTO_COMPILE_MIN_STEPS}"}
        eager_s = compiled_s = compile_s = 0.0
        failure = None
        try:
            if cfg.compile == "auto":
                eager_s = self._time_prefix(batch)
            else:  # one eager pass first: a compiled graph only reads the CPU bf16 attention kernels measured eagerly
                self._time_prefix(batch, repeats=0)
            t0 = time.perf_counter()
            backbone.compile_frozen(frozen_compile)
            self._time_prefix(batch, repeats=0)  # compiles
            compile_s = time.perf_counter() - t0
            if cfg.compile == "auto":
                compiled_s = self._time_prefix(batch)
        except Exception as e:  # e.g. a graph break in a backbone's code (fullgraph): train eagerly
            failure = e
        summed = self.rt.all_reduce_sum(
            torch.tensor([failure is not None, eager_s, compiled_s], dtype=torch.float64)
        )
        if summed[0] > 0:
            backbone.drop_frozen_compiled()
            why = f"{type(failure).__name__}: {failure}" if failure else "failed on another rank"
            if cfg.compile == "always":
                raise RuntimeError(
                    f"train.compile=always: compiling the frozen {'+'.join(parts)} failed ({why}); "
                    "set train.compile=auto or never to train eagerly"
                ) from failure
            log.warning("train.compile=auto: compiling the frozen parts failed (%s); training eagerly", why)
            return {**out, "reason": f"compile failed: {why}"[:300]}
        out.update(compiled=True, compile_s=round(compile_s, 2))
        if cfg.compile == "always":
            return {**out, "reason": "train.compile=always"}
        keep = bool(summed[2] < (1 - AUTO_COMPILE_MARGIN) * summed[1])
        out.update(eager_ms=round(eager_s * 1000, 2), compiled_ms=round(compiled_s * 1000, 2), compiled=keep)
        if not keep:
            backbone.drop_frozen_compiled()
        log.info("train.compile=auto: frozen %s, eager %.1f ms vs compiled %.1f ms: %s", "+".join(parts),
                 eager_s * 1000, compiled_s * 1000, "compiled" if keep else "eager")  # fmt: skip
        return {**out, "reason": "measured"}

    @torch.no_grad()
    def _time_prefix(self, batch: Batch, repeats: int = 2) -> float:
        """Fastest of ``repeats`` timed runs of the backbone's prefix on ``batch`` (after one untimed run)."""
        best = float("inf")
        devices = [self.rt.device] if self.rt.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self.rt.autocast(self.cfg.train.precision):
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                self.model.compute_prefix(batch)
                if self.rt.device.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    best = min(best, time.perf_counter() - t0)
        return best

    def _train_step(self, micro: list[Batch]) -> dict[str, Any]:
        rt, model = self.rt, self.wrapped
        weight = rt.all_reduce_sum(torch.stack([self._weight(b) for b in micro]).sum())
        scale = rt.world_size / weight.clamp(min=1)
        # [err, weight] sums per embodiment and per dataset, kept where the loss is (on CUDA the host reads them
        # once per step, after the backward passes, instead of waiting on the device in every micro-batch)
        per_emb = torch.zeros(2, len(self.model.specs), device=rt.device)
        per_ds = torch.zeros(2, len(self.datasets), device=rt.device)
        for i, batch in enumerate(micro):
            t, noise = self._flow_inputs(batch, self.step)
            sync = i == len(micro) - 1
            with rt.no_sync(model, sync), rt.autocast(self.cfg.train.precision):
                # on the device already: a DDP/FSDP2 wrapper moves CPU tensor arguments with blocking copies
                terms = model(batch, noise=to_device(noise, rt.device), time=to_device(t, rt.device))
            (terms.err.sum() * scale).backward()
            pair = torch.stack([terms.err.detach().float(), terms.weight.detach().float()])  # [2, B]
            per_emb += _sums_by(pair, terms.embodiment_id, per_emb.shape[1])
            ds = torch.tensor([self.datasets.index(d) for d in batch.meta["dataset"]])
            per_ds += _sums_by(pair, to_device(ds, rt.device), per_ds.shape[1])
        grad_norm = rt.clip_grad_norm(self.model, self.cfg.train.grad_clip)
        per_emb, per_ds = rt.all_reduce_sum(per_emb).cpu(), rt.all_reduce_sum(per_ds).cpu()
        loss = float(per_emb[0].sum() / per_emb[1].sum().clamp(min=1))
        if not (math.isfinite(grad_norm) and math.isfinite(loss)):
            # the same on every rank (a global norm, a reduced loss): all stop together, before the update that
            # would make every weight NaN
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDivergedError(self.step + 1, loss, grad_norm)
        # the rates this step applies (the scheduler moves them on below): lr is optim.lr's schedule, lr/<group>
        # each group's own (a backbone group may run at optim.backbone_lr)
        lrs = {f"lr/{g['name']}": g["lr"] for g in self.optimizer.param_groups}
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._update_ema()
        metrics: dict[str, Any] = {
            "loss": loss,
            "lr": self.cfg.optim.lr * lr_multiplier(self.step, self.cfg.optim, self.cfg.train.steps),
            **lrs,
        }
        metrics["grad_norm"] = grad_norm
        for i, s in enumerate(self.model.specs):
            if per_emb[1, i] > 0:
                metrics[f"loss/{s.name}"] = float(per_emb[0, i] / per_emb[1, i])
        for i, name in enumerate(self.datasets):
            if per_ds[1, i] > 0:
                metrics[f"loss_dataset/{name}"] = float(per_ds[0, i] / per_ds[1, i])
        return metrics

    def run(self) -> TrainResult:
        cfg, rt = self.cfg, self.rt
        logger = MetricsLogger(
            cfg.logging,
            self.run_dir,
            enabled=rt.is_main,
            total_steps=cfg.train.steps,
            start_step=self.step,
            config=self.config,
        )
        if rt.is_main:
            counts = self.model.parameter_counts()["all"]
            logger.event(
                self.step,
                "start" if self.step == 0 else "resume",
                processes=rt.world_size,
                strategy=rt.strategy,
                global_batch=self.global_batch,
                parameters=counts["total"],
                trainable=counts["trainable"],
                embodiments=",".join(self.model.embodiment_ids),
            )
            logger.artifact("config", "config", self.run_dir / "config.yaml")
        last, final_loss, stats_logged = latest_complete(self.run_dir), None, False
        batches = self._batches()
        self.wrapped.train()
        window = _Window()
        stopped: str | None = None
        stop = StopRequests(self.run_dir, is_main=rt.is_main, all_true=rt.all_true)
        try:
            stop.__enter__()
            if self.val_loader is not None and cfg.train.val_at_start and self.step == 0:
                logger.event(0, "validation", **self.validate())
            while self.step < cfg.train.steps:
                self._check_table()
                t0 = time.perf_counter()
                micro = [next(batches) for _ in range(cfg.train.grad_accum)]
                wait = time.perf_counter() - t0
                if self.compile_decision is None:
                    # a one-off, reported by its event: not counted in the step's time
                    deciding = time.perf_counter()
                    self.compile_decision = self._decide_compile(micro[0])
                    t0 += time.perf_counter() - deciding
                    if self.compile_decision["parts"]:
                        logger.event(self.step, "compile", **self.compile_decision)
                try:
                    metrics = self._train_step(micro)
                except TrainingDivergedError as e:
                    logger.event(e.step, "diverged", loss=e.loss, grad_norm=e.grad_norm, checkpoint=str(last))
                    raise e.explained(last, self.optimizer.param_groups) from None
                self.step += 1
                self.samples_seen += self.global_batch
                window.add(metrics, time.perf_counter() - t0, wait)
                final_loss = metrics["loss"]
                # every rank learns at the same step whether any was asked to stop (vla.train.stop)
                stopped = stop.check() if self.step < cfg.train.steps else None
                if stopped or self.step % cfg.logging.every == 0 or self.step == cfg.train.steps:
                    self._log_window(logger, metrics, window)
                if not stopped and self.val_loader is not None and self.step % cfg.train.val_every == 0:
                    logger.event(self.step, "validation", **self.validate())
                if stopped or self.step % cfg.train.save_every == 0 or self.step == cfg.train.steps:
                    last = self.save()
                    logger.event(self.step, "checkpoint", path=str(last))
                    if not stats_logged:  # once per launch: the stats cannot change within a run
                        logger.artifact("norm_stats", "stats", last / "norm_stats.json")
                        stats_logged = True
                    if not stopped and self.step < cfg.train.steps:
                        # asked during the write (a scheduler's SIGTERM): stop on this checkpoint, not one more
                        stopped = stop.check()
                        if stopped and window.times:  # this step not logged yet
                            self._log_window(logger, metrics, window)
                if stopped:
                    logger.event(self.step, "stopped", reason=stopped, checkpoint=str(last))
                    break
            stop.done()  # stopped, or finished while a STOP file was being created: the relaunch trains on
        finally:
            try:
                self.loader.close()  # its kept workers (a later run() starts new ones)
            finally:
                stop.__exit__()
                logger.close()
        return TrainResult(self.run_dir, self.step, last, final_loss, stopped)

    def _log_window(self, logger: MetricsLogger, metrics: dict[str, Any], window: _Window) -> None:
        """One metrics row for the steps of ``window`` (then emptied): the losses averaged over them (a single
        step's loss is noisy), step time and data wait averaged, the rest (grad norm, lr) as of this step."""
        rt = self.rt
        means, mean_t, mean_w = window.take()
        metrics = {**metrics, **means}
        metrics.update(
            step_time_s=round(mean_t, 5),
            data_wait_s=round(mean_w, 5),
            data_wait_frac=round(mean_w / mean_t, 4) if mean_t else 0.0,
            samples_per_s=round(self.global_batch / mean_t, 3) if mean_t else 0.0,
            samples_seen=self.samples_seen,
            epoch=self.loader.epoch,
            peak_rss_mb=round(_peak_rss_mb(), 1),
            **rt.memory_stats(),
        )
        logger.log(self.step, metrics)

    def _check_table(self) -> None:
        version = getattr(self.model, "table_version", 0)
        if version != self.table_version:
            raise RuntimeError(
                "the model's embodiment table changed (add_embodiment) after the optimizer was built; build the "
                "Trainer after every add_embodiment"
            )

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Masked flow-matching loss over ``train.val_batches`` batches of the validation split, with fixed noise
        (the same every time, so successive values are comparable): ``val_loss`` and ``val_loss/<embodiment>``
        for each embodiment in those batches (with rehearsal: the base robots' next to the new one's)."""
        assert self.val_loader is not None
        self.wrapped.eval()
        # [err, weight] per embodiment slot, on the model's device until all batches ran
        per_emb = torch.zeros(2, len(self.model.specs), device=self.rt.device)
        self.val_loader.epoch, self.val_loader.batches_done = 0, 0
        for i, batch in enumerate(self.val_loader):
            if i >= self.cfg.train.val_batches:
                break
            t, noise = self._flow_inputs(batch, _VALIDATION_STEP)
            with self.rt.autocast(self.cfg.train.precision):
                terms = self.wrapped(
                    batch, noise=to_device(noise, self.rt.device), time=to_device(t, self.rt.device)
                )
            pair = torch.stack([terms.err.detach().float(), terms.weight.detach().float()])
            per_emb += _sums_by(pair, terms.embodiment_id, per_emb.shape[1])
        self.wrapped.train()
        per_emb = self.rt.all_reduce_sum(per_emb).cpu()
        out = {"val_loss": round(float(per_emb[0].sum() / per_emb[1].sum().clamp(min=1)), 6)}
        for name, j in self.model.embodiment_ids.items():
            if per_emb[1, j] > 0:
                out[f"val_loss/{name}"] = round(float(per_emb[0, j] / per_emb[1, j]), 6)
        return out

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write ``checkpoints/step-XXXXXXX`` (see vla.train.checkpoint) and prune old ones. Collective."""
        rt, step = self.rt, self.step
        tmp = ckpt.partial_dir(self.run_dir, step)
        if rt.is_main:
            (self.run_dir / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
            ckpt.clean_partials(self.run_dir)
        rt.barrier()
        with (
            ckpt.explained_write_errors(self.run_dir, step),
            self._ema_weights(),
            held_in_float32(self.held_bf16),
        ):
            rt.save_model_folder(self.model, self.wrapped, tmp, adapter=self.adapter_ref)
        rt.barrier()
        with ckpt.explained_write_errors(self.run_dir, step):
            ckpt.save_train_state(
                tmp,
                rank=rt.rank,
                app_state=self._app_state(),
                loader_state=self.loader.state_dict(),
                attention=cpu_bf16_kernel_choices(),
                device=rt.device,
            )
        rt.barrier()
        final = None
        if rt.is_main:
            meta = {
                "step": step,
                "samples_seen": self.samples_seen,
                "world_size": rt.world_size,
                "global_batch": self.global_batch,
                "epoch": self.loader.epoch,
                "embodiments": list(self.model.embodiment_ids),
                "scheduler": self.scheduler.state_dict(),
                "strategy": rt.strategy,
                "cpu_bf16_attention": cpu_bf16_kernel_choices(),
                "compile_frozen": self.compile_decision,
                "mixture": self._mixture_probs(),
            }
            with ckpt.explained_write_errors(self.run_dir, step):
                ckpt.write_trainer_meta(tmp, meta, self.config)
                final = ckpt.publish(self.run_dir, step)
            ckpt.prune(self.run_dir, self.cfg.train.keep_last, self.cfg.checkpoint.keep_every)
        rt.barrier()
        return final or self.run_dir / CHECKPOINTS / ckpt.step_dir_name(step)


@contextlib.contextmanager
def _damaged_checkpoint(folder: Path) -> Iterator[None]:
    """Around the reads of a checkpoint marked complete: a file that cannot be read or decoded (truncated or
    changed after the write: a disk error, a copy cut short, an edit) becomes a ``ResumeError`` naming the folder
    and how to resume from the one before. Only reads are wrapped: a failure of the run itself (out of memory,
    a refused setting) is not blamed on the checkpoint."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        yield
    except ResumeError:
        raise
    except (
        OSError,
        EOFError,
        ValueError,  # JSON
        KeyError,  # a record without its fields
        RuntimeError,  # torch.load of a cut-short file
        pickle.UnpicklingError,
        yaml.YAMLError,
        CheckpointException,  # DCP: any rank's failure
    ) as e:
        run = folder.parent.parent
        earlier = [p for p in complete_steps(run) if p != folder]
        fallback = (
            f"resume from {earlier[-1].name}, the one before"
            if earlier
            else "start anew (it is the run's only one)"
        )
        # the last line: DCP's CheckpointException carries each rank's whole traceback in its text
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        why = f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"
        raise ResumeError(
            f"{folder}: marked complete but its training state cannot be read ({why}). If it was changed or cut "
            f"short after it was written (a disk error, a partial copy), move it aside "
            f"(mv {folder} {folder.parent / ('damaged-' + folder.name)}) and re-run the same command to {fallback}"
        ) from e


def train(
    cfg: TrainConfig,
    run_dir: str | Path,
    *,
    init_from: str | Path | None = None,
    require_embodiment: str | None = None,
) -> TrainResult:
    """Run (or resume) a training run in ``run_dir``; returns where it ended. One run trains in a folder at a time
    (``checkpoint.run_dir_lock``)."""
    check_run_dir_target(run_dir)  # every rank alike, before anything is written there
    mark_launch()  # a STOP file older than this was left from before (vla.train.stop)
    env_kernel()  # a bad VLA_CPU_BF16_ATTENTION fails now, before any process waits for another
    # the process group first: every rank learns whether rank 0 got the folder, and all refuse together
    rt = Runtime.start(cfg.distributed)
    try:
        with ckpt.run_dir_lock(Path(run_dir), rank=rt.rank, agree=rt.all_true):
            trainer = Trainer(
                cfg, run_dir, init_from=init_from, require_embodiment=require_embodiment, runtime=rt
            )
            try:
                return trainer.run()
            finally:
                trainer.rt.close()
    except BaseException:
        # a refused or failed launch of several processes: the process exits next, so its process group goes
        # first (left to the interpreter's exit, gloo's threads sometimes aborted it: "terminate called without an
        # active exception", a killed rank instead of the error's exit status)
        if rt.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        raise


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
