"""``vla demo`` (``make demo``): the end-to-end tour on embedded defaults, no downloads, a few seconds on a CPU.

The tour: write a small two-robot dataset with our LeRobot v3 writer (plus an RLDS export in the DROID layout),
inspect it, validate it, compute normalization stats, convert the RLDS export to LeRobot, render a preview, stream
mixed-embodiment training batches through the loader, then build the VLA (a tiny SmolVLM backbone of the real
classes, built locally), train it 12 steps with the real trainer (`vla train debug`: a resumable run folder with a
step checkpoint) and sample action chunks from that checkpoint;
finally generate two domain-randomized simulation episodes with a scripted expert and load them.
It ends by saying which parts of the pipeline are not built yet.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np


def _say(title: str) -> None:
    print(f"\n== {title}")


def run_demo(workdir: str | Path = "outputs/demo") -> int:
    from vla.config import DataConfig, load_config
    from vla.data.convert import convert_dataset
    from vla.data.inspect import dataset_info, show_frame
    from vla.data.loader import build_loader
    from vla.data.preview import preview_episode
    from vla.data.stats import write_stats
    from vla.data.validate import validate_dataset
    from vla.data.writers.rlds import droid_features, synthetic_droid_episode, write_rlds
    from vla.data.writers.synthetic import make_lerobot_dataset

    t0 = time.perf_counter()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the tour prints its own progress
    work = Path(workdir)
    marker = work / ".vla_demo"  # only a folder an earlier demo made is wiped: --workdir may be any path
    if work.exists() and any(work.iterdir()) and not marker.is_file():
        raise FileExistsError(
            f"--workdir {work} is not empty and was not made by 'vla demo'; pass a new or empty folder"
        )
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    marker.write_text("made by vla demo; the next run wipes and rewrites this folder\n")

    _say(
        "1. write datasets: SYNTHETIC (made up here: smooth states/actions, striped images that code their frame "
        "index; not robot data) as LeRobot v3.0 with AV1 video, and as RLDS in DROID's published layout"
    )
    widowx = make_lerobot_dataset(
        work / "data" / "widowx_demo",
        num_episodes=4,
        episode_length=[24, 30, 20, 26],
        cameras={"primary": (96, 128), "secondary": (96, 128)},
        state_dim=7,
        action_dim=7,
        fps=5,
        robot_type="widowx_bridge",
        seed=0,
    )
    rng = np.random.default_rng(0)
    episodes = [synthetic_droid_episode(rng, 20, (90, 160, 3)) for _ in range(3)]
    droid = work / "data" / "droid_100"
    write_rlds(droid, "droid_100", {"train": episodes}, *droid_features((90, 160, 3)))
    print(
        f"wrote {widowx} and {droid} (both synthetic: the shapes and formats of real data, not its content)"
    )

    _say("2. vla data info")
    for path in (widowx, droid):
        info = dataset_info(path)
        splits = ", ".join(
            f"{k}: {v['episodes']} episodes / {v['frames']} frames" for k, v in info["splits"].items()
        )
        print(f"{info['name']:<14} {info['format']:<13} embodiment={info['embodiment']:<14} {splits}")

    _say("3. vla data show --json (one DROID step: raw fields as stored + the canonical frame)")
    shown = show_frame(droid, None, 1, 5)
    print(json.dumps({k: shown[k] for k in ("format", "split", "episode", "frame", "num_frames")}))
    print("raw keys:", ", ".join(sorted(shown["raw"])[:8]), "...")
    print(
        "standardized:", json.dumps({k: shown["standardized"][k] for k in ("embodiment", "prompt", "action")})
    )

    _say("4. vla data validate")
    for path in (widowx, droid):
        problems = validate_dataset(path)
        print(f"{path.name}: {len(problems)} problem(s)" + "".join(f"\n  {p}" for p in problems))

    _say("5. vla data stats (one streaming pass, per embodiment)")
    for path in (widowx, droid):
        out = write_stats(path, progress=False)
        print(f"{path.name}: {out}")

    _say("6. vla data convert (RLDS -> LeRobot v3.0, canonical layout)")
    converted = convert_dataset(droid, work / "data" / "droid_lerobot", video=True).out
    print(f"wrote {converted}: {dataset_info(converted)['splits']}")

    _say("7. vla data preview")
    print(f"wrote {preview_episode(widowx, work / 'widowx_ep0.mp4', episode=0)}")

    _say("8. loader: mixed-embodiment batches (history 2, chunk 10, 224 px, augmentation on, normalized)")
    cfg = load_config(
        DataConfig,
        {
            "datasets": [str(widowx), str(droid)],
            "batch_size": 8,
            "obs_history": 2,
            "chunk_length": 10,
            "image_size": 224,
            "augment": {"enabled": True},
        },
    )
    loader = build_loader(cfg)
    for i, batch in enumerate(loader):
        batch.validate()
        if i == 0:
            print("images:", {k: list(v.shape) for k, v in batch.images.items()})
            print(
                "state",
                list(batch.state.shape),
                "actions",
                list(batch.actions.shape),
                "action_is_pad",
                int(batch.action_is_pad.sum()),
                "padded steps",
            )
            print(
                "embodiments:",
                {e: batch.meta["embodiment"].count(e) for e in sorted(set(batch.meta["embodiment"]))},
            )
        if i == 4:
            break
    print(f"loader state after 5 batches: {loader.state_dict()['batches_done']} batches done (resumable)")

    _say(
        "9. model: tiny SmolVLM backbone + flow-matching expert + per-embodiment heads (vla model init),"
        " trained with vla train (the debug preset)"
    )
    import torch

    from vla.models.hub import from_pretrained, init_checkpoint

    ckpt = init_checkpoint("tiny_smolvlm", work / "model_init", embodiments=sorted(loader.embodiment_ids))
    model = from_pretrained(ckpt)
    counts = model.parameter_counts()["all"]
    print(f"wrote {ckpt}: {counts['total']:,} parameters ({counts['trainable']:,} trainable)")
    from vla.train.config import load_train_config
    from vla.train.trainer import train

    run = train(
        load_train_config(
            "debug",
            [
                f"data.datasets=[{widowx},{droid}]",
                "data.batch_size=8",
                "train.steps=12",
                "train.save_every=12",
                "optim.lr=1e-3",
                "optim.warmup_steps=2",
                "logging.every=4",
                "logging.progress=true",
            ],
        ),
        work / "runs" / "debug",
    )
    model = from_pretrained(run.last_checkpoint).eval()
    print(
        f"vla train debug: {run.step} steps, final loss {run.final_loss:.3f}; checkpoint {run.last_checkpoint}"
    )
    cfg = load_config(
        DataConfig,
        {"datasets": [str(widowx), str(droid)], "batch_size": 8, "chunk_length": 8, "image_size": 64},
    )
    batch = next(iter(build_loader(cfg, embodiment_ids=model.embodiment_ids)))
    actions = model.sample_actions(batch, generator=torch.Generator().manual_seed(0))
    print(f"sampled action chunks {list(actions.shape)} (10 Euler steps, prefix computed once)")

    _say(
        "10. simulation: MuJoCo WidowX, language task, scripted expert, medium randomization (vla sim generate)"
    )
    from vla.data.readers import open_dataset
    from vla.sim.generate import GenerateConfig, generate

    sim_out = work / "data" / "sim_widowx_pick_place"
    counts = generate(
        GenerateConfig(
            "widowx", "pick_place", episodes=2, out=str(sim_out), randomization="medium", image_size=64
        ),
        progress_bar=False,
    )
    reader = open_dataset(sim_out)
    print(f"wrote {counts['written']} episodes ({counts['dropped']} failed demos dropped) to {sim_out}")
    for e in range(reader.num_episodes("train")):
        meta = reader.episode_metadata("train", e)
        rec = meta.get("randomization", {})
        dyn = rec.get("dynamics", {})
        print(
            f"  episode {e}: {reader.episode_length('train', e)} frames, "
            f"task {reader.read_frame('train', e, 0)['task']!r}, "
            f"randomized: {', '.join(k for k in sorted(rec) if k != 'level')} (level {rec.get('level')}; "
            f"{len(dyn)} dynamics fields, ...)"
        )
    write_stats(sim_out, progress=False)
    sim_cfg = load_config(DataConfig, {"datasets": [str(sim_out)], "batch_size": 4, "chunk_length": 10})
    sim_batch = next(iter(build_loader(sim_cfg)))
    print(f"loader batch from the sim data: state {list(sim_batch.state.shape)}, "
          f"actions {list(sim_batch.actions.shape)}, cameras {sorted(sim_batch.images)}")  # fmt: skip

    _say("not built yet")
    print(
        "LoRA fine-tuning for a new body (vla finetune), serving (vla serve) and closed-loop evaluation (vla eval)"
    )
    print(
        "are open issues; this tour will grow into pretrain -> fine-tune -> serve -> evaluate as they land."
    )
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s; outputs in {work}")
    return 0
