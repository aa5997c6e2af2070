"""Kinematic descriptions of the simulated arms: data only, one ``ArmSpec`` per published robot.

Every number comes from a published robot model, named per arm below and in its ``sources``; "Menagerie" is
google-deepmind/mujoco_menagerie (franka_emika_panda/panda.xml @f2e9fb62 and mjx_panda.xml @9d895b38,
universal_robots_ur5e/ur5e.xml @832d908f, trossen_wx250s/wx250s.xml @3ff28577, kinova_gen3/gen3.xml @39664247,
aloha/aloha.xml @441860e1 with its README's system-identified joints). A chain row is MuJoCo body semantics
(Menagerie's body/joint attributes): a child body placed in its parent by ``pos`` (m) then
``quat`` (w, x, y, z), the hinge at the body origin with ``axis`` in the body frame, joint value 0 = the pose
described. Gripper frames share one convention so tasks and experts can treat every arm alike: +z is the approach
axis, the two fingers slide along ±y, the TCP site sits at ``tcp_offset`` along +z.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

Vec3 = tuple[float, float, float]
Quat = tuple[float, float, float, float]

X: Vec3 = (1.0, 0.0, 0.0)
Y: Vec3 = (0.0, 1.0, 0.0)
Z: Vec3 = (0.0, 0.0, 1.0)
IDENTITY: Quat = (1.0, 0.0, 0.0, 0.0)
RX_POS90: Quat = (1.0, 1.0, 0.0, 0.0)  # +90° about x (MuJoCo normalizes)
RX_NEG90: Quat = (1.0, -1.0, 0.0, 0.0)  # -90° about x
RY_POS90: Quat = (1.0, 0.0, 1.0, 0.0)  # +90° about y: maps local +z onto the parent's +x
RX_180: Quat = (0.0, 1.0, 0.0, 0.0)
PI = math.pi


@dataclass(frozen=True)
class LinkSpec:
    """One moving body of a serial arm and its hinge joint + position servo.

    ``range`` is the joint limit in rad (``None`` = continuous joint). The servo is MuJoCo's position actuator,
    torque = kp·(ctrl − q) − kv·q̇ clamped to ±``force`` (N·m); ``dampratio`` replaces ``kv`` when set.
    ``velocity`` (rad/s) is the joint's published speed limit: the servo's setpoint never moves faster (see
    ``World.act``); ``inf`` = none. ``mass`` (kg) and ``com`` (m, body frame) are the published inertials; the rotational inertia is derived
    from the collision capsule (vendor tensors carried over from URDFs are implausible, e.g. Panda link1
    Ixx ≈ 0.70 kg·m² for 4.97 kg in panda.xml). ``radius`` (m) sizes the
    capsule drawn from this body's origin to its child's origin.
    """

    name: str
    pos: Vec3
    axis: Vec3
    range: tuple[float, float] | None
    kp: float
    kv: float = 0.0
    force: float = 100.0
    quat: Quat = IDENTITY
    dampratio: float | None = None
    damping: float = 0.0
    armature: float = 0.0
    frictionloss: float = 0.0
    mass: float = 0.5
    com: Vec3 = (0.0, 0.0, 0.0)
    radius: float = 0.04
    velocity: float = math.inf


@dataclass(frozen=True)
class GripperSpec:
    """A parallel-jaw gripper: a palm body rigidly mounted on the last link, two slide fingers, one servo.

    ``mount_pos``/``mount_quat`` place the gripper frame (+z approach, ±y finger travel) in the last link's frame.
    ``finger_range`` is each finger joint's travel from the centre plane in m, (closed, open). ``pad_inset`` is
    how far the finger pad's inner face sits inward of the joint's position (m), so the jaw gap is
    ``2 · (q − pad_inset)``. The servo drives the left finger (ctrl in m); a joint equality slaves the right one.
    """

    mount_pos: Vec3
    mount_quat: Quat
    finger_range: tuple[float, float]
    finger_z: float  # finger bodies' origin along +z, m
    tcp_offset: float  # TCP (site ``ee``) along +z, m
    kp: float
    kv: float = 0.0
    force: float = 100.0
    dampratio: float | None = None
    damping: float = 0.0
    armature: float = 0.0
    palm_mass: float = 0.3
    finger_mass: float = 0.02
    palm_half: Vec3 = (0.02, 0.04, 0.02)  # palm box half-sizes, m
    pad_inset: float = 0.0  # m, pad inner face inward of the finger joint position

    def __post_init__(self) -> None:
        if self.pad_inset >= self.finger_range[1]:
            raise ValueError(
                f"gripper: pad_inset {self.pad_inset} must be < the open finger position {self.finger_range[1]}"
            )

    @property
    def jaw_range(self) -> tuple[float, float]:
        """Gap between the finger pads (m), (closed, open)."""
        lo, hi = self.finger_range
        return 2 * (lo - self.pad_inset), 2 * (hi - self.pad_inset)


@dataclass(frozen=True)
class ArmSpec:
    """A whole arm: fixed base body (``base_quat`` in the mount frame), moving links, gripper, home pose (rad)."""

    name: str
    links: tuple[LinkSpec, ...]
    gripper: GripperSpec
    home: tuple[float, ...]
    base_quat: Quat = IDENTITY
    base_mass: float = 1.0
    base_com: Vec3 = (0.0, 0.0, 0.0)
    base_radius: float = 0.05
    rgba: tuple[float, float, float, float] = (0.85, 0.85, 0.85, 1.0)
    sources: tuple[str, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)  # sampled values for generated arms

    def __post_init__(self) -> None:
        if len(self.home) != len(self.links):
            raise ValueError(
                f"arm {self.name!r}: home has {len(self.home)} values for {len(self.links)} joints"
            )
        for link, q in zip(self.links, self.home):
            if link.range is not None and not link.range[0] <= q <= link.range[1]:
                raise ValueError(f"arm {self.name!r}: home {q} outside {link.name} range {link.range}")
            if not link.velocity > 0:
                raise ValueError(
                    f"arm {self.name!r}: {link.name} velocity {link.velocity} rad/s must be > 0 (inf = no limit)"
                )


def with_velocity_limits(links: tuple[LinkSpec, ...], limits: tuple[float, ...]) -> tuple[LinkSpec, ...]:
    """``links`` with each joint's published speed limit (rad/s), one per link."""
    if len(limits) != len(links):
        raise ValueError(f"{len(limits)} velocity limits for {len(links)} links")
    return tuple(replace(link, velocity=float(v)) for link, v in zip(links, limits))


