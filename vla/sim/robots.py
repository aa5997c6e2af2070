"""Robots built from code with ``mujoco.MjSpec``: a registry of named robots and ``build_robot`` to attach one.

Each arm is an ``ArmSpec`` (``vla.sim.arms``: published kinematics, or ``vla.sim.procedural``) turned into bodies,
hinge joints with limits/damping/armature, capsule collision geoms sized from the link offsets, explicit
inertials, PD position servos, a two-finger parallel-jaw gripper with one servo, sites ``ee`` (TCP) and
``flange``, and a ``wrist`` camera looking along the approach axis. Nothing is downloaded. ``load_mjcf_robot``
attaches a user's full MJCF model instead.

Names: a single arm's elements are ``<prefix>joint1`` … ``<prefix>ee``, ``<prefix>wrist``; ALOHA adds the arm name
(``<prefix>left_joint1``, ``<prefix>left_wrist``). Robot geoms carry collision bit 2: arms never collide with
themselves (simplified capsules overlap at the joints) but do touch objects and the table (``vla.sim.objects``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mujoco
import numpy as np

from vla.registry import Registry
from vla.sim.arms import ALOHA_BASES, KINOVA_GEN3, PANDA, UR5E, VIPERX, WIDOWX, ArmSpec, Vec3
from vla.sim.handles import ArmHandles, RobotHandles

ROBOT_CONTYPE, ROBOT_CONAFFINITY = 2, 1 | 4  # touch objects and the table, never robots (vla.sim.objects)
_LIMITED = {True: mujoco.mjtLimited.mjLIMITED_TRUE, False: mujoco.mjtLimited.mjLIMITED_FALSE}
WRIST_FOVY = 75.0  # deg; wide, so both fingertips and the grasp target are in view


@dataclass(frozen=True)
class RobotDescription:
    """A robot as data: its arms with their base placement in the robot's root frame, and its workspace.

    ``arms`` holds ``(arm name, ArmSpec, base position (m), base yaw (rad))``; a single arm has name ``""``.
    """

    name: str
    arms: tuple[tuple[str, ArmSpec, Vec3, float], ...]
    workspace_center: Vec3
    workspace_half: tuple[float, float]
    reach: float
    params: dict[str, Any] = field(default_factory=dict)


RobotFactory = Callable[..., RobotDescription]
ROBOTS: Registry[RobotFactory] = Registry(
    "sim robot", hint="Register a factory in vla/sim/robots.py (see ROBOTS.register calls there)."
)


def _single(arm: ArmSpec, center: Vec3, half: tuple[float, float], reach: float) -> RobotFactory:
    def factory(rng: np.random.Generator) -> RobotDescription:
        return RobotDescription(arm.name, (("", arm, (0.0, 0.0, 0.0), 0.0),), center, half, reach)

    return factory


# Workspaces are centred under the fact sheet's home EE position (§1 summary table), reach = datasheet value.
ROBOTS.register("panda", _single(PANDA, (0.5, 0.0, 0.0), (0.2, 0.25), 0.855))
ROBOTS.register("ur5e", _single(UR5E, (-0.134, 0.5, 0.0), (0.25, 0.2), 0.85))
ROBOTS.register("widowx", _single(WIDOWX, (0.3, 0.0, 0.0), (0.1, 0.15), 0.65))
ROBOTS.register("kinova_gen3", _single(KINOVA_GEN3, (0.5, 0.0, 0.0), (0.2, 0.25), 0.902))


@ROBOTS.register("aloha")
def _aloha(rng: np.random.Generator) -> RobotDescription:
    """Two ViperX 300 arms facing each other across the table (fact sheet §7.1); root frame = table centre."""
    arms = tuple((side, VIPERX, pos, yaw) for side, (pos, yaw) in ALOHA_BASES.items())
    return RobotDescription("aloha", arms, (0.0, 0.0, 0.0), (0.25, 0.2), 0.75)


@ROBOTS.register("procedural")
def _procedural(rng: np.random.Generator, **options: Any) -> RobotDescription:
    from vla.sim.procedural import procedural_arm  # local: keeps the data-only arms import light

    arm = procedural_arm(rng, **options)
    reach = float(arm.params["reach"])
    center = (float(arm.params["home_tcp_x"]), 0.0, 0.0)  # workspace under the home TCP
    return RobotDescription("procedural", (("", arm, (0.0, 0.0, 0.0), 0.0),), center,
                            (0.2 * reach, 0.3 * reach), reach, dict(arm.params))  # fmt: skip


def yaw_quat(yaw: float) -> list[float]:
    """MuJoCo quaternion (w, x, y, z) of a rotation by ``yaw`` rad about +z."""
    return [math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2)]


def look_at_quat(eye: np.ndarray, target: np.ndarray, up: np.ndarray) -> list[float]:
    """Quaternion of a MuJoCo camera frame at ``eye`` looking at ``target`` (camera looks along −z, +y is up)."""
    z = np.asarray(eye, float) - np.asarray(target, float)
    z /= np.linalg.norm(z)
    x = np.cross(up, z)
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    quat = np.zeros(4)
    mujoco.mju_mat2Quat(quat, np.stack([x, y, z], axis=1).reshape(-1))
    return quat.tolist()


def _inertia(mass: float, length: float, radius: float) -> list[float]:
    # Isotropic upper bound of a capsule's inertia (kg·m²): the fact sheet's vendor tensors are partly
    # implausible (§10.8), and a slightly large inertia only adds stability.
    i = mass * (length**2 / 12.0 + radius**2 / 2.0)
    return [i, i, i]


def _capsule_or_sphere(body: mujoco.MjsBody, end: np.ndarray, radius: float, rgba: Any) -> None:
    common = dict(contype=ROBOT_CONTYPE, conaffinity=ROBOT_CONAFFINITY, rgba=list(rgba))
    if np.linalg.norm(end) > 1e-6:
        body.add_geom(
            type=mujoco.mjtGeom.mjGEOM_CAPSULE, fromto=[0, 0, 0, *end], size=[radius, 0, 0], **common
        )
    else:
        body.add_geom(type=mujoco.mjtGeom.mjGEOM_SPHERE, size=[radius, 0, 0], **common)


def _add_servo(spec: mujoco.MjSpec, name: str, joint: str, kp: float, kv: float, dampratio: float | None,
               force: float, ctrlrange: tuple[float, float] | None) -> None:  # fmt: skip
    act = spec.add_actuator(name=name, target=joint, trntype=mujoco.mjtTrn.mjTRN_JOINT)
    if dampratio is not None:
        act.set_to_position(kp=kp, dampratio=dampratio)
    else:
        act.set_to_position(kp=kp, kv=kv)
    act.forcelimited = mujoco.mjtLimited.mjLIMITED_TRUE
    act.forcerange = [-force, force]
    if ctrlrange is not None:
        act.ctrllimited = mujoco.mjtLimited.mjLIMITED_TRUE
        act.ctrlrange = list(ctrlrange)


def arm_to_mjspec(arm: ArmSpec) -> mujoco.MjSpec:
    """A standalone MjSpec holding one arm (root body ``link0``) with unprefixed names, e.g. to save as XML."""
    spec = mujoco.MjSpec()
    spec.modelname = arm.name
    spec.compiler.degree = False  # every angle here is in rad (MjSpec defaults to degrees, like MJCF)
    _build_arm(spec, spec.worldbody, arm, "")
    return spec


def _build_arm(spec: mujoco.MjSpec, parent: mujoco.MjsBody, arm: ArmSpec, prefix: str) -> None:
    """Add ``arm`` under ``parent`` (bodies) and to ``spec`` (servos, finger coupling), names prefixed."""
    links = arm.links
    # Hinge ranges follow the spec's angle unit (MjSpec defaults to degrees, like MJCF); we never change it.
    unit = 180.0 / math.pi if spec.compiler.degree else 1.0
    base = parent.add_body(name=f"{prefix}link0", quat=list(arm.base_quat), mass=arm.base_mass,
                           ipos=list(arm.base_com), explicitinertial=True,
                           inertia=_inertia(arm.base_mass, links[0].pos[2], arm.base_radius))  # fmt: skip
    _capsule_or_sphere(base, np.asarray(links[0].pos), arm.base_radius, arm.rgba)
    parent = base
    for i, link in enumerate(links):
        end = np.asarray(links[i + 1].pos if i + 1 < len(links) else arm.gripper.mount_pos, float)
        body = parent.add_body(name=f"{prefix}{link.name}", pos=list(link.pos), quat=list(link.quat),
                               mass=link.mass, ipos=list(link.com), explicitinertial=True,
                               inertia=_inertia(link.mass, float(np.linalg.norm(end)), link.radius))  # fmt: skip
        joint = f"{prefix}joint{i + 1}"
        body.add_joint(name=joint, type=mujoco.mjtJoint.mjJNT_HINGE, axis=list(link.axis),
                       damping=link.damping, armature=link.armature, frictionloss=link.frictionloss,
                       limited=_LIMITED[link.range is not None],
                       range=[unit * q for q in link.range] if link.range else [0.0, 0.0])  # fmt: skip
        _capsule_or_sphere(body, end, link.radius, arm.rgba)
        _add_servo(spec, joint, joint, link.kp, link.kv, link.dampratio, link.force, link.range)
        parent = body
    _add_gripper(spec, parent, arm, prefix)


def _add_gripper(spec: mujoco.MjSpec, parent: mujoco.MjsBody, arm: ArmSpec, prefix: str) -> None:
    g = arm.gripper
    half = np.asarray(g.palm_half, float)
    palm = parent.add_body(name=f"{prefix}gripper", pos=list(g.mount_pos), quat=list(g.mount_quat), mass=g.palm_mass,
                           ipos=[0, 0, half[2]], explicitinertial=True,
                           inertia=_inertia(g.palm_mass, 2 * half[1], half[2]))  # fmt: skip
    palm.add_geom(type=mujoco.mjtGeom.mjGEOM_BOX, size=half.tolist(), pos=[0, 0, half[2]], rgba=list(arm.rgba),
                  contype=ROBOT_CONTYPE, conaffinity=ROBOT_CONAFFINITY)  # fmt: skip
    palm.add_site(name=f"{prefix}flange", size=[0.005, 0, 0], rgba=[0, 0, 1, 0.5], group=3)
    palm.add_site(
        name=f"{prefix}ee", pos=[0, 0, g.tcp_offset], size=[0.006, 0, 0], rgba=[1, 0, 0, 0.5], group=3
    )
    # Wrist camera: behind the palm on the −x side (off the finger plane), aimed 0.15 m past the TCP.
    eye = np.array([-(half[0] + 0.03), 0.0, half[2]])
    palm.add_camera(name=f"{prefix}wrist", pos=eye.tolist(), fovy=WRIST_FOVY,
                    quat=look_at_quat(eye, np.array([0, 0, g.tcp_offset + 0.15]), np.array([-1.0, 0, 0])))  # fmt: skip
    # Finger pads: inner face ``pad_inset`` inward of the joint position (gap = 2·(q − inset)), reaching 15 mm
    # past the TCP.
    pad_len = g.tcp_offset + 0.015 - g.finger_z
    pad_t = 0.006
    pad_y = pad_t - g.pad_inset  # pad centre along the finger's opening direction, finger frame
    for side, sign in (("left", 1.0), ("right", -1.0)):
        finger = palm.add_body(name=f"{prefix}{side}_finger", pos=[0, 0, g.finger_z], mass=g.finger_mass,
                               ipos=[0, sign * pad_y, pad_len / 2], explicitinertial=True,
                               inertia=_inertia(g.finger_mass, pad_len, pad_t))  # fmt: skip
        finger.add_joint(name=f"{prefix}{side}_finger", type=mujoco.mjtJoint.mjJNT_SLIDE, axis=[0, sign, 0],
                         range=list(g.finger_range), limited=mujoco.mjtLimited.mjLIMITED_TRUE,
                         damping=g.damping, armature=g.armature)  # fmt: skip
        finger.add_geom(type=mujoco.mjtGeom.mjGEOM_BOX, size=[0.01, pad_t, pad_len / 2],
                        pos=[0, sign * pad_y, pad_len / 2], friction=[1.5, 0.005, 0.0001],
                        rgba=[0.15, 0.15, 0.15, 1], contype=ROBOT_CONTYPE, conaffinity=ROBOT_CONAFFINITY)  # fmt: skip
    # One servo on the left finger; the right one mirrors it through a joint equality (q_right = q_left).
    spec.add_equality(name=f"{prefix}finger_coupling", type=mujoco.mjtEq.mjEQ_JOINT,
                      name1=f"{prefix}right_finger", name2=f"{prefix}left_finger", data=[0, 1] + [0] * 10)  # fmt: skip
    _add_servo(
        spec, f"{prefix}gripper", f"{prefix}left_finger", g.kp, g.kv, g.dampratio, g.force, g.finger_range
    )


def _arm_handles(arm: ArmSpec, full_prefix: str, arm_name: str) -> ArmHandles:
    n = len(arm.links)
    return ArmHandles(
        name=arm_name,
        joints=tuple(f"{full_prefix}joint{i + 1}" for i in range(n)),
        actuators=tuple(f"{full_prefix}joint{i + 1}" for i in range(n)),
        joint_limits=tuple(link.range if link.range else (-math.inf, math.inf) for link in arm.links),
        velocity_limits=tuple(float(link.velocity) for link in arm.links),
        home=tuple(float(q) for q in arm.home),
        gripper_joints=(f"{full_prefix}left_finger", f"{full_prefix}right_finger"),
        gripper_actuator=f"{full_prefix}gripper",
        gripper_range=arm.gripper.finger_range,
        pad_inset=arm.gripper.pad_inset,
        ee_site=f"{full_prefix}ee",
        flange_site=f"{full_prefix}flange",
        wrist_camera=f"{full_prefix}wrist",
        base_body=f"{full_prefix}link0",
        gripper_body=f"{full_prefix}gripper",
    )


def _parent_body(spec_parent: mujoco.MjSpec | mujoco.MjsBody) -> mujoco.MjsBody:
    return spec_parent.worldbody if isinstance(spec_parent, mujoco.MjSpec) else spec_parent


def build_robot(name: str, spec_parent: mujoco.MjSpec | mujoco.MjsBody, *, prefix: str = "",
                seed: int | None = None, pos: Vec3 = (0.0, 0.0, 0.0), yaw: float = 0.0,
                spec: mujoco.MjSpec | None = None, **options: Any) -> RobotHandles:  # fmt: skip
    """Add robot ``name`` (one of ``ROBOTS.names()``) under ``spec_parent`` and return its handles.

    The robot's root body ``<prefix>base`` is placed at ``pos`` (m) rotated by ``yaw`` (rad) about +z in the
    parent; its frame is the one the fact sheet's world positions use. ``seed`` drives ``procedural``;
    ``options`` go to the robot's factory (``procedural``: ``dof``). Compile the parent spec afterwards.
    With a body as ``spec_parent`` pass its ``spec`` too, or a non-empty ``prefix`` (the robot is then built
    in its own spec and attached with ``MjsFrame.attach_body``, which needs a namespace).
    """
    factory = ROBOTS.get(name)
    try:
        desc = factory(np.random.default_rng(seed), **options)
    except TypeError as e:
        raise TypeError(f"build_robot({name!r}): bad option(s) {sorted(options)}: {e}") from e
    if isinstance(spec_parent, mujoco.MjSpec):
        spec = spec_parent
    if spec is None and not prefix:
        raise ValueError(
            f"build_robot({name!r}) under a body needs spec=<the body's MjSpec> or a non-empty prefix"
        )
    target_spec = spec if spec is not None else mujoco.MjSpec()
    if spec is None:
        target_spec.compiler.degree = False  # attach keeps the child's compiler settings
    local_prefix = prefix if spec is not None else ""  # attach adds the prefix itself
    root = _parent_body(spec_parent if spec is not None else target_spec).add_body(
        name=f"{local_prefix}base", pos=list(pos), quat=yaw_quat(yaw)
    )
    arms = []
    for arm_name, arm, arm_pos, arm_yaw in desc.arms:
        arm_prefix = f"{arm_name}_" if arm_name else ""
        frame = root.add_body(
            name=f"{local_prefix}{arm_prefix}mount", pos=list(arm_pos), quat=yaw_quat(arm_yaw)
        )
        _build_arm(target_spec, frame, arm, f"{local_prefix}{arm_prefix}")
        arms.append(_arm_handles(arm, f"{prefix}{arm_prefix}", arm_name))
    if spec is None:
        _parent_body(spec_parent).add_frame().attach_body(root, prefix, "")
    return RobotHandles(robot=name, prefix=prefix, arms=tuple(arms), root_body=f"{prefix}base",
                        workspace_center=desc.workspace_center, workspace_half=desc.workspace_half,
                        reach=desc.reach, params=dict(desc.params))  # fmt: skip


@dataclass(frozen=True)
class MjcfRobot:
    """A user-supplied MJCF robot after attachment: its (prefixed) element names, as found in the file."""

    path: str
    root_body: str
    bodies: tuple[str, ...]
    joints: tuple[str, ...]
    actuators: tuple[str, ...]
    sites: tuple[str, ...]
    cameras: tuple[str, ...]


def load_mjcf_robot(path: str | Path, spec_parent: mujoco.MjSpec | mujoco.MjsBody, *, prefix: str = "mjcf/",
                    pos: Vec3 = (0.0, 0.0, 0.0), yaw: float = 0.0) -> MjcfRobot:  # fmt: skip
    """Attach every top-level body of the MJCF robot at ``path`` (with its actuators, tendons, equalities).

    Its root body ``<prefix>base`` sits at ``pos`` (m), turned by ``yaw`` (rad). ``prefix`` must be non-empty
    (MuJoCo's attach namespaces the file's names with it). World-level geoms and lights of the file (a floor in
    a scene file) are not copied: pass the robot file, not its scene. Meshes resolve relative to the file.
    """
    if not prefix:
        raise ValueError("load_mjcf_robot: prefix must be non-empty (it namespaces the file's element names)")
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"MJCF robot file not found: {path}. Pass the path of a MuJoCo XML robot model "
            "(e.g. mujoco_menagerie/franka_emika_panda/panda.xml), or use a built-in robot: "
            f"{', '.join(ROBOTS.names())}."
        )
    try:
        child = mujoco.MjSpec.from_file(str(path))
    except ValueError as e:
        raise ValueError(f"could not parse MJCF robot {path}: {e}") from e
    tops = list(child.worldbody.bodies)
    if not tops:
        raise ValueError(f"MJCF robot {path} has no body under <worldbody>; nothing to attach")

    def names(items: Any) -> tuple[str, ...]:
        return tuple(f"{prefix}{x.name}" for x in items if x.name)

    # Read the names first: attaching renames the child's elements in place.
    robot = MjcfRobot(
        path=str(path),
        root_body=f"{prefix}base",
        bodies=names(child.bodies[1:]),
        joints=names(child.joints),
        actuators=names(child.actuators),
        sites=names(child.sites),
        cameras=names(child.cameras),
    )
    root = _parent_body(spec_parent).add_body(name=f"{prefix}base", pos=list(pos), quat=yaw_quat(yaw))
    frame = root.add_frame()
    for body in tops:
        frame.attach_body(body, prefix, "")
    return robot
