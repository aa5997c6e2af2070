"""vla.sim robots and worlds: every registered robot compiles, holds its home pose, matches the fact sheet's
home end-effector positions, follows servo targets, opens/closes its gripper and renders its cameras."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco is imported (conftest sets it too)

import subprocess
import sys
from pathlib import Path

import mujoco
import numpy as np
import pytest

from vla.embodiments import EMBODIMENTS, EmbodimentSpec, get_embodiment
from vla.registry import RegistryError
from vla.sim import (
    ROBOTS,
    add_object,
    build_robot,
    build_world,
    embodiment_for,
    load_mjcf_robot,
    procedural_embodiment_spec,
    sim_embodiment_spec,
)
from vla.sim.arms import PANDA
from vla.sim.robots import arm_to_mjspec

ROBOT_NAMES = ROBOTS.names()
FIXED_ROBOTS = [n for n in ROBOT_NAMES if n != "procedural"]


@pytest.fixture(scope="module", params=ROBOT_NAMES)
def world(request: pytest.FixtureRequest):
    w = build_world(request.param, seed=3, image_size=64)
    yield w
    w.close()


def test_registry_lists_the_six_robots_and_suggests_names() -> None:
    assert set(ROBOT_NAMES) == {"panda", "ur5e", "widowx", "kinova_gen3", "aloha", "procedural"}
    with pytest.raises(RegistryError, match="Did you mean 'panda'"):
        build_robot("pandaa", mujoco.MjSpec())


def test_holds_home_pose_for_200_steps(world) -> None:
    world.reset()
    bound = world.bound
    home = np.concatenate([arm.home for arm in world.robot.arms])
    world.step(200)
    q = bound.joint_positions(world.data)
    assert np.all(np.isfinite(world.data.qpos)) and np.all(np.isfinite(world.data.qvel))
    assert np.all(q >= bound.joint_low - 1e-3) and np.all(q <= bound.joint_high + 1e-3)
    # Gravity sag of a PD servo: the softest arm (WidowX, kp 50, fact sheet §4.3) sags ≈ 0.03 rad.
    assert np.abs(q - home).max() < 0.06, np.abs(q - home)
    assert np.linalg.norm(world.data.qvel) < 0.5


# Home-pose positions in the robot's root frame (= the fact sheet's world frame), from the §1 summary table
# "home/keyframe EE position" column. Our chains reproduce the Menagerie chains (measured error < 0.1 mm), so the
# tolerance is 2 mm — tight enough to tell Franka's 0.1034 m TCP from the mjx 0.100 m one (§10.6) — except 4 mm
# for ALOHA's TCP, which drops site A's −3 mm z offset (vla/sim/arms.py).
HOME_SITES = [
    ("panda", "", "ee", (0.5545, 0.0, 0.5211), "§1 Panda: TCP@0.1034 (0.5545, 0, 0.5211)"),
    ("panda", "", "flange", (0.5545, 0.0, 0.6245), "§1 Panda: flange (0.5545, 0, 0.6245)"),
    ("ur5e", "", "flange", (-0.134, 0.492, 0.488), "§1 UR5e: attachment_site (−0.134, 0.492, 0.488)"),
    ("widowx", "", "flange", (0.1334, 0.0, 0.2516), "§1 WX250s: gripper_link (0.1334, 0, 0.2516)"),
    ("widowx", "", "ee", (0.2265, 0.0, 0.2610), "§1 WX250s: ee_gripper_link (0.2265, 0, 0.2610)"),
    ("kinova_gen3", "", "flange", (0.4567, 0.0014, 0.4337), "§1 Gen3: pinch_site 'home' (0.4567, 0.0014, 0.4337)"),
    ("aloha", "left", "flange", (-0.3172, -0.019, 0.3153), "§1 ViperX: gripper_link (±0.3172, −0.019, 0.3153)"),
    ("aloha", "right", "flange", (0.3172, -0.019, 0.3153), "§1 ViperX: gripper_link (±0.3172, −0.019, 0.3153)"),
    ("aloha", "left", "ee", (-0.1875, -0.019, 0.3252), "§1 ViperX: site A (±0.1875, −0.019, 0.3252)"),
    ("aloha", "right", "ee", (0.1875, -0.019, 0.3252), "§1 ViperX: site A (±0.1875, −0.019, 0.3252)"),
]  # fmt: skip
# Approach axis (gripper +z) at home, §1 summary table.
HOME_APPROACH = {"panda": (0, 0, -1), "ur5e": (0, 0, -1), "kinova_gen3": (1, 0, 0)}


@pytest.mark.parametrize(("robot", "arm", "site", "expected", "source"), HOME_SITES)
def test_home_positions_match_fact_sheet(robot: str, arm: str, site: str, expected, source: str) -> None:
    spec = mujoco.MjSpec()
    # Mount the robot somewhere arbitrary to check the root-frame transform too.
    handles = build_robot(robot, spec, prefix="r/", pos=(0.3, -0.2, 0.1), yaw=0.7)
    model = spec.compile()
    data = mujoco.MjData(model)
    handles.bind(model).reset(data)
    mujoco.mj_forward(model, data)
    root = data.body(handles.root_body)
    arm_h = next(a for a in handles.arms if a.name == arm)
    name = arm_h.ee_site if site == "ee" else arm_h.flange_site
    local = root.xmat.reshape(3, 3).T @ (data.site(name).xpos - root.xpos)
    atol = 0.004 if (robot, site) == ("aloha", "ee") else 0.002
    np.testing.assert_allclose(local, expected, rtol=0, atol=atol, err_msg=source)
    if robot in HOME_APPROACH:
        approach = root.xmat.reshape(3, 3).T @ data.site(arm_h.ee_site).xmat.reshape(3, 3)[:, 2]
        np.testing.assert_allclose(approach, HOME_APPROACH[robot], atol=1e-3)


def test_servos_drive_joints_to_targets(world) -> None:
    world.reset()
    bound = world.bound
    action = world.robot.home_action()
    first, last = 0, world.robot.dof - 1  # base yaw and the last wrist joint (of the last arm)
    dims = bound.joint_dims[[first, last]]  # their places in the action vector
    action[dims] += 0.3
    bound.apply_action(world.data, action)
    world.step(500)  # 1 s
    q = bound.joint_positions(world.data)
    np.testing.assert_allclose(q[[first, last]], action[dims], atol=0.05)
    assert np.abs(q[[first, last]] - world.robot.home_action()[dims]).min() > 0.25  # really moved


# Published joint speed limits (rad/s), as the arms cite them: Franka's interface specification (fact sheet §2.3),
# UR's joint_limits.yaml (180°/s, §3.2), Interbotix's wx250s/vx300s xacros (π), ros_kortex's Gen3 URDF (§5).
VELOCITY_LIMITS = {
    "panda": (2.175,) * 4 + (2.61,) * 3,
    "ur5e": (math.pi,) * 6,
    "widowx": (math.pi,) * 6,
    "kinova_gen3": (1.3963,) * 4 + (1.2218,) * 3,
    "aloha": (math.pi,) * 12,
}


@pytest.mark.parametrize("robot", FIXED_ROBOTS)
def test_joint_speed_limits_are_the_published_ones(robot: str) -> None:
    w = build_world(robot, seed=0, image_size=16)
    np.testing.assert_allclose(w.bound.joint_vmax, VELOCITY_LIMITS[robot])
    w.close()


def test_procedural_arms_draw_one_speed_limit_within_the_published_span() -> None:
    limits = []
    for seed in range(6):
        w = build_world("procedural", seed=seed, image_size=16)
        vmax = w.bound.joint_vmax
        assert np.all(vmax == vmax[0]) and vmax[0] == w.robot.params["joint_velocity_limit"]
        limits.append(float(vmax[0]))
        w.close()
    assert all(1.2 <= v <= math.pi for v in limits) and len(set(limits)) == 6


def test_act_moves_servo_setpoints_no_faster_than_the_speed_limit(world) -> None:
    """A far target is approached at the joint's speed limit over several control periods (as a real arm's
    trajectory generator does), the joint itself never much faster; a target within reach is held exactly."""
    world.reset()
    bound, dt = world.bound, world.model.opt.timestep
    home = world.robot.home_action()
    action = home.copy()
    dim = bound.joint_dims[0]  # base yaw (of the first arm)
    action[dim] += 1.0
    vmax = bound.joint_vmax[0]
    world.act(action, 50)  # one 10 Hz period: the setpoint moves vmax · 0.1 s, not 1 rad
    ctrl = world.data.ctrl[bound.arm_ctrl]
    assert ctrl[0] - home[dim] == pytest.approx(vmax * 50 * dt, rel=0.01)
    assert ctrl[0] - home[dim] <= vmax * 50 * dt + 1e-12
    np.testing.assert_array_equal(ctrl[1:], home[bound.joint_dims[1:]])  # joints asked to stay do stay
    top = 0.0
    for _ in range(1500):  # 3 s, one physics step per call
        world.act(action, 1)
        top = max(top, abs(float(world.data.qvel[bound.arm_qvel[0]])))
    assert 0.75 * vmax < top < 1.1 * vmax  # moved at about the limit, never far past it
    assert world.data.ctrl[bound.arm_ctrl[0]] == pytest.approx(action[dim])
    assert bound.joint_positions(world.data)[0] == pytest.approx(action[dim], abs=0.01)
    action[dim] -= 0.01  # within reach of one physics step's ramp: the setpoint goes there at once
    world.act(action, 10)
    assert world.data.ctrl[bound.arm_ctrl[0]] == pytest.approx(action[dim])
    with pytest.raises(ValueError, match="at least one physics step"):
        world.act(home, 0)  # would otherwise leave the full target in ctrl, past the limit


def test_arm_speed_limits_must_be_positive() -> None:
    link = dataclasses.replace(PANDA.links[0], velocity=0.0)
    with pytest.raises(ValueError, match=r"velocity 0\.0 rad/s must be > 0"):
        dataclasses.replace(PANDA, links=(link, *PANDA.links[1:]))


def test_arm_handles_need_one_speed_limit_per_joint(world) -> None:
    """A handle set whose speed limits do not line up with its joints would pace the wrong joints."""
    arm = world.robot.arms[0]
    with pytest.raises(ValueError, match=rf"{arm.dof - 1} velocity_limits for {arm.dof} joints"):
        dataclasses.replace(arm, velocity_limits=arm.velocity_limits[:-1])
    with pytest.raises(ValueError, match=r"must all be > 0 rad/s"):
        dataclasses.replace(arm, velocity_limits=(0.0,) * arm.dof)
    with pytest.raises(ValueError, match=rf"{arm.dof + 1} home for {arm.dof} joints"):
        dataclasses.replace(arm, home=(*arm.home, 0.0))
    assert dataclasses.replace(arm, velocity_limits=()).velocity_limits == ()  # none: targets at once


def test_act_keeps_the_joint_space_path_straight() -> None:
    """Joints asked to move by different amounts arrive together (a synchronized point-to-point motion): clipping
    each joint to its own limit would move them in another direction first and bend the TCP's path."""
    world = build_world("kinova_gen3", seed=0, image_size=16)
    world.reset()
    bound = world.bound
    home = world.robot.home_action()
    action = home.copy()
    dims = bound.joint_dims
    action[dims[1]] += 0.8  # shoulder: the move that sets the pace
    action[dims[3]] -= 0.2
    action[dims[5]] += 0.4  # a wrist joint with a lower limit, but less to travel
    world.act(action, 50)
    moved = world.data.ctrl[bound.arm_ctrl] - home[dims]
    wanted = action[dims] - home[dims]
    np.testing.assert_allclose(moved, wanted * moved[1] / wanted[1], atol=1e-12)  # same direction
    assert moved[1] == pytest.approx(bound.joint_vmax[1] * 0.1, rel=0.01)  # the pacing joint at its limit
    world.close()


