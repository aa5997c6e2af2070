"""Sim-vs-reference agreement of success rates over a set of policies: Pearson r, MMRV and Kendall τ.

Each metric takes the two vectors keyword-only (``sim=``, ``real=``): MMRV is not symmetric, so a swapped call
must be impossible rather than silently wrong. ``real`` is the reference: logged real-robot success rates, or a
second evaluation standing in for reality (e.g. the held-out ``reality_proxy`` randomization level).

* Pearson r: linear correlation of the two rate vectors (nan when either is constant: undefined).
* MMRV, mean maximum rank violation (Li et al. 2024, "Evaluating Real-World Robot Manipulation Policies in
  Simulation" (SimplerEnv), ``simpler_env/utils/metrics.py``): for policy i, the largest *real* gap
  ``|real_i - real_j|`` over the policies j that sim orders differently from real (``(sim_i > sim_j) !=
  (real_i > real_j)``, strict comparisons as upstream); the mean over i. 0 = sim ranks like real; a violation
  between policies that real separates widely costs more than one between near-equal policies.
* Kendall τ-b (ties accounted for), via ``scipy.stats.kendalltau``: rank agreement in [-1, 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _pair(sim: Sequence[float], real: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    s, r = np.asarray(sim, dtype=np.float64), np.asarray(real, dtype=np.float64)
    if s.ndim != 1 or s.shape != r.shape:
        raise ValueError(
            f"sim and real must be 1-d and of equal length, got {list(s.shape)} and {list(r.shape)}"
        )
    if len(s) < 2:
        raise ValueError(f"agreement needs at least 2 policies, got {len(s)}")
    if not (np.isfinite(s).all() and np.isfinite(r).all()):
        raise ValueError("sim and real success rates must be finite")
    return s, r


def pearson(*, sim: Sequence[float], real: Sequence[float]) -> float:
    """Pearson correlation of the sim and reference success rates (nan when either vector is constant)."""
    s, r = _pair(sim, real)
    ds, dr = s - s.mean(), r - r.mean()
    denom = float(np.sqrt((ds * ds).sum() * (dr * dr).sum()))
    return float((ds * dr).sum() / denom) if denom > 0 else float("nan")


def mmrv(*, sim: Sequence[float], real: Sequence[float]) -> float:
    """Mean maximum rank violation (SimplerEnv's definition, see the module docstring); lower is better."""
    s, r = _pair(sim, real)
    worst = np.zeros(len(s))
    for i in range(len(s)):
        for j in range(len(s)):
            if (s[i] > s[j]) != (r[i] > r[j]):
                worst[i] = max(worst[i], abs(r[i] - r[j]))
    return float(worst.mean())


def kendall_tau(*, sim: Sequence[float], real: Sequence[float]) -> float:
    """Kendall's τ-b between the sim and reference rankings (nan when either vector is constant)."""
    from scipy.stats import kendalltau

    s, r = _pair(sim, real)
    return float(kendalltau(s, r).statistic)


def agreement(*, sim: Sequence[float], real: Sequence[float]) -> dict[str, Any]:
    """All three metrics plus the paired rates: ``{"pearson", "mmrv", "kendall_tau", "policies"}``."""
    return {
        "pearson": pearson(sim=sim, real=real),
        "mmrv": mmrv(sim=sim, real=real),
        "kendall_tau": kendall_tau(sim=sim, real=real),
        "policies": len(sim),
    }


__all__ = ["agreement", "kendall_tau", "mmrv", "pearson"]
