"""Domain randomization over the four sources of the reality gap: dynamics, perception, actuation, system.

A policy trained in simulation meets a different world through each source; ``Randomizer`` randomizes all four,
records exactly what it sampled and lets users widen or narrow each range::

    rand = Randomizer.from_level("medium", ["actuation.latency_steps=[0,2]"])
    record = rand.sample(rng, world)   # JSON-serializable {"dynamics", "perception", "actuation", "system"}
    rand.apply(world, record)          # once after build, before the first step
    rand.reset()                       # per episode: clears the latency FIFO and the last frame
    ctrl = rand.act(action, step, rng)            # every control step
    images = rand.observe(images, rng)            # every rendered observation

Levels are YAML presets ``configs/sim/{none,low,medium,high}.yaml`` (each range contains the one before) and the
held-out ``configs/sim/reality_proxy.yaml`` for evaluation, whose ``held_out`` fields lie outside ``high``.
``none`` is the identity: applying its record leaves the model bit-identical.

Record layout: each range field ``x`` of a section has its sampled value(s) under ``record[section]["x"]`` (one
number, or one per geom/dof/light, or a dict per object/actuator/camera); the absolute values written to the model
are recorded next to them (``geom_friction``, ``body_mass``, ``kp``, ``lights``, ``cameras`` …), so ``apply`` only
writes values (idempotent) and a stored record reproduces an episode's world exactly. Scales are relative to the
world as built (its values are cached on the world, so re-sampling for a new episode never compounds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mujoco
import numpy as np
import yaml

from vla.config import ConfigError, load_config, parse_overrides, resolve_preset
from vla.sim.perception import (
    IntRange,
    PerceptionRandomization,
    Range,
    apply_perception,
    cached_nominal,
    check_ranges,
    corrupt_image,
    integer,
    js,
    sample_perception,
    uniform,
)

LEVELS = ("none", "low", "medium", "high", "reality_proxy")
SECTIONS = ("dynamics", "perception", "actuation", "system")


def _positive(section: str, cfg: Any, names: tuple[str, ...]) -> None:
    for n in names:
        if getattr(cfg, n)[0] < 0:
            raise ConfigError(f"{section}.{n} must be >= 0, got {list(getattr(cfg, n))}")


@dataclass(frozen=True)
class DynamicsRandomization:
    """Contact and mass properties. Scales multiply the world's built values (1 = unchanged).

    ``friction_scale`` / ``torsional_scale`` / ``rolling_scale`` scale the three ``geom_friction`` coefficients
    (per geom when ``per_element``, else one scale for all geoms); ``mass_scale`` scales each object's mass and
    inertia (all bodies of the object: uniform density); ``damping_scale`` / ``armature_scale`` /
    ``frictionloss_scale`` scale every joint dof's (per dof when ``per_element``).
    """

    per_element: bool = True
    friction_scale: Range = (1.0, 1.0)
    torsional_scale: Range = (1.0, 1.0)
    rolling_scale: Range = (1.0, 1.0)
    mass_scale: Range = (1.0, 1.0)
    damping_scale: Range = (1.0, 1.0)
    armature_scale: Range = (1.0, 1.0)
    frictionloss_scale: Range = (1.0, 1.0)

    def __post_init__(self) -> None:
        check_ranges("dynamics", self)
        _positive("dynamics", self, tuple(n for n in self.__dataclass_fields__ if n.endswith("_scale")))


@dataclass(frozen=True)
class ActuationRandomization:
    """Between the policy's action and the servos.

    ``latency_steps``: the action applied at step t is the one given at t − k (a FIFO, pre-filled with the first
    action of the episode); ``gain_scale``: each actuator's servo stiffness kp (``gainprm[0]`` and ``-biasprm[1]``,
    damping kv kept) scaled, per actuator; ``dead_zone``: a dimension whose command changes by less than this
    (action units: rad, gripper 0–1) keeps the previous command; ``action_noise_std``: Gaussian noise added to every
    dimension each step; ``gripper_force_scale``: each gripper servo's ``forcerange`` scaled.
    """

    latency_steps: IntRange = (0, 0)
    gain_scale: Range = (1.0, 1.0)
    dead_zone: Range = (0.0, 0.0)
    action_noise_std: Range = (0.0, 0.0)
    gripper_force_scale: Range = (1.0, 1.0)

    def __post_init__(self) -> None:
        check_ranges("actuation", self)
        _positive("actuation", self, ("latency_steps", "gain_scale", "dead_zone", "action_noise_std",
                                      "gripper_force_scale"))  # fmt: skip


@dataclass(frozen=True)
class SystemRandomization:
    """Timing, frames, resets and placement (the environment applies the timing and reset values).

    ``control_period_scale``: per-episode multiplier of the control period; ``control_jitter_std``: std of the
    per-step period jitter as a fraction of the period; ``drop_frame_prob``: probability that ``observe`` returns
    the previous frame; ``reset_joint_std``: std (rad) of the per-joint offset added to the home pose
    (``record["system"]["reset_joint_offset"]``); ``object_xy_jitter``: per-axis offset (m) of each object's
    built position, redrawn where it would make objects overlap or leave the table (``sample_object_jitter``).
    """

    control_period_scale: Range = (1.0, 1.0)
    control_jitter_std: Range = (0.0, 0.0)
    drop_frame_prob: Range = (0.0, 0.0)
    reset_joint_std: Range = (0.0, 0.0)
    object_xy_jitter: Range = (0.0, 0.0)

    def __post_init__(self) -> None:
        check_ranges("system", self)
        _positive("system", self, ("control_period_scale", "control_jitter_std", "drop_frame_prob",
                                   "reset_joint_std"))  # fmt: skip
        if self.control_period_scale[0] <= 0 or self.drop_frame_prob[1] > 1:
            raise ConfigError("system: control_period_scale must be > 0 and drop_frame_prob within [0, 1]")


@dataclass(frozen=True)
class RandomizationConfig:
    """One randomization level: a range per parameter and source. ``held_out`` lists (``section.field``) the
    ranges that lie outside ``high`` on purpose (``reality_proxy``); ``description`` says what the level is for."""

    name: str = "none"
    description: str = ""
    held_out: tuple[str, ...] = ()
    dynamics: DynamicsRandomization = field(default_factory=DynamicsRandomization)
    perception: PerceptionRandomization = field(default_factory=PerceptionRandomization)
    actuation: ActuationRandomization = field(default_factory=ActuationRandomization)
    system: SystemRandomization = field(default_factory=SystemRandomization)

    def __post_init__(self) -> None:
        for key in self.held_out:
            sec, _, name = key.partition(".")
            if sec not in SECTIONS or name not in getattr(self, sec).__dataclass_fields__:
                raise ConfigError(f"held_out entry {key!r} is not a 'section.field' of this config")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_randomization(level: str | Path = "none", overrides: dict[str, Any] | list[str] | None = None,
                       ) -> RandomizationConfig:  # fmt: skip
    """A level (``configs/sim/<level>.yaml``) or YAML path, plus overrides as a nested dict or dotted strings."""
    path = resolve_preset("sim", level)
    data = yaml.safe_load(path.read_text()) or {}
    if isinstance(overrides, dict):
        data = _merge(data, overrides)
    elif overrides:
        data = _merge(data, parse_overrides(list(overrides)))
    return load_config(RandomizationConfig, data, kind="sim")


# ---- dynamics / actuation / system -------------------------------------------------------------------------
def _read_nominal(m: mujoco.MjModel) -> dict[str, Any]:
    return {k: getattr(m, k).copy() for k in ("geom_friction", "body_mass", "body_inertia", "dof_damping",
            "dof_armature", "dof_frictionloss", "actuator_gainprm", "actuator_biasprm", "actuator_forcerange",
            "body_pos", "qpos0")}  # fmt: skip


def _object_bodies(m: mujoco.MjModel, root: str) -> list[int]:
    rid = m.body(root).id
    return [b for b in range(m.nbody) if m.body_rootid[b] == rid]


def sample_dynamics(cfg: DynamicsRandomization, rng: np.random.Generator, world: Any) -> dict[str, Any]:
    """Friction per geom, mass per object, damping/armature/frictionloss per dof (see the class)."""
    nom, m = cached_nominal(world, "dynamics", _read_nominal), world.model
    n = m.ngeom if cfg.per_element else 1
    scale = np.stack([uniform(rng, r, n) for r in (cfg.friction_scale, cfg.torsional_scale,
                                                   cfg.rolling_scale)], axis=-1)  # fmt: skip
    rec: dict[str, Any] = {"per_element": cfg.per_element}
    rec["friction_scale"], rec["torsional_scale"], rec["rolling_scale"] = (
        scale[:, i].tolist() for i in range(3)
    )
    rec["geom_friction"] = (nom["geom_friction"] * scale).tolist()
    rec["mass_scale"], rec["body_mass"], rec["body_inertia"] = {}, {}, {}
    for name, obj in world.objects.items():
        s = uniform(rng, cfg.mass_scale)
        rec["mass_scale"][name] = s
        for b in _object_bodies(m, obj.body):
            bname = m.body(b).name
            rec["body_mass"][bname] = float(nom["body_mass"][b] * s)
            rec["body_inertia"][bname] = (nom["body_inertia"][b] * s).tolist()
    n = m.nv if cfg.per_element else 1
    for key, attr in (("damping_scale", "dof_damping"), ("armature_scale", "dof_armature"),
                      ("frictionloss_scale", "dof_frictionloss")):  # fmt: skip
        s = uniform(rng, getattr(cfg, key), n)
        rec[key] = js(s)
        rec[attr] = (nom[attr] * s).tolist()
    return rec


def sample_actuation(cfg: ActuationRandomization, rng: np.random.Generator, world: Any) -> dict[str, Any]:
    """Per-episode latency, dead zone and noise std; per-actuator kp and per-gripper force range."""
    nom, m = cached_nominal(world, "dynamics", _read_nominal), world.model
    rec: dict[str, Any] = {"latency_steps": integer(rng, cfg.latency_steps)}
    rec["dead_zone"] = uniform(rng, cfg.dead_zone)
    rec["action_noise_std"] = uniform(rng, cfg.action_noise_std)
    rec["gain_scale"], rec["kp"] = {}, {}
    for a in world.robot.actuator_names:
        s, i = uniform(rng, cfg.gain_scale), m.actuator(a).id
        rec["gain_scale"][a] = s
        rec["kp"][a] = [float(nom["actuator_gainprm"][i, 0] * s), float(nom["actuator_biasprm"][i, 1] * s)]
    rec["gripper_force_scale"], rec["gripper_forcerange"] = {}, {}
    for arm in world.robot.arms:
        s, i = uniform(rng, cfg.gripper_force_scale), m.actuator(arm.gripper_actuator).id
        rec["gripper_force_scale"][arm.gripper_actuator] = s
        rec["gripper_forcerange"][arm.gripper_actuator] = (nom["actuator_forcerange"][i] * s).tolist()
    return rec


def sample_system(cfg: SystemRandomization, rng: np.random.Generator, world: Any) -> dict[str, Any]:
    """Timing values, frame-drop probability, the reset offset vector and per-object xy offsets."""
    rec: dict[str, Any] = {name: uniform(rng, getattr(cfg, name))
                           for name in ("control_period_scale", "control_jitter_std", "drop_frame_prob")}  # fmt: skip
    std = uniform(rng, cfg.reset_joint_std)
    rec["reset_joint_std"] = std
    rec["reset_joint_offset"] = (rng.normal(0.0, std, world.robot.dof) if std > 0 else
                                 np.zeros(world.robot.dof)).tolist()  # fmt: skip
    rec["object_xy_jitter"] = sample_object_jitter(cfg.object_xy_jitter, rng, world)
    return rec


JITTER_MARGIN = 0.005  # m kept between the footprints of two jittered objects that collide
JITTER_TRIES = 20  # draws per object before it keeps its built position


def _built_xy(world: Any, obj: Any) -> np.ndarray:
    """An object's xy as built (world frame), where ``apply_model_values`` adds the offset."""
    nom, m = cached_nominal(world, "dynamics", _read_nominal), world.model
    if obj.joint is not None and m.joint(obj.joint).type == mujoco.mjtJoint.mjJNT_FREE:
        adr = m.joint(obj.joint).qposadr[0]
        return nom["qpos0"][adr : adr + 2].copy()
    return nom["body_pos"][m.body(obj.body).id, :2].copy()


