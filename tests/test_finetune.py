"""`vla finetune` / `vla export`: a pretrained tiny checkpoint fine-tuned on a new robot body (LoRA, frozen backbone,
full), adapter checkpoints that hold only what changed, exact resume, merged export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import events, kill_inside_checkpoint, mixture_file, run_cli, tiny_dataset

from vla.models.hub import from_pretrained
from vla.models.run_dir import latest_complete
from vla.models.testing import synthetic_batch

SETS = [
    "train.steps=4",
    "train.save_every=2",
    "logging.every=1",
    "logging.progress=false",
    "optim.warmup_steps=1",
]


def _sets(*over: str) -> list[str]:
    return [x for a in over for x in ("--set", a)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny model pretrained 4 steps on a WidowX dataset, and a dataset of a robot it has never seen (UR5e)."""
    root = tmp_path_factory.mktemp("ft")
    wx = _hold_out_last_episode(tiny_dataset(root, "wx"))
    ur5e = _hold_out_last_episode(tiny_dataset(root, "ur5e_demos", robot_type="sim_ur5e", seed=3))
    run = root / "pretrain"
    r = run_cli(["train", "debug", "--run-dir", str(run), *_sets(f"data.datasets=[{wx}]", *SETS)])
    assert r.returncode == 0, r.stderr[-3000:]
    return run, ur5e