# Generic Robotiq-2F-85-like gripper for arms sold without one (UR5e, Gen3): 85 mm stroke and the pinch point
# 0.12 m beyond the tool flange, from Menagerie's kinova_gen3 README recipe. Gains: Menagerie mjx_panda.xml's hand.
ROBOTIQ_LIKE = GripperSpec(
    mount_pos=(0.0, 0.0, 0.0),
    mount_quat=IDENTITY,
    finger_range=(0.0, 0.0425),
    finger_z=0.07,
    tcp_offset=0.12,
    kp=350.0,
    kv=10.0,
    force=100.0,
    damping=10.0,
    armature=0.1,
    palm_mass=0.9,
    finger_mass=0.05,
    palm_half=(0.03, 0.045, 0.035),
)

# ---- Franka Emika Panda: Menagerie panda.xml (chain, inertials, servos, key), mjx_panda.xml hand ------------
_PANDA_J = dict(damping=1.0, armature=0.1)  # panda.xml: damping 1, armature 0.1 on every joint
# Franka's joint speed limits (fact sheet §2.3, Franka "Robot and interface specifications"): 2.175 rad/s on J1-4,
# 2.61 rad/s on J5-7.
_PANDA_V = (2.175, 2.175, 2.175, 2.175, 2.61, 2.61, 2.61)
# fmt: off
_PANDA_LINKS = (
    LinkSpec("link1", (0, 0, 0.333), Z, (-2.8973, 2.8973), 4500, 450, 87, mass=4.9707,
             com=(0.0039, 0.0021, -0.0476), radius=0.06, **_PANDA_J),
    LinkSpec("link2", (0, 0, 0), Z, (-1.7628, 1.7628), 4500, 450, 87, quat=RX_NEG90, mass=0.6469,
             com=(-0.0031, -0.0287, 0.0035), radius=0.06, **_PANDA_J),
    LinkSpec("link3", (0, -0.316, 0), Z, (-2.8973, 2.8973), 3500, 350, 87, quat=RX_POS90, mass=3.2286,
             com=(0.0275, 0.0393, -0.0665), radius=0.06, **_PANDA_J),
    LinkSpec("link4", (0.0825, 0, 0), Z, (-3.0718, -0.0698), 3500, 350, 87, quat=RX_POS90, mass=3.5879,
             com=(-0.0532, 0.1044, 0.0275), radius=0.06, **_PANDA_J),
    LinkSpec("link5", (-0.0825, 0.384, 0), Z, (-2.8973, 2.8973), 2000, 200, 12, quat=RX_NEG90,
             mass=1.2259, com=(-0.0120, 0.0411, -0.0384), radius=0.06, **_PANDA_J),
    LinkSpec("link6", (0, 0, 0), Z, (-0.0175, 3.7525), 2000, 200, 12, quat=RX_POS90, mass=1.6666,
             com=(0.0601, -0.0141, -0.0105), radius=0.05, **_PANDA_J),
    LinkSpec("link7", (0.088, 0, 0), Z, (-2.8973, 2.8973), 2000, 200, 12, quat=RX_POS90, mass=0.7355,
             com=(0.0105, -0.0043, 0.0616), radius=0.04, **_PANDA_J),
)
# fmt: on
PANDA = ArmSpec(
    name="panda",
    links=with_velocity_limits(_PANDA_LINKS, _PANDA_V),
    # Hand at link7 +0.107 z rotated −45° about z; fingers slide along hand y from hand +0.0584 z, 0…0.04 m
    # each; TCP = Franka hand_tcp at 0.1034 (franka_description franka_hand.xacro; panda.xml has no TCP site).
    gripper=GripperSpec(
        mount_pos=(0, 0, 0.107),
        mount_quat=(0.9238795, 0, 0, -0.3826834),
        finger_range=(0.0, 0.04),
        finger_z=0.0584,
        tcp_offset=0.1034,
        kp=350.0,
        kv=10.0,
        force=200.0,
        damping=10.0,
        armature=0.1,
        palm_mass=0.73,
        finger_mass=0.015,
        palm_half=(0.02, 0.1, 0.03),
    ),
    home=(0.0, 0.0, 0.0, -1.57079, 0.0, 1.57079, -0.7853),
    base_mass=0.6298,
    base_com=(-0.041, -0.0001, 0.050),
    base_radius=0.06,
    rgba=(0.95, 0.95, 0.95, 1.0),
    sources=(
        "mujoco_menagerie franka_emika_panda/panda.xml @f2e9fb62, mjx_panda.xml @9d895b38 (hand)",
        "frankaemika/franka_description @032e7ee8 franka_arm.xacro (collision capsule radii)",
    ),
)