def test_act_paces_each_arm_of_a_bimanual_robot_on_its_own() -> None:
    """ALOHA's two arms are two controllers: a far target on the left arm does not slow the right arm's short move."""
    world = build_world("aloha", seed=0, image_size=16)
    world.reset()
    bound = world.bound
    lo, mid, hi = bound.arm_joint_slices
    assert (lo, mid, hi) == (0, 6, 12)
    home = world.robot.home_action()
    action = home.copy()
    left, right = bound.joint_dims[lo], bound.joint_dims[mid]  # each arm's waist
    action[left] += 1.0
    action[right] += 0.05  # reachable in 8 physics steps at pi rad/s
    world.act(action, 25)  # one 20 Hz period
    ctrl = world.data.ctrl[bound.arm_ctrl]
    assert ctrl[lo] - home[left] == pytest.approx(math.pi * 25 * world.model.opt.timestep, rel=0.01)
    assert ctrl[mid] == pytest.approx(action[right])
    world.close()


def test_act_rejects_non_finite_targets_and_survives_huge_ones_on_continuous_joints() -> None:
    """NaN or inf targets are an error naming the dims, with nothing written to the servos; a huge finite target on
    a continuous joint (Kinova Gen3's joint 1 has no position limit) ramps at the speed limit instead of overflowing
    the ramp's step count; every one of the period's n physics steps runs."""
    world = build_world("kinova_gen3", seed=0, image_size=16)
    world.reset()
    bound = world.bound
    assert np.isinf(bound.joint_low[0])  # the premise: a continuous joint
    home = world.robot.home_action()
    before = world.data.ctrl.copy()
    for bad in (np.nan, np.inf, -np.inf):
        action = home.copy()
        action[bound.joint_dims[2]] = bad
        with pytest.raises(ValueError, match=r"non-finite values at dims \[2\]"):
            world.act(action, 5)
        np.testing.assert_array_equal(world.data.ctrl, before)
    # 1e300 still gives a finite ramp length; 1e306 overflows |delta| / per_step itself, and the arm must not stall
    for huge in (1e300, 1e306, -1e306):
        world.reset()
        action = home.copy()
        action[bound.joint_dims[0]] = huge
        t0 = world.data.time
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no numpy overflow warning either
            world.act(action, 7)
        assert world.data.time == pytest.approx(t0 + 7 * world.model.opt.timestep)
        moved = world.data.ctrl[bound.arm_ctrl[0]] - home[bound.joint_dims[0]]
        expected = math.copysign(bound.joint_vmax[0] * 7 * world.model.opt.timestep, huge)
        assert moved == pytest.approx(expected, rel=1e-6), huge
    world.close()


