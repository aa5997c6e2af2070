"""The ``vla`` command. Sub-commands import their modules lazily so ``vla --help`` stays instant.

    vla data info PATH                                  format, splits, episodes, frames, features, embodiment
    vla data show PATH [--split S] --episode E --frame F --json
    vla data stats PATH [--out FILE]                    normalization stats (one streaming pass)
    vla data validate PATH                              every problem in one pass; exit 1 if any
    vla data convert SRC DST --to lerobot               any readable dataset -> LeRobot v3.0 (every split kept)
    vla data merge SRC... --out DST                     join like datasets (e.g. generation shards)
    vla data preview PATH --episode E --out FILE.mp4|.gif
    vla train PRESET_OR_YAML --run-dir DIR [--set k=v]  train or resume (torchrun / accelerate launch for many)
    vla serve CKPT [--port 8000] [--api-key-file F]     serve a checkpoint to robots (openpi WebSocket + REST)
    vla demo                                            the end-to-end tour on embedded defaults

Errors in user input print one line naming what, where and the fix (exit 2); ``VLA_DEBUG=1`` shows tracebacks.
Commands that write a dataset or checkpoint refuse an existing destination unless given ``--overwrite``; a dataset
the same command was writing when it was interrupted is resumed instead (re-run it to finish the dataset).
``vla --version``; ``python -m vla`` is the same command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from vla.models.policies.flow_vla import FlowVLA
    from vla.train.trainer import TrainResult


def _print_json(obj: object) -> None:
    print(json.dumps(obj, indent=None, allow_nan=False))


def _register_spec(args: argparse.Namespace) -> None:
    """``--embodiment NAME_OR_YAML``: a spec file (e.g. from ``vla embodiment draft``) of a robot_type no config
    registers, made known for this command."""
    if getattr(args, "embodiment", None):
        from vla.embodiments import get_embodiment

        get_embodiment(args.embodiment)


def cmd_data_info(args: argparse.Namespace) -> int:
    from vla.data.inspect import dataset_info

    _register_spec(args)
    info = dataset_info(args.path)
    if args.json:
        _print_json(info)
        return 0
    print(f"{info['path']}\n  format:     {info['format']}\n  name:       {info['name']}")
    if info.get("incomplete"):
        print(f"  INCOMPLETE: holds only the episodes written before `{info['incomplete']}` was interrupted; "
              "re-run that command to finish it")  # fmt: skip
    if info.get("data_problem"):
        print(f"  DATA PROBLEM: {info['data_problem']}")
    embodiment = info["embodiment"] or f"(no registered key map: {info['key_map_problem']})"
    print(f"  embodiment: {embodiment}")
    if info.get("fps"):
        print(f"  fps:        {info['fps']}")
    for split, s in info["splits"].items():
        print(f"  split {split!r}: {s['episodes']} episodes, {s['frames']} frames")
    print("  features:")
    for name, f in info["features"].items():
        print(f"    {name:<44} {f['kind']:<7} {f['dtype']:<8} {f['shape']}")
    return 0


def cmd_data_show(args: argparse.Namespace) -> int:
    from vla.data.inspect import format_frame, show_frame

    _register_spec(args)
    out = show_frame(args.path, args.split, args.episode, args.frame)
    if args.json:
        _print_json(out)
    else:
        print(format_frame(out))
    return 0


def cmd_data_stats(args: argparse.Namespace) -> int:
    from vla.data.normalize import StatsFile
    from vla.data.stats import compute_stats, nonfinite_report, write_stats

    _register_spec(args)
    if len(args.path) == 1:
        path = write_stats(args.path[0], out=args.out, max_episodes=args.max_episodes)
    else:  # one embodiment-wide set over several datasets (stats files cannot be merged exactly afterwards)
        if not args.out:
            raise ValueError(
                "several datasets: pass --out FILE.json for their joint stats (then data.stats_path=FILE)"
            )
        path = compute_stats(list(args.path), max_episodes=args.max_episodes).save(args.out)
    print(f"wrote {path}")
    for line in nonfinite_report(StatsFile.load(path)):
        print(f"warning: {line}", file=sys.stderr)
    return 0


def cmd_data_validate(args: argparse.Namespace) -> int:
    from vla.data.validate import validate_dataset

    _register_spec(args)
    problems = validate_dataset(args.path, max_episodes=args.max_episodes)
    if args.json:
        _print_json([p.to_json() for p in problems])
    else:
        for p in problems:
            print(p)
        print(
            f"{len(problems)} problem(s) found in {args.path}"
            if problems
            else f"OK: no problems found in {args.path}"
        )
    return 1 if problems else 0


def cmd_data_convert(args: argparse.Namespace) -> int:
    from vla.data.convert import convert_dataset

    summary = convert_dataset(
        args.src,
        args.dst,
        to=args.to,
        video=not args.no_video,
        vcodec=args.vcodec,
        max_episodes=args.max_episodes,
        split=args.split,
        overwrite=args.overwrite,
    )
    print(summary)
    return 0


def cmd_data_preview(args: argparse.Namespace) -> int:
    from vla.data.preview import preview_episode

    out = preview_episode(args.path, args.out, split=args.split, episode=args.episode, fps=args.fps)
    print(f"wrote {out}")
    return 0


def _quiet_transformers() -> None:
    """Silence transformers' "Loading weights" bars and notices: a locally built model's loading says nothing new."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def cmd_model_init(args: argparse.Namespace) -> int:
    from vla.models.model_init import init_checkpoint

    _quiet_transformers()
    stats, found = None, None
    if args.stats_from:
        from vla.data.normalize import StatsFile
        from vla.data.stats import find_stats, write_stats

        found = find_stats(args.stats_from)
        if found is None:  # a fresh dataset: one streaming pass, saved where `vla data stats` would save it
            print(f"computing normalization stats of {args.stats_from} (one pass) ...", file=sys.stderr)
            found = write_stats(args.stats_from, progress=None)
            print(f"wrote {found}", file=sys.stderr)
        stats = StatsFile.load(found)
    out = init_checkpoint(
        args.config,
        args.out,
        embodiments=args.embodiment or None,
        stats=stats,
        overrides=args.overrides,
        seed=args.seed,
        overwrite=args.overwrite,
    )
    print(f"wrote {out}" + (f" (normalization stats from {found})" if found is not None else ""))
    return 0