# ---- Universal Robots UR5e: Menagerie ur5e.xml @832d908f (base 180° about z): chain, inertials, servos ---
_UR_BIG = dict(kp=2000.0, kv=400.0, force=150.0, armature=0.1)  # ur5e.xml class "size3"
_UR_SMALL = dict(kp=500.0, kv=100.0, force=28.0, armature=0.1)  # ur5e.xml class "size1"
_TWO_PI = 6.28319
# fmt: off
_UR5E_LINKS = (
    LinkSpec("shoulder_link", (0, 0, 0.163), Z, (-_TWO_PI, _TWO_PI), mass=3.7, radius=0.06, **_UR_BIG),
    LinkSpec("upper_arm_link", (0, 0.138, 0), Y, (-_TWO_PI, _TWO_PI), quat=RY_POS90, mass=8.393,
             com=(0, 0, 0.2125), radius=0.055, **_UR_BIG),
    LinkSpec("forearm_link", (0, -0.131, 0.425), Y, (-3.1415, 3.1415), mass=2.275, com=(0, 0, 0.196),
             radius=0.045, **_UR_BIG),
    LinkSpec("wrist_1_link", (0, 0, 0.392), Y, (-_TWO_PI, _TWO_PI), quat=RY_POS90, mass=1.219,
             com=(0, 0.127, 0), radius=0.04, **_UR_SMALL),
    LinkSpec("wrist_2_link", (0, 0.127, 0), Z, (-_TWO_PI, _TWO_PI), mass=1.219, com=(0, 0, 0.1),
             radius=0.04, **_UR_SMALL),
    LinkSpec("wrist_3_link", (0, 0, 0.1), Y, (-_TWO_PI, _TWO_PI), mass=0.1889, com=(0, 0.0772, 0),
             radius=0.04, **_UR_SMALL),
)
# fmt: on
UR5E = ArmSpec(
    name="ur5e",
    # UR's joint speed limit, 180°/s on every joint (fact sheet §3.2, Universal_Robots_ROS2_Description
    # config/ur5e/joint_limits.yaml)
    links=with_velocity_limits(_UR5E_LINKS, (PI,) * 6),
    # Tool flange = Menagerie attachment_site, wrist_3 +0.1 y, −90° about x; no gripper in ur5e.xml.
    gripper=replace(ROBOTIQ_LIKE, mount_pos=(0, 0.1, 0), mount_quat=(-1, 1, 0, 0)),
    home=(-1.5708, -1.5708, 1.5708, -1.5708, -1.5708, 0.0),
    base_quat=(0.0, 0.0, 0.0, -1.0),
    base_mass=4.0,
    base_radius=0.06,
    rgba=(0.55, 0.65, 0.75, 1.0),
    sources=(
        "mujoco_menagerie universal_robots_ur5e/ur5e.xml @832d908f (chain, inertials, servos, capsules)",
        "gripper: mujoco_menagerie kinova_gen3 README Robotiq 2F-85 recipe (assumed for UR5e)",
    ),
)

