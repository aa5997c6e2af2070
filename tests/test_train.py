"""`vla train`: configs and presets, the optimizer, the loop end to end, crash-safe checkpoints and exact resume."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from train_helpers import (
    REPO,
    cli_env,
    count_attention_kernels,
    events,
    kill_inside_checkpoint,
    metrics,
    mixture_file,
    run_cli,
    tiny_dataset,
    weights,
)

from vla.config import ConfigError
from vla.models.run_dir import (
    CHECKPOINTS,
    complete_steps,
    display_name,
    latest_complete,
    resolve_checkpoint,
    step_dir_name,
)
from vla.paths import config_dir
from vla.train.config import OptimConfig, diff_configs, load_train_config
from vla.train.optim import (
    apply_settings,
    build_optimizer,
    build_scheduler,
    lr_multiplier,
    param_groups,
    settings,
)
from vla.train.trainer import ResumeError, train

TRAIN_PRESETS = sorted(  # the finetune_* presets need a checkpoint: tests/test_finetune.py parses them
    p.stem for p in (config_dir() / "train").glob("*.yaml") if not p.stem.startswith("finetune_")
)


@pytest.fixture(scope="module")
def wx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("mix")
    return [
        tiny_dataset(root, "wx_a", seed=1),
        tiny_dataset(root, "ur5e_b", robot_type="sim_ur5e", seed=2),
    ]


def _args(ds: Path | str, *extra: str, steps: int = 4, save_every: int = 2) -> list[str]:
    return [
        f"data.datasets=[{ds}]",
        f"train.steps={steps}",
        f"train.save_every={save_every}",
        "logging.every=1",
        "logging.progress=false",
        *extra,
    ]


def _sets(over: list[str]) -> list[str]:
    return [x for a in over for x in ("--set", a)]


# ---- configs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", TRAIN_PRESETS)
def test_every_train_preset_parses(preset: str) -> None:
    over = ["data.datasets=[x]"] if preset == "debug" else []  # the others name their mixture
    cfg = load_train_config(preset, over)
    assert cfg.train.steps >= 1 and cfg.data.batch_size >= 1
    # one source of truth: the loader resizes to what the vision tower reads, and covers the model's chunk
    assert cfg.data.image_size == cfg.model.backbone.image_size
    assert cfg.data.chunk_length == 0 or cfg.data.chunk_length >= cfg.model.chunk_length


def test_config_overrides_and_errors() -> None:
    cfg = load_train_config("debug", ["data.datasets=[a]", "model=bench_smolvla", "model.chunk_length=20"])
    assert cfg.model.backbone.pretrained == "tiny:smolvlm:bench" and cfg.model.chunk_length == 20
    assert cfg.data.image_size == 224 and cfg.data.chunk_length == 20  # followed the model
    with pytest.raises(ConfigError, match=r"Did you mean train\.steps"):
        load_train_config("debug", ["data.datasets=[a]", "train.step=3"])
    with pytest.raises(ConfigError, match=r"train\.save_every must be >= 1, got 0"):
        load_train_config("debug", ["data.datasets=[a]", "train.save_every=0"])
    with pytest.raises(ConfigError, match=r"exactly one of data.datasets or data.mixture"):
        load_train_config("debug")
    with pytest.raises(ConfigError, match=r"data.chunk_length=4 is shorter than model.chunk_length=8"):
        load_train_config("debug", ["data.datasets=[a]", "data.chunk_length=4"])
    with pytest.raises(ConfigError, match=r"Unknown train preset 'debg'\. Did you mean debug"):
        load_train_config("debg")


def test_an_unknown_key_in_a_preset_file_names_the_file_and_steps_fit_checkpoint_names(
    tmp_path: Path,
) -> None:
    preset = tmp_path / "bad_preset.yaml"
    preset.write_text("model: tiny_smolvlm\ndata:\n  batch_size: 4\ntrain:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{preset}: Unknown config key 'train.stepz'")):
        load_train_config(str(preset))
    data = tmp_path / "data.yaml"
    data.write_text("batch_sise: 4\n")
    with pytest.raises(ConfigError, match=re.escape(f"{data}: Unknown config key 'batch_sise'")):
        load_train_config("debug", [f"data={data}"])
    from vla.config import DataConfig, load_config

    with pytest.raises(ConfigError, match=re.escape(f"{data}: Unknown config key 'batch_sise'")):
        load_config(DataConfig, data)
    nested = tmp_path / "nested.yaml"  # a section naming its own preset is not an unknown key
    nested.write_text("data:\n  preset: bridge\n  batch_size: 4\n  chunk_length: 0\n")
    assert load_train_config(str(nested)).data.batch_size == 4
    with pytest.raises(ConfigError, match=r"train.steps must be < 10000000"):
        load_train_config("debug", ["train.steps=10000000", "data.datasets=[d]"])


def test_a_plain_string_for_a_list_field_is_one_element(tmp_path: Path) -> None:
    """``--set data.datasets=PATH`` (no brackets) and ``datasets: PATH`` in YAML mean ``[PATH]`` (draccus alone
    split the string into single characters), for every string-list field of every config."""
    path = "/data/robots/wx"
    cfg = load_train_config("debug", [f"data.datasets={path}", "finetune.lora.targets=q_proj"])
    assert cfg.data.datasets == (path,) and cfg.finetune.lora.targets == ("q_proj",)
    assert load_train_config("debug", [f"data.datasets=[{path}, b]"]).data.datasets == (path, "b")
    preset = tmp_path / "run.yaml"
    preset.write_text(f"model: tiny_smolvlm\ndata:\n  datasets: {path}\n  batch_size: 2\n")
    assert load_train_config(str(preset)).data.datasets == (path,)
    from vla.config import DataConfig, load_config
    from vla.models.config import ModelConfig

    data_yaml = tmp_path / "data.yaml"
    data_yaml.write_text(f"datasets: {path}\n")
    assert load_config(DataConfig, data_yaml).datasets == (path,)
    assert load_config(ModelConfig, None, ["embodiments=widowx_bridge"], kind="model").embodiments == (
        "widowx_bridge",
    )


def test_diff_configs_splits_compatible_from_incompatible() -> None:
    a = json.loads(json.dumps(_cfg_dict(["train.steps=10"])))
    b = _cfg_dict(["train.steps=20", "model.chunk_length=6", "data.batch_size=8"])
    bad, ok = diff_configs(a, b)
    assert any(line.startswith("model.chunk_length: 8 -> 6") for line in bad)
    assert any(line.startswith("train.steps: 10 -> 20") for line in ok)
    assert any(line.startswith("data.batch_size") for line in ok)  # the global batch is checked on its own
    # the number of processes may change at the same global batch: grad_accum is checked through it
    bad, ok = diff_configs(a, _cfg_dict(["train.steps=10", "train.grad_accum=2"]))
    assert bad == [] and ok == ["train.grad_accum: 1 -> 2"]
    bad, ok = diff_configs(a, _cfg_dict(["train.steps=10", "model.backbone.gradient_checkpointing=true"]))
    assert bad == [] and ok == ["model.backbone.gradient_checkpointing: False -> True"]  # memory, not shape
    del a["optim"]["eps"]  # a setting newer than the run's config
    bad, ok = diff_configs(a, _cfg_dict(["train.steps=10"]))
    assert bad == [] and ok == ["optim.eps: not recorded by the run -> 1e-08"]
    del a["data"]["seed"]  # ... but set to another value than its default, it is a change like any other
    bad, ok = diff_configs(a, _cfg_dict(["train.steps=10", "data.seed=5"]))
    assert bad == ["data.seed: None -> 5"] and ok == ["optim.eps: not recorded by the run -> 1e-08"]


def test_a_fine_tune_base_written_another_way_is_the_same_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs started before the fine-tune base was resolved recorded it as typed (relative, through a symlink): the
    same folder resolved is no change, so re-running the same `vla finetune` still resumes; another folder is."""
    base = tmp_path / "runs" / "base"
    base.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    old = _cfg_dict(["finetune.init=runs/base"])
    for same in (str(base), str(tmp_path / "link" / "base"), "./runs/base"):
        assert diff_configs(old, _cfg_dict([f"finetune.init={same}"])) == ([], []), same
    (tmp_path / "other").mkdir()
    bad, _ = diff_configs(old, _cfg_dict([f"finetune.init={tmp_path / 'other'}"]))
    assert bad and bad[0].startswith("finetune.init:")


def _cfg_dict(over: list[str]) -> dict:
    from vla.train.config import config_dict

    return config_dict(load_train_config("debug", ["data.datasets=[a]", *over]))


# ---- optimizer -----------------------------------------------------------------------------------------------
def test_param_groups_and_schedule() -> None:
    from vla.models.testing import tiny_model

    model = tiny_model()
    cfg = OptimConfig(lr=1e-3, backbone_lr=1e-4, warmup_steps=2, min_lr_ratio=0.1)
    groups = {g["name"]: g for g in param_groups(model.named_parameters(), cfg)}
    assert groups["backbone"]["lr"] == 1e-4 and groups["expert"]["lr"] == 1e-3
    assert groups["heads/no_decay"]["weight_decay"] == 0.0 and groups["heads"]["weight_decay"] > 0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(
        names[id(p)].endswith("bias") or "norm" in names[id(p)] or "embed" in names[id(p)] or p.dim() < 2
        for g in groups.values()
        if g["name"].endswith("no_decay")
        for p in g["params"]
    )
    counted = sum(len(g["params"]) for g in groups.values())
    assert counted == sum(1 for p in model.parameters() if p.requires_grad)
    lrs = [lr_multiplier(s, cfg, 10) for s in range(10)]
    assert lrs[0] == 0.5 and lrs[1] == 1.0 and lrs[2] == 1.0 and lrs[-1] > 0.1
    assert all(a >= b for a, b in itertools.pairwise(lrs[1:]))
    assert lr_multiplier(10, cfg, 10) == pytest.approx(0.1)