def _serving_problem(model: FlowVLA, target: Path) -> str | None:
    """Why ``Policy`` would refuse to serve this checkpoint with its stats (NaN or degenerate bounds, stats keyed
    for another embodiment, ...), checked the way serving checks it; None when it would serve."""
    from vla.policy import Policy, _default_embodiments

    try:
        # every embodiment it would serve, named: one that needs a --stats-dataset choice is reported, not skipped
        Policy(model, name=str(target), embodiments=_default_embodiments(model, str(target)))
    except ValueError as e:
        return str(e)
    return None


def cmd_model_info(args: argparse.Namespace) -> int:
    from vla.models.hub import stats_coverage, stats_summary
    from vla.models.run_dir import resolve_checkpoint

    _quiet_transformers()
    target = resolve_checkpoint(args.target)  # a run folder means its newest complete step
    if target.is_dir() and not (target / "config.json").is_file():
        raise FileNotFoundError(
            f"{target / 'config.json'}: missing, so {target} is not a vla checkpoint folder; restore config.json "
            "(or pass a model preset name or YAML file)"
        )
    if (target / "config.json").is_file():  # a checkpoint folder (its weights file missing is an error there)
        from vla.models.hub import from_pretrained

        model = from_pretrained(target)
    else:
        from vla.embodiments import get_embodiment
        from vla.models.config import load_model_config
        from vla.models.policies import POLICIES

        cfg = load_model_config(args.target, args.overrides)
        names = args.embodiment or list(cfg.embodiments) or ["widowx_bridge"]
        model = POLICIES.get(cfg.policy)(cfg, [get_embodiment(n) for n in names])
    counts = model.parameter_counts()
    serving = _serving_problem(model, target) if model.norm_stats is not None else None
    if args.json:
        _print_json(
            {
                "policy": model.cfg.policy,
                "backbone": model.cfg.backbone.pretrained,
                "embodiments": list(model.embodiment_ids),
                "parameters": counts,
                "norm_stats": stats_coverage(model.norm_stats, list(model.embodiment_ids)),
                "serving_problem": serving,
            }
        )
        return 0
    print(
        f"{model.cfg.policy}: backbone {model.cfg.backbone.family} {model.cfg.backbone.pretrained} "
        f"({model.backbone.num_layers} language layers), expert {model.expert.width} x {len(model.expert.layers)}"
    )
    print(f"embodiments: {', '.join(model.embodiment_ids)}")
    print(f"normalization stats: {stats_summary(model.norm_stats, list(model.embodiment_ids))}")
    if serving:
        print(f"SERVING PROBLEM: {serving}")
    print(f"{'component':<20}{'total':>16}{'trainable':>16}")
    for name, c in counts.items():
        print(f"{name:<20}{c['total']:>16,}{c['trainable']:>16,}")
    return 0