# ---- Trossen WidowX 250 6DOF (wx250s): Menagerie wx250s.xml @3ff28577 (chain, inertials, servos, gripper) ---
_WX = dict(kp=50.0, dampratio=0.95, force=35.0, armature=0.1, frictionloss=0.1)
# fmt: off
_WIDOWX_LINKS = (
    LinkSpec("shoulder_link", (0, 0, 0.072), Z, (-3.14158, 3.14158), mass=0.4809, com=(0, 0, 0.0066),
             radius=0.03, **_WX),
    LinkSpec("upper_arm_link", (0, 0, 0.03865), Y, (-1.88496, 1.98968), mass=0.4308,
             com=(0.0172, 0, 0.1913), radius=0.025, **_WX),
    LinkSpec("upper_forearm_link", (0.04975, 0, 0.25), Y, (-2.14675, 1.6057), mass=0.2346,
             com=(0.1080, 0.0001, 0), radius=0.025, **_WX),
    LinkSpec("lower_forearm_link", (0.175, 0, 0), X, (-3.14158, 3.14158), mass=0.2210,
             com=(0.0374, 0.0052, 0), radius=0.025, **_WX),
    LinkSpec("wrist_link", (0.075, 0, 0), Y, (-1.74533, 2.14675), mass=0.0850, com=(0.0424, 0, 0.0106),
             radius=0.025, **_WX),
    LinkSpec("gripper_link", (0.065, 0, 0), X, (-3.14158, 3.14158), mass=0.1101,
             com=(0.0325, 0, 0.0091), radius=0.025, **_WX),
)
# fmt: on
WIDOWX = ArmSpec(
    name="widowx",
    # π rad/s on every joint: Interbotix interbotix_xsarm_descriptions urdf/wx250s.urdf.xacro @41746ab1
    links=with_velocity_limits(_WIDOWX_LINKS, (PI,) * 6),
    # Gripper frame = gripper_link turned so +z is its +x (approach); fingers at +0.066 slide along y,
    # 0.015…0.037 m each (the "30…74 mm" of Trossen's joint-limit table is this joint travel); TCP =
    # Interbotix ee_gripper_link at +0.093575 (wx250s.xml). The pads' contact faces sit 9.6 mm inward of the
    # finger joint (Menagerie wx250s.xml: finger contact spheres r 0.6 mm at finger-frame y ∓0.009), so the
    # jaw gap between the pads is 10.8…54.8 mm, and the 0.015 m closed target squeezes a held object.
    gripper=GripperSpec(
        mount_pos=(0, 0, 0),
        mount_quat=RY_POS90,
        finger_range=(0.015, 0.037),
        finger_z=0.066,
        tcp_offset=0.093575,
        kp=200.0,
        dampratio=0.95,
        force=35.0,
        armature=0.1,
        palm_mass=0.01,  # gripper_link's own mass is on the wrist_rotate body above
        finger_mass=0.01625,
        palm_half=(0.02, 0.04, 0.015),
        pad_inset=0.0096,
    ),
    home=(0.0, -0.96, 1.16, 0.0, -0.3, 0.0),
    base_mass=0.5387,
    base_com=(-0.0380, 0.0006, 0.0193),
    base_radius=0.04,
    rgba=(0.25, 0.25, 0.28, 1.0),
    sources=(
        "mujoco_menagerie trossen_wx250s/wx250s.xml @3ff28577",
        "radii estimated from the Dynamixel XM430 envelope (emanual.robotis.com)",
    ),
)

