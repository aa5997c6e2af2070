"""A tabletop world: floor, table, lights, one robot at the table edge, a ``primary`` camera, optional objects.

``build_world`` assembles an ``MjSpec`` and compiles it into a ``World`` (model, data, robot handles, renderer).
Geometry: the table top is the plane z = 0 (as in Menagerie's ALOHA scene, fact sheet §7.1) and the floor is at
z = −``TABLE_HEIGHT``. A single arm sits at the table's −x edge, turned so its workspace (centred under its home
TCP) lies toward +x; ALOHA's two arms sit at their Menagerie aloha.xml positions around the table centre.

Shadows, reflections and multisampling are off by default: MuJoCo's default offscreen rendering spends nearly all of
its ~40 ms per frame (measured on CPU EGL, whatever the size) on the 4096² shadow map and multisampling, and a 128 px
frame without them costs ~1.5 ms. ``RenderSettings`` keeps them as explicit, randomizable knobs (costs in
``vla.sim.perception``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mujoco
import numpy as np

from vla.sim.handles import BoundRobot, RobotHandles
from vla.sim.objects import SCENE_CONAFFINITY, SCENE_CONTYPE, ObjectHandles, add_object
from vla.sim.robots import build_robot, look_at_quat

TABLE_HEIGHT = 0.75  # m (ALOHA scene table, fact sheet §7.1)
ALOHA_TABLE_HALF = (0.61, 0.37)  # m, fact sheet §7.1
TIMESTEP = 0.002  # s; Menagerie's default, with the implicitfast integrator its arms use (§3.4, §5.4)
# How the servos follow actions (``World.act``); `vla sim generate` records it per episode so a replay can tell
# data made before the arms had joint speed limits (no record: setpoints jumped to each target at once).
SERVO_MODEL = "joint_speed_limited_ramp"


@dataclass(frozen=True)
class RenderSettings:
    """Rendering quality knobs (each costs time: ``vla.sim.perception``). ``offsamples`` = MSAA samples (0 = off)."""

    shadows: bool = False
    shadowsize: int = 1024
    offsamples: int = 0
    reflections: bool = False
    primary_fovy: float | None = None  # deg; None = 50 (single arm) or 70 (ALOHA's wide table)


@dataclass
class World:
    """A compiled scene. ``cameras`` maps embodiment camera slots (``primary``, ``wrist`` or ``left_wrist`` /
    ``right_wrist``) to MuJoCo camera names; ``render`` accepts either. ``params`` records how it was built."""

    spec: mujoco.MjSpec
    model: mujoco.MjModel
    data: mujoco.MjData
    robot: RobotHandles
    objects: dict[str, ObjectHandles]
    cameras: dict[str, str]
    image_size: int
    render_settings: RenderSettings
    params: dict[str, Any] = field(default_factory=dict)
    _renderer: mujoco.Renderer | None = field(default=None, repr=False)
    _bound: BoundRobot | None = field(default=None, repr=False)

    @property
    def bound(self) -> BoundRobot:
        """The robot's index arrays for this model (state, apply_action, reset)."""
        if self._bound is None:
            self._bound = self.robot.bind(self.model)
        return self._bound

    def reset(self, gripper: float = 1.0) -> None:
        """Reset all state to the compiled defaults, then put the robot at home (gripper 1 = open)."""
        mujoco.mj_resetData(self.model, self.data)
        self.bound.reset(self.data, gripper)
        mujoco.mj_forward(self.model, self.data)

    def step(self, n: int = 1) -> None:
        """Advance ``n`` physics steps of ``model.opt.timestep`` s with the current controls."""
        mujoco.mj_step(self.model, self.data, nstep=n)

    def act(self, action: np.ndarray, n: int) -> None:
        """Run one control period of ``n`` physics steps toward ``action`` (``BoundRobot.apply_action``'s layout).

        The gripper commands apply at once. Each arm's joint servo setpoints (``data.ctrl``) move from where they
        are toward the action's targets along a straight line in joint space, as fast as the arm's slowest joint
        relative to its speed limit (``joint_vmax``, rad/s) allows, as a real arm's synchronized point-to-point
        trajectory generator does for speed (accelerations are not limited here): a far target is approached over
        several periods instead of being handed to a stiff servo as a step (which would swing the arm, and any
        object it hits, at speeds no real arm reaches), and the path between targets is the one asked for
        (clipping each joint on its own would bend it, e.g. into the table). Targets within reach are held for the
        rest of the period. ``n`` must be >= 1; a non-finite action is a ValueError (nothing is written to ctrl).
        """
        if n < 1:
            raise ValueError(f"World.act: a control period needs at least one physics step, got n={n}")
        b, d = self.bound, self.data
        start = d.ctrl[b.arm_ctrl].copy()
        b.apply_action(d, action)  # grippers, and the joint targets (clipped to the joint limits) into ctrl
        delta = d.ctrl[b.arm_ctrl] - start
        per_step = b.joint_vmax * self.model.opt.timestep  # rad per physics step (inf: no limit)
        ramp = np.ones_like(delta)  # per joint: physics steps its arm's ramp takes (at least 1)
        pace = np.zeros_like(delta)  # per joint: fraction of delta per physics step, where the ramp overflows
        for lo, hi in zip(b.arm_joint_slices[:-1], b.arm_joint_slices[1:]):
            with np.errstate(over="ignore"):  # a huge target on a continuous joint: |delta| / per_step is inf
                ramp[lo:hi] = max(1.0, float(np.ceil(np.max(np.abs(delta[lo:hi]) / per_step[lo:hi]))))
            if np.isinf(ramp[lo]):  # the slowest joint's pace, computed without the overflowing division
                with np.errstate(divide="ignore", over="ignore"):  # a joint that stays put (or ~so) paces inf
                    pace[lo:hi] = np.min(per_step[lo:hi] / np.abs(delta[lo:hi]))
        # compared as floats: an inf ramp (see above) is more than any n, and int() cannot take it
        steps = int(min(n, ramp.max()))
        for k in range(1, steps + 1):
            frac = np.where(np.isinf(ramp), k * pace, k / ramp)
            d.ctrl[b.arm_ctrl] = start + delta * np.minimum(1.0, frac)
            mujoco.mj_step(self.model, self.data)
        if n > steps:  # every setpoint has reached its target
            mujoco.mj_step(self.model, self.data, nstep=n - steps)

    def instability_warnings(self) -> int:
        """How many times MuJoCo has found the simulation unstable (bad positions, velocities or accelerations) and
        reset it, so far; an increase over a step means the state after it is not a continuation of the one before."""
        kinds = (
            mujoco.mjtWarning.mjWARN_BADQPOS,
            mujoco.mjtWarning.mjWARN_BADQVEL,
            mujoco.mjtWarning.mjWARN_BADQACC,
        )
        return sum(int(self.data.warning[int(k)].number) for k in kinds)

    def recompile(self) -> None:
        """Recompile after editing ``spec`` (e.g. added objects), keeping the state of unchanged elements."""
        self.model, self.data = self.spec.recompile(self.model, self.data)
        self.close()
        self._bound = None

    def render(self, camera: str) -> np.ndarray:
        """Render ``camera`` (a slot or a MuJoCo camera name) as uint8 [image_size, image_size, 3] RGB."""
        name = self.cameras.get(camera, camera)
        try:
            self.model.camera(name)
        except KeyError:
            names = [self.model.camera(i).name for i in range(self.model.ncam)]
            raise KeyError(
                f"no camera {camera!r}; slots: {sorted(self.cameras)}, MuJoCo cameras: {names}"
            ) from None
        if self._renderer is None:
            self._renderer = mujoco.Renderer(self.model, self.image_size, self.image_size)
            flags = self._renderer.scene.flags
            flags[mujoco.mjtRndFlag.mjRND_SHADOW] = self.render_settings.shadows
            flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = self.render_settings.reflections
        self._renderer.update_scene(self.data, camera=name)
        return self._renderer.render()

    def close(self) -> None:
        """Free the renderer's GL context (a new one is made on the next ``render``)."""
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None