def test_act_hands_joints_without_a_speed_limit_their_target_at_once() -> None:
    """An arm whose joints have no speed limit (``inf``, the default of a ``LinkSpec``) gets its target in one physics
    step, as every arm did before the limits existed."""
    world = build_world("widowx", seed=0, image_size=16)
    world.reset()
    bound = world.bound
    bound.joint_vmax[:] = np.inf
    action = world.robot.home_action()
    action[bound.joint_dims[0]] += 1.0
    world.act(action, 5)
    assert world.data.ctrl[bound.arm_ctrl[0]] == pytest.approx(action[bound.joint_dims[0]])
    world.close()


def _finger_gap(world, arm) -> float:
    a, b = (world.data.body(j).xpos for j in arm.gripper_joints)  # finger bodies share the joints' names
    return float(np.linalg.norm(a - b))


def _pad_gap(world, arm) -> float:
    """Distance between the two finger pads' inner faces (m)."""
    m = world.model
    pads = [int(np.flatnonzero(m.geom_bodyid == m.body(f).id)[0]) for f in arm.gripper_joints]
    centres = np.linalg.norm(world.data.geom_xpos[pads[0]] - world.data.geom_xpos[pads[1]])
    return float(centres - m.geom_size[pads[0], 1] - m.geom_size[pads[1], 1])


