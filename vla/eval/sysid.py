"""``vla eval sysid``: fit simulator parameters to logged trajectories by minimizing the replay error, and write
the fit as a randomization preset centred on it.

The objective is the mean per-step joint divergence (rad) of ``vla.eval.replay`` over the logged episodes. The
search runs CMA-ES (Hansen's ``cma`` package) over the log of each scale (friction, damping, armature, kp; within
``[1/4, 4]`` of the replayed world's values) and over latency (whole control steps, rounded, ``0..max_latency``),
starting at the nominal world. After the fit each parameter's sensitivity is measured — the objective's rise when
the parameter alone moves ±25 % (latency ±1 step) — and a parameter whose logs barely react (e.g. contact friction
from a reach without contact, or joint damping on a robot whose damping is all in its servos) is flagged
``identifiable: false``: its value is the search's and says little.

The preset (YAML, loadable by ``--randomization``): the ``none`` level with ``dynamics.friction_scale``,
``damping_scale``, ``armature_scale`` and ``actuation.gain_scale`` set to ``[fit·(1-spread), fit·(1+spread)]``
and ``actuation.latency_steps`` to ``[L, L]`` — the same scales of the same model values, relative to the built
world.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vla.eval.replay import PARAM_NAMES, LoggedEpisode, Replayer, SimParams

SCALE_BOUND = math.log(4.0)
SENSITIVITY_FLOOR = 1e-4  # rad: an objective change below this when a parameter moves is "not identifiable"


def parse_params(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PARAM_NAMES]
    if bad or not names:
        raise ValueError(f"--params: unknown {bad or text!r}; choose from {','.join(PARAM_NAMES)}")
    return names


class Objective:
    """Mean replay divergence of ``episodes`` for a vector ``x`` over the fitted ``names`` (log scales; latency
    in steps). Worlds are built once per episode."""

    def __init__(self, episodes: list[LoggedEpisode], names: list[str], *, use_record: bool = False) -> None:
        if not episodes:
            raise ValueError("system identification needs at least one logged episode")
        self.names = names
        self.replayers = [Replayer(ep, use_record=use_record) for ep in episodes]
        self.evaluations = 0

    def params(self, x: np.ndarray) -> SimParams:
        values: dict[str, Any] = {}
        for name, v in zip(self.names, x, strict=True):
            values[name] = max(0, round(float(v))) if name == "latency" else math.exp(float(v))
        return SimParams(**values)

    def error(self, p: SimParams) -> float:
        self.evaluations += 1
        return float(np.mean([r.divergence(p)["mean"] for r in self.replayers]))

    def __call__(self, x: np.ndarray) -> float:
        return self.error(self.params(np.asarray(x)))

    def close(self) -> None:
        for r in self.replayers:
            r.close()


def fit(episodes: list[LoggedEpisode], names: list[str], *, max_latency: int = 4, max_evals: int = 300,
        seed: int = 0, use_record: bool = False) -> dict[str, Any]:  # fmt: skip
    """CMA-ES fit of ``names`` to the logs: ``{"params", "error_before", "error_after", "sensitivity", ...}``."""
    import cma

    obj = Objective(episodes, names, use_record=use_record)
    try:
        lower = [-0.49 if n == "latency" else -SCALE_BOUND for n in names]
        upper = [max_latency + 0.49 if n == "latency" else SCALE_BOUND for n in names]
        stds = [2.5 if n == "latency" else 1.0 for n in names]  # x sigma0 0.4: ~1 step, ~0.4 in log scale
        x0 = np.zeros(len(names))
        before = obj(x0)
        if len(names) == 1:  # CMA-ES needs two dimensions; a 1-d fit is a bounded scalar search
            best_x = _fit_1d(obj, lower[0], upper[0], names[0] == "latency")
        else:
            es = cma.CMAEvolutionStrategy(x0, 0.4, {"bounds": [lower, upper], "CMA_stds": stds, "seed": seed + 1,
                                                    "maxfevals": max_evals, "verbose": -9, "tolfun": 1e-7})  # fmt: skip
            es.optimize(obj)
            best_x = es.result.xbest if es.result.xbest is not None else x0
        best = obj.params(best_x)
        after = obj.error(best)
        if after > before:  # never report a fit worse than the start
            best, after = obj.params(x0), before
        sensitivity = {n: _sensitivity(obj, best, n, after) for n in names}
        return {
            "params": {n: getattr(best, n) for n in names},
            "all_params": asdict(best),
            "error_before": before,
            "error_after": after,
            "units": "rad: mean per-step L2 joint divergence over the episodes",
            "sensitivity": sensitivity,
            "identifiable": {n: s >= SENSITIVITY_FLOOR for n, s in sensitivity.items()},
            "evaluations": obj.evaluations,
            "episodes": len(episodes),
        }
    finally:
        obj.close()


def _fit_1d(obj: Objective, low: float, high: float, integer: bool) -> np.ndarray:
    if integer:
        values = list(range(0, int(high) + 1))
        errs = [obj(np.array([v])) for v in values]
        return np.array([values[int(np.argmin(errs))]])
    from scipy.optimize import minimize_scalar

    res = minimize_scalar(lambda v: obj(np.array([v])), bounds=(low, high), method="bounded",
                          options={"xatol": 1e-3})  # fmt: skip
    return np.array([res.x])


def _sensitivity(obj: Objective, best: SimParams, name: str, at_best: float) -> float:
    """The objective's smallest rise when ``name`` alone moves off the fit (±25 %, latency ±1 step)."""
    value = getattr(best, name)
    moves = [value + 1, value - 1] if name == "latency" else [value * 1.25, value / 1.25]
    rises = []
    for v in moves:
        if name == "latency" and v < 0:
            continue
        rises.append(obj.error(SimParams(**{**asdict(best), name: v})) - at_best)
    return float(min(rises)) if rises else 0.0