# ---- Kinova Gen3 7-DoF: Menagerie gen3.xml @39664247 (chain, inertials, servos, keys) ----------------------
# Deviation: armature 0.1 on every joint (Menagerie sets none). With capsule-derived inertia the 500 N·m/rad
# wrist servos are otherwise unstable at dt = 2 ms; harmonic-drive joints do have a large reflected inertia.
_G_BIG = dict(kp=2000.0, kv=100.0, force=105.0, armature=0.1)
_G_SMALL = dict(kp=500.0, kv=50.0, force=52.0, armature=0.1)
# fmt: off
_GEN3_LINKS = (
    LinkSpec("shoulder_link", (0, 0, 0.15643), Z, None, quat=RX_180, mass=1.3773,
             com=(0, -0.0104, -0.0734), radius=0.06, **_G_BIG),
    LinkSpec("half_arm_1_link", (0, 0.005375, -0.12838), Z, (-2.24, 2.24), quat=RX_POS90, mass=1.1636,
             com=(0, -0.0996, -0.0133), radius=0.055, **_G_BIG),
    LinkSpec("half_arm_2_link", (0, -0.21038, -0.006375), Z, None, quat=RX_NEG90, mass=1.1636,
             com=(0, -0.0066, -0.1179), radius=0.055, **_G_BIG),
    LinkSpec("forearm_link", (0, 0.006375, -0.21038), Z, (-2.57, 2.57), quat=RX_POS90, mass=0.9302,
             com=(0, -0.0755, -0.0150), radius=0.055, **_G_BIG),
    LinkSpec("spherical_wrist_1_link", (0, -0.20843, -0.006375), Z, None, quat=RX_NEG90, mass=0.6781,
             com=(0, -0.0094, -0.0639), radius=0.05, **_G_SMALL),
    LinkSpec("spherical_wrist_2_link", (0, 0.00017505, -0.10593), Z, (-2.09, 2.09), quat=RX_POS90,
             mass=0.6781, com=(0, -0.0455, -0.0097), radius=0.05, **_G_SMALL),
    LinkSpec("bracelet_link", (0, -0.10593, -0.00017505), Z, None, quat=RX_NEG90, mass=0.5,
             com=(0.0003, 0.0114, -0.0298), radius=0.045, **_G_SMALL),
)
# fmt: on
KINOVA_GEN3 = ArmSpec(
    name="kinova_gen3",
    # ros_kortex gen3 URDF: 1.3963 rad/s on J1-4, 1.2218 rad/s on J5-7 (fact sheet §5)
    links=with_velocity_limits(_GEN3_LINKS, (1.3963,) * 4 + (1.2218,) * 3),
    # Flange = Menagerie pinch_site (bracelet −0.061525 z, 180° about x); a 2F-85-like gripper there puts the
    # pinch point 0.12 m further (Menagerie kinova_gen3 README Robotiq recipe: −0.181525).
    gripper=replace(ROBOTIQ_LIKE, mount_pos=(0, 0, -0.061525), mount_quat=RX_180),
    home=(0.0, 0.26179939, PI, -2.26892803, 0.0, 0.95993109, PI / 2),
    base_mass=1.697,
    base_com=(-0.0006, -0.0002, 0.0845),
    base_radius=0.06,
    rgba=(0.3, 0.3, 0.33, 1.0),
    sources=(
        "mujoco_menagerie kinova_gen3/gen3.xml @39664247",
        "NVlabs/curobo @07e6ccfc configs/robot/spheres/kinova_gen3.yml (radii)",
    ),
)