def test_pad_gap_spans_the_jaw_range(world) -> None:
    """The pads' inner faces, not the finger joints, bound what fits in the jaw (WidowX: 9.6 mm inset)."""
    for command in (0.0, 1.0):
        world.reset(gripper=command)
        for arm in world.robot.arms:
            assert _pad_gap(world, arm) == pytest.approx(arm.jaw_range[int(command)], abs=1e-6), arm.name
    widowx = build_world("widowx", seed=0).robot.arms[0]
    assert widowx.jaw_range == pytest.approx((0.0108, 0.0548))


def test_gripper_closes_and_opens(world) -> None:
    world.reset(gripper=1.0)
    bound = world.bound
    opened = [_finger_gap(world, arm) for arm in world.robot.arms]
    action = world.robot.home_action()
    action[bound.gripper_dims] = 0.0
    bound.apply_action(world.data, action)
    world.step(400)
    closed = [_finger_gap(world, arm) for arm in world.robot.arms]
    assert np.all(bound.gripper_opening(world.data) < 0.1)
    action[bound.gripper_dims] = 1.0
    bound.apply_action(world.data, action)
    world.step(400)
    reopened = [_finger_gap(world, arm) for arm in world.robot.arms]
    for arm, o, c, r in zip(world.robot.arms, opened, closed, reopened):
        stroke = 2 * (arm.gripper_range[1] - arm.gripper_range[0])
        assert o - c > 0.8 * stroke and r - c > 0.8 * stroke, (arm.name, o, c, r, stroke)


