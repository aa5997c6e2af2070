"""Success rates with 95 % Wilson score intervals, per run and per group (task, embodiment, randomization level).

The Wilson interval (Wilson 1927, "Probable inference, the law of succession, and statistical inference",
JASA 22:209) stays inside [0, 1] and keeps its coverage at the extremes (0/n, n/n) and for the small episode
counts closed-loop evaluation affords, where the normal (Wald) interval collapses to a point.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile: a two-sided 95 % interval


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """``(low, high)`` of the Wilson score interval for ``successes`` out of ``trials`` (two-sided, ``z`` sigmas)."""
    if trials < 0 or not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval: need 0 <= successes <= trials, got {successes} of {trials}")
    if trials == 0:
        return (0.0, 1.0)  # no evidence: the whole range
    p = successes / trials
    z2 = z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z / (1 + z2 / trials) * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials))
    # exact endpoints at 0/n and n/n (the formula gives them up to rounding)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return (low, high)


def success_summary(outcomes: Sequence[bool]) -> dict[str, Any]:
    """``{"episodes", "successes", "success_rate", "ci95": [low, high]}`` of a list of episode outcomes."""
    n, k = len(outcomes), int(sum(bool(o) for o in outcomes))
    low, high = wilson_interval(k, n)
    return {"episodes": n, "successes": k, "success_rate": k / n if n else 0.0, "ci95": [low, high]}


def grouped_summary(episodes: Iterable[Mapping[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """``success_summary`` per distinct value of ``episode[key]`` (e.g. ``task``, ``embodiment``, ``level``)."""
    groups: dict[str, list[bool]] = {}
    for ep in episodes:
        groups.setdefault(str(ep[key]), []).append(bool(ep["success"]))
    return {name: success_summary(outcomes) for name, outcomes in sorted(groups.items())}


__all__ = ["Z95", "grouped_summary", "success_summary", "wilson_interval"]