def sample_object_jitter(bounds: Range, rng: np.random.Generator, world: Any) -> dict[str, list[float]]:
    """Per-object xy offsets (m, each axis in ``bounds``) that keep objects apart and on the table.

    Independent offsets could push two neighbours (tasks place footprints only ``CLEARANCE`` = 5 cm apart) into
    each other, and interpenetrating free bodies explode at the first step. So objects are drawn one by one and an
    offset is redrawn (``JITTER_TRIES`` times, then 0: the built position) when the jittered footprint
    (``ObjectHandles.radius``) would come within ``JITTER_MARGIN`` of another colliding object's footprint (those
    already jittered where they now are, the rest where they were built, so falling back to 0 stays clear), or
    would stick out past the table edge further than the built one did. Flat markers collide with nothing and are
    only kept on the table. Without conflicts this draws exactly what independent offsets did (same rng stream);
    the fallback 0 lies outside ``bounds`` that exclude 0.
    """
    objs = world.objects
    table = np.asarray(world.params["table_half"], float)
    where = {name: (_built_xy(world, obj), obj.radius) for name, obj in objs.items() if obj.kind != "marker"}
    out: dict[str, list[float]] = {}
    for name, obj in objs.items():
        built, dxy = _built_xy(world, obj), np.zeros(2)
        # an object built overhanging the edge (a drawer's circumscribed circle) may not overhang more
        edge = np.maximum(table, np.abs(built) + obj.radius)
        others = [(xy, r) for n, (xy, r) in where.items() if n != name] if obj.kind != "marker" else []
        for _ in range(JITTER_TRIES):
            cand = np.asarray(uniform(rng, bounds, 2), float)
            xy = built + cand
            if np.all(np.abs(xy) + obj.radius <= edge) and all(
                np.linalg.norm(xy - p) >= obj.radius + r + JITTER_MARGIN for p, r in others
            ):
                dxy = cand
                break
        if name in where:
            where[name] = (built + dxy, obj.radius)
        out[name] = js(dxy)
    return out


