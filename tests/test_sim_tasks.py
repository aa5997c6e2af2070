"""vla.sim tasks, scripted experts and the Gymnasium env: every task builds on every robot, success detectors,
language that names the target, expert success, gymnasium's env checker, determinism and spaces."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco is imported (conftest sets it too)

import numpy as np
import pytest

from vla.sim import ROBOTS, build_world, embodiment_for
from vla.sim.env import VLASimEnv, make
from vla.sim.tasks import GRASP_MARGIN, TASKS, Workspace

ROBOT_NAMES = ROBOTS.names()
TASK_NAMES = TASKS.names()


def _episode(robot: str, task: str, seed: int):
    """Build the world of one episode the way the env does (no rendering)."""
    probe = build_world(robot, seed=seed, image_size=32)
    t = TASKS.get(task)
    setup = t.setup(np.random.default_rng([seed, 1]), Workspace.of(probe))
    world = build_world(robot, seed=seed, image_size=32, objects=setup.objects)
    t.initialize(world, setup)
    return t, setup, world


def _run_expert(env: VLASimEnv, seed: int) -> bool:
    env._obs = lambda: None  # type: ignore[method-assign]  # skip rendering: only success matters here
    env.reset(seed=seed)
    for _ in range(env.max_steps):
        _, _, terminated, truncated, info = env.step(env.expert_action())
        if terminated or truncated:
            return bool(info["success"])
    return False


def test_registry_has_the_seven_tasks() -> None:
    assert set(TASK_NAMES) == {
        "reach",
        "reach_slots",
        "reach_fixed_slots",
        "pick_place",
        "push",
        "stack",
        "drawer",
    }


def test_nearest_object_tells_the_named_object_from_a_distractor() -> None:
    """``nearest_object``: at the goal state the TCP is nearest the named object; with a distractor moved under the
    TCP instead, the distractor (a grounding failure, which the target distance alone cannot tell from a miss)."""
    import mujoco

    from vla.sim.tasks import set_free_pos

    t, setup, world = _episode("panda", "reach_slots", seed=3)
    target = setup.goal["target"]
    t.set_goal_state(world, setup)
    name, dist = t.nearest_object(world, setup)
    assert name == target and dist < 0.03
    other = next(n for n in setup.goal["heights"] if n != target)
    tcp = world.data.site(world.robot.arms[0].ee_site).xpos.copy()
    set_free_pos(world, target, setup.objects[0]["pos"])  # back on its slot
    set_free_pos(world, other, tcp - [0.0, 0.0, setup.goal["heights"][other] + 0.01])
    mujoco.mj_forward(world.model, world.data)
    name, dist = t.nearest_object(world, setup)
    assert name == other and dist < 0.01 and t.target_distance(world, setup) > 0.1
    _, no_target, drawer_world = _episode("panda", "drawer", seed=0)
    assert TASKS.get("drawer").nearest_object(drawer_world, no_target) is None
    # a destination (pick_place's bowl) is not a candidate, only the named object and its distractors
    pp, pp_setup, pp_world = _episode("panda", "pick_place", seed=0)
    bowl = pp_setup.goal["place"]
    set_free_pos(pp_world, bowl, pp_world.data.site(pp_world.robot.arms[0].ee_site).xpos * [1, 1, 0])
    mujoco.mj_forward(pp_world.model, pp_world.data)
    assert pp.nearest_object(pp_world, pp_setup)[0] != bowl


@pytest.mark.parametrize("robot", ["panda", "ur5e", "widowx", "kinova_gen3", "aloha", "procedural"])
def test_reach_slots_puts_the_objects_on_three_fixed_slots(robot: str) -> None:
    """reach_slots: the three objects sit on a left, centre and right slot across the (one arm's) workspace middle
    (within the jitter), never overlapping, colours differ, and which slot holds the named target varies from
    episode to episode. ALOHA: the row lies on one arm's half of the table, so the nearer arm is clear."""
    from vla.sim.tasks import CLEARANCE, ReachSlots

    jitter = ReachSlots.SLOT_JITTER + 1e-9
    target_slots = set()
    for seed in range(12):
        _, setup, world = _episode(robot, "reach_slots", seed)
        ws = Workspace.of(world)
        pos = {o["name"]: np.asarray(o["pos"][:2]) for o in setup.objects}
        for i, a in enumerate(pos):
            for b in list(pos)[i + 1 :]:
                apart = world.objects[a].radius + world.objects[b].radius + CLEARANCE
                assert np.linalg.norm(pos[a] - pos[b]) >= apart, (a, b)
        if robot == "aloha":
            bases = np.array(ws.arm_bases)
            x = pos[setup.goal["target"]][0]
            assert abs(x - ws.center[0]) > 0.1  # off the line halfway between the arms
            dists = sorted(abs(bases[:, 0] - x))
            assert dists[1] - dists[0] > 0.2
            continue
        xy = {n: p - ws.center for n, p in pos.items()}
        assert all(abs(v[0]) <= jitter for v in xy.values()), xy
        ys = sorted((v[1], n) for n, v in xy.items())
        gap = (ys[2][0] - ys[0][0]) / 2
        assert abs(ys[1][0]) <= jitter and abs(ys[2][0] + ys[0][0]) <= 2 * jitter, ys
        assert gap >= 0.6 * ws.half[1] - 2 * jitter
        target_slots.add([n for _, n in ys].index(setup.goal["target"]))
        assert len({n.split("_")[0] for n in xy}) == 3  # distinct colours: the instruction decides
    if robot != "aloha":
        assert target_slots == {0, 1, 2}


@pytest.mark.parametrize("robot", ["panda", "kinova_gen3", "aloha"])
def test_reach_fixed_slots_keeps_each_colour_on_its_slot(robot: str) -> None:
    """reach_fixed_slots: always red, green and blue, red towards -y, green at the centre, blue towards +y (within
    the jitter), whatever the seed; the target colour and the kinds vary, so the instruction says where to go."""
    from vla.sim.tasks import ReachFixedSlots

    jitter = ReachFixedSlots.SLOT_JITTER + 1e-9
    targets, kinds = set(), set()
    for seed in range(12):
        _, setup, _ = _episode(robot, "reach_fixed_slots", seed)
        pos = {o["name"].split("_")[0]: np.asarray(o["pos"][:2]) for o in setup.objects}
        assert set(pos) == {"red", "green", "blue"}
        assert pos["red"][1] < pos["green"][1] - 0.05 < pos["blue"][1] - 0.1, pos
        centre = (pos["red"] + pos["blue"]) / 2
        assert np.all(np.abs(pos["green"] - centre) <= 2 * jitter), (
            pos
        )  # slots symmetric about the centre one
        targets.add(setup.goal["target"].split("_")[0])
        kinds |= {o["kind"] for o in setup.objects}
    assert targets == {"red", "green", "blue"} and kinds == {"cube", "cylinder"}


PINNED_REACH_SLOTS_SEED5 = (["blue_cylinder", "red_cylinder", "orange_cylinder"], "blue_cylinder")


def test_reach_slots_draws_are_unchanged_by_the_fixed_slot_variant() -> None:
    """reach_slots' episodes are what they were before reach_fixed_slots shared its setup: the same random draws
    in the same order (pinned: seed 5 on Panda, names in slot order and the target)."""
    _, setup, _ = _episode("panda", "reach_slots", 5)
    by_y = [o["name"] for o in sorted(setup.objects, key=lambda o: o["pos"][1])]
    assert (by_y, setup.goal["target"]) == PINNED_REACH_SLOTS_SEED5


@pytest.mark.parametrize("robot", ["panda", "kinova_gen3", "widowx"])
def test_reach_needs_the_gripper_on_the_target_not_any_link(robot: str) -> None:
    """A random policy's sweeps touch objects with some arm link: that is contact but not "the gripper on the
    target", so reach does not count it. At the goal state the TCP is over the target and its graded distance is
    small; at reset it is not."""
    import mujoco

    from vla.sim.tasks import gripper_over, robot_touches, set_free_pos

    t, setup, world = _episode(robot, "reach", seed=2)
    target = setup.goal["target"]
    height = setup.goal["heights"][target]
    world.step(20)
    far = t.target_distance(world, setup)
    # put the target on the geom of the arm's second link (far from the TCP): contact, but not over it
    link = world.model.joint(world.robot.arms[0].joints[1]).bodyid[0]
    geom = int(np.flatnonzero(world.model.geom_bodyid == link)[0])
    set_free_pos(world, target, world.data.geom_xpos[geom] - [0.0, 0.0, height / 2])
    mujoco.mj_forward(world.model, world.data)
    assert robot_touches(world, target) and not gripper_over(world, target, height)
    assert not t.success(world, setup)
    t.set_goal_state(world, setup)
    assert t.success(world, setup)
    near = t.target_distance(world, setup)
    assert near is not None and far is not None and 3 * near < far, (near, far)


@pytest.mark.parametrize("robot", ROBOT_NAMES)
@pytest.mark.parametrize("task", TASK_NAMES)
def test_task_builds_detector_false_at_reset_true_at_goal(robot: str, task: str) -> None:
    t, setup, world = _episode(robot, task, seed=1)
    assert setup.goal["target"] in world.objects
    world.step(50)
    assert not t.success(world, setup)
    t.set_goal_state(world, setup)
    # let placed objects settle (reach: contact is immediate)
    world.step(20 if not task.startswith("reach") else 0)
    import mujoco

    mujoco.mj_forward(world.model, world.data)
    assert t.success(world, setup), (robot, task)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_instructions_name_the_target_and_vary(task: str) -> None:
    t = TASKS.get(task)
    seen_targets, seen_texts = set(), set()
    for seed in range(8):
        _, setup, _ = _episode("panda", task, seed)
        text = t.instruction(setup, np.random.default_rng(seed))
        desc = setup.descriptions[setup.goal["target"]]
        if task == "drawer":
            assert setup.goal["action"] in text
            seen_targets.add(setup.goal["action"])
        else:
            assert desc in text, (text, desc)
            # Language matters: at least one distractor, none with the same description.
            others = [d for n, d in setup.descriptions.items() if n != setup.goal["target"]]
            assert others and desc not in others
            seen_targets.add(desc)
        seen_texts.add(text)
    assert len(seen_targets) > 1 and len(seen_texts) > 1


# Panda on every task; every robot on reach and pick_place; WidowX and Kinova on reach_slots; the weakest arm (WidowX, 10.8…54.8 mm jaw, kp 50
# servos) and the two-armed ALOHA on stack and drawer as well. Seeds are fixed, not picked: the sweep below
# measures every robot x task over seeds 0-9.
EXPERT_CASES = [("panda", t) for t in TASK_NAMES] + [
    (r, t) for r in ROBOT_NAMES if r != "panda" for t in ("reach", "pick_place")] + [
    (r, "reach_slots") for r in ("widowx", "kinova_gen3")] + [("kinova_gen3", "reach_fixed_slots")] + [
    (r, t) for r in ("widowx", "aloha") for t in ("stack", "drawer")]  # fmt: skip


@pytest.mark.parametrize(("robot", "task"), EXPERT_CASES)
def test_expert_succeeds(robot: str, task: str) -> None:
    env = make(robot, task, image_size=16)
    seeds = [0, 1, 2] if robot == "panda" else [0, 3]
    results = [_run_expert(env, s) for s in seeds]
    assert all(results), results


@pytest.mark.parametrize("randomization", ["none", "medium"])
@pytest.mark.parametrize("robot", ROBOT_NAMES)
@pytest.mark.parametrize("task", TASK_NAMES)
def test_expert_success_rate_sweep(robot: str, task: str, randomization: str) -> None:
    """Bar: >= 80 % expert success per robot x task (measured: >= 90 % everywhere, seeds 0-9)."""
    env = make(robot, task, image_size=16, randomization=randomization)
    rate = np.mean([_run_expert(env, s) for s in range(10)])
    assert rate >= 0.8, rate


def test_graspable_objects_fit_the_jaw() -> None:
    """Objects to pick are sized from the robot's jaw: WidowX's 54.8 mm pads get smaller cubes than Panda's."""
    for robot in ("widowx", "panda"):
        jaw = build_world(robot, seed=0).robot.arms[0].jaw_range[1]
        for seed in range(5):
            *_, world = _episode(robot, "pick_place", seed)
            for name, obj in world.objects.items():
                width = 2 * obj.params.get("half", obj.params.get("radius", 0.0))
                if obj.kind in ("cube", "cylinder"):
                    assert width <= jaw - 2 * GRASP_MARGIN + 1e-9, (robot, name, width, jaw)


def test_push_names_a_target_marker_and_a_distractor() -> None:
    t = TASKS.get("push")
    for seed in range(4):
        _, setup, world = _episode("panda", "push", seed)
        g = setup.goal
        markers = [n for n, o in world.objects.items() if o.kind == "marker"]
        assert g["place"] in markers and len(markers) == 2
        colours = {n.split("_")[0] for n in world.objects}
        assert len(colours) == len(world.objects)  # every object and marker its own colour
        text = t.instruction(setup, np.random.default_rng(seed))
        assert setup.descriptions[g["target"]] in text and setup.descriptions[g["place"]] in text, text
        # markers are flat and collide with nothing
        geom = world.model.geom(world.objects[g["place"]].geoms[0])
        assert geom.contype[0] == 0 and geom.conaffinity[0] == 0


def test_object_jitter_recorded_is_the_jitter_simulated() -> None:
    """system.object_xy_jitter survives task.initialize: the recorded offset is where the object really starts."""
    for task in ("pick_place", "drawer", "push"):
        env = make("panda", task, image_size=16, randomization="medium")
        env._obs = lambda: None  # type: ignore[method-assign]
        _, info = env.reset(seed=3)
        jitter = info["randomization"]["system"]["object_xy_jitter"]
        assert any(np.any(np.abs(v) > 1e-4) for v in jitter.values())
        env.step(env.world.robot.home_action().astype(np.float32))  # objects at rest stay put
        for obj in env.setup.objects:
            name = obj["name"]
            built = np.asarray(obj["pos"][:2])
            start = np.asarray(env.setup.goal["start"][name][:2])
            np.testing.assert_allclose(start - built, jitter[name], atol=1e-9)
            np.testing.assert_allclose(env.world.data.body(name).xpos[:2] - built, jitter[name], atol=1e-3)


@pytest.mark.parametrize("robot", ["panda", "aloha", "procedural"])
def test_spaces_match_embodiment_spec_and_gymnasium_checker(robot: str) -> None:
    from gymnasium.utils.env_checker import check_env

    env = make(robot, "pick_place", image_size=32, seed=0)
    obs, info = env.reset(seed=0)
    spec = embodiment_for(env.world.robot)
    assert obs["state"].shape == (spec.state_dim,) and obs["state"].dtype == np.float32
    assert env.action_space.shape == (spec.action_dim,)
    assert set(obs["images"]) == set(spec.cameras)
    for img in obs["images"].values():
        assert img.shape == (32, 32, 3) and img.dtype == np.uint8
    assert info["task"] == "pick_place" and info["randomization"] == {} and info["instruction"]
    assert env.substeps * env.world.model.opt.timestep == pytest.approx(1.0 / env.control_hz)
    check_env(env, skip_render_check=True)


def test_reset_is_deterministic_per_seed_and_step_contract() -> None:
    env = make("panda", "pick_place", image_size=32)
    o1, i1 = env.reset(seed=5)
    a = env.expert_action()
    o1b, r, term, trunc, info = env.step(a)
    o2, i2 = env.reset(seed=5)
    assert i1["instruction"] == i2["instruction"]
    np.testing.assert_array_equal(o1["state"], o2["state"])
    for slot in o1["images"]:
        np.testing.assert_array_equal(o1["images"][slot], o2["images"][slot])
    o2b, *_ = env.step(env.expert_action())
    np.testing.assert_array_equal(o1b["state"], o2b["state"])
    assert r == 0.0 and not term and not trunc and info["success"] is False
    # Different seeds give different scenes (target or instruction) somewhere in a few draws.
    instructions = {env.reset(seed=s)[1]["instruction"] for s in range(6)}
    assert len(instructions) > 1


def test_randomizer_protocol_is_called() -> None:
    calls: list[str] = []

    class Fake:
        def sample(self, rng, world):
            calls.append("sample")
            return {"noise": 0.0}

        def apply(self, world, record):
            calls.append("apply")

        def act(self, action, step_index, rng):
            calls.append("act")
            return action

        def observe(self, images, rng):
            calls.append("observe")
            return images

    env = make("widowx", "reach", image_size=16, randomization=Fake())
    _, info = env.reset(seed=0)
    env.step(env.expert_action())
    assert info["randomization"] == {"noise": 0.0}
    assert calls == ["sample", "apply", "observe", "act", "observe"]


def test_truncates_at_max_steps() -> None:
    env = make("panda", "reach", image_size=16, max_steps=3)
    env.reset(seed=0)
    home = env.world.robot.home_action().astype(np.float32)
    out = [env.step(home) for _ in range(3)]
    assert [o[3] for o in out] == [False, False, True]


def test_a_simulation_that_blows_up_ends_the_episode_as_a_failure() -> None:
    """MuJoCo answers a blown-up state (here: joint speeds past its 1e10 bound) by resetting to the home pose and
    counting a warning; the env must not carry on from there, and never report a success on the reset state."""
    env = make("widowx", "reach", image_size=16)
    env.reset(seed=0)
    _, _, terminated, truncated, info = env.step(env.expert_action())
    assert not info["physics_diverged"] and not truncated
    env.world.data.qvel[:] = 1e12
    _, reward, terminated, truncated, info = env.step(env.expert_action())
    assert info["physics_diverged"] and truncated and not terminated and reward == 0.0 and not info["success"]
    env.close()


def test_a_non_finite_policy_action_ends_the_episode_as_a_flagged_failure() -> None:
    """A policy that outputs NaN has failed; the episode ends there (nothing simulated, the servos untouched) and
    says why, instead of one broken episode aborting a whole evaluation."""
    env = make("widowx", "reach", image_size=16)
    env.reset(seed=0)
    *_, info = env.step(env.expert_action())
    assert info["non_finite_action"] is False
    ctrl, t = env.world.data.ctrl.copy(), env.world.data.time
    action = env.expert_action()
    action[1] = np.nan
    _, reward, terminated, truncated, info = env.step(action)
    assert (
        info["non_finite_action"] and truncated and not terminated and reward == 0.0 and not info["success"]
    )
    assert not info["physics_diverged"] and env.world.data.time == t
    np.testing.assert_array_equal(env.world.data.ctrl, ctrl)
    env.close()


@pytest.mark.parametrize("robot", ["panda", "kinova_gen3"])
def test_random_actions_under_reality_proxy_move_joints_at_about_their_speed_limits(robot: str) -> None:
    """Uniform random joint targets under `reality_proxy` (soft damping, latency) used to swing these arms at
    7-27x their published joint speeds and throw objects hard enough to blow the simulation up; the servo
    setpoints now ramp at the limits, so the joints stay near them."""
    env = make(robot, "reach", image_size=16, randomization="reality_proxy", seed=0)
    rng = np.random.default_rng(0)
    low, high = env.action_space.low, env.action_space.high
    low, high = np.where(np.isfinite(low), low, -np.pi), np.where(np.isfinite(high), high, np.pi)
    top = 0.0
    for episode in range(2):
        env.reset(seed=episode)
        bound = env.world.bound
        for _ in range(25):
            *_, info = env.step(rng.uniform(low, high))
            assert not info["physics_diverged"]
            top = max(top, float(np.max(np.abs(env.world.data.qvel[bound.arm_qvel]) / bound.joint_vmax)))
    assert 0.5 < top < 1.5
    env.close()