def test_cameras_render_non_constant_images(world) -> None:
    world.reset()
    expected = {"primary", *(f"{a.name}_wrist" if a.name else "wrist" for a in world.robot.arms)}
    assert set(world.cameras) == expected
    for slot in world.cameras:
        img = world.render(slot)
        assert img.shape == (64, 64, 3) and img.dtype == np.uint8
        assert img.reshape(-1, 3).std(axis=0).max() > 5.0, slot


def test_procedural_robot_is_deterministic_per_seed_and_varies_across_seeds() -> None:
    def build(seed: int, **options):
        spec = mujoco.MjSpec()
        handles = build_robot("procedural", spec, seed=seed, **options)
        return handles, spec.compile()

    (h1, m1), (h2, m2) = build(7), build(7)
    assert h1.params == h2.params
    np.testing.assert_array_equal(m1.body_pos, m2.body_pos)
    np.testing.assert_array_equal(m1.jnt_range, m2.jnt_range)
    params = [build(seed)[0].params for seed in range(8)]
    assert len({p["dof"] for p in params}) >= 2
    assert len({round(p["upper_arm"], 6) for p in params}) == 8
    for dof in (4, 5, 6, 7):
        handles, model = build(1, dof=dof)
        assert handles.dof == dof and handles.params["dof"] == dof
        assert model.nu == dof + 1  # arm servos + one gripper servo
        assert 0.04 <= handles.params["gripper_width"] <= 0.1
    with pytest.raises(ValueError, match="dof must be one of"):
        build(0, dof=9)


@pytest.mark.parametrize("robot", FIXED_ROBOTS)
def test_sim_embodiment_yaml_matches_robot(robot: str) -> None:
    handles = build_robot(robot, mujoco.MjSpec())
    spec = get_embodiment(f"sim_{robot}")
    assert spec == sim_embodiment_spec(handles), "YAML out of date: regenerate with sim_embodiment_spec"
    for field in (
        f for f in spec.action if f.kind == "joint_pos"
    ):  # the spec tells users how fast targets are followed
        assert (
            "speed limit" in field.description
            and f"{VELOCITY_LIMITS[robot][-1]:.4g} rad/s" in field.description
        )
    assert embodiment_for(handles) == spec
    assert spec.state_dim == spec.action_dim == handles.dof + len(handles.arms) == handles.state_dim
    lo, hi = spec.limits("action")
    limits = np.asarray([lim for arm in handles.arms for lim in arm.joint_limits])
    joint_dims = [i for i, n in enumerate(spec.action_names()) if "gripper" not in n]
    np.testing.assert_array_equal(lo[joint_dims], limits[:, 0])
    np.testing.assert_array_equal(hi[joint_dims], limits[:, 1])
    assert set(spec.cameras) == {"primary", *(f"{a.name}_wrist" if a.name else "wrist" for a in handles.arms)}


def test_every_sim_yaml_has_a_robot() -> None:
    sims = {n for n in EMBODIMENTS.names() if n.startswith("sim_")}
    assert sims == {f"sim_{r}" for r in FIXED_ROBOTS} | {f"sim_procedural_{d}dof" for d in (4, 5, 6, 7)}


def test_procedural_embodiment_spec_follows_dof() -> None:
    for dof in (4, 7):
        handles = build_robot("procedural", mujoco.MjSpec(), seed=dof, dof=dof)
        spec = procedural_embodiment_spec(handles)
        assert spec.name == f"sim_procedural_{dof}dof"
        assert spec.state_dim == spec.action_dim == dof + 1
        assert spec.extra["robot_params"]["dof"] == dof
        assert EmbodimentSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="needs a procedural robot"):
        procedural_embodiment_spec(build_robot("panda", mujoco.MjSpec()))


def test_apply_action_checks_shape() -> None:
    w = build_world("widowx", seed=0)
    with pytest.raises(ValueError, match=r"expected \(7,\)"):
        w.bound.apply_action(w.data, np.zeros(6))


def test_objects_rest_on_the_table_without_overlap() -> None:
    w = build_world("panda", seed=1, objects=["cube", "cylinder", "bowl", "drawer"])
    assert {o.kind for o in w.objects.values()} == {"cube", "cylinder", "bowl", "drawer"}
    objs = list(w.objects.values())
    for i, a in enumerate(objs):
        for b in objs[i + 1 :]:
            gap = np.linalg.norm(np.subtract(a.params["pos"][:2], b.params["pos"][:2]))
            assert gap >= a.radius + b.radius, (a.name, b.name)
    drawer = w.objects["drawer3"]
    w.data.joint(drawer.joint).qpos = 0.05  # pulled out 5 cm
    w.step(300)
    for obj in objs:
        assert w.data.body(obj.body).xpos[2] > -0.005, obj.name  # nothing fell through the table
    assert 0.0 <= w.data.joint(drawer.joint).qpos[0] <= 0.06
    assert w.params["objects"]["cube0"]["mass"] == pytest.approx(w.model.body("cube0").mass[0])
    with pytest.raises(ValueError, match="kind must be one of"):
        add_object(mujoco.MjSpec(), "sphere", name="s", pos=(0, 0, 0))