def cmd_model_predict(args: argparse.Namespace) -> int:
    from vla.predict import format_prediction, predict_frame

    out = predict_frame(
        args.checkpoint,
        args.dataset,
        episode=args.episode,
        frame=args.frame,
        split=args.split,
        seed=args.seed,
        num_steps=args.num_steps,
    )
    if args.json:
        _print_json(out)
    else:
        print(format_prediction(out))
    return 0


def cmd_data_merge(args: argparse.Namespace) -> int:
    from vla.data.merge import merge_datasets

    print(merge_datasets(args.sources, args.out, overwrite=args.overwrite))
    return 0


def cmd_sim_generate(args: argparse.Namespace) -> int:
    from vla.sim.generate import GenerateConfig, generate

    cfg = GenerateConfig(
        embodiment=args.embodiment,
        task=args.task,
        episodes=args.episodes,
        out=args.out,
        workers=args.workers,
        seed=args.seed,
        randomization=args.randomization,
        image_size=args.image_size,
        shard=args.shard,
        num_shards=args.num_shards,
        keep_failed=args.keep_failed,
        settle_steps=args.settle_steps,
        vcodec=args.vcodec,
        max_steps=args.max_steps,
    )
    counts = generate(cfg)
    print(
        f"{counts['out']}: wrote {counts['written']} episodes, dropped {counts['dropped']} unsuccessful, "
        f"skipped {counts['skipped']} already done"
    )
    return 0


def cmd_sim_preview(args: argparse.Namespace) -> int:
    from vla.sim.preview import preview_expert

    out = preview_expert(
        args.embodiment,
        args.task,
        args.out,
        seed=args.seed,
        randomization=args.randomization,
        settle_steps=args.settle_steps,
    )
    print(f"wrote {out}")
    return 0


def _train_logging() -> None:
    """INFO logging on rank 0; the other ranks of a distributed run log only errors and draw no loading bars (the
    issue's "only rank 0 logs and prints": N ranks would print every warning N times)."""
    import logging

    rank = os.environ.get("RANK") or "0"
    if rank != "0":
        import warnings

        logging.basicConfig(level=logging.ERROR, format=f"%(levelname)s [rank {rank}] %(name)s: %(message)s")
        warnings.simplefilter("ignore")  # rank 0 shows them once
        _quiet_transformers()
        return
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "transformers", "accelerate", "OpenGL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_train(args: argparse.Namespace) -> int:

    from vla.train.config import load_train_config
    from vla.train.trainer import train

    _train_logging()
    if args.run_dir is None and not args.dry_run:
        raise ValueError("vla train: --run-dir DIR is required (the run's checkpoints and metrics go there)")
    cfg = load_train_config(args.config, args.overrides)
    if args.dry_run:
        from vla.train.plan import dry_run, mixture_embodiments

        names = args.embodiment or mixture_embodiments(cfg) or ["widowx_bridge"]
        _print_json(dry_run(cfg, names, gpus=args.gpus))
        return 0
    return _train_done(train(cfg, args.run_dir))


def cmd_finetune(args: argparse.Namespace) -> int:
    from vla.embodiments import get_embodiment
    from vla.train.config import load_finetune_config
    from vla.train.trainer import train

    _train_logging()
    spec = get_embodiment(args.embodiment)  # a registered name or a spec YAML (`vla embodiment draft`)
    cfg = load_finetune_config(args.preset, args.init, args.overrides)
    return _train_done(train(cfg, args.run_dir, require_embodiment=spec.name))