def _table(spec: mujoco.MjSpec, half: tuple[float, float]) -> None:
    hx, hy = half
    world = spec.worldbody
    common = dict(contype=SCENE_CONTYPE, conaffinity=SCENE_CONAFFINITY)
    world.add_geom(name="floor", type=mujoco.mjtGeom.mjGEOM_PLANE, size=[3, 3, 0.05], pos=[0, 0, -TABLE_HEIGHT],
                   rgba=[0.45, 0.47, 0.5, 1], **common)  # fmt: skip
    world.add_geom(name="table", type=mujoco.mjtGeom.mjGEOM_BOX, size=[hx, hy, 0.02], pos=[0, 0, -0.02],
                   rgba=[0.62, 0.5, 0.38, 1], friction=[1.0, 0.005, 0.0001], **common)  # fmt: skip
    for i, (sx, sy) in enumerate(((1, 1), (1, -1), (-1, 1), (-1, -1))):
        world.add_geom(name=f"table_leg{i}", type=mujoco.mjtGeom.mjGEOM_BOX,
                       size=[0.025, 0.025, (TABLE_HEIGHT - 0.04) / 2],
                       pos=[sx * (hx - 0.05), sy * (hy - 0.05), -(TABLE_HEIGHT + 0.04) / 2],
                       rgba=[0.4, 0.32, 0.25, 1], **common)  # fmt: skip