def test_resumed_optimizer_takes_the_new_settings_and_an_unchanged_one_is_exact() -> None:
    """Loading an optimizer and schedule restores the saved rates, decay and eps: ``apply_settings`` puts the
    config's back (a changed ``optim.lr`` must not be reported as applied and then ignored), and with the same
    config it leaves every value exactly as the schedule set it (bitwise resume)."""
    from vla.models.testing import tiny_model

    model = tiny_model()
    old = OptimConfig(lr=1e-3, warmup_steps=2, weight_decay=0.01, fused=False)
    opt = build_optimizer(model.named_parameters(), old)
    sched = build_scheduler(opt, old, 10)
    for _ in range(3):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    before = [(g["lr"], g["weight_decay"], g["eps"]) for g in opt.param_groups]

    def resumed(cfg: OptimConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        o = build_optimizer(model.named_parameters(), cfg)
        s = build_scheduler(o, cfg, 10)
        fresh = settings(o)
        o.load_state_dict(saved_opt)
        s.load_state_dict(saved_sched)
        apply_settings(o, s, fresh, cfg, 10)
        return o, s

    same, _ = resumed(old)
    assert [(g["lr"], g["weight_decay"], g["eps"]) for g in same.param_groups] == before
    new = OptimConfig(lr=1e-5, expert_lr=2e-5, warmup_steps=2, weight_decay=0.5, eps=1e-6, fused=True)
    o, s = resumed(new)
    for g in o.param_groups:
        base = 2e-5 if g["name"].startswith("expert") else 1e-5
        assert g["lr"] == pytest.approx(base * lr_multiplier(3, new, 10))
        assert g["weight_decay"] == (0.0 if g["name"].endswith("no_decay") else 0.5) and g["eps"] == 1e-6
        assert g["fused"] is True  # the saved groups said False
    s.step()  # the schedule goes on from the new base rates
    for g in o.param_groups:
        base = 2e-5 if g["name"].startswith("expert") else 1e-5
        assert g["lr"] == pytest.approx(base * lr_multiplier(4, new, 10))


def test_resume_with_a_new_learning_rate_and_ema_switched_on(
    wx: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A compatible change takes effect: the resumed steps run at the new rate, and EMA switched on at resume
    starts from the resumed weights (the checkpoint has none) instead of failing to load."""
    run = tmp_path / "run"
    train(load_train_config("debug", _args(wx, "optim.lr=1e-3", steps=2)), run)
    over = _args(wx, "optim.lr=1e-5", "ema.decay=0.5", steps=3)
    with caplog.at_level(logging.WARNING):
        result = train(load_train_config("debug", over), run)
    assert "optim.lr: 0.001 -> 1e-05" in caplog.text and "has no EMA weights" in caplog.text
    cfg = load_train_config("debug", over)
    rows = {r["step"]: r for r in metrics(run)}
    # each row: the rate its step ran at (step N is 0-based step N - 1; rows were one step ahead before)
    assert rows[2]["lr"] == pytest.approx(1e-3 * lr_multiplier(1, cfg.optim, 2))
    assert rows[3]["lr"] == pytest.approx(1e-5 * lr_multiplier(2, cfg.optim, 3))
    top = weights(result.last_checkpoint)
    raw = {
        k.removeprefix(".model."): v
        for k, v in _optim_state(result.last_checkpoint).items()
        if k.startswith(".model.")
    }
    assert any(not torch.equal(top[k], raw[k]) for k in raw if k in top)  # the top level holds EMA weights


def test_resume_refuses_a_changed_mixture(two_datasets: list[Path], tmp_path: Path) -> None:
    """The mixture's sampling probabilities are recorded: a reweighted mixture YAML (same name, same datasets)
    or another data.sim_fraction cannot continue the run."""
    mix = mixture_file(tmp_path, two_datasets)
    over = [a for a in _args("x", steps=2) if not a.startswith("data.datasets")] + [f"data.mixture={mix}"]
    run = tmp_path / "run"
    train(load_train_config("debug", over), run)
    mix.write_text(mix.read_text().replace("weight: 2.0", "weight: 5.0"))
    with pytest.raises(ResumeError, match=r"data mixture differs(.|\n)*ur5e_b: 0\.666666\d* -> 0\.8333"):
        train(load_train_config("debug", [a.replace("steps=2", "steps=3") for a in over]), run)
    a = _cfg_dict([])
    b = json.loads(json.dumps(a))
    b["data"]["sim_fraction"] = 0.5
    assert diff_configs(a, b)[0] == ["data.sim_fraction: None -> 0.5"]


# ---- the loop ------------------------------------------------------------------------------------------------
def test_debug_run_loss_falls_and_predict_runs(wx: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    over = _args(wx, "optim.warmup_steps=5", "optim.lr=1e-3", steps=40, save_every=20)
    r = run_cli(["train", "debug", "--run-dir", str(run), *_sets(over)])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 41))
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    for key in (
        "lr",
        "grad_norm",
        "samples_per_s",
        "data_wait_frac",
        "step_time_s",
        "peak_rss_mb",
        "loss/widowx_bridge",
        "loss_dataset/wx",
    ):
        assert key in rows[-1]
    assert [p.name for p in complete_steps(run)] == ["step-0000020", "step-0000040"]
    step = latest_complete(run)
    assert resolve_checkpoint(run) == step
    assert display_name(step) == f"{run.name}/step-0000040"  # what a server shows clients
    for name in (
        "config.json",
        "model.safetensors",
        "norm_stats.json",
        "backbone",
        "embodiments",
        "README.md",
        "COMPLETE",
        "train_state/trainer.json",
        "train_state/config.yaml",
        "train_state/dcp",
        "train_state/rank0.json",
        "train_state/rng0.pt",
    ):
        assert (step / name).exists(), name
    r = run_cli(["model", "predict", str(run), str(wx), "--episode", "1", "--frame", "3", "--json"])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["embodiment"] == "widowx_bridge" and len(out["actions"][0]) == 7


def test_a_failed_checkpoint_write_is_one_error_naming_the_step_and_a_full_disk(
    wx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """DCP raises a BaseException subclass and torch.save says "unexpected pos" on a full disk: `vla train` reported
    tracebacks (exit 1). Now: one line naming the step, "the disk is full" when it is, exit 2; the run resumes."""
    import shutil as shutil_mod
    import traceback
    from collections import namedtuple

    from torch.distributed.checkpoint.api import CheckpointException

    from vla.cli import main
    from vla.train import checkpoint as ckpt

    real = ckpt.save_train_state
    usage = namedtuple("usage", "total used free")
    cases = [
        (CheckpointException("save", {0: (RuntimeError("boom"), traceback.extract_stack())}), None,
         "(CheckpointException: RuntimeError: boom)"),
        (RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598"), 5 * 2**20,
         "the disk has only 5 MiB free, likely full"),
        (OSError(28, "No space left on device"), None, "the disk is full"),
    ]  # fmt: skip
    run = tmp_path / "run"
    for error, free, message in cases:

        def failing(*args: Any, error: BaseException = error, **kw: Any) -> None:
            raise error

        monkeypatch.setattr(ckpt, "save_train_state", failing)
        if free is not None:
            monkeypatch.setattr(
                shutil_mod, "disk_usage", lambda p, free=free: usage(2**40, 2**40 - free, free)
            )
        assert main(["train", "debug", "--run-dir", str(run), *_sets(_args(wx, steps=2))]) == 2
        err = capsys.readouterr().err
        assert "writing the checkpoint of step 2 under" in err and message in err and "Traceback" not in err
        assert "the previous checkpoints are intact" in err
        monkeypatch.undo()
    monkeypatch.setattr(ckpt, "save_train_state", real)
    assert train(load_train_config("debug", _args(wx, steps=2)), run).step == 2


def test_a_second_launch_on_a_run_folder_in_use_is_refused(wx: Path, tmp_path: Path) -> None:
    """While a run writes its step-2 checkpoint, a second ``vla train`` on its folder (a double submit) is refused
    with the holder's pid, and the first run's checkpoint in progress is left alone (before: the second launch
    removed it as a leftover and trained over the same steps). Once the first is killed, the folder resumes."""
    over = _args(wx)
    run = tmp_path / "run"
    second: list[Any] = []

    def launch_again() -> None:
        second.append(run_cli(["train", "debug", "--run-dir", str(run), *_sets(over)]))
        second.append(sorted(p.name for p in (run / CHECKPOINTS).iterdir()))

    kill_inside_checkpoint(
        ["train", "debug", "--run-dir", str(run), *_sets(over)], run, 2, while_stalled=launch_again
    )
    refused, names = second
    assert refused.returncode == 2 and "is in use by another training process (pid" in refused.stderr
    assert ".step-0000002.partial" in names
    assert train(load_train_config("debug", over), run).step == 4  # the kill released the folder


def test_a_second_run_in_the_same_process_on_a_held_folder_is_refused(wx: Path, tmp_path: Path) -> None:
    """POSIX locks do not exclude the process that holds them: a notebook or a sweep starting a second ``train()``
    on a folder its first one (a thread) still trains in was let through."""
    from vla.train.checkpoint import RunDirBusy, run_dir_lock

    run = tmp_path / "run"
    with run_dir_lock(run):
        with pytest.raises(RunDirBusy, match="in use by another training run in this process"):
            train(load_train_config("debug", [f"data.datasets=[{wx}]", "train.steps=1"]), run)
        assert not (run / "checkpoints").exists()
    with run_dir_lock(run):  # released on exit, refused or not
        pass


def test_a_run_folder_on_a_filesystem_without_locks_trains_unguarded_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NFSv3 without lockd answers ENOLCK, Lustre without flock ENOSYS: the run goes on (a warning says the folder
    is not guarded) instead of refusing to train where it used to."""
    import errno
    import fcntl

    from vla.train.checkpoint import run_dir_lock

    def no_locks(*args: Any) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with caplog.at_level(logging.WARNING), run_dir_lock(tmp_path / "run"):
        pass
    assert "cannot lock the run folder" in caplog.text


def test_a_relaunch_before_the_first_checkpoint_sets_the_killed_launchs_rows_aside(
    wx: Path, tmp_path: Path
) -> None:
    """Killed before its first checkpoint, a launch left rows for steps the relaunch trains again from step 0."""
    run = tmp_path / "run"
    run.mkdir()
    torn = '{"step": 1, "loss": 9.0}\n{"step": 2, "lo'  # a kill tore the last line
    (run / "metrics.jsonl").write_text(torn)
    train(load_train_config("debug", _args(wx, steps=2)), run)
    assert [r["step"] for r in metrics(run)] == [1, 2] and all(r["loss"] != 9.0 for r in metrics(run))
    assert (run / "metrics.rolled_back.jsonl").read_text() == torn + "\n"


@pytest.mark.parametrize(
    "variant", ["plain", "workers", "mixture"], ids=["0-workers", "2-workers", "two-dataset-mixture"]
)
def test_kill_inside_checkpoint_write_then_resume_is_bitwise_exact(
    variant: str, wx: Path, two_datasets: list[Path], tmp_path: Path
) -> None:
    """4 steps straight == 2 steps + SIGKILL inside step 4's checkpoint write + re-run, bit for bit."""
    extra = ["optim.warmup_steps=1"]
    if variant == "workers":
        extra.append("data.num_workers=2")
    if variant == "mixture":
        mix = mixture_file(tmp_path, two_datasets)
        over = [a for a in _args("x", *extra) if not a.startswith("data.datasets")] + [f"data.mixture={mix}"]
    else:
        over = _args(wx, *extra)
    straight = train(load_train_config("debug", over), tmp_path / "straight")
    assert straight.step == 4
    killed = tmp_path / "killed"
    kill_inside_checkpoint(["train", "debug", "--run-dir", str(killed), *_sets(over)], killed, step=4)
    assert [p.name for p in complete_steps(killed)] == ["step-0000002"]  # 4 never looked complete
    assert (killed / "checkpoints" / ".step-0000004.partial").is_dir()
    resumed = train(load_train_config("debug", over), killed)
    assert resumed.step == 4
    assert not (killed / "checkpoints" / ".step-0000004.partial").exists()  # cleaned on restart
    a, b = weights(straight.last_checkpoint), weights(resumed.last_checkpoint)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = json.loads((straight.last_checkpoint / "train_state" / "rank0.json").read_text())
    sb = json.loads((resumed.last_checkpoint / "train_state" / "rank0.json").read_text())
    assert sa == sb  # loader position (and mixture stream) identical
    ra, rb = (
        torch.load(r.last_checkpoint / "train_state" / "rng0.pt", weights_only=False)
        for r in (straight, resumed)
    )
    # the global torch RNG too (what a LoRA dropout draws from): the resumed loader's DataLoader draws nothing from it
    assert torch.equal(ra["torch"], rb["torch"])
    # python's and numpy's: seeded by train.seed at a fresh start, restored on resume
    assert ra["python"] == rb["python"] and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(ra["numpy"], rb["numpy"])
    )
    assert _optim_state(straight.last_checkpoint).keys() == _optim_state(resumed.last_checkpoint).keys()
    oa, ob = _optim_state(straight.last_checkpoint), _optim_state(resumed.last_checkpoint)
    assert all(torch.equal(oa[k], ob[k]) for k in oa)
    la = [r["loss"] for r in metrics(tmp_path / "straight")]
    # steps 1-2 of the killed process, then 3-4 of the resumed one: the killed one's 3-4, which the resume trains
    # again, are set aside (before: they stayed, and every plot showed steps 3-4 twice)
    assert [r["step"] for r in metrics(killed)] == [1, 2, 3, 4]
    assert la == [r["loss"] for r in metrics(killed)]
    rolled = [json.loads(line) for line in (killed / "metrics.rolled_back.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rolled if "loss" in r] == la[2:]


def _optim_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP train state (model, optimizer moments), by its flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir / "train_state" / "dcp"), str(out))
    state = torch.load(out, weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x: object) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(x, torch.Tensor):
            flat[prefix] = x

    walk("", state)
    assert any("exp_avg" in k for k in flat)
    return flat


def test_resume_refuses_incompatible_and_warns_on_compatible(
    wx: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    train(load_train_config("debug", _args(wx, steps=2)), run)
    with pytest.raises(ResumeError) as e:
        train(
            load_train_config("debug", _args(wx, "model.chunk_length=10", "data.batch_size=2", steps=3)), run
        )
    msg = str(e.value)
    assert "model.chunk_length: 8 -> 10" in msg and "global batch" in msg and "4 -> 2" in msg
    with caplog.at_level(logging.WARNING):
        result = train(load_train_config("debug", _args(wx, "logging.every=2", steps=3)), run)
    assert result.step == 3
    assert "train.steps: 2 -> 3" in caplog.text and "resumed from" in caplog.text


def test_resume_keeps_the_runs_norm_stats_when_the_datas_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The dataset's stats file is rewritten between launches (``vla data stats`` re-run): the resumed run keeps
    normalizing with its checkpoint's stats (its steps are bitwise those of a straight run on the old stats, its
    checkpoints carry the old stats) and warns naming what changed; fine-tuning from it takes the new stats."""
    ds = tiny_dataset(tmp_path / "data")
    straight = train(load_train_config("debug", _args(ds, steps=3)), tmp_path / "straight")
    run = tmp_path / "run"
    train(load_train_config("debug", _args(ds, steps=2)), run)
    stats_file = ds / "meta" / "vla_stats.json"
    drifted = json.loads(stats_file.read_text())
    action = drifted["stats"]["widowx_bridge"]["action"]
    for name in ("mean", "q01", "q99", "min", "max"):  # widowx actions are quantile-normalized
        action[name] = [v + 1.0 for v in action[name]]
    stats_file.write_text(json.dumps(drifted))
    with caplog.at_level(logging.WARNING):
        resumed = train(load_train_config("debug", _args(ds, steps=3)), run)
    assert "the data's norm stats differ from the run's for widowx_bridge/action;" in caplog.text
    a, b = weights(straight.last_checkpoint), weights(resumed.last_checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)
    kept = json.loads((resumed.last_checkpoint / "norm_stats.json").read_text())["stats"]
    assert kept == json.loads((straight.last_checkpoint / "norm_stats.json").read_text())["stats"]
    tuned = train(load_train_config("debug", _args(ds, steps=1)), tmp_path / "tuned", init_from=run)
    new = json.loads((tuned.last_checkpoint / "norm_stats.json").read_text())["stats"]
    assert new["widowx_bridge"]["action"]["q01"] == action["q01"]


def test_image_size_mismatch_is_an_error(wx: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data.image_size=32 but the model's vision tower reads 64 px"):
        train(load_train_config("debug", _args(wx, "data.image_size=32")), tmp_path / "r")


def test_ema_validation_and_wandb_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """EMA weights at the top level (raw ones in train_state), a validation loss on the dataset's val split,
    and a wandb run written offline into the run folder."""
    import wandb

    # the wandb service process (wandb-core) otherwise lives as long as this test process: under `make test` a
    # worker's leftover one was seen spinning a whole core for the rest of the suite
    request.addfinalizer(wandb.teardown)
    ds = tiny_dataset(tmp_path, "wx_val")
    info = ds / "meta" / "info.json"
    meta = json.loads(info.read_text())
    meta["splits"] = {"train": "0:3", "val": "3:4"}  # episode 3 held out
    info.write_text(json.dumps(meta))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    over = _args(ds, "ema.decay=0.5", "train.val_every=2", "train.val_batches=2", "logging.wandb=true")
    result = train(load_train_config("debug", over), run)
    vals = events(run, "validation")
    assert [v["step"] for v in vals] == [2, 4] and all(v["val_loss"] > 0 for v in vals)
    assert list((run / "wandb").glob("offline-run-*")), "no offline wandb run written"
    top = weights(result.last_checkpoint)
    raw = {
        k.removeprefix(".model."): v
        for k, v in _optim_state(result.last_checkpoint).items()
        if k.startswith(".model.")
    }
    trainable = [k for k in raw if k in top]
    assert trainable and any(not torch.equal(top[k], raw[k]) for k in trainable)  # EMA != raw weights


def test_held_out_episodes_are_the_validation_set(tmp_path: Path) -> None:
    """``data.val_episodes=1``: a dataset with only a train split loses its last episode to validation; training
    never sees it, validation sees nothing else."""
    from vla.config import DataConfig
    from vla.data.loader import build_loader

    ds = tiny_dataset(tmp_path, "wx_holdout")  # 4 episodes, train split only
    cfg = DataConfig(datasets=(str(ds),), batch_size=8, image_size=32, shuffle=False, val_episodes=1)
    trained = {e for batch in build_loader(cfg) for e in batch.meta["episode"]}
    val_cfg = dataclasses.replace(cfg, batch_size=2)  # 26 frames = 13 full batches
    held = [e for batch in build_loader(val_cfg, held_out=True, train=False) for e in batch.meta["episode"]]
    assert trained == {0, 1, 2} and held == [3] * 26  # episode 3 (26 frames), every frame once
    with pytest.raises(ValueError, match="val_episodes=4 would hold out every episode"):
        build_loader(DataConfig(datasets=(str(ds),), val_episodes=4))

    run = tmp_path / "run"
    train(
        load_train_config(
            "debug", _args(ds, "data.val_episodes=1", "train.val_every=2", "train.val_batches=1")
        ),
        run,
    )
    vals = events(run, "validation")
    assert [v["step"] for v in vals] == [2, 4] and all(v["val_loss/widowx_bridge"] > 0 for v in vals)


def test_fsdp2_memory_plan_counts_unsharded_gradients_under_gradient_accumulation() -> None:
    """FSDP2 with gradient sync off between micro-batches keeps every unsharded float32 gradient (4 B/trainable
    parameter, not divided by the GPUs); the working set is the two largest units gathered plus the largest
    unit's gradient."""
    from vla.train.plan import memory_plan

    units = [(600, 600), (100, 100), (50, 0)]
    one = memory_plan(1000, 800, gpus=8, strategy="fsdp2", ema=False, units=units, gathered_bytes=2)
    two = memory_plan(
        1000, 800, gpus=8, strategy="fsdp2", ema=False, units=units, gathered_bytes=2, grad_accum=2
    )
    assert one.working_set == 2 * (600 + 100) + 4 * 600 and one.accumulated_grads == 0
    assert two.accumulated_grads == 4 * 800 and two.total == one.total + 4 * 800


def test_a_run_needs_a_run_folder(capsys: pytest.CaptureFixture[str]) -> None:
    from vla.cli import main

    assert main(["train", "debug"]) == 2
    assert "--run-dir DIR is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    "preset", ["oxe_magic_soup_smolvlm2_500m", "oxe_droid_sim_smolvlm2_500m", "droid_paligemma2_3b"]
)
def test_real_backbone_presets_build_on_meta_and_report_counts(preset: str) -> None:
    """The cluster presets cannot run here (no weights), but they parse, build on the meta device from the
    published HF configs, and report parameter counts and a memory plan (`vla train PRESET --dry-run`)."""
    r = run_cli(["train", preset, "--dry-run", "--gpus", "8"])  # the README's command: no run folder needed
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout)
    counts = plan["parameters"]
    if "smolvlm2" in preset:  # SmolVLM2-500M: SigLIP-B/16 at 512 px + 16 of SmolLM2's 32 layers, frozen
        assert 95e6 < counts["vision"]["total"] < 100e6 and 190e6 < counts["language"]["total"] < 210e6
        assert counts["vision"]["trainable"] == counts["language"]["trainable"] == 0
        assert 95e6 < counts["expert"]["trainable"] < 105e6  # 720 wide x 16 layers, as SmolVLA's expert
        # bf16 presets: the frozen backbone's Linear/Conv weights held in bf16 under DDP (train.frozen_bf16)
        held = plan["frozen_params_held_in_bf16"]
        assert 0.8 * (95e6 + 190e6) < held < counts["all"]["total"] - counts["all"]["trainable"]
        gib = (4 * counts["all"]["total"] - 2 * held) / 2**30
        assert plan["memory_per_gpu_gib"][0]["weights"] == pytest.approx(gib, abs=0.01)
    else:  # PaliGemma2-3B: SigLIP So400m + Gemma2-2B (26 layers), trained end to end
        assert 410e6 < counts["vision"]["total"] < 420e6 and 2.5e9 < counts["language"]["total"] < 2.6e9
        assert counts["all"]["trainable"] == counts["all"]["total"]
        assert plan["frozen_params_held_in_bf16"] == 0  # nothing frozen
        # FSDP2's largest unit is the 256k x 2304 token embedding, not a decoder layer (the plan counted only layers)
        assert 580e6 < plan["largest_fsdp2_unit_params"] < 600e6
    ddp, fsdp = plan["memory_per_gpu_gib"]
    assert fsdp["total_gib"] < ddp["total_gib"] / 4  # sharded over 8 GPUs
    assert len(plan["embodiments"]) >= 1