def apply_model_values(world: Any, rec: dict[str, Any]) -> None:
    """Write the dynamics, actuation and system (object placement) values of a record into ``world``."""
    m, d = world.model, world.data
    nom = cached_nominal(world, "dynamics", _read_nominal)
    dyn, act = rec["dynamics"], rec["actuation"]
    m.geom_friction[:] = dyn["geom_friction"]
    for b, mass in dyn["body_mass"].items():
        bid = m.body(b).id
        m.body_mass[bid], m.body_inertia[bid] = mass, dyn["body_inertia"][b]
    for attr in ("dof_damping", "dof_armature", "dof_frictionloss"):
        getattr(m, attr)[:] = dyn[attr]
    for a, (kp, bias) in act["kp"].items():
        i = m.actuator(a).id
        m.actuator_gainprm[i, 0], m.actuator_biasprm[i, 1] = kp, bias
    for a, fr in act["gripper_forcerange"].items():
        m.actuator_forcerange[m.actuator(a).id] = fr
    moved = False
    for name, dxy in rec["system"]["object_xy_jitter"].items():
        obj = world.objects[name]
        if obj.joint is not None and m.joint(obj.joint).type == mujoco.mjtJoint.mjJNT_FREE:
            adr = m.joint(obj.joint).qposadr[0]
            m.qpos0[adr : adr + 2] = nom["qpos0"][adr : adr + 2] + dxy
            if np.any(dxy):
                d.qpos[adr : adr + 2], moved = m.qpos0[adr : adr + 2], True
        else:
            bid = m.body(obj.body).id
            m.body_pos[bid, :2] = nom["body_pos"][bid, :2] + dxy
            moved = moved or bool(np.any(dxy))
    if moved:
        mujoco.mj_forward(m, d)