def _lights(spec: mujoco.MjSpec, settings: RenderSettings) -> None:
    spec.worldbody.add_light(name="key", type=mujoco.mjtLightType.mjLIGHT_DIRECTIONAL, pos=[0.5, -0.5, 2.5],
                             dir=[-0.2, 0.2, -1], diffuse=[0.7, 0.7, 0.7], specular=[0.2, 0.2, 0.2],
                             castshadow=settings.shadows)  # fmt: skip
    spec.visual.headlight.ambient = [0.35, 0.35, 0.35]
    spec.visual.headlight.diffuse = [0.35, 0.35, 0.35]
    spec.visual.quality.shadowsize = settings.shadowsize if settings.shadows else 0
    spec.visual.quality.offsamples = settings.offsamples


def _place(rng: np.random.Generator, regions: Sequence[tuple[np.ndarray, np.ndarray]], radius: float,
           placed: list[tuple[np.ndarray, float]], tries: int = 200) -> np.ndarray:  # fmt: skip
    """Sample an xy position in the first region (rectangle ``(center, half)``) that has room for a footprint of
    ``radius`` at least 2 cm clear of ``placed`` ones; later regions are fallbacks (e.g. the whole table)."""
    for center, half in regions:
        for _ in range(tries):
            xy = center + rng.uniform(-1, 1, 2) * np.maximum(half - radius, 0.0)
            if all(np.linalg.norm(xy - p) >= radius + r + 0.02 for p, r in placed):
                return xy
    raise RuntimeError(
        f"could not place an object of radius {radius:.3f} m clear of {len(placed)} others on the table; "
        "pass fewer or smaller objects, or explicit positions"
    )