def write_preset(result: dict[str, Any], out: str | Path, *, name: str, spread: float = 0.05) -> Path:
    """The fitted values as a randomization preset (see the module docstring); validated by loading it back."""
    from vla.config import read_preset
    from vla.sim.randomization import load_randomization

    if not 0 <= spread < 1:
        raise ValueError(f"--spread must be in [0, 1), got {spread}")
    p = result["all_params"]
    data = dict(read_preset("sim", "none"))
    band = lambda v: [round(v * (1 - spread), 6), round(v * (1 + spread), 6)]  # noqa: E731
    data["name"] = name
    data["description"] = (
        f"system identification (vla eval sysid): replay error {result['error_before']:.4g} -> "
        f"{result['error_after']:.4g} rad; fitted {result['params']}"
    )
    data["dynamics"] = {"friction_scale": band(p["friction"]), "damping_scale": band(p["damping"]),
                        "armature_scale": band(p["armature"])}  # fmt: skip
    data["actuation"] = {"gain_scale": band(p["kp"]), "latency_steps": [int(p["latency"])] * 2}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(f"# {line}\n" for line in _summary_lines(result))
    out.write_text(header + yaml.safe_dump(data, sort_keys=False))
    load_randomization(out)
    return out


def _summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        f"replay error before {result['error_before']:.5f}, after {result['error_after']:.5f} ({result['units']})"
    ]
    for n, v in result["params"].items():
        ok = "" if result["identifiable"][n] else "  (NOT identifiable from these logs: sensitivity below "
        ok += f"{SENSITIVITY_FLOOR} rad)" if ok else ""
        lines.append(f"{n} = {v:.4g}{ok}")
    return lines


def synthesize_logs(embodiment: str, task: str, params: SimParams, seeds: list[int], *,
                    max_steps: int | None = None) -> list[LoggedEpisode]:  # fmt: skip
    """Scripted-expert logs from a world whose parameters are ``params`` (known ground truth for tests): the
    expert acts on the state it sees; the servos get its actions ``params.latency`` steps late."""
    from vla.eval.replay import apply_params, nominal_params
    from vla.eval.state_env import StateOnlyEnv

    env = StateOnlyEnv(embodiment, task, max_steps=max_steps)
    out = []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        m = env.world.model
        apply_params(m, nominal_params(m), [m.actuator(a).id for a in env.world.robot.actuator_names], params)
        states, actions = [obs["state"]], []
        for t in range(env.max_steps):
            actions.append(env.expert_action().astype(np.float64))
            obs, _, term, trunc, _ = env.step(actions[max(0, t - params.latency)])
            if term or trunc:
                break
            states.append(obs["state"])
        out.append(LoggedEpisode(embodiment=embodiment, task=task, states=np.asarray(states),
                                 actions=np.asarray(actions[: len(states)]), seed=seed, name=f"synthetic/{seed}"))  # fmt: skip
    env.close()
    return out


__all__ = ["Objective", "fit", "parse_params", "synthesize_logs", "write_preset"]
