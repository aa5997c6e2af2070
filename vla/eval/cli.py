"""``vla eval``: closed-loop success (``sim``), robustness per randomization axis (``sweep``), sim-vs-reference
agreement (``gap``), replay error against logs (``replay``), system identification (``sysid``), whether a
checkpoint looks or copies its state (``probe``) and the HTML ``report``. Registered on the ``vla`` parser by
``add_eval_parser``; every sub-command imports its module lazily.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _sim_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("policy", help="checkpoint (step folder, run folder or export), 'expert' or 'random'")
    s.add_argument(
        "--embodiment", required=True, help="sim robot: panda, widowx, ur5e, kinova_gen3, aloha, ..."
    )
    s.add_argument(
        "--task",
        required=True,
        help="reach, reach_slots, reach_fixed_slots, pick_place, push, stack or drawer",
    )
    s.add_argument("--episodes", type=int, default=50, help="episodes (per cell for a sweep)")
    s.add_argument("--workers", type=int, default=1, help="spawned worker processes (one env + policy each)")
    s.add_argument(
        "--seed", type=int, default=0, help="episode i starts from seed (seed, i): same for all policies"
    )
    s.add_argument("--execute-steps", type=int, default=None, help="actions run per chunk (default: all H)")
    s.add_argument("--image-size", type=int, default=128, help="rendered camera size (px)")
    s.add_argument("--max-steps", type=int, default=None, help="episode length (default: the task's)")
    s.add_argument(
        "--via-server", default=None, metavar="URL", help="evaluate the policy a `vla serve` serves"
    )
    s.add_argument(
        "--device", default="cpu", help="torch device of an in-process checkpoint (cpu, cuda, cuda:1)"
    )
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--num-steps", type=int, default=None, help="flow steps (default: the checkpoint's)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


def _config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "policy": args.policy,
        "embodiment": args.embodiment,
        "task": args.task,
        "episodes": args.episodes,
        "workers": args.workers,
        "seed": args.seed,
        "execute_steps": args.execute_steps,
        "image_size": args.image_size,
        "max_steps": args.max_steps,
        "via_server": args.via_server,
        "device": args.device,
        "dtype": args.dtype,
        "num_steps": args.num_steps,
    }


def cmd_eval_sim(args: argparse.Namespace) -> int:
    from vla.eval.rollout import EvalConfig, evaluate

    cfg = EvalConfig(**_config_kwargs(args), out=args.out, randomization=args.randomization,
                     video_every=args.video_every)  # fmt: skip
    res = evaluate(cfg, progress_bar=not args.no_progress)
    low, high = res["ci95"]
    print(
        f"{res['policy']} on {res['embodiment']}/{res['task']} ({res['randomization']}): "
        f"{res['successes']}/{res['episodes']} = {res['success_rate']:.1%} [95% CI {low:.1%}, {high:.1%}] "
        f"-> {args.out}/results.json"
    )
    return 0


def cmd_eval_sweep(args: argparse.Namespace) -> int:
    from vla.eval.rollout import EvalConfig
    from vla.eval.sweep import parse_axes, parse_levels, sweep

    cfg = EvalConfig(**_config_kwargs(args), out=args.out, video_every=args.video_every)
    res = sweep(cfg, parse_axes(args.axes), parse_levels(args.levels), held_out=not args.no_reality_proxy,
                progress_bar=not args.no_progress)  # fmt: skip
    for axis, cells in res["axes"].items():
        print(f"{axis:<11} " + "  ".join(f"{c['level']}={c['success_rate']:.0%}" for c in cells))
    if "reality_proxy" in res:
        print(f"reality_proxy {res['reality_proxy']['success_rate']:.0%}")
    print(f"-> {args.out}/results.json, {', '.join(res['plots'])}")
    return 0


def cmd_eval_gap(args: argparse.Namespace) -> int:
    from vla.eval.gap import gap

    res = gap(args.sim_runs, args.reference, args.out)
    print(f"{res['policies']} policies: Pearson r={res['pearson']:.3f}  MMRV={res['mmrv']:.3f}  "
          f"Kendall tau={res['kendall_tau']:.3f} -> {args.out}/gap.json")  # fmt: skip
    return 0


def _episode_list(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--episodes: expected comma-separated episode indices, got {text!r}") from None


def _logged(args: argparse.Namespace) -> list[Any]:
    from vla.eval.replay import read_sim_episodes

    episodes = read_sim_episodes(args.dataset, _episode_list(args.episodes), args.split)
    if args.embodiment:
        for ep in episodes:
            ep.embodiment = args.embodiment
    return episodes


def cmd_eval_replay(args: argparse.Namespace) -> int:
    from vla.eval.replay import SimParams, replay, write_report

    if args.bridge:
        from vla.eval.bridge import replay_bridge

        report = replay_bridge(
            args.dataset, split=args.split or "train", episodes=_episode_list(args.episodes)
        )
        s = report["summary"]
        print(f"{s['episodes']} Bridge episodes on the sim WidowX: end-effector divergence mean {s['mean_m'] * 1e3:.1f} mm, "
              f"final {s['final_m'] * 1e3:.1f} mm, max {s['max_m'] * 1e3:.1f} mm")  # fmt: skip
    else:
        params = SimParams.parse(args.params or "")
        report = replay(_logged(args), params, use_record=not args.no_record).to_json()
        s = report["summary"]
        print(f"{len(report['episodes'])} episodes, joint divergence (rad) mean {s['mean']:.5f} final "
              f"{s['final']:.5f} max {s['max']:.5f}")  # fmt: skip
    if args.out:
        print(f"-> {write_report(report, args.out)}")
    return 0


def cmd_eval_sysid(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vla.eval.sysid import fit, parse_params, write_preset

    result = fit(_logged(args), parse_params(args.params), max_latency=args.max_latency, max_evals=args.max_evals,
                 seed=args.seed, use_record=args.use_record)  # fmt: skip
    out = write_preset(result, args.out, name=f"sysid_{Path(args.dataset).name}", spread=args.spread)
    Path(out).with_suffix(".json").write_text(json.dumps(result, indent=1, allow_nan=False))
    print(
        f"replay error {result['error_before']:.5f} -> {result['error_after']:.5f} rad ({result['evaluations']} replays)"
    )
    for name, value in result["params"].items():
        flag = "" if result["identifiable"][name] else "  (not identifiable from these logs)"
        print(f"  {name} = {value:.4g}{flag}")
    print(f"-> {out} (use with --randomization {out}), {Path(out).with_suffix('.json')}")
    return 0


def cmd_eval_probe(args: argparse.Namespace) -> int:
    from vla.eval.probe import probe, write_probe

    result = probe(args.policy, args.embodiment, args.task, episodes=args.episodes, seed=args.seed,
                   image_size=args.image_size, randomization=args.randomization, samples=args.samples,
                   shift=args.shift, device=args.device, dtype=args.dtype)  # fmt: skip
    s = result["summary"]
    print(
        f"{result['policy']} on {result['embodiment']}/{args.task}, first observation of {args.episodes} episodes:"
    )
    for key in ("spread_ratio", "image_sensitivity", "instruction_sensitivity", "state_response"):
        print(f"  {key:<24} {'n/a' if s[key] is None else f'{s[key]:.3f}'}")
    print(f"  first-chunk error {s['first_chunk_error']:.4f} (the expert moves {s['expert_motion']:.4f} over the "
          f"chunk); {s['error_vs_mean_motion']:.2f} x the error of the expert's average motion")  # fmt: skip
    for line in result["verdict"]:
        print(f"  -> {line}")
    if args.out:
        print(f"-> {write_probe(result, args.out)}")
    return 0


def cmd_eval_report(args: argparse.Namespace) -> int:
    from vla.eval.report import build_report

    out = build_report(args.runs, args.out, title=args.title)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, self-contained)")
    return 0


def add_eval_parser(sub: Any) -> None:
    """Add ``vla eval ...`` to the top-level sub-parsers ``sub``."""
    ev = sub.add_parser("eval", help="closed-loop evaluation and reality-gap metrics").add_subparsers(
        dest="eval_command", required=True
    )
    s = ev.add_parser(
        "sim", help="closed-loop success rate with a 95%% Wilson interval -> RUN_DIR/results.json"
    )
    _sim_args(s)
    s.add_argument("--out", required=True, help="run folder: results.json, videos/")
    s.add_argument("--randomization", default="none",
                   help="level (none|low|medium|high|reality_proxy) or a preset YAML (e.g. from vla eval sysid)")  # fmt: skip
    s.add_argument("--video-every", type=int, default=10,
                   help="record every K-th episode (plus a success and a failure); 0 = none")  # fmt: skip
    s.set_defaults(fn=cmd_eval_sim)

    s = ev.add_parser(
        "sweep", help="success vs. severity of one randomization source at a time (+ reality_proxy)"
    )
    _sim_args(s)
    s.add_argument(
        "--out", required=True, help="sweep folder: results.json, sweep_<axis>.png, runs/, presets/"
    )
    s.add_argument("--axes", default="dynamics,perception,actuation,system")
    s.add_argument("--levels", default="0,1,2,3", help="0=none 1=low 2=medium 3=high")
    s.add_argument("--no-reality-proxy", action="store_true", help="skip the held-out reality_proxy column")
    s.add_argument(
        "--video-every", type=int, default=0, help="record every K-th episode of each cell; 0 = none"
    )
    s.set_defaults(fn=cmd_eval_sweep)

    s = ev.add_parser("gap", help="sim-vs-reference agreement over policies: Pearson r, MMRV, Kendall tau")
    s.add_argument("sim_runs", nargs="+", help="eval run folders (one per policy)")
    s.add_argument("--reference", nargs="+", required=True,
                   help="a CSV (policy,success_rate[,task]) of real rates, or eval run folders (e.g. reality_proxy)")  # fmt: skip
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_eval_gap)

    s = ev.add_parser("replay", help="replay logged actions open loop in the sim: state divergence per step")
    s.add_argument("dataset", help="a `vla sim generate` dataset, or with --bridge the Bridge RLDS export")
    s.add_argument(
        "--bridge", action="store_true", help="real WidowX logs (Bridge RLDS) on the sim WidowX via IK"
    )
    s.add_argument("--episodes", default=None, help="comma-separated episode indices (default: all)")
    s.add_argument("--split", default=None)
    s.add_argument("--embodiment", default=None, help="sim robot to replay on (default: the dataset's)")
    s.add_argument("--params", default=None, help="sim parameter scales, e.g. damping=1.2,kp=0.9,latency=1")
    s.add_argument(
        "--no-record", action="store_true", help="do not re-apply the episodes' randomization records"
    )
    s.add_argument("--out", default=None, help="replay.json")
    s.set_defaults(fn=cmd_eval_replay)

    s = ev.add_parser(
        "sysid", help="fit sim parameters to logs (min replay error, CMA-ES) -> randomization preset"
    )
    s.add_argument("dataset", help="logged trajectories (a LeRobot dataset written by `vla sim generate`)")
    s.add_argument("--embodiment", default=None, help="sim robot to replay on (default: the dataset's)")
    s.add_argument("--params", default="friction,damping,armature,kp,latency")
    s.add_argument("--out", required=True, help="preset YAML (the fit report is written next to it as .json)")
    s.add_argument("--episodes", default=None, help="comma-separated episode indices (default: all)")
    s.add_argument("--split", default=None)
    s.add_argument("--max-evals", type=int, default=300, help="replay budget of the search")
    s.add_argument("--max-latency", type=int, default=4, help="largest latency (control steps) searched")
    s.add_argument("--spread", type=float, default=0.05, help="preset range: fit x [1 - spread, 1 + spread]")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--use-record", action="store_true",
                   help="replay with the episodes' randomization records (default: the nominal world is fitted)")  # fmt: skip
    s.set_defaults(fn=cmd_eval_sysid)

    s = ev.add_parser(
        "probe",
        help="does a checkpoint use the camera and the instruction, or copy its state? (first chunks)",
    )
    s.add_argument("policy", help="checkpoint (step folder, run folder or export)")
    s.add_argument("--embodiment", required=True, help="sim robot: panda, widowx, ur5e, kinova_gen3, ...")
    s.add_argument(
        "--task",
        required=True,
        help="reach, reach_slots, reach_fixed_slots, pick_place, push, stack or drawer",
    )
    s.add_argument(
        "--episodes", type=int, default=20, help="episodes whose first observation is probed (>= 2)"
    )
    s.add_argument(
        "--seed", type=int, default=0, help="episode i starts from seed (seed, i), as in `vla eval sim`"
    )
    s.add_argument("--image-size", type=int, default=128, help="rendered camera size (px)")
    s.add_argument("--randomization", default="low", help="level or preset YAML, as in `vla eval sim`")
    s.add_argument("--samples", type=int, default=4, help="noise draws averaged per chunk")
    s.add_argument("--shift", type=float, default=0.05, help="added to every joint of the state (rad)")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    s.add_argument("--out", default=None, help="probe.json")
    s.set_defaults(fn=cmd_eval_probe)

    s = ev.add_parser("report", help="one self-contained offline HTML page over eval outputs")
    s.add_argument("runs", nargs="+", help="sim/sweep run folders, gap folders, replay .json files")
    s.add_argument("--out", required=True, help="report.html")
    s.add_argument("--title", default="vla eval report")
    s.set_defaults(fn=cmd_eval_report)


def _print_json(obj: object) -> None:
    print(json.dumps(obj, indent=None, allow_nan=False))


__all__ = ["add_eval_parser"]