@pytest.fixture(scope="module")
def lora_run(base: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``vla finetune`` with LoRA (4 steps, checkpoints at 2 and 4) of the base on the UR5e data: one run that the
    tests below only read (each of them ran this same command itself before)."""
    base_run, ur5e = base
    run = tmp_path_factory.mktemp("lora") / "ft"
    r = _finetune(base_run, ur5e, run)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def merged(lora_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``vla export --merge`` of ``lora_run``: a plain checkpoint with the adapters folded in."""
    out = tmp_path_factory.mktemp("export") / "merged"
    r = run_cli(["export", str(lora_run), "--merge", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _hold_out_last_episode(ds: Path) -> Path:
    """Episodes 0-2 train, episode 3 is the ``val`` split (LeRobot v3 ``splits``)."""
    info = ds / "meta" / "info.json"
    meta = json.loads(info.read_text())
    meta["splits"] = {"train": "0:3", "val": "3:4"}
    info.write_text(json.dumps(meta))
    return ds


def _finetune(base_run: Path, data: Path, run: Path, *extra: str, preset: str = "finetune_lora"):
    args = ["finetune", str(base_run), "--embodiment", "sim_ur5e", "--run-dir", str(run), "--preset", preset]
    return run_cli([*args, *_sets(f"data.datasets=[{data}]", "data.num_workers=0", *SETS, *extra)])


def test_lora_finetune_changes_only_adapters_and_the_new_slot(
    base: tuple[Path, Path], lora_run: Path
) -> None:
    base_run, _ = base
    step = latest_complete(lora_run)
    meta = json.loads((step / "config.json").read_text())
    ref = meta["vla_adapter"]
    assert ref["base"] == str(latest_complete(base_run).resolve()) and len(ref["base_sha256"]) == 64
    assert ref["base_embodiments"] == ["widowx_bridge"] and ref["lora"]["r"] == 16
    assert not (step / "model.safetensors").exists() and (step / "adapter.safetensors").is_file()
    full = (latest_complete(base_run) / "model.safetensors").stat().st_size
    assert (step / "adapter.safetensors").stat().st_size < full  # only what changed
    stored = load_file(str(step / "adapter.safetensors"))
    assert any("lora_A" in k for k in stored) and "heads.action_out.weight" in stored

    tuned = from_pretrained(lora_run)  # run folder -> newest step; base + new slot + LoRA + tensors
    plain = from_pretrained(latest_complete(base_run))
    assert list(tuned.embodiment_ids) == ["widowx_bridge", "sim_ur5e"]
    tuned_params = dict(tuned.named_parameters())
    for name, p in plain.named_parameters():
        owner, _, leaf = name.rpartition(".")
        mine = tuned_params.get(name)
        if mine is None:  # a projection LoRA wraps: its weight moved to <module>.base_layer.<leaf>
            mine = tuned_params[f"{owner}.base_layer.{leaf}"]
        if name.startswith(("heads.", "embodiment_tokens.")):
            assert torch.equal(mine[:1], p), name  # the WidowX slot: bitwise unchanged
        else:
            assert torch.equal(mine, p), name  # every base weight: bitwise unchanged
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in stored.items() if "lora_B" in k)


def test_export_merge_gives_the_adapter_models_actions(lora_run: Path, merged: Path, tmp_path: Path) -> None:
    r = run_cli(["export", str(lora_run), "--out", str(tmp_path / "plain")])
    assert r.returncode == 2 and "pass --merge" in r.stderr and not (tmp_path / "plain").exists()
    assert (merged / "model.safetensors").is_file()
    assert "vla_adapter" not in json.loads((merged / "config.json").read_text())
    tuned = from_pretrained(lora_run).eval()
    merged = from_pretrained(merged).eval()
    batch = synthetic_batch(
        merged, batch_size=2, image_hw=(48, 64), embodiments=["sim_ur5e", "widowx_bridge"]
    )
    noise = torch.randn(2, 8, merged.cfg.max_action_dim, generator=torch.Generator().manual_seed(0))
    a = tuned.sample_actions(batch, noise=noise)
    b = merged.sample_actions(batch, noise=noise)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_finetune_resume_after_kill_is_exact(base: tuple[Path, Path], lora_run: Path, tmp_path: Path) -> None:
    base_run, ur5e = base
    killed = tmp_path / "killed"
    args = ["finetune", str(base_run), "--embodiment", "sim_ur5e", "--run-dir", str(killed)]
    kill_inside_checkpoint(
        [*args, *_sets(f"data.datasets=[{ur5e}]", "data.num_workers=0", *SETS)], killed, step=4
    )
    assert latest_complete(killed).name == "step-0000002"
    assert _finetune(base_run, ur5e, killed).returncode == 0
    a = load_file(str(latest_complete(lora_run) / "adapter.safetensors"))  # the same command, uninterrupted
    b = load_file(str(latest_complete(killed) / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_changed_base_is_refused(base: tuple[Path, Path], tmp_path: Path) -> None:
    base_run, ur5e = base
    copy = tmp_path / "base_copy"
    shutil.copytree(latest_complete(base_run), copy)
    assert _finetune(copy, ur5e, tmp_path / "ft").returncode == 0
    weights = copy / "model.safetensors"
    state = load_file(str(weights))
    key = next(iter(state))
    state[key] = state[key] + 1
    from safetensors.torch import save_file

    save_file(state, str(weights))
    with pytest.raises(ValueError, match="changed since the fine-tune"):
        from_pretrained(tmp_path / "ft")


@pytest.mark.parametrize("preset", ["finetune_frozen_backbone", "finetune_full"])
def test_other_finetune_modes(preset: str, base: tuple[Path, Path], tmp_path: Path) -> None:
    base_run, ur5e = base
    r = _finetune(base_run, ur5e, tmp_path / "ft", preset=preset)
    assert r.returncode == 0, r.stderr[-3000:]
    step = latest_complete(tmp_path / "ft")
    if preset == "finetune_full":
        assert (step / "model.safetensors").is_file()
    else:
        stored = load_file(str(step / "adapter.safetensors"))
        assert any(k.startswith("expert.") for k in stored) and not any(
            k.startswith("backbone.") for k in stored
        )
    model = from_pretrained(step)
    assert list(model.embodiment_ids) == ["widowx_bridge", "sim_ur5e"]


def test_finetune_embodiment_must_match_the_data(base: tuple[Path, Path], tmp_path: Path) -> None:
    base_run, ur5e = base
    args = ["finetune", str(base_run), "--embodiment", "sim_panda", "--run-dir", str(tmp_path / "ft")]
    r = run_cli([*args, *_sets(f"data.datasets=[{ur5e}]", *SETS)])
    assert r.returncode == 2 and "--embodiment 'sim_panda'" in r.stderr and "sim_ur5e" in r.stderr


@pytest.mark.parametrize(
    "preset", ["finetune_lora", "finetune_lora_r32", "finetune_frozen_backbone", "finetune_full"]
)
def test_finetune_presets_parse_with_the_checkpoints_model(preset: str, base: tuple[Path, Path]) -> None:
    from vla.train.config import load_finetune_config

    base_run, ur5e = base
    cfg = load_finetune_config(preset, base_run, [f"data.datasets=[{ur5e}]"])
    assert cfg.finetune.init == str(latest_complete(base_run))
    assert cfg.model.backbone.pretrained == "tiny:smolvlm" and cfg.data.image_size == 64
    assert cfg.finetune.mode in ("lora", "frozen_backbone", "full")
    if preset.startswith("finetune_lora"):
        assert cfg.finetune.lora.r == (32 if preset.endswith("r32") else 16)


def test_lora_adapter_checkpoint_is_small_at_the_bench_config() -> None:
    """At the bench_smolvla config with r=16, what an adapter checkpoint stores (LoRA matrices + the embodiment
    tables) is <= 10 % of the full model's parameters (counted on the meta device: nothing is allocated)."""
    from vla.embodiments import get_embodiment
    from vla.models.config import load_model_config
    from vla.models.lora import LoraSettings, apply_lora, lora_parameter_names
    from vla.models.meta import build_on_meta
    from vla.train.finetune import masked_tables

    model = build_on_meta(
        load_model_config("bench_smolvla"), [get_embodiment("widowx_bridge"), get_embodiment("sim_ur5e")]
    )
    total = sum(p.numel() for p in model.parameters())
    apply_lora(model, LoraSettings(r=16))
    params = dict(model.named_parameters())
    stored = sum(params[n].numel() for n in [*lora_parameter_names(model), *masked_tables(model)])
    assert sum(p.numel() for p in model.parameters()) == total + sum(
        params[n].numel() for n in lora_parameter_names(model)
    )
    assert stored / total <= 0.10, stored / total


@pytest.mark.slow  # compiling the serving graphs takes ~1-2 minutes on 2 CPU cores; the eager path runs above
def test_compiled_serving_uses_the_adapters(lora_run: Path, merged: Path) -> None:
    tuned = from_pretrained(lora_run).prepare_inference(compile=True)
    merged = from_pretrained(merged).eval()
    batch = synthetic_batch(
        merged, batch_size=2, image_hw=(48, 64), embodiments=["sim_ur5e", "widowx_bridge"]
    )
    noise = torch.randn(2, 8, merged.cfg.max_action_dim, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        tuned.sample_actions(batch, noise=noise),
        merged.sample_actions(batch, noise=noise),
        atol=1e-4,
        rtol=1e-4,
    )


def test_finetune_an_unregistered_robot_from_its_spec_file(base: tuple[Path, Path], tmp_path: Path) -> None:
    """`--embodiment path/to/my_arm.yaml`: a robot no config knows, trained from its spec file alone."""
    import yaml

    from vla.embodiments import EMBODIMENTS, get_embodiment
    from vla.paths import config_dir

    spec = yaml.safe_load((config_dir() / "embodiments" / "sim_ur5e.yaml").read_text())
    spec["name"] = "my_arm_ft"
    spec_file = tmp_path / "my_arm_ft.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    assert "my_arm_ft" not in EMBODIMENTS
    assert (
        get_embodiment(spec_file).name == "my_arm_ft"
    )  # registered for this process: the stats pass finds it
    data = tiny_dataset(tmp_path, "my_arm_demos", robot_type="my_arm_ft", seed=5)
    base_run, _ = base
    args = ["finetune", str(base_run), "--embodiment", str(spec_file), "--run-dir", str(tmp_path / "ft")]
    r = run_cli([*args, *_sets(f"data.datasets=[{data}]", "data.num_workers=0", *SETS)])
    assert r.returncode == 0, r.stderr[-3000:]
    model = from_pretrained(tmp_path / "ft")
    assert list(model.embodiment_ids) == ["widowx_bridge", "my_arm_ft"]
    # a fresh process knows the robot from the checkpoint alone
    r = run_cli(
        ["model", "predict", str(tmp_path / "ft"), str(data), "--episode", "0", "--frame", "0", "--json"]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["embodiment"] == "my_arm_ft"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_embodiment(tmp_path / "missing.yaml")


def test_save_pretrained_refuses_unmerged_lora(tmp_path: Path) -> None:
    from vla.models.hub import save_pretrained
    from vla.models.lora import LoraSettings, apply_lora
    from vla.models.testing import tiny_model

    model = apply_lora(tiny_model(), LoraSettings(r=2))
    with pytest.raises(ValueError, match="merge_lora"):
        save_pretrained(model, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_rehearsal_replays_the_base_data_with_its_stats(base: tuple[Path, Path], tmp_path: Path) -> None:
    """``finetune.rehearsal``: the base robot's data at the configured share of samples, normalized with the base
    checkpoint's own stats; both robots' validation losses are logged (from step 0); the fine-tuned checkpoint
    keeps the base's stats. Bound: with rehearsal, LoRA moves the base robot's validation loss by < 10 %."""
    from types import SimpleNamespace

    from vla.config import DataConfig
    from vla.data.loader import build_loader
    from vla.models.hub import load_norm_stats

    base_run, ur5e = base
    wx = base_run.parent / "wx"
    mix = mixture_file(tmp_path, [wx])
    base_step = latest_complete(base_run)
    rehearsal = SimpleNamespace(mixture=str(mix), fraction=0.25, data_root=str(tmp_path))
    loader = build_loader(
        DataConfig(datasets=(str(ur5e),), batch_size=8, image_size=64, seed=1),
        rehearsal=rehearsal,
        base_stats=load_norm_stats(base_step),
    )
    seen = [e for _, batch in zip(range(25), loader) for e in batch.meta["embodiment"]]
    share = seen.count("widowx_bridge") / len(seen)
    assert 0.17 < share < 0.33, share  # 200 seeded samples around the configured 0.25
    theirs = load_norm_stats(base_step).stats["widowx_bridge"]
    assert all(
        ours.to_dict() == theirs[f].to_dict() for f, ours in loader.stats.stats["widowx_bridge"].items()
    )

    over = [f"finetune.rehearsal.mixture={mix}", "finetune.rehearsal.fraction=0.5", "train.val_every=4",
            "train.val_batches=2", "train.val_at_start=true"]  # fmt: skip
    r = _finetune(base_run, ur5e, tmp_path / "ft", *over)
    assert r.returncode == 0, r.stderr[-3000:]
    vals = events(tmp_path / "ft", "validation")
    assert [v["step"] for v in vals] == [0, 4], r.stderr[-3000:]
    assert all({"val_loss/widowx_bridge", "val_loss/sim_ur5e"} <= set(v) for v in vals), vals
    before, after = vals[0]["val_loss/widowx_bridge"], vals[-1]["val_loss/widowx_bridge"]
    assert abs(after - before) < 0.1 * before, (before, after)
    step = latest_complete(tmp_path / "ft")
    tuned, plain = from_pretrained(step), from_pretrained(base_step)
    for name in (
        "heads.action_out.weight",
        "embodiment_tokens.weight",
    ):  # the rehearsed robot's slot: unchanged
        assert torch.equal(dict(tuned.named_parameters())[name][:1], dict(plain.named_parameters())[name])
    stats = json.loads((step / "norm_stats.json").read_text())["stats"]
    assert {"widowx_bridge", "sim_ur5e"} <= set(stats)
    assert (
        stats["widowx_bridge"]
        == json.loads((base_step / "norm_stats.json").read_text())["stats"]["widowx_bridge"]
    )
    keys = json.loads((step / "preprocessing.json").read_text())["stats_keys"]
    assert keys["wx"]["action"] == "widowx_bridge" and keys["ur5e_demos"]["action"] == "sim_ur5e"


def test_finetune_without_rehearsal_keeps_the_base_stats(merged: Path) -> None:
    """The base robot stays servable from a fine-tuned checkpoint: its stats and stats keys travel along."""
    from vla.policy import Policy

    policy = Policy.from_checkpoint(merged)
    assert sorted(policy.embodiments) == ["sim_ur5e", "widowx_bridge"]
