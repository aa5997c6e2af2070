"""Training and sampling run the action expert two ways: ``velocity`` (one joint [state, actions] pass, what the
loss trains) and ``extend`` + ``flow_step`` (the state's keys/values cached once, each denoising step runs only the
actions, what serving runs). A property test over random batch sizes, embodiment mixes, image sizes, step counts and
noise, for both backbone families (Llama-style SmolVLM, Gemma-style PaliGemma), catches any divergence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla.models.testing import synthetic_batch, tiny_model

EMBODIMENTS = ("widowx_bridge", "franka_droid", "aloha", "google_robot_rt1")
CASES = 4  # random draws per family


@pytest.mark.parametrize("family", ["smolvlm", "paligemma"])
def test_cached_flow_steps_equal_the_joint_velocity_pass(family: str) -> None:
    model = tiny_model(family, embodiments=EMBODIMENTS, seed=0)
    rng = np.random.default_rng(0)
    for case in range(CASES):
        batch_size = int(rng.integers(1, 6))
        names = [EMBODIMENTS[i] for i in rng.integers(0, len(EMBODIMENTS), batch_size)]
        hw = [(32, 40), (24, 24), (40, 32)][int(rng.integers(0, 3))]
        steps = int(rng.integers(1, 4))
        batch = synthetic_batch(
            model, batch_size=batch_size, image_hw=hw, seed=case, embodiments=names, horizon=6
        )
        horizon = int(model.chunk_lengths[batch.embodiment_id].max())
        noise = torch.randn(
            batch_size, horizon, model.cfg.max_action_dim, generator=torch.Generator().manual_seed(case)
        )
        cached = model.sample_actions(batch, num_steps=steps, noise=noise)
        joint = model.sample_actions(batch, num_steps=steps, noise=noise, reuse_prefix=False)
        where = f"case {case}: {names}, images {hw}, {steps} steps"
        assert cached.abs().sum() > 0, where
        torch.testing.assert_close(cached, joint, atol=1e-5, rtol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
