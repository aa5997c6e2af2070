"""``vla eval probe``: its numbers tell a policy that looks at the scene and reads the instruction from one that copies
its proprioception forward, and the command runs on a real (tiny) checkpoint in the sim."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vla.cli import main
from vla.eval.probe import ProbeInputs, summarize, verdict

N, H, D = 12, 8, 6


def _expert() -> np.ndarray:
    """First chunks of N episodes: a common motion plus a per-episode (target-dependent) part."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0.0, 1.0, H)[None, :, None]
    return 0.1 * ramp + ramp * rng.normal(0.0, 0.15, (N, 1, D))


def test_a_policy_that_looks_passes_and_a_copycat_is_named() -> None:
    expert = _expert()
    nxt = np.roll(np.arange(N), -1)
    differs = np.ones(N, bool)
    differs[3] = False  # one pair with the same instruction: left out of the instruction number
    # Looks: follows the target; another scene or instruction moves it as the expert would move; a shifted state
    # moves it little (it aims at the target).
    looks = ProbeInputs(pred=expert + 0.01, expert=expert, image_swap=expert[nxt] + 0.01,
                        instruction_swap=expert[nxt] + 0.01, state_shift=expert + 0.01 + 0.1 * 0.05, shift=0.05,
                        instruction_differs=differs)  # fmt: skip
    s = summarize(looks)
    assert s["spread_ratio"] == pytest.approx(1.0) and s["image_sensitivity"] == pytest.approx(1.0)
    assert s["instruction_sensitivity"] == pytest.approx(1.0) and s["state_response"] == pytest.approx(0.1)
    assert s["first_chunk_error"] == pytest.approx(0.01) and s["error_vs_mean_motion"] < 0.2
    assert verdict(s) == ["no shortcut found at the first observation"]
    # Copies its state: one mean motion whatever the scene or instruction, moved one for one by the state.
    mean = np.broadcast_to(expert.mean(0), expert.shape)
    copycat = ProbeInputs(pred=mean, expert=expert, image_swap=mean, instruction_swap=mean, state_shift=mean + 0.05,
                          shift=0.05, instruction_differs=differs)  # fmt: skip
    s = summarize(copycat)
    assert s["spread_ratio"] == pytest.approx(0.0, abs=1e-9) and s["image_sensitivity"] == 0.0
    assert s["instruction_sensitivity"] == 0.0 and s["state_response"] == pytest.approx(1.0)
    assert s["error_vs_mean_motion"] == pytest.approx(1.0)  # it is the average motion
    said = " | ".join(verdict(s))
    for words in ("one motion for every target", "does not use the camera", "does not follow the instruction",
                  "copies its proprioception", "has not found the target"):  # fmt: skip
        assert words in said, said
    # undefined rather than made up: one episode, or no pair of episodes with different instructions
    one = ProbeInputs(*(a[:1] for a in (mean, expert, mean, mean, mean)), 0.05, differs[:1])
    assert all(v is None for v in summarize(one).values())
    same = ProbeInputs(mean, expert, mean, mean, mean + 0.05, 0.05, np.zeros(N, bool))
    assert summarize(same)["instruction_sensitivity"] is None


def test_probe_command_on_a_checkpoint(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "probe.json"
    args = ["eval", "probe", str(tiny_checkpoint), "--embodiment", "widowx", "--task", "reach", "--episodes", "3",
            "--image-size", "32", "--samples", "1", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res["embodiment"] == "sim_widowx" and res["episodes"] == 3 and len(res["episodes_detail"]) == 3
    s = res["summary"]
    assert all(np.isfinite(s[k]) for k in ("spread_ratio", "image_sensitivity", "state_response",
                                           "error_vs_mean_motion"))  # fmt: skip
    assert s["expert_motion"] > 0  # the expert's first chunk moves the arm
    printed = capsys.readouterr().out
    assert res["verdict"] and "spread_ratio" in printed
    assert f"{s['error_vs_mean_motion']:.2f} x the error of the expert's average motion" in printed
    assert main(args) == 0 and json.loads(out.read_text())["summary"] == s  # deterministic (seeded noise)
    # the probe compares episodes: one is refused with the reason
    assert main([*args[:8], "1", *args[9:]]) != 0
    assert "--episodes must be at least 2" in capsys.readouterr().err