def test_prune_keeps_the_newest_and_milestones_and_clean_removes_partials(tmp_path: Path) -> None:
    from vla.train.checkpoint import clean_partials, prune

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8, 10):
        (root / f"step-{step:07d}").mkdir(parents=True)
        (root / f"step-{step:07d}" / "COMPLETE").write_text("{}")
    (root / "step-0000012").mkdir()  # no marker: an interrupted write, never counted nor pruned
    leftovers = [
        ".step-0000014.partial",
        ".step-0000016.deleting",
        # save_pretrained's staging copies of the model written into a partial step (killed inside the write)
        "..step-0000014.partial.tmp-k2_x9abc",
        "..step-0000014.partial.old-0q1w2e3r",
    ]
    for name in leftovers:
        (root / name).mkdir()
    # not ours: kept
    (root / ".notes").mkdir()
    (root / "..step-0000014.partial.tmp-nope").mkdir()
    removed = prune(tmp_path, keep_last=2, keep_every=4)
    assert sorted(p.name for p in removed) == ["step-0000002", "step-0000006"]
    assert [p.name for p in complete_steps(tmp_path)] == ["step-0000004", "step-0000008", "step-0000010"]
    assert [p.name for p in clean_partials(tmp_path)] == sorted(leftovers)
    assert sorted(p.name for p in root.iterdir()) == [
        "..step-0000014.partial.tmp-nope",
        ".notes",
        "step-0000004",
        "step-0000008",
        "step-0000010",
        "step-0000012",
    ]
    with pytest.raises(FileNotFoundError, match="no COMPLETE marker"):
        resolve_checkpoint(root / "step-0000012")