# ---- ViperX 300 6DOF as in ALOHA: Menagerie aloha.xml @441860e1 (chain, inertials; joints per its README) ---
# fmt: off
_VIPERX_LINKS = (
    LinkSpec("shoulder_link", (0, 0, 0.079), Z, (-3.14158, 3.14158), 43, force=35, damping=5.76,
             mass=0.7986, com=(0.0003, 0, 0.0116), radius=0.035),
    LinkSpec("upper_arm_link", (0, 0, 0.04805), Y, (-1.85005, 1.25664), 265, force=144, armature=0.395,
             damping=20.0, frictionloss=2.0, mass=0.7926, com=(0.0207, 0, 0.2265), radius=0.03),
    LinkSpec("upper_forearm_link", (0.05955, 0, 0.3), Y, (-1.76278, 1.6057), 227, force=59,
             armature=0.383, damping=18.49, frictionloss=1.15, mass=0.3222, com=(0.1057, 0, 0),
             radius=0.03),
    LinkSpec("lower_forearm_link", (0.2, 0, 0), X, (-3.14158, 3.14158), 78, force=22, armature=0.14,
             damping=6.78, mass=0.4148, com=(0.0513, 0.0068, 0), radius=0.03),
    LinkSpec("wrist_link", (0.1, 0, 0), Y, (-1.8675, 2.23402), 37, force=35, armature=0.008,
             damping=6.28, mass=0.1154, com=(0.0467, 0, 0.0106), radius=0.03),
    LinkSpec("gripper_link", (0.069744, 0, 0), X, (-3.14158, 3.14158), 10.4, force=35, damping=1.2,
             mass=0.2517, com=(0.0396, 0, 0.0040), radius=0.03),
)
# fmt: on
VIPERX = ArmSpec(
    name="viperx",
    # π rad/s on every joint: Interbotix interbotix_xsarm_descriptions urdf/vx300s.urdf.xacro @41746ab1
    links=with_velocity_limits(_VIPERX_LINKS, (PI,) * 6),
    # Gripper frame = gripper_link with +z along its +x; finger origins at +0.0562, software travel
    # 0.002…0.037 m; TCP = Menagerie site "gripper" variant A (0.13 along x; its −0.003 z is dropped).
    gripper=GripperSpec(
        mount_pos=(0, 0, 0),
        mount_quat=RY_POS90,
        finger_range=(0.002, 0.037),
        finger_z=0.0562,
        tcp_offset=0.13,
        kp=2000.0,
        kv=124.0,
        force=35.0,
        damping=40.0,
        armature=0.243,
        palm_mass=0.4216,
        finger_mass=0.0863,
        palm_half=(0.025, 0.06, 0.02),
    ),
    home=(0.0, -0.96, 1.16, 0.0, -0.3, 0.0),  # aloha.xml keyframe "neutral_pose"
    base_mass=0.9690,
    base_com=(-0.0535, -0.0006, 0.0206),
    base_radius=0.04,
    rgba=(0.2, 0.2, 0.22, 1.0),
    sources=(
        "mujoco_menagerie aloha/aloha.xml @441860e1 and README",
        "radii estimated from the Dynamixel XM540 envelope (emanual.robotis.com/docs/en/dxl/x/xm540-w270)",
    ),
)

# ALOHA layout (Menagerie aloha.xml): arm bases in the table frame (table top ≈ z 0), the right arm turned
# 180° about z.
ALOHA_BASES: dict[str, tuple[Vec3, float]] = {
    "left": ((-0.469, -0.019, 0.02), 0.0),
    "right": ((0.469, -0.019, 0.02), PI),
}