# ---- the randomizer ----------------------------------------------------------------------------------------
class Randomizer:
    """Samples, applies and records one episode's randomization; shapes actions and images during it.

    ``act`` and ``observe`` use the record last given to ``apply`` (identity before any ``apply``).
    """

    def __init__(self, config: RandomizationConfig) -> None:
        self.config = config
        self.record: dict[str, Any] | None = None
        self._fifo: list[np.ndarray] = []
        self._held: np.ndarray | None = None
        self._last_images: dict[str, np.ndarray] | None = None

    @classmethod
    def from_level(
        cls, level: str = "none", overrides: dict[str, Any] | list[str] | None = None
    ) -> Randomizer:
        """A randomizer for a level name (``none|low|medium|high|reality_proxy``) or YAML path, plus overrides
        (a nested dict or dotted ``section.field=value`` strings; unknown keys get "did you mean")."""
        return cls(load_randomization(level, overrides))

    def sample(self, rng: np.random.Generator, world: Any) -> dict[str, Any]:
        """Every parameter of one episode, JSON-serializable, grouped by source (same rng state → same record)."""
        c = self.config
        rec = {
            "level": c.name,
            "dynamics": sample_dynamics(c.dynamics, rng, world),
            "perception": sample_perception(c.perception, rng, world),
            "actuation": sample_actuation(c.actuation, rng, world),
            "system": sample_system(c.system, rng, world),
        }
        return json.loads(json.dumps(js(rec)))  # a plain, detached copy; fails loudly if not serializable

    def apply(self, world: Any, record: dict[str, Any]) -> None:
        """Write ``record`` into ``world`` (lights may be added → recompiled first), then reset act/observe state.

        Call once after ``build_world`` and before the first step (object offsets move the current state too).
        """
        apply_perception(world, record["perception"])  # may recompile: first, so later writes survive
        apply_model_values(world, record)
        self.record = record
        self.reset()

    def reset(self) -> None:
        """Clear the latency FIFO, the held command (dead zone) and the last frame (between episodes)."""
        self._fifo.clear()
        self._held = None
        self._last_images = None

    def act(self, action: np.ndarray, step: int, rng: np.random.Generator) -> np.ndarray:
        """The command the servos get at control step ``step``: delayed, dead-zoned, noised (float64 copy).

        Latency k: returns the action given k calls ago (the episode's first action until then); ``step == 0``
        starts a new episode's FIFO.
        """
        a = np.array(action, dtype=np.float64)
        if self.record is None:
            return a
        act = self.record["actuation"]
        if step == 0:
            self._fifo.clear()
            self._held = None
        k = int(act["latency_steps"])
        if not self._fifo:
            self._fifo.extend(a.copy() for _ in range(k))
        self._fifo.append(a)
        out = self._fifo.pop(0).copy()
        dz = float(act["dead_zone"])
        if dz > 0 and self._held is not None:
            small = np.abs(out - self._held) < dz
            out[small] = self._held[small]
        self._held = out.copy()
        std = float(act["action_noise_std"])
        if std > 0:
            out = out + rng.normal(0.0, std, out.shape)
        return out

    def observe(self, images: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Corrupted copies of ``images`` (uint8 [H, W, 3] per camera), or the previous frame when dropped."""
        if self.record is None:
            return dict(images)
        drop = float(self.record["system"]["drop_frame_prob"])
        last = self._last_images
        if drop > 0 and last is not None and last.keys() == images.keys() and rng.random() < drop:
            return {k: v.copy() for k, v in last.items()}
        out = {k: corrupt_image(v, self.record["perception"], rng) for k, v in images.items()}
        if drop > 0:
            self._last_images = {k: v.copy() for k, v in out.items()}
        return out


__all__ = [
    "LEVELS",
    "ActuationRandomization",
    "DynamicsRandomization",
    "PerceptionRandomization",
    "RandomizationConfig",
    "Randomizer",
    "SystemRandomization",
    "load_randomization",
]