def test_resolve_checkpoint_refuses_what_is_not_a_complete_checkpoint_however_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every reader (model info, predict, serve, finetune's base) goes through ``resolve_checkpoint``. Before, a step
    folder typed relative to ``checkpoints/`` skipped its marker check, and a hidden leftover of a killed write
    passed as a plain checkpoint folder: a fine-tune trained a whole run on a half-written base."""
    run = tmp_path / "run"
    root = run / CHECKPOINTS
    (root / "step-0000004").mkdir(parents=True)  # no COMPLETE marker
    for name in (".step-0000006.partial", "..step-0000006.partial.tmp-k2_x9abc"):
        (root / name).mkdir()
    monkeypatch.chdir(root)
    for written in ("step-0000004", "./step-0000004/", "../checkpoints/step-0000004"):
        with pytest.raises(FileNotFoundError, match="no COMPLETE marker"):
            resolve_checkpoint(written)
    for name in (".step-0000006.partial", "..step-0000006.partial.tmp-k2_x9abc"):
        with pytest.raises(FileNotFoundError, match=f"left by an interrupted checkpoint write.*{run}"):
            resolve_checkpoint(root / name)
    (root / "step-0000004" / "COMPLETE").write_text("{}")
    assert resolve_checkpoint("step-0000004") == root.resolve() / "step-0000004"
    # a run folder before its first checkpoint, a file, a missing path: each named for what it is
    early = tmp_path / "early"
    early.mkdir()
    (early / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="a training run folder with no checkpoint yet"):
        resolve_checkpoint(early)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="a file, not a checkpoint folder"):
        resolve_checkpoint(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        resolve_checkpoint(tmp_path / "nope")
    assert resolve_checkpoint("HuggingFaceTB/SmolVLM2-500M-Video-Instruct") == Path(
        "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    )  # a hub id, looked up by from_pretrained


def test_a_kill_while_the_model_is_staged_leaves_nothing_after_the_next_start(
    wx: Path, tmp_path: Path
) -> None:
    """SIGKILL inside ``save_pretrained`` (the model staged under its hidden ``..step-X.partial.tmp-*`` name next to
    the partial step): the next start removes the staging copy as well as the partial step."""
    run = tmp_path / "run"
    over = _args(wx, steps=1, save_every=1)
    env = cli_env()
    env["VLA_TEST_KILL_AT"] = "hub.staged:1"
    r = run_cli(["train", "debug", "--run-dir", str(run), *_sets(over)], env=env)
    assert r.returncode == -9, r.stderr[-3000:]
    root = run / CHECKPOINTS
    assert any(p.name.startswith("..step-0000001.partial.tmp-") for p in root.iterdir()), list(root.iterdir())
    # a run that never writes step 1 again (save_pretrained itself only clears leftovers of the folder it writes)
    result = train(load_train_config("debug", _args(wx, steps=2, save_every=2)), run)
    assert result.step == 2
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002"]


def test_gradient_accumulation_equals_the_larger_batch(wx: Path, tmp_path: Path) -> None:
    """2 micro-batches of 2 per step compute the same steps as batches of 4: the loss is the masked mean over the
    whole global batch and flow noise is drawn per sample."""
    big = train(
        load_train_config("debug", _args(wx, "data.batch_size=4", steps=3, save_every=3)), tmp_path / "a"
    )
    acc = train(
        load_train_config(
            "debug", _args(wx, "data.batch_size=2", "train.grad_accum=2", steps=3, save_every=3)
        ),
        tmp_path / "b",
    )
    la, lb = [r["loss"] for r in metrics(tmp_path / "a")], [r["loss"] for r in metrics(tmp_path / "b")]
    assert lb == pytest.approx(la, rel=1e-5)
    wa, wb = weights(big.last_checkpoint), weights(acc.last_checkpoint)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=k)


def test_resume_trading_batch_size_for_accumulation_continues_the_same_samples(
    wx: Path, tmp_path: Path
) -> None:
    """2 steps of batch 4, then resumed as 2 micro-batches of 2 (the same global batch) with gradient checkpointing
    switched on: the loader's position converts to the new batch size (the same samples follow), so the steps equal
    4 straight steps of batch 4; the checkpointing setting reaches the layers and the saved config."""
    from vla.models.attention import SharedKVLayer
    from vla.models.hub import from_pretrained

    straight = train(load_train_config("debug", _args(wx, "data.batch_size=4", steps=4)), tmp_path / "a")
    run = tmp_path / "b"
    train(load_train_config("debug", _args(wx, "data.batch_size=4", steps=2)), run)
    over = ["data.batch_size=2", "train.grad_accum=2", "model.backbone.gradient_checkpointing=true"]
    resumed = train(load_train_config("debug", _args(wx, *over, steps=4)), run)
    la, lb = [r["loss"] for r in metrics(tmp_path / "a")], [r["loss"] for r in metrics(run)]
    assert lb == pytest.approx(la, rel=1e-5)
    wa, wb = weights(straight.last_checkpoint), weights(resumed.last_checkpoint)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=k)
    model = from_pretrained(resumed.last_checkpoint)
    assert model.cfg.backbone.gradient_checkpointing
    layers = [m for m in model.modules() if isinstance(m, SharedKVLayer)]
    assert layers and all(m.checkpoint_activations for m in layers)


def test_bf16_run_records_and_resume_pins_its_attention_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CPU bf16 attention kernels a run measured go into trainer.json (rank 0's) and each rank's own record; a
    resumed run keeps its rank's record (ranks measure apart), or trainer.json's where there is none (an older
    checkpoint, or another world size). On a CPU that emulates bf16 the run warns (and still trains)."""
    import vla.runtime
    from vla.models import attention

    ds = tiny_dataset(tmp_path, "wx_bf16")
    run = tmp_path / "run"
    monkeypatch.setattr(vla.runtime, "_bf16_slowdown", 80.0)  # as measured on an AVX2-only AMD EPYC
    with caplog.at_level("WARNING", logger="vla.train.trainer"):
        first = train(
            load_train_config("debug", _args(ds, "train.precision=bf16", steps=2, save_every=2)), run
        )
    assert any("without bf16 units" in r.getMessage() and "80x" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(vla.runtime, "_bf16_slowdown", 0.4)  # bf16 units (AMX / AVX-512 BF16): no warning
    caplog.clear()
    ts = first.last_checkpoint / "train_state"
    chosen = json.loads((ts / "trainer.json").read_text())["cpu_bf16_attention"]
    assert chosen and set(chosen.values()) <= set(attention.KERNELS), chosen
    assert json.loads((ts / "attention0.json").read_text()) == chosen
    ks = attention.KERNELS
    flip = lambda c: {k: ks[(ks.index(v) + 1) % len(ks)] for k, v in c.items()}  # noqa: E731
    # the rank's record, flipped: the resumed run must take it over rather than measure again
    (ts / "attention0.json").write_text(json.dumps(flip(chosen)))
    with caplog.at_level("WARNING", logger="vla.train.trainer"):
        second = train(
            load_train_config("debug", _args(ds, "train.precision=bf16", steps=3, save_every=3)), run
        )
    assert not any("without bf16 units" in r.getMessage() for r in caplog.records)
    assert attention.cpu_bf16_kernel_choices() == flip(chosen)
    # no rank record (a checkpoint from before them): trainer.json's applies
    ts = second.last_checkpoint / "train_state"
    (ts / "attention0.json").unlink()
    meta = json.loads((ts / "trainer.json").read_text())
    assert meta["cpu_bf16_attention"] == flip(chosen)
    (ts / "trainer.json").write_text(json.dumps({**meta, "cpu_bf16_attention": flip(flip(chosen))}))
    train(load_train_config("debug", _args(ds, "train.precision=bf16", steps=4, save_every=4)), run)
    assert attention.cpu_bf16_kernel_choices() == flip(flip(chosen))


def test_a_kernel_pinned_by_the_environment_is_recorded_and_kept_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """VLA_CPU_BF16_ATTENTION's kernel goes into trainer.json like a measured one; a resume under another value
    keeps the checkpoint's kernel (bitwise resume) and says so; a bad value fails before any step."""
    from vla.models import attention

    ds = tiny_dataset(tmp_path, "wx_env")
    run = tmp_path / "run"
    monkeypatch.setenv(attention.KERNEL_ENV, "explicit")
    first = train(load_train_config("debug", _args(ds, "train.precision=bf16", steps=2, save_every=2)), run)
    meta = json.loads((first.last_checkpoint / "train_state" / "trainer.json").read_text())
    assert meta["cpu_bf16_attention"] == {"pinned": "explicit"}
    calls = count_attention_kernels(monkeypatch)
    monkeypatch.setenv(attention.KERNEL_ENV, "sdpa")
    with caplog.at_level("WARNING", logger="vla.models.attention"):
        second = train(
            load_train_config("debug", _args(ds, "train.precision=bf16", steps=3, save_every=3)), run
        )
    assert calls["explicit"] > 0 and calls["sdpa"] == calls["sdpa_fp32"] == 0, calls
    assert "VLA_CPU_BF16_ATTENTION=sdpa ignored" in caplog.text
    meta = json.loads((second.last_checkpoint / "train_state" / "trainer.json").read_text())
    assert meta["cpu_bf16_attention"] == {"pinned": "explicit"}
    monkeypatch.setenv(attention.KERNEL_ENV, "flash")
    with pytest.raises(ValueError, match=r"VLA_CPU_BF16_ATTENTION='flash': must be one of"):
        train(load_train_config("debug", _args(ds, steps=1, save_every=1)), tmp_path / "bad")
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_layout_missing_from_a_resumed_record_is_recorded_and_fp32_records_no_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resuming from a measured record that lacks a head layout, with VLA_CPU_BF16_ATTENTION set, runs that layout
    with the variable's kernel and records it beside the record's own, so a later resume keeps it too; an fp32 run
    uses no bf16 CPU attention and records none, whatever the variable says."""
    from vla.models import attention

    ds = tiny_dataset(tmp_path, "wx_layouts")
    run = tmp_path / "run"
    monkeypatch.delenv(attention.KERNEL_ENV, raising=False)
    first = train(load_train_config("debug", _args(ds, "train.precision=bf16", steps=2, save_every=2)), run)
    meta_file = first.last_checkpoint / "train_state" / "trainer.json"
    meta = json.loads(meta_file.read_text())
    chosen = meta["cpu_bf16_attention"]
    assert chosen and "pinned" not in chosen, chosen
    # the tiny model's backbone and expert share one layout: the record keeps another, invented one instead
    dropped = sorted(chosen)[0]
    kept = {**{k: v for k, v in chosen.items() if k != dropped}, "3x1x8": "sdpa"}
    meta_file.write_text(json.dumps({**meta, "cpu_bf16_attention": kept}))
    (meta_file.parent / "attention0.json").write_text(json.dumps(kept))  # the rank's own record, which wins
    monkeypatch.setenv(attention.KERNEL_ENV, "explicit")
    second = train(load_train_config("debug", _args(ds, "train.precision=bf16", steps=3, save_every=3)), run)
    meta = json.loads((second.last_checkpoint / "train_state" / "trainer.json").read_text())
    assert meta["cpu_bf16_attention"] == {**kept, dropped: "explicit"}

    # in the same process, after the bf16 runs (as the demo runs pretraining and fine-tunes): nothing carried over
    fp32 = train(load_train_config("debug", _args(ds, steps=1, save_every=1)), tmp_path / "fp32")
    meta = json.loads((fp32.last_checkpoint / "train_state" / "trainer.json").read_text())
    assert meta["cpu_bf16_attention"] == {}


def test_bf16_holds_frozen_weights_in_bf16_with_bitwise_the_same_losses(
    wx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.frozen_bf16`` (on by default): under bf16 autocast the frozen vision tower's Linear/Conv weights are
    stored in bf16, the values autocast rounds them to at every call. The losses and the trained weights are bit for
    bit those of the float32-held run; the checkpoint stays float32, its frozen weights rounded to bf16 once."""
    from vla.models import attention
    from vla.train.model_setup import held_in_float32, hold_frozen_in_bf16

    # two runs compared bit for bit: one bf16 attention kernel for both (each run would measure its own)
    monkeypatch.setenv(attention.KERNEL_ENV, "sdpa_fp32")
    runs = {}
    for hold in (False, True):
        over = (
            "model.backbone.freeze_vision=true",
            "train.precision=bf16",
            f"train.frozen_bf16={str(hold).lower()}",
        )
        runs[hold] = train(
            load_train_config("debug", _args(wx, *over, steps=3, save_every=3)), tmp_path / str(hold)
        )
    assert [r["loss"] for r in metrics(tmp_path / "True")] == [r["loss"] for r in metrics(tmp_path / "False")]
    plain, rounded = weights(runs[False].last_checkpoint), weights(runs[True].last_checkpoint)
    changed = [k for k in plain if not torch.equal(plain[k], rounded[k])]
    frozen = ("backbone.vision.", "backbone.projector.")  # what freeze_vision freezes
    assert changed and all(k.startswith(frozen) for k in changed), changed
    assert all(v.dtype == torch.float32 for v in rounded.values())
    # rounded to bf16 once; every other tensor, the trained ones included, is bit for bit equal
    for k in changed:
        torch.testing.assert_close(rounded[k], plain[k].to(torch.bfloat16).float(), rtol=0, atol=0, msg=k)
    # the helper itself: trainable and tied layers keep float32; saving restores float32 exactly, then bf16 again
    lin, tied, emb = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False), torch.nn.Embedding(4, 4)
    still = torch.nn.Linear(4, 4).requires_grad_(False)
    tied.weight = emb.weight
    tied.requires_grad_(False)
    model = torch.nn.ModuleList([lin, still, tied, emb])
    held = hold_frozen_in_bf16(model)
    assert held == [still] and still.weight.dtype == torch.bfloat16
    assert lin.weight.dtype == tied.weight.dtype == torch.float32
    before = still.weight.detach().clone()
    with held_in_float32(held):
        assert still.weight.dtype == torch.float32 and torch.equal(still.weight.bfloat16(), before)
    assert still.weight.dtype == torch.bfloat16 and torch.equal(still.weight, before)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_frozen_backbone_matches_eager_and_resumes_bitwise(
    wx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    """``train.compile``: with the whole backbone frozen, its vision tower and language layers run as compiled
    graphs (frozen weights; in bf16 over the bf16-held weights, through checkpoint saves). Every step runs them;
    the losses follow the eager run's; the decision and its reason are logged and kept in the checkpoint; 4 steps
    straight equal a run stopped after its step-2 checkpoint, resumed, bit for bit, the resumed run taking the
    checkpoint's decision over ``auto`` (which alone would stay eager in so short a run). Two language and expert
    layers (of the tiny model's four): a stack, at half the compile time (Inductor's lowering, the bulk of this
    test's minutes on a slow CPU, grows with the graph)."""
    import vla.train.trainer
    from vla.models import attention
    from vla.models.compiled import frozen_compile

    # separate runs compared bit for bit: one bf16 attention kernel for all (each run would measure its own)
    monkeypatch.setenv(attention.KERNEL_ENV, "sdpa_fp32")
    frozen = ("model.backbone.freeze_vision=true", "model.backbone.freeze_language=true")
    frozen += (f"train.precision={precision}", "model.backbone.num_vlm_layers=2", "model.expert.num_layers=2")
    ran: list[str] = []

    def counted(fn: Any, **kwargs: Any) -> Any:
        graph = frozen_compile(fn, **kwargs)
        return lambda *args: ran.append(fn.__name__) or graph(*args)

    monkeypatch.setattr(vla.train.trainer, "frozen_compile", counted)

    def run(name: str, *over: str, steps: int = 4) -> Any:
        cfg = load_train_config("debug", _args(wx, *frozen, *over, steps=steps, save_every=2))
        return train(cfg, tmp_path / name)

    run("eager", "train.compile=never")
    straight = run("straight", "train.compile=always")
    (event,) = events(tmp_path / "straight", "compile")
    assert event["parts"] == ["vision", "language"] and event["compiled"]
    # every step ran the graphs (one call each per prefix), after the call that compiled them
    assert ran.count("encode_pixels") == ran.count("run_layers") >= 1 + 4
    meta = json.loads((straight.last_checkpoint / "train_state" / "trainer.json").read_text())
    assert meta["compile_frozen"]["compiled"] and meta["compile_frozen"]["reason"] == "train.compile=always"
    losses = {n: [r["loss"] for r in metrics(tmp_path / n)] for n in ("eager", "straight")}
    # fused kernels round differently: within 1e-4 in fp32, 2e-3 in bf16 (bf16's own precision is 4e-3)
    assert losses["straight"] == pytest.approx(losses["eager"], rel=1e-4 if precision == "fp32" else 2e-3)
    (never,) = events(tmp_path / "eager", "compile")
    assert not never["compiled"] and never["reason"] == "train.compile=never"
    # the straight run as if stopped after its step-2 checkpoint: that checkpoint and the log up to it
    stopped = tmp_path / "resumed"
    step2 = step_dir_name(2)
    shutil.copytree(straight.last_checkpoint.parent / step2, stopped / CHECKPOINTS / step2)
    shutil.copy(tmp_path / "straight" / "config.yaml", stopped / "config.yaml")
    log = (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (stopped / "metrics.jsonl").write_text("".join(x for x in log if json.loads(x)["step"] <= 2))
    # 2 steps left: auto alone would not compile; the checkpoint's choice wins
    run("resumed", "train.compile=auto")
    first, again = events(stopped, "compile")
    assert first["compiled"] and again["compiled"] and again["reason"] == "the resumed checkpoint's choice"
    a, b = weights(straight.last_checkpoint), weights(latest_complete(stopped))
    assert latest_complete(stopped).name == "step-0000004"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in metrics(stopped)] == losses["straight"]  # 2 logged before the stop, 2 after


def test_auto_compile_measures_and_a_failed_compile_trains_eagerly(
    wx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.compile=auto`` (its step threshold lowered for the test) times eager and compiled on the first batch
    and keeps the graphs only when they win by the margin; when compiling fails, ``auto`` trains eagerly and says
    why, ``always`` stops with an error naming the setting."""
    import vla.train.trainer
    from vla.train.config import AUTO_COMPILE_MARGIN

    monkeypatch.setattr(vla.train.trainer, "AUTO_COMPILE_MIN_STEPS", 1)
    frozen = ("model.backbone.freeze_vision=true", "model.backbone.freeze_language=true")

    train(load_train_config("debug", _args(wx, *frozen, steps=2, save_every=2)), tmp_path / "auto")
    (event,) = events(tmp_path / "auto", "compile")
    assert event["reason"] == "measured" and event["eager_ms"] > 0 and event["compiled_ms"] > 0
    assert event["compiled"] == (event["compiled_ms"] < (1 - AUTO_COMPILE_MARGIN) * event["eager_ms"])

    def broken(fn: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no graph for you")

    monkeypatch.setattr(vla.train.trainer, "frozen_compile", broken)
    done = train(load_train_config("debug", _args(wx, *frozen, steps=2, save_every=2)), tmp_path / "fallback")
    (event,) = events(tmp_path / "fallback", "compile")
    assert (
        not event["compiled"] and "no graph for you" in event["reason"] and done.last_checkpoint is not None
    )
    with pytest.raises(
        RuntimeError, match=r"train\.compile=always: compiling the frozen vision\+language failed"
    ):
        train(
            load_train_config("debug", _args(wx, *frozen, "train.compile=always", steps=2, save_every=2)),
            tmp_path / "always",
        )


def test_an_fsdp_launch_config_with_a_ddp_preset_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``accelerate launch --config_file configs/accelerate/fsdp2.yaml`` with a preset that says ddp: before,
    accelerate refused deep inside with "FSDP2 preparation should be done via accelerate.prepare()"."""
    from vla.train.config import DistributedConfig
    from vla.train.distributed import Runtime

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match=r"distributed\.strategy=ddp .*--set distributed\.strategy=fsdp2"):
        Runtime.start(DistributedConfig(strategy="ddp"))


# ---- stopping early (vla.train.stop) -------------------------------------------------------------------------
def _launch_and_stop(
    wx: Path, run: Path, stop: Callable[[subprocess.Popen], None], *extra: str
) -> tuple[int, str, int]:
    """``vla train debug`` (400 steps, a checkpoint only at the end: far more than a stop takes to be seen, even
    on a fast machine) in its own process group, ``stop(proc)`` once it has logged step 3; returns (exit status,
    stdout, the step it stopped at)."""
    over = _args(wx, "optim.warmup_steps=1", *extra, steps=400, save_every=1000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vla.cli", "train", "debug", "--run-dir", str(run), *_sets(over)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(), cwd=REPO,
        start_new_session=True,  # a group of its own: the test signals it as a scheduler signals a job
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or len(metrics(run)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        stop(proc)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = events(run, "stopped")
    assert len(stopped) == 1, out[-3000:]
    return proc.returncode, out, stopped[0]["step"]


@pytest.mark.parametrize("how", ["sigterm_to_the_group", "stop_file"])
def test_a_stopped_run_writes_a_checkpoint_at_its_step_and_resumes_there(
    wx: Path, tmp_path: Path, how: str
) -> None:
    """SIGTERM to every process of the run (a scheduler's time limit, with 2 loader workers, which must not take the
    run down with them), or ``touch RUN/STOP``: the step in progress ends, a checkpoint is written at that step, and
    the relaunch goes on from it. Before: SIGTERM killed the run, losing every step since its last checkpoint."""
    run = tmp_path / "run"

    def sigterm(proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGTERM)

    def stop_file(proc: subprocess.Popen) -> None:
        (run / "STOP").touch()

    rc, out, step = _launch_and_stop(
        wx, run, sigterm if how == "sigterm_to_the_group" else stop_file, "data.num_workers=2"
    )
    assert rc == (143 if how == "sigterm_to_the_group" else 0), out[-3000:]
    assert 3 <= step < 400 and f"stopped at step {step}" in out and "Traceback" not in out, out[-3000:]
    assert [p.name for p in complete_steps(run)] == [step_dir_name(step)]
    assert not (run / "STOP").exists()  # removed: the relaunch trains on
    end = step + 3  # the relaunch trains a few more (a shorter schedule: a compatible change, warned)
    over = _args(wx, "optim.warmup_steps=1", steps=end, save_every=1000)
    r = run_cli(["train", "debug", "--run-dir", str(run), *_sets(over)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert events(run, "resume")[-1]["step"] == step and latest_complete(run).name == step_dir_name(end)
    assert [row["step"] for row in metrics(run)] == list(range(1, end + 1))  # each step once


def test_a_stop_file_left_from_before_is_removed_at_start(wx: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "STOP").touch()
    r = run_cli(["train", "debug", "--run-dir", str(run), *_sets(_args(wx, steps=2, save_every=2))])
    assert r.returncode == 0 and "removed a STOP file left from before this launch" in r.stderr, r.stderr[
        -3000:
    ]
    assert latest_complete(run).name == "step-0000002" and not events(run, "stopped")


@pytest.mark.parametrize("outcome", ["stopped", "finished"])
def test_the_slurm_script_asks_the_run_to_stop_before_the_time_limit_and_requeues(
    tmp_path: Path, outcome: str
) -> None:
    """``scripts/slurm/pretrain.sbatch`` under a stand-in SLURM (``srun`` and ``scontrol`` on PATH): the signal
    SLURM sends ahead of the time limit (USR1, ``--signal=B:USR1@600``) creates RUN_DIR/STOP while the step runs;
    a run that then stopped (its last metrics row the "stopped" event) is requeued, one that finished is not."""
    bin_dir, run = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    run.mkdir()
    log = tmp_path / "calls.txt"
    last_row = (
        {"step": 3, "event": "stopped"} if outcome == "stopped" else {"step": 10, "event": "checkpoint"}
    )
    # srun: record its arguments, wait for the STOP file, remove it and end the way vla train does
    srun = [
        "#!/bin/bash",
        f'echo "srun $*" >> {log}',
        f"for i in $(seq 300); do [ -e {run}/STOP ] && rm {run}/STOP && break; sleep 0.1; done",
        f"echo '{json.dumps(last_row)}' >> {run}/metrics.jsonl",
        "exit 0",
    ]
    (bin_dir / "srun").write_text("\n".join(srun) + "\n")
    scontrol = [
        "#!/bin/bash",
        f'echo "scontrol $*" >> {log}',
        '[ "$1" = show ] && echo node-a && echo node-b',
        "exit 0",
    ]
    (bin_dir / "scontrol").write_text("\n".join(scontrol) + "\n")
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "96"}  # fmt: skip
    script = REPO / "scripts" / "slurm" / "pretrain.sbatch"
    proc = subprocess.Popen(
        ["bash", str(script), "debug", str(run), "--set", "train.steps=10"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (log.is_file() and "srun" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # SLURM, 10 minutes before the limit
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    calls = log.read_text()
    assert "--cpus-per-task=96" in calls and "--rdzv-endpoint node-a:24242" in calls
    assert "-m vla.cli train debug --run-dir" in calls and "--set train.steps=10" in calls
    assert "asking the run to stop" in out, out
    assert ("scontrol requeue 4242" in calls) == (outcome == "stopped"), (calls, out)


def test_a_sigterm_during_a_scheduled_checkpoint_stops_on_that_checkpoint(wx: Path, tmp_path: Path) -> None:
    """SIGTERM while step 5's checkpoint is written (held open by the test hook): the run stops on that checkpoint
    instead of training one more step and writing a second one (before: step 6 written too, twice the write in a
    scheduler's grace period)."""
    run = tmp_path / "run"
    over = _args(wx, "optim.warmup_steps=1", steps=300, save_every=5)
    env = {**cli_env(), "VLA_TEST_CHECKPOINT_STALL": "4", "VLA_TEST_CHECKPOINT_STALL_STEP": "5"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vla.cli", "train", "debug", "--run-dir", str(run), *_sets(over)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run / CHECKPOINTS / ".step-0000005.partial").is_dir():  # step 5's write, held for 4 s
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-3000:]
    assert [e["step"] for e in events(run, "stopped")] == [5], out[-3000:]
    assert [p.name for p in complete_steps(run)] == ["step-0000005"]
    assert [row["step"] for row in metrics(run)] == [1, 2, 3, 4, 5]


def test_stop_requests_keep_a_stop_file_made_during_start_up_and_take_repeated_sigterms_as_one(
    tmp_path: Path,
) -> None:
    """A STOP file created after the launch began (during a start-up that takes minutes on a cluster) is obeyed,
    one older than the launch is removed; SIGTERMs milliseconds apart (the scheduler's to every process, torchrun's
    forwarded one) are one request, not "stop at once" (before: the second killed the run inside its stop
    checkpoint)."""
    from vla.train import stop as stop_mod

    stop_file = tmp_path / "STOP"
    stop_file.touch()
    os.utime(stop_file, (time.time() - 3600,) * 2)  # from an earlier launch
    stop_mod.mark_launch()
    with stop_mod.StopRequests(tmp_path, is_main=True, all_true=lambda ok: ok) as stop:
        assert not stop_file.exists() and stop.check() is None
    stop_mod.mark_launch()
    stop_file.touch()  # during this launch's start-up
    with stop_mod.StopRequests(tmp_path, is_main=True, all_true=lambda ok: ok) as stop:
        assert stop_file.exists() and stop.check() == f"{stop_file} exists"
        stop.done()
    assert not stop_file.exists()
    with stop_mod.StopRequests(tmp_path, is_main=True, all_true=lambda ok: ok) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the same request by a second path: this process lives on
        assert stop.check() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is not stop._on_sigterm  # restored


def test_a_wandb_failure_mid_run_turns_wandb_off_instead_of_stopping_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """wandb's service process killed by a job-wide signal made every later ``log`` raise ConnectionResetError,
    which ended the run without its stop checkpoint; now one warning, and metrics.jsonl keeps every row."""
    from vla.train.config import LoggingConfig
    from vla.train.logger import MetricsLogger

    class LostService:
        def log(self, *args: Any, **kwargs: Any) -> None:
            raise ConnectionResetError("Connection lost")

        def finish(self) -> None:
            raise ConnectionResetError("Connection lost")

    logger = MetricsLogger(
        LoggingConfig(progress=False), tmp_path, enabled=True, total_steps=3, start_step=0, config={}
    )
    logger._wandb = LostService()
    with caplog.at_level(logging.WARNING):
        logger.log(1, {"loss": 1.0})
        logger.log(2, {"loss": 0.5})
        logger.event(2, "checkpoint", path="x")
        logger.close()
    assert caplog.text.count("wandb failed (ConnectionResetError") == 1
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


def test_rank0_failing_to_take_the_folder_for_any_reason_tells_the_other_ranks(tmp_path: Path) -> None:
    """Not only a busy folder: one that cannot be created or written (EACCES, a full disk) also reaches the other
    ranks through the agreement, instead of leaving them in it until the collective's timeout."""
    from vla.train.checkpoint import RunDirBusy, run_dir_lock

    (tmp_path / "a_file").write_text("")
    told: list[bool] = []

    def agree(ok: bool) -> bool:
        told.append(ok)
        return ok

    with pytest.raises(OSError), run_dir_lock(tmp_path / "a_file" / "run", rank=0, agree=agree):
        pass
    assert told == [False]
    other_rank = run_dir_lock(tmp_path / "run", rank=1, agree=lambda ok: False)
    with pytest.raises(RunDirBusy, match="rank 0 could not take the run folder"), other_rank:
        pass


def test_a_shared_filesystem_error_looking_for_the_stop_file_does_not_leave_rank0_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ESTALE/EIO from an NFS or Lustre hiccup while rank 0 looks for the STOP file: a warning and "no file", so
    rank 0 still joins the step's all-reduce (before: it raised out of the check, the others waited for it)."""
    import errno

    from vla.train import stop as stop_mod

    def stale(self: Path, *args: Any, **kwargs: Any) -> bool:
        raise OSError(errno.ESTALE, "Stale file handle")

    with stop_mod.StopRequests(tmp_path, is_main=True, all_true=lambda ok: ok) as stop:
        monkeypatch.setattr(Path, "exists", stale)
        with caplog.at_level(logging.WARNING):
            assert stop.check() is None
        monkeypatch.undo()
    assert "cannot look for the STOP file" in caplog.text


def test_logged_losses_are_means_over_the_logging_window(wx: Path, tmp_path: Path) -> None:
    """With logging.every=2 each row's loss is the mean of its two steps' losses (the same run logged every step
    gives them); a single step's loss, logged before, is noise."""
    rows = {}
    for every in (1, 2):
        run = tmp_path / f"every{every}"
        over = _args(wx, "optim.warmup_steps=1", f"logging.every={every}", steps=4, save_every=4)
        assert train(load_train_config("debug", over), run).step == 4
        rows[every] = {r["step"]: r for r in metrics(run)}
    assert sorted(rows[2]) == [2, 4]
    for step in (2, 4):
        for key in [k for k in rows[2][step] if k == "loss" or k.startswith("loss/")]:
            want = (rows[1][step - 1][key] + rows[1][step][key]) / 2
            assert rows[2][step][key] == pytest.approx(want, rel=1e-6), (step, key)


def test_cuda_rng_state_is_one_device_and_resumes_on_fewer_gpus(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank saves its own GPU's generator, restored onto the resuming rank's GPU. Before, every visible GPU's
    state was saved (``get_rng_state_all``: 8 under the SLURM script) and ``set_rng_state_all`` indexed
    ``default_generators`` by each, an IndexError on a node with fewer GPUs or ``CUDA_VISIBLE_DEVICES=0``.
    (torch.cuda is stood in for: this machine has no GPU; the states are opaque byte tensors to this code.)"""
    from vla.train import checkpoint as ckpt

    per_device = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(8)}
    restored: list[tuple[int, int]] = []

    def get_state(device: torch.device) -> torch.Tensor:
        return per_device[device.index].clone()

    def set_state(state: torch.Tensor, device: torch.device) -> None:
        restored.append((int(state[0]), device.index))

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    state = ckpt.rng_state(torch.device("cuda", 5))
    assert torch.equal(state["cuda"], per_device[5])  # this rank's GPU only
    ckpt.set_rng_state(state, torch.device("cuda", 0))  # resumed where the node has one GPU
    assert restored == [(5, 0)]
    # a checkpoint of the old format (every visible GPU's state) on a process that sees fewer GPUs
    old = {**state, "cuda": [per_device[i] for i in range(8)]}
    ckpt.set_rng_state(old, torch.device("cuda", 3))
    assert restored[-1] == (3, 3)
    with caplog.at_level(logging.WARNING, logger="vla.train.checkpoint"):
        ckpt.set_rng_state({**state, "cuda": [per_device[0]]}, torch.device("cuda", 2))
    assert restored[-1] == (3, 3) and "cover 1 GPU(s), not cuda:2" in caplog.text
    ckpt.set_rng_state(state, torch.device("cpu"))  # a CUDA checkpoint resumed on CPU: the CPU states only
    assert len(restored) == 2
    assert "cuda" not in ckpt.rng_state(torch.device("cpu"))


def test_process_group_gets_the_configured_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's default collective timeout is 10 minutes, less than rank 0 may take to write and fsync a 3B model's
    checkpoint while the others wait at a barrier: the run's ``distributed.timeout_minutes`` (60) is passed."""
    import datetime

    import torch.distributed as dist

    from vla.train.config import DistributedConfig
    from vla.train.distributed import Runtime

    seen: dict[str, Any] = {}

    class Started(Exception):
        pass

    def init(backend: str, **kwargs: Any) -> None:
        seen.update(kwargs, backend=backend)
        raise Started

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Started):
        Runtime.start(DistributedConfig(timeout_minutes=90))
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(minutes=90), "device_id": None}
    assert DistributedConfig().timeout_minutes == 60
    with pytest.raises(ConfigError, match=r"distributed\.timeout_minutes must be > 0"):
        load_train_config("sim_pretrain", ["distributed.timeout_minutes=0"])


def test_tf32_is_set_on_cuda_runtimes_only_and_keeps_the_legacy_flag_readable() -> None:
    """``train.tf32`` (on by default) switches CUDA float32 matmuls/convolutions to TF32 on a CUDA runtime, and
    the runtime's close puts the process's settings back; a CPU runtime changes nothing. Set so that
    ``allow_tf32`` stays readable: torch >= 2.9 raises on reading it once the newer ``fp32_precision`` was set
    (user code and older libraries read it); a process that chose through ``fp32_precision`` is set through it."""
    from vla.train.distributed import Runtime, restore_cuda_tf32, set_cuda_tf32

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = False
        assert load_train_config("sim_pretrain", []).train.tf32 is True
        Runtime(0, 1, torch.device("cpu"), "single", None).set_tf32(True)
        assert matmul.allow_tf32 is False and cudnn.allow_tf32 is False
        cuda = Runtime(0, 1, torch.device("cuda"), "single", None)  # its flags only: nothing runs on it
        cuda.set_tf32(True)
        assert matmul.allow_tf32 is True and cudnn.allow_tf32 is True
        assert getattr(matmul, "fp32_precision", "tf32") == "tf32"  # what torch >= 2.9 reads
        cuda.close()
        assert matmul.allow_tf32 is False and cudnn.allow_tf32 is False
        if hasattr(matmul, "fp32_precision"):
            matmul.fp32_precision = "tf32"  # the newer API: reading allow_tf32 now raises
            before = set_cuda_tf32(False)
            assert matmul.fp32_precision == "ieee" and before[:2] == ("fp32_precision", "tf32")
            restore_cuda_tf32(before)
            assert matmul.fp32_precision == "tf32"
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved
    with pytest.raises(ConfigError, match=r"train\.tf32"):
        load_train_config("sim_pretrain", ["train.tf32=maybe"])


def test_fused_adamw_falls_back_when_a_parameter_has_no_fused_kernel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torch's AdamW(fused=True) accepts any parameters and fails at the first step(); the check is made when the
    optimizer is built, so the run falls back to the foreach implementation instead of failing at step 1."""
    from torch import nn

    good = nn.Parameter(torch.zeros(3))
    assert build_optimizer([("heads.w", good)], OptimConfig(fused=True)).param_groups[0]["fused"] is True
    odd = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with caplog.at_level(logging.WARNING, logger="vla.train.optim"):
        opt = build_optimizer([("heads.w", good), ("heads.z", odd)], OptimConfig(fused=True))
    assert not opt.param_groups[0]["fused"] and "a torch.complex64 parameter on cpu" in caplog.text
    for p in (good, odd):
        p.grad = torch.ones_like(p)
    opt.step()  # before: RuntimeError "`fused=True` requires all the params to be floating point Tensors"


def test_a_diverging_run_stops_before_writing_nan_weights_and_keeps_its_checkpoints(
    wx: Path, tmp_path: Path
) -> None:
    """A non-finite loss or gradient norm stops the run at that step with the fix named; the update is not applied
    and no checkpoint written. Before, the run went on to "done" with NaN weights, and train.keep_last pruned the
    last good checkpoints in favour of NaN ones that no command could load. metrics.jsonl stays strict JSON."""
    from vla.models.run_dir import latest_complete
    from vla.train.trainer import TrainingDivergedError

    run = tmp_path / "run"
    train(load_train_config("debug", _args(wx, "train.keep_last=1", steps=2)), run)
    good = latest_complete(run)
    before = weights(good)
    over = _args(wx, "train.keep_last=1", "optim.lr=1e12", "train.grad_clip=0", steps=40, save_every=40)
    with pytest.raises(
        TrainingDivergedError, match=r"training diverged at step .*Lower optim\.lr"
    ) as diverged:
        train(load_train_config("debug", over), run)
    assert 2 < diverged.value.step < 40
    assert f"the newest checkpoint, {good}, is intact" in str(diverged.value)
    assert latest_complete(run) == good and sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        good.name
    ]
    after = weights(good)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # strict: no NaN
    event = next(r for r in rows if r.get("event") == "diverged")
    assert event["step"] == diverged.value.step and event["checkpoint"] == str(good)
    # the CLI: one line, exit 2
    r = run_cli(["train", "debug", "--run-dir", str(run), *_sets(over)])
    assert (
        r.returncode == 2 and "error: training diverged at step" in r.stderr and "Traceback" not in r.stderr
    )


def test_run_dir_that_is_a_checkpoint_model_or_dataset_is_refused(wx: Path, tmp_path: Path) -> None:
    """LeRobot users resume from a checkpoint folder; here that started a new run from step 0 inside the published
    checkpoint, writing checkpoints/, config.yaml and metrics into it, and exited 0."""
    run = tmp_path / "run"
    train(load_train_config("debug", _args(wx, steps=2)), run)
    step = run / "checkpoints" / "step-0000002"
    listing = sorted(p.name for p in step.iterdir())
    for target, said in [
        (step, f"a checkpoint folder inside a run, not a run folder; to resume that run, pass its run folder: "
               f"--run-dir {run}"),
        (wx, f"a dataset folder, not a run folder; give the dataset as data.datasets=[{wx}]"),
        (run / "checkpoints", f"the checkpoints folder of a run, not a run folder; to resume that run, pass "
                              f"--run-dir {run}"),
    ]:  # fmt: skip
        r = run_cli(["train", "debug", "--run-dir", str(target), *_sets(_args(wx, steps=4))])
        assert r.returncode == 2 and said in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in step.iterdir()) == listing  # nothing written into it
    model = tmp_path / "model"
    shutil.copytree(step, model)
    with pytest.raises(ValueError, match=r"a model folder .* vla finetune"):
        train(load_train_config("debug", _args(wx, steps=4)), model)
    train(load_train_config("debug", _args(wx, steps=4)), run)  # the run folder itself resumes


@pytest.mark.parametrize("damage", ["dcp", "config"])
def test_a_damaged_complete_checkpoint_names_the_folder_and_the_one_before(
    wx: Path, tmp_path: Path, damage: str
) -> None:
    """A checkpoint marked complete whose train state was cut short afterwards (a disk error, a partial copy):
    before, a raw CheckpointException/EOFError traceback, or (config.yaml) a list of every setting as changed."""
    run = tmp_path / "run"
    train(load_train_config("debug", _args(wx, steps=4)), run)
    newest = run / "checkpoints" / "step-0000004"
    target = (
        next((newest / "train_state" / "dcp").glob("*.distcp"))
        if damage == "dcp"
        else newest / "train_state" / "config.yaml"
    )
    target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 3])
    over = _args(wx, steps=6)
    r = run_cli(["train", "debug", "--run-dir", str(run), *_sets(over)])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"{newest}: marked complete but its training state cannot be read" in r.stderr, r.stderr[-3000:]
    assert "to resume from step-0000002, the one before" in r.stderr
    newest.rename(run / "checkpoints" / "damaged-step-0000004")  # as the message says
    assert train(load_train_config("debug", over), run).step == 6


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("optim.lr=null", "optim.lr: expected a number, got null (YAML reads null"),
        ("train.seed=null", "train.seed: expected an integer, got null"),
        ("model.backbone=3", "model.backbone: expected a mapping of BackboneConfig settings, got 3"),
        ("data.datasets=null", "data.datasets: expected a list of strings, got null"),
        ("train.steps=[1,2]", "train.steps: expected an integer, got [1, 2]"),
        ("optim.betas=0.9", "optim.betas: expected a list of 2 (a number, a number), got 0.9"),
        (
            "train.steps=true",
            "train.steps: expected an integer, got true (YAML reads yes/no/on/off/true/false",
        ),
        ("train.compile=no", "train.compile: expected a string, got false (YAML reads yes/no"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_key_and_what_it_takes(override: str, said: str) -> None:
    """Before: tracebacks (a null learning rate reached LambdaLR, model.backbone=3 an AttributeError), draccus
    messages naming no key ("Couldn't instantiate class LoopConfig"), or silently taken (steps=true: 1 step)."""
    with pytest.raises(ConfigError) as e:
        load_train_config("debug", ["data.datasets=[/x]", override])
    assert said in str(e.value)
    # numbers PyYAML reads as strings still work, and so do preset names for the model section
    cfg = load_train_config("debug", ["data.datasets=[/x]", "optim.lr=1e-4", "model=tiny_smolvlm"])
    assert cfg.optim.lr == 1e-4


def test_a_dataset_written_another_way_is_the_same_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shell completion adds a trailing slash; a path may be relative or through a symlink: resuming was refused
    ("cannot continue: data.datasets: [...] -> [...]") for the same folder. Another folder still is a change."""
    ds, other = tmp_path / "wx", tmp_path / "other"
    ds.mkdir()
    other.mkdir()
    (tmp_path / "link").symlink_to(ds)
    monkeypatch.chdir(tmp_path)
    old = _cfg_dict([f"data.datasets=[{ds}]"])
    for same in (f"{ds}/", "wx", "./wx/", str(tmp_path / "link")):
        assert diff_configs(old, _cfg_dict([f"data.datasets=[{same}]"])) == ([], []), same
    bad, _ = diff_configs(old, _cfg_dict([f"data.datasets=[{other}]"]))
    assert bad == [f"data.datasets: ['{ds}'] -> ['{other}']"]
    bad, _ = diff_configs(old, _cfg_dict([f"data.datasets=[{ds},{other}]"]))
    assert len(bad) == 1
    gone = _cfg_dict(["data.datasets=[/no/such/wx]"])  # not on this machine: compared as text
    assert diff_configs(gone, _cfg_dict(["data.datasets=[/no/such/wx/]"])) == ([], [])


def test_settings_vla_train_would_ignore_are_refused(wx: Path, tmp_path: Path) -> None:
    """``train.val_at_start`` without ``train.val_every`` validated nothing, silently (a held-out episode was then
    never evaluated); ``model.embodiments`` was ignored by training but recorded, and then refused the resume."""
    with pytest.raises(ConfigError, match=r"train\.val_at_start=true validates only when validation is on"):
        load_train_config("debug", ["data.datasets=[/x]", "train.val_at_start=true"])
    with pytest.raises(
        ValueError, match=r"model\.embodiments=\['franka'\]: vla train builds the embodiment table"
    ):
        train(load_train_config("debug", _args(wx, "model.embodiments=[franka]", steps=1)), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_logged_lr_is_optim_lr_as_the_step_ran_it_and_groups_have_their_own(
    wx: Path, tmp_path: Path
) -> None:
    """Before, ``lr`` was the first parameter group's (the backbone's, at optim.backbone_lr) after the scheduler had
    already moved on: with optim.lr=3e-4 and backbone_lr=1e-5 the progress line said 8e-06."""
    over = _args(wx, "optim.lr=3e-4", "optim.backbone_lr=1e-5", "optim.warmup_steps=10", steps=2)
    cfg = load_train_config("debug", over)
    train(cfg, tmp_path / "run")
    rows = {r["step"]: r for r in metrics(tmp_path / "run")}
    for step in (1, 2):
        factor = lr_multiplier(step - 1, cfg.optim, 2)
        assert rows[step]["lr"] == pytest.approx(3e-4 * factor)
        backbone = [v for k, v in rows[step].items() if k.startswith("lr/backbone")]
        assert backbone and all(v == pytest.approx(1e-5 * factor) for v in backbone)


def test_lowering_retention_on_resume_names_the_checkpoints_it_will_delete(
    wx: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """checkpoint.keep_every 2 -> 0 on resume: the next save deletes the milestones kept so far; the resume warning
    listed only "keep_every: 2 -> 0"."""
    run = tmp_path / "run"
    train(
        load_train_config(
            "debug", _args(wx, "train.keep_last=1", "checkpoint.keep_every=2", steps=4, save_every=1)
        ),
        run,
    )
    assert [p.name for p in complete_steps(run)] == ["step-0000002", "step-0000004"]
    with caplog.at_level(logging.WARNING):
        train(load_train_config("debug", _args(wx, "train.keep_last=1", steps=5, save_every=1)), run)
    assert "the next checkpoint deletes step-0000002, kept until now" in caplog.text
    assert [p.name for p in complete_steps(run)] == ["step-0000005"]