def _train_done(result: TrainResult) -> int:
    """The last line of ``vla train``/``vla finetune`` (rank 0) and the exit status: 0 when the run reached
    train.steps or was stopped by its STOP file, 143 when SIGTERM stopped it (vla.train.stop)."""
    from vla.train.stop import SIGTERM_EXIT

    main = int(os.environ.get("RANK", "0")) == 0
    if result.stopped:
        if main:
            print(
                f"stopped at step {result.step} ({result.stopped}): checkpoint {result.last_checkpoint}; run the "
                "same command again to resume",
                flush=True,
            )
        return SIGTERM_EXIT if result.stopped == "SIGTERM" else 0
    if result.last_checkpoint is not None and main:
        print(f"done: step {result.step}, checkpoint {result.last_checkpoint}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vla.models.hub import from_pretrained, save_pretrained
    from vla.models.run_dir import resolve_checkpoint

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it, or choose another --out")
    src = resolve_checkpoint(args.checkpoint)
    model = from_pretrained(src)
    if getattr(model, "adapter_reference", None) is not None:
        if not args.merge:
            raise ValueError(
                f"{src} is an adapter checkpoint (LoRA / frozen-backbone fine-tune); pass --merge to fold the "
                "adapters into the weights and write a plain folder"
            )
        from vla.models.lora import has_lora, merge_lora

        if has_lora(model):
            merge_lora(model)
        model.adapter_reference = None
    print(f"wrote {save_pretrained(model, out)} (from {src})")
    return 0


def cmd_embodiment_draft(args: argparse.Namespace) -> int:
    from vla.data.draft_spec import write_draft

    draft = write_draft(args.dataset, args.name, args.out, overwrite=args.overwrite)
    print(f"wrote {args.out}")
    print("\n".join(draft.summary()))
    print(
        f"then: vla data stats {args.dataset} --embodiment {args.out}; "
        f"vla finetune INIT --embodiment {args.out} --set data.datasets=[{args.dataset}] ..."
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from vla.demo import run_demo

    return run_demo(args.workdir, quick=args.quick)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except the uninformative ones (None, False, empty lists)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == [] or action.required:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose help shows defaults; sub-commands inherit the class (``add_subparsers``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


SPEC_HELP = "robot spec (name or YAML, e.g. from `vla embodiment draft`) of a robot_type no config registers"


def build_parser() -> argparse.ArgumentParser:
    from vla import __version__

    p = _Parser(prog="vla", description="Cross-embodiment vision-language-action models.")
    p.add_argument("--version", action="version", version=f"vla {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="inspect, validate, convert and summarize datasets").add_subparsers(
        dest="data_command", required=True
    )
    s = data.add_parser("info", help="format, splits, episodes, frames, features, embodiment")
    s.add_argument("path")
    s.add_argument("--embodiment", default=None, help=SPEC_HELP)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_data_info)

    s = data.add_parser("show", help="one step: raw fields as stored and the standardized frame")
    s.add_argument("path")
    s.add_argument("--embodiment", default=None, help=SPEC_HELP)
    s.add_argument("--split", default=None)
    s.add_argument("--episode", type=int, required=True)
    s.add_argument("--frame", type=int, required=True)
    s.add_argument("--json", action="store_true", help="one JSON object on one line, every value in full")
    s.set_defaults(fn=cmd_data_show)

    s = data.add_parser("stats", help="normalization statistics per embodiment (versioned JSON)")
    s.add_argument(
        "path", nargs="+", help="one dataset, or several for joint per-embodiment stats (needs --out)"
    )
    s.add_argument(
        "--out", default=None, help="output JSON (default: <dataset>/meta/vla_stats.json or the cache)"
    )
    s.add_argument("--max-episodes", type=int, default=None)
    s.add_argument("--embodiment", default=None, help=SPEC_HELP)
    s.set_defaults(fn=cmd_data_stats)

    s = data.add_parser("validate", help="report every problem in one pass (exit 1 if any)")
    s.add_argument("path")
    s.add_argument("--embodiment", default=None, help=SPEC_HELP)
    s.add_argument("--max-episodes", type=int, default=None)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_data_validate)

    s = data.add_parser("convert", help="convert a dataset to LeRobot v3.0")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--to", choices=["lerobot"], required=True)
    s.add_argument("--vcodec", choices=["av1", "h264"], default="av1", help="video codec of the cameras")
    s.add_argument("--no-video", action="store_true", help="store images in parquet instead of video")
    s.add_argument("--max-episodes", type=int, default=None, help="at most this many episodes (all splits)")
    s.add_argument("--split", default=None, help="convert only this split (default: every split)")
    s.add_argument("--overwrite", action="store_true", help="replace a dataset already at DST")
    s.set_defaults(fn=cmd_data_convert)

    s = data.add_parser("preview", help="render an episode: cameras side by side, state/action traces below")
    s.add_argument("path")
    s.add_argument("--split", default=None)
    s.add_argument("--episode", type=int, default=0, help="episode index within the split")
    s.add_argument("--out", required=True, help="FILE.mp4 or FILE.gif")
    s.add_argument("--fps", type=float, default=None, help="playback rate (default: the dataset's)")
    s.set_defaults(fn=cmd_data_preview)

    s = data.add_parser("merge", help="join LeRobot datasets with the same features (e.g. generation shards)")
    s.add_argument("sources", nargs="+")
    s.add_argument("--out", required=True, help="a new folder (not one of the sources)")
    s.add_argument("--overwrite", action="store_true", help="replace a dataset already at --out")
    s.set_defaults(fn=cmd_data_merge)

    sim = sub.add_parser("sim", help="simulated demonstrations (MuJoCo)").add_subparsers(
        dest="sim_command", required=True
    )
    s = sim.add_parser("generate", help="scripted-expert episodes -> LeRobot v3.0 dataset")
    s.add_argument(
        "--embodiment",
        required=True,
        help="panda, ur5e, widowx, kinova_gen3, aloha, procedural_<4..7>dof (a new arm per episode; "
        "plain procedural: the DoF of seed 0's arm)",
    )
    s.add_argument(
        "--task", required=True, help="reach, reach_slots, reach_fixed_slots, pick_place, push, stack, drawer"
    )
    s.add_argument("--episodes", type=int, required=True, help="episodes over all shards")
    s.add_argument("--out", required=True, help="dataset folder (re-running with the same settings resumes)")
    s.add_argument("--workers", type=int, default=1, help="processes simulating episodes")
    s.add_argument("--seed", type=int, default=0, help="episode i's world is drawn from (seed, i)")
    s.add_argument(
        "--randomization", default="none", help="none|low|medium|high|reality_proxy or a YAML file"
    )
    s.add_argument("--image-size", type=int, default=128, help="camera images are SIZE x SIZE pixels")
    s.add_argument("--shard", type=int, default=0, help="this run's block of episodes (array jobs)")
    s.add_argument("--num-shards", type=int, default=1, help="blocks the episodes are split into")
    s.add_argument(
        "--keep-failed", action="store_true", help="keep unsuccessful demos (flagged success=false)"
    )
    s.add_argument(
        "--settle-steps",
        type=int,
        default=None,
        help="control steps recorded after success (release and retreat; default: 1 s of them)",
    )
    s.add_argument("--vcodec", choices=["av1", "h264"], default="av1", help="video codec of the cameras")
    s.add_argument("--max-steps", type=int, default=None, help="episode length limit (default: the task's)")
    s.set_defaults(fn=cmd_sim_generate)
    s = sim.add_parser("preview", help="render the scripted expert on one episode")
    s.add_argument("--embodiment", required=True)
    s.add_argument("--task", required=True)
    s.add_argument("--out", required=True, help="FILE.mp4 or FILE.gif")
    s.add_argument("--seed", type=int, default=0, help="the episode's seed")
    s.add_argument(
        "--randomization", default="none", help="none|low|medium|high|reality_proxy or a YAML file"
    )
    s.add_argument("--settle-steps", type=int, default=None, help="steps shown after success (default: 1 s)")
    s.set_defaults(fn=cmd_sim_preview)

    model = sub.add_parser("model", help="create and inspect model checkpoints").add_subparsers(
        dest="model_command", required=True
    )
    s = model.add_parser("init", help="write an untrained checkpoint (integration tests, robot bring-up)")
    s.add_argument("config", help="preset name under configs/model/ or a YAML file")
    s.add_argument("--out", required=True)
    s.add_argument(
        "--embodiment", action="append", help="embodiment name (repeatable; default: the config's)"
    )
    s.add_argument(
        "--stats-from",
        default=None,
        help="dataset whose normalization stats go into the checkpoint (computed first if `vla data stats` "
        "has not been run on it); they must cover every --embodiment",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of the random initial weights")
    s.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at --out")
    s.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted config override, repeatable (e.g. --set flow.num_steps=5)",
    )
    s.set_defaults(fn=cmd_model_init)

    s = model.add_parser("info", help="parameter counts per component of a config or checkpoint")
    s.add_argument("target", help="preset name, YAML file or checkpoint folder")
    s.add_argument("--embodiment", action="append")
    s.add_argument("--json", action="store_true")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_model_info)

    s = model.add_parser(
        "predict", help="a checkpoint's action chunk on one dataset frame, next to the recorded actions"
    )
    s.add_argument(
        "checkpoint", help="checkpoint folder, run folder (its newest complete step) or step folder"
    )
    s.add_argument("dataset")
    s.add_argument("--split", default=None)
    s.add_argument("--episode", type=int, required=True)
    s.add_argument("--frame", type=int, required=True, help="raw frame index within the episode")
    s.add_argument("--seed", type=int, default=0, help="seed of the flow's noise (same seed, same chunk)")
    s.add_argument("--num-steps", type=int, default=None, help="flow steps (default: the checkpoint's)")
    s.add_argument("--json", action="store_true", help="one JSON object on one line")
    s.set_defaults(fn=cmd_model_predict)

    s = sub.add_parser(
        "train",
        help="train (or resume) a VLA: vla train PRESET_OR_YAML --run-dir DIR [--set key=value ...]",
        description="Train a VLA from a TrainConfig preset (configs/train/) or YAML file. Re-running with an "
        "existing --run-dir resumes from its newest complete checkpoint. Launch on several processes with "
        "`torchrun --nproc-per-node N -m vla.cli train ...` or `accelerate launch --config_file "
        "configs/accelerate/<name>.yaml -m vla.cli train ...`.",
    )
    s.add_argument(
        "config", help="preset name under configs/train/ (debug, sim_pretrain, ...) or a YAML file"
    )
    s.add_argument(
        "--run-dir",
        default=None,
        help="run folder: checkpoints/, metrics.jsonl, config.yaml (required unless --dry-run)",
    )
    s.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, repeatable (e.g. --set train.steps=100 --set data.datasets=[data/x])",
    )
    s.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (model built on the meta device: parameter counts, global batch, training memory "
        "per GPU under DDP and FSDP2) as JSON and exit; reads no data or weights",
    )
    s.add_argument("--gpus", type=int, default=8, help="with --dry-run: GPUs the memory plan shards over")
    s.add_argument(
        "--embodiment", action="append", help="with --dry-run: embodiment table (default: the mixture's)"
    )
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser(
        "finetune",
        help="fine-tune a checkpoint on a (new) robot: vla finetune INIT --embodiment NAME_OR_YAML --run-dir DIR",
        description="`vla train` with a fine-tuning preset (LoRA by default): INIT is a vla train run or step folder "
        "(or a vla model init folder), the data comes from --set data.datasets=[...]. Re-running resumes.",
    )
    s.add_argument(
        "init", help="checkpoint to start from: run folder (newest complete step), step or model folder"
    )
    s.add_argument("--embodiment", required=True, help="the robot: a registered name or a spec YAML file")
    s.add_argument("--run-dir", required=True)
    s.add_argument(
        "--preset",
        default="finetune_lora",
        help="finetune_lora (default), finetune_lora_r32, finetune_frozen_backbone, finetune_full, or a YAML file",
    )
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    s.set_defaults(fn=cmd_finetune)

    s = sub.add_parser("export", help="write a checkpoint as a plain model folder (LoRA merged with --merge)")
    s.add_argument("checkpoint", help="step or run folder (its newest complete step)")
    s.add_argument("--merge", action="store_true", help="fold LoRA adapters into the weights")
    s.add_argument("--out", required=True)
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(fn=cmd_export)

    emb = sub.add_parser("embodiment", help="robot specs").add_subparsers(
        dest="embodiment_command", required=True
    )
    s = emb.add_parser("draft", help="draft an EmbodimentSpec YAML from a dataset of a new robot")
    s.add_argument("dataset", help="LeRobot v2.1/v3 or RLDS dataset folder")
    s.add_argument("--name", required=True, help="the spec's name (use the dataset's robot_type)")
    s.add_argument("--out", required=True, help="NAME.yaml")
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(fn=cmd_embodiment_draft)

    from vla.serving.serve import add_serve_parser

    add_serve_parser(sub)

    from vla.eval.cli import add_eval_parser

    add_eval_parser(sub)

    s = sub.add_parser(
        "demo",
        help="the main job end to end on embedded defaults: sim data -> pretrain -> LoRA on an unseen robot -> "
        "closed-loop eval -> a served episode -> report and model card",
    )
    s.add_argument("--workdir", default="runs/demo")
    s.add_argument(
        "--quick", action="store_true", help="smoke-test sizes (seconds per stage; numbers mean nothing)"
    )
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vla.runtime import tune_allocator

    tune_allocator()  # freed tensors' memory stays in the process: no page faults per step (VLA_MALLOC_TUNING=0: off)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `vla data show ... | head`: the reader went away, nothing to report
        sys.stderr.close()
        return 0
    except (ValueError, KeyError, IndexError, OSError, RuntimeError, NotImplementedError) as e:
        if os.environ.get("VLA_DEBUG"):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
