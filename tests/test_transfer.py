"""The first, cheap evidence of cross-embodiment transfer (the fine-tuning issue's test): a tiny VLA pretrained with
``vla train`` on simulated reach demonstrations of three robots (Panda, UR5e, WidowX), then LoRA-fine-tuned with
``vla finetune`` on a fourth robot it never saw (Kinova Gen3), reaches a lower held-out validation loss after the
same steps than the same fine-tuning of a freshly initialised model. Same data, steps, seeds and validation
batches on both sides; the stages are ``make demo``'s (``vla.demo.Demo``), at a size that fits CI.

Measured on the 2-core EPYC (validation loss at fine-tuning steps 0/10/20/30): from the pretrained model
0.965/0.776/0.712/0.688, from a fresh one 1.873/1.480/1.138/1.066; pretraining's own 1.856 -> 1.022 in 300 steps.
The pretrained side is lower from step 0 (its new slot starts from the most similar robot's heads and its backbone
knows the scenes) and stays lower."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vla.demo import Demo, DemoSizes

SIZES = DemoSizes(
    episodes_per_robot=8,
    new_robot_episodes=6,
    pretrain_steps=300,
    finetune_steps=30,
    batch_size=8,
    eval_episodes=1,
    workers=2,
    task="reach",  # the measurements above (make demo's own task is reach_fixed_slots)
)


def _val_curve(run: Path) -> dict[int, float]:
    """``{step: val_loss}`` of a run's ``metrics.jsonl``."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): float(r["val_loss"]) for r in recs if "val_loss" in r}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    d = Demo(tmp_path_factory.mktemp("transfer"), SIZES)
    d.generate()
    d.pretrain()
    d.finetune()
    return d


@pytest.mark.timeout(
    1800
)  # the module's fixture runs three trainings (about 2 minutes on a quiet 2-core CPU)
def test_pretrained_model_fine_tunes_to_a_lower_validation_loss_than_a_fresh_one(demo: Demo) -> None:
    pre = _val_curve(demo.root / "finetune_pretrained")
    fresh = _val_curve(demo.root / "finetune_fresh")
    print(f"validation loss by step: from pretrained {pre}; from fresh {fresh}")
    assert pre.keys() == fresh.keys() and {0, SIZES.finetune_steps} <= pre.keys(), (pre, fresh)
    last = SIZES.finetune_steps
    # the comparison the issue asks for, with a margin (measured 35 % lower)
    assert pre[last] < 0.9 * fresh[last], (pre, fresh)
    assert pre[0] < fresh[0]  # the head start pretraining gives
    # pretraining itself learned: its own held-out loss fell
    pretrain = _val_curve(demo.root / "pretrain")
    assert pretrain[SIZES.pretrain_steps] < 0.7 * pretrain[0], pretrain


def test_the_model_reads_the_demo_image_size(tmp_path: Path) -> None:
    """``DemoSizes.image_size`` (the study's ``--image-size``) sets the rendered images and the model's input size
    alike: the pretrained model, the fresh one and both fine-tunes read 96 px, so nothing is resized behind the
    user's back and a larger size really gives the vision tower more pixels."""
    from dataclasses import replace

    from vla.data.readers import open_dataset
    from vla.demo import QUICK

    d = Demo(tmp_path, replace(QUICK, image_size=96))
    d.generate()
    d.pretrain()
    d.finetune()
    ds = open_dataset(d.dataset("panda"))
    frames = ds.read_images("train", 0, [0], ds.image_keys())
    assert all(v.shape[1:3] == (96, 96) for v in frames.values()), {k: v.shape for k, v in frames.items()}
    for folder in ("fresh_init", "export_pretrained", "export_fresh"):
        config = json.loads((tmp_path / folder / "config.json").read_text())
        assert config["model"]["backbone"]["image_size"] == 96, (folder, config["model"]["backbone"])