def build_world(
    robot: str,
    *,
    seed: int | None = None,
    image_size: int = 128,
    objects: Sequence[str | dict[str, Any]] = (),
    render: RenderSettings | None = None,
    **robot_options: Any,
) -> World:
    """Build and compile a tabletop world with robot ``robot`` and ``objects`` placed at random in its workspace.

    ``objects`` entries are a kind (``"cube"``) or ``add_object`` keyword dicts (``{"kind": "bowl", "rgba": …}``;
    ``pos`` optional). ``seed`` drives the procedural robot, object sizes/colours and placement; ``image_size`` is
    the square render size in px. ``robot_options`` go to ``build_robot`` (``procedural``: ``dof``).
    """
    settings = render or RenderSettings()
    rng = np.random.default_rng(seed)
    spec = mujoco.MjSpec()
    spec.modelname = f"vla_{robot}"
    spec.compiler.degree = False
    spec.option.timestep = TIMESTEP
    spec.option.integrator = mujoco.mjtIntegrator.mjINT_IMPLICITFAST
    # Elliptic friction cones with impratio 10 (Menagerie's WidowX and ALOHA settings, fact sheet §4.3, §7.4):
    # with the default pyramidal cone a held object creeps down between the pads of a gentle gripper.
    spec.option.cone = mujoco.mjtCone.mjCONE_ELLIPTIC
    spec.option.impratio = 10.0
    spec.visual.global_.offwidth = max(640, image_size)
    spec.visual.global_.offheight = max(480, image_size)
    _lights(spec, settings)

    robot_seed = int(rng.integers(2**31))
    if robot == "aloha":
        half = np.asarray(ALOHA_TABLE_HALF)
        handles = build_robot(robot, spec, seed=robot_seed, **robot_options)
        base, yaw = np.zeros(3), 0.0
    else:  # probe the workspace first, then mount the arm at the table edge facing it
        probe = build_robot(robot, mujoco.MjSpec(), seed=robot_seed, **robot_options)
        cx, cy, _ = probe.workspace_center
        yaw = -math.atan2(cy, cx)
        half = np.array([max(0.35, 0.75 * probe.reach), max(0.3, 0.6 * probe.reach)])
        base = np.array([-half[0] + 0.1, 0.0, 0.0])
        handles = build_robot(robot, spec, seed=robot_seed, pos=tuple(base), yaw=yaw, **robot_options)
    _table(spec, (float(half[0]), float(half[1])))

    # Workspace in world coordinates (the robot's root frame turned by yaw).
    c, s = math.cos(yaw), math.sin(yaw)
    wc = np.asarray(handles.workspace_center, float)
    ws_center = base[:2] + np.array([c * wc[0] - s * wc[1], s * wc[0] + c * wc[1]])
    ws_half = np.asarray(handles.workspace_half, float)
    if robot == "aloha":  # overhead camera of the ALOHA scene (§7.1)
        eye, target, fovy = np.array([0.0, -0.3038, 1.0252]), np.array([0.0, 0.08, 0.0]), 70.0
    else:  # three-quarter view from the front-right, framing the arm and its workspace; sized by the reach
        target = np.array([*(0.6 * ws_center + 0.4 * base[:2]), 0.2 * handles.reach])
        eye = target + 1.9 * handles.reach * np.array([0.45, -0.7, 0.55])
        fovy = 50.0
    fovy = settings.primary_fovy or fovy
    spec.worldbody.add_camera(name="primary", pos=eye.tolist(), fovy=fovy,
                              quat=look_at_quat(eye, target, np.array([0.0, 0.0, 1.0])))  # fmt: skip

    # Fallback region: the table minus a 0.3 m strip at the robot's edge (single arms) or the arm bases (ALOHA).
    margin = np.array([0.15, 0.0]) if robot != "aloha" else np.array([0.25, 0.0])
    regions = [(ws_center, ws_half), (margin, half - margin - np.array([0.0, 0.02]))]
    placed: list[tuple[np.ndarray, float]] = []
    object_handles: dict[str, ObjectHandles] = {}
    for i, entry in enumerate(objects):
        kw = {"kind": entry} if isinstance(entry, str) else dict(entry)
        kind = kw.pop("kind")
        name = kw.pop("name", f"{kind}{i}")
        pos = kw.pop("pos", None)
        if pos is None:  # build at the origin to learn the footprint, then move it to a free spot
            obj = add_object(spec, kind, name=name, pos=(0.0, 0.0, 0.0), rng=rng, **kw)
            xy = _place(rng, regions, obj.radius, placed)
            spec.body(name).pos = [xy[0], xy[1], 0.0]
            obj.params["pos"] = [float(xy[0]), float(xy[1]), 0.0]
        else:
            obj = add_object(spec, kind, name=name, pos=tuple(pos), rng=rng, **kw)
            xy = np.asarray(pos[:2], float)
        placed.append((xy, obj.radius))
        object_handles[name] = obj

    model = spec.compile()
    data = mujoco.MjData(model)
    cams = {"primary": "primary"}
    for arm in handles.arms:
        cams[f"{arm.name}_wrist" if arm.name else "wrist"] = arm.wrist_camera
    params = {"robot": robot, "seed": seed, "robot_seed": robot_seed, "robot_params": handles.params,
              "table_half": half.tolist(), "robot_base": base.tolist(), "robot_yaw": yaw,
              "workspace_center": ws_center.tolist(), "workspace_half": ws_half.tolist(),
              "objects": {k: o.params for k, o in object_handles.items()}}  # fmt: skip
    world = World(spec, model, data, handles, object_handles, cams, image_size, settings, params)
    world.reset()
    return world


__all__ = ["RenderSettings", "World", "build_world"]