def test_build_robot_under_a_body() -> None:
    spec = mujoco.MjSpec()
    cart = spec.worldbody.add_body(name="cart", pos=(1.0, 0.0, 0.0))
    attached = build_robot("widowx", cart, prefix="w/")  # own spec + attach
    direct = build_robot("panda", cart, prefix="p/", spec=spec)  # built in place
    model = spec.compile()
    for handles in (attached, direct):
        handles.bind(model)  # every name resolves
    with pytest.raises(ValueError, match="needs spec="):
        build_robot("widowx", cart)


def test_load_mjcf_robot(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"MJCF robot file not found: .*nope\.xml.*built-in robot"):
        load_mjcf_robot(tmp_path / "nope.xml", mujoco.MjSpec())
    path = tmp_path / "panda.xml"
    path.write_text(arm_to_mjspec(PANDA).to_xml())  # a self-contained MJCF robot
    spec = mujoco.MjSpec()
    robot = load_mjcf_robot(path, spec, prefix="u/", pos=(0.5, 0.0, 0.0))
    model = spec.compile()
    assert robot.joints[0] == "u/joint1" and len(robot.joints) == 9  # 7 hinges + 2 fingers
    assert model.nu == len(robot.actuators) == 8
    assert model.body(robot.root_body).pos[0] == pytest.approx(0.5)


def test_sim_never_imports_models() -> None:
    code = "import vla.sim, sys; bad = [m for m in sys.modules if m.startswith('vla.models')]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "MUJOCO_GL": "egl"})


def test_world_recompile_keeps_state_and_render_names_cameras() -> None:
    w = build_world("widowx", seed=2, objects=["cube"])
    w.step(20)
    qpos = w.data.qpos.copy()
    add_object(w.spec, "cylinder", name="late", pos=(0.0, 0.2, 0.0), rng=np.random.default_rng(0))
    w.recompile()
    np.testing.assert_array_equal(w.data.qpos[: len(qpos)], qpos)
    assert w.data.qpos.shape == (len(qpos) + 7,)  # the new free joint
    with pytest.raises(KeyError, match="slots: \\['primary', 'wrist'\\]"):
        w.render("nope")
    w.close()


@pytest.mark.parametrize("robot", ROBOT_NAMES)
def test_closing_gripper_is_blocked_by_an_object(robot: str) -> None:
    w = build_world(robot, seed=0)
    arm = w.robot.arms[0]
    tcp = w.data.site(arm.ee_site).xpos.copy()
    # A fixed 4 cm cube centred on the TCP: the fingers must stop on it (pads collide with objects).
    add_object(w.spec, "cube", name="probe", pos=(tcp[0], tcp[1], tcp[2] - 0.02), size=(0.02,), free=False)
    w.recompile()
    w.reset()
    action = w.robot.home_action()
    action[w.bound.gripper_dims[0]] = 0.0
    w.bound.apply_action(w.data, action)
    w.step(500)
    assert 0.035 < _pad_gap(w, arm) < 0.05, _pad_gap(w, arm)


def test_ik_orientation_error_is_numpys_cross_products_bit_for_bit() -> None:
    """The IK's hand-written cross products (numpy's ``np.cross`` cost the scripted experts a third of their time)
    give exactly numpy's bits, so expert demonstrations, and every dataset generated from them, are unchanged."""
    from scipy.spatial.transform import Rotation

    from vla.sim.ik import orientation_error

    rots = Rotation.random(40, random_state=0).as_matrix()
    for rot, rot_des in zip(rots[:20], rots[20:], strict=True):
        full = 0.5 * sum(np.cross(rot[:, i], rot_des[:, i]) for i in range(3))
        assert orientation_error(rot, rot_des, approach_only=False).tobytes() == full.tobytes()
        approach = np.cross(rot[:, 2], rot_des[:, 2])
        assert orientation_error(rot, rot_des, approach_only=True).tobytes() == approach.tobytes()
