"""Generated demonstrations show the whole skill: recording goes on for ``settle_steps`` after the success detector
fires, so a stack / pick-and-place demo shows the fingers opening and the arm moving away from the object
(``vla.sim.generate``), in the dataset's actions, states and camera frames."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vla.data.readers import open_dataset
from vla.sim.env import make
from vla.sim.generate import GenerateConfig, expert_rollout, generate
from vla.sim.tasks import body_pos


def test_generated_stack_demo_records_the_release_and_retreat(tmp_path: Path) -> None:
    out = tmp_path / "stack"
    generate(GenerateConfig(embodiment="panda", task="stack", episodes=1, out=str(out), image_size=48,
                            vcodec="h264"), progress_bar=False)  # fmt: skip
    reader = open_dataset(out)
    meta = reader.episode_metadata("train", 0)
    raw = reader.read_episode("train", 0)
    fired, settle = int(meta["success_step"]), int(meta["settle_steps"])
    assert meta["success"] and settle == 10  # 1 s at the Panda's 10 Hz
    assert raw.length == fired + settle == meta["steps"]
    grip = -1  # the Panda's gripper dim (state and action): opening in [0, 1], 1 = open
    action, state = raw.steps["action"], raw.steps["observation.state"]
    assert (action[fired - 1 :, grip] == 1.0).all(), "the open command is held through the settle steps"
    assert state[fired - 1, grip] < 0.8 and state[-1, grip] > 0.95, "the fingers are seen opening fully"
    # the arm moves away: the cameras see it (the first settle frame differs from the last one)
    for key in reader.image_keys():
        frames = reader.read_images("train", 0, [fired, raw.length - 1], [key])[key].astype(np.float64)
        assert np.abs(frames[1] - frames[0]).mean() > 1.0, key


def test_settle_steps_lift_the_gripper_off_the_object() -> None:
    """Without settle steps the episode ends with the object between the fingers; with them the gripper is far above
    it and the task still succeeds; ``settle=0`` gives the old episode, frame for frame."""
    env = make("panda", "stack", image_size=16)
    short = expert_rollout(env, 0, 0)
    target = env.setup.goal["target"]
    height = env.setup.goal["heights"][target]

    def gap() -> float:
        return float(env.world.data.site_xpos[env.expert.site][2] - body_pos(env.world, target)[2])

    before = gap()
    long = expert_rollout(env, 0, 10)
    after = gap()
    assert short[2]["success"] and long[2]["success"]
    assert before < height, "the episode used to end with the fingers around the cube"
    assert after > before + 0.05 and after > 2 * height
    assert len(long[1]) == len(short[1]) + 10
    np.testing.assert_array_equal(np.stack(long[1][: len(short[1])]), np.stack(short[1]))
