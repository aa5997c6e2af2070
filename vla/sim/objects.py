"""Task objects added to an ``MjSpec``: cubes, cylinders, bowls (targets), a drawer and flat target markers,
randomized from an RNG.

``add_object`` is the one hook later slices (tasks, randomization) use: any size, colour or mass left ``None`` is
sampled from ``rng``, and every value used is recorded in ``ObjectHandles.params``. The default size ranges suit
grippers opening ~70 mm or more; tasks shrink them to fit a smaller jaw (``vla.sim.tasks.Workspace.graspable``;
WidowX's pads open 10.8…54.8 mm).
Collision bits (MuJoCo collides two geoms when ``contype_a & conaffinity_b or contype_b & conaffinity_a``):
objects 1, robots 2 (``vla.sim.robots``), table and floor 4, bowl walls 8. Arms never collide with themselves
or each other (their simplified capsules overlap at the joints), and bowl walls ignore the table (12 wall boxes
resting on it would cost ~40 contacts and most of the step time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mujoco
import numpy as np

OBJECT_CONTYPE, OBJECT_CONAFFINITY = 1, 1 | 2 | 4  # objects touch objects, robots, the table
SCENE_CONTYPE, SCENE_CONAFFINITY = (
    4,
    1,
)  # table/floor; affinity 1 also catches user MJCF robots (defaults 1/1)
WALL_CONTYPE, WALL_CONAFFINITY = 8, 1 | 2  # bowl walls touch objects and robots only
OBJECT_KINDS = ("cube", "cylinder", "bowl", "drawer", "marker")

# Default sampling ranges, m and kg.
CUBE_HALF = (0.016, 0.028)
CYLINDER_RADIUS, CYLINDER_HALF_HEIGHT = (0.016, 0.028), (0.025, 0.05)
BOWL_RADIUS, BOWL_HEIGHT = (0.06, 0.09), (0.03, 0.05)
DRAWER_HALF = ((0.09, 0.12), (0.12, 0.16), (0.05, 0.07))  # cabinet half-extents x (depth), y, z
MARKER_RADIUS, MARKER_HALF_HEIGHT = (0.035, 0.045), 0.0005  # flat target disc on the table
SMALL_MASS, BOWL_MASS = (0.03, 0.2), (0.1, 0.4)
BOWL_WALLS = 12
WALL = 0.006  # wall thickness, m


@dataclass(frozen=True)
class ObjectHandles:
    """Names of one object's elements and the parameters it was built with (sizes m, mass kg, rgba).

    ``joint`` is the free joint of a loose object, the drawer's slide joint (m, 0 = closed), or ``None`` for a
    fixed object. ``radius`` is the object's footprint radius (m) for placement without overlap.
    """

    name: str
    kind: str
    body: str
    joint: str | None
    geoms: tuple[str, ...]
    sites: tuple[str, ...]
    radius: float
    params: dict[str, Any] = field(default_factory=dict)


def _u(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    return float(rng.uniform(*bounds))


def _box(body: mujoco.MjsBody, name: str, half: Any, pos: Any, rgba: Any, mass: float = 0.0,
         quat: Any = (1.0, 0.0, 0.0, 0.0), bits: tuple[int, int] = (OBJECT_CONTYPE, OBJECT_CONAFFINITY)) -> str:  # fmt: skip
    body.add_geom(name=name, type=mujoco.mjtGeom.mjGEOM_BOX, size=list(half), pos=list(pos), quat=list(quat),
                  rgba=list(rgba), mass=mass, contype=bits[0], conaffinity=bits[1])  # fmt: skip
    return name


def add_object(
    spec_parent: mujoco.MjSpec | mujoco.MjsBody,
    kind: str,
    *,
    name: str,
    pos: tuple[float, float, float],
    rng: np.random.Generator | None = None,
    size: tuple[float, ...] | None = None,
    rgba: tuple[float, float, float, float] | None = None,
    mass: float | None = None,
    yaw: float = 0.0,
    free: bool | None = None,
) -> ObjectHandles:
    """Add one object whose bottom rests at ``pos`` (m, parent frame), turned by ``yaw`` (rad) about +z.

    ``size`` per kind (m): cube ``(half,)``; cylinder ``(radius, half_height)``; bowl ``(radius, height)``;
    drawer ``(half_x, half_y, half_z)`` of the cabinet, opening toward its −x side; marker ``(radius,)`` of a
    flat disc that collides with nothing (a target region drawn on the table). ``free`` (default: True except
    for the drawer and the marker, which are always fixed) gives a free joint ``<name>_joint``.
    """
    if kind not in OBJECT_KINDS:
        raise ValueError(f"add_object: kind must be one of {OBJECT_KINDS}, got {kind!r}")
    rng = rng if rng is not None else np.random.default_rng()
    parent = spec_parent.worldbody if isinstance(spec_parent, mujoco.MjSpec) else spec_parent
    rgba = tuple(rgba) if rgba is not None else (*rng.uniform(0.1, 0.95, 3).tolist(), 1.0)
    quat = [math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2)]
    body = parent.add_body(name=name, pos=list(pos), quat=quat)
    free = kind not in ("drawer", "marker") if free is None else free
    if free and kind in ("drawer", "marker"):
        raise ValueError(f"add_object: a {kind} is always fixed; pass free=None or False")
    joint = f"{name}_joint" if free else None
    if free:
        body.add_freejoint(name=joint)
    sites: list[str] = []
    if kind == "cube":
        (half,) = size or (_u(rng, CUBE_HALF),)
        mass = mass if mass is not None else _u(rng, SMALL_MASS)
        geoms = [_box(body, f"{name}_geom", [half] * 3, [0, 0, half], rgba, mass)]
        radius, params = half * math.sqrt(2), {"half": half}
    elif kind == "cylinder":
        r, hh = size or (_u(rng, CYLINDER_RADIUS), _u(rng, CYLINDER_HALF_HEIGHT))
        mass = mass if mass is not None else _u(rng, SMALL_MASS)
        body.add_geom(name=f"{name}_geom", type=mujoco.mjtGeom.mjGEOM_CYLINDER, size=[r, hh, 0], pos=[0, 0, hh],
                      rgba=list(rgba), mass=mass, contype=OBJECT_CONTYPE, conaffinity=OBJECT_CONAFFINITY)  # fmt: skip
        geoms, radius, params = [f"{name}_geom"], r, {"radius": r, "half_height": hh}
    elif kind == "bowl":
        r, height = size or (_u(rng, BOWL_RADIUS), _u(rng, BOWL_HEIGHT))
        mass = mass if mass is not None else _u(rng, BOWL_MASS)
        geoms, radius, params = _bowl(body, name, r, height, rgba, mass), r, {"radius": r, "height": height}
        body.add_site(
            name=f"{name}_target", pos=[0, 0, WALL], size=[0.01, 0, 0], rgba=[0, 1, 0, 0.3], group=3
        )
        sites.append(f"{name}_target")
    elif kind == "marker":
        (r,) = size or (_u(rng, MARKER_RADIUS),)
        mass = 0.0
        body.add_geom(name=f"{name}_geom", type=mujoco.mjtGeom.mjGEOM_CYLINDER, size=[r, MARKER_HALF_HEIGHT, 0],
                      pos=[0, 0, MARKER_HALF_HEIGHT], rgba=list(rgba), contype=0, conaffinity=0)  # fmt: skip
        geoms, radius, params = [f"{name}_geom"], r, {"radius": r}
    else:
        half = np.asarray(size or [_u(rng, b) for b in DRAWER_HALF], float)
        mass = mass if mass is not None else 0.3
        geoms, drawer_sites, joint = _drawer(body, name, half, rgba, mass)
        sites += drawer_sites
        radius, params = float(np.hypot(half[0], half[1])), {"half": half.tolist()}
    params.update(kind=kind, rgba=list(rgba), mass=float(mass), pos=list(pos), yaw=float(yaw), free=free)
    return ObjectHandles(name, kind, name, joint, tuple(geoms), tuple(sites), float(radius), params)


def _bowl(body: mujoco.MjsBody, name: str, r: float, height: float, rgba: Any, mass: float) -> list[str]:
    """An open container: a disc base plus ``BOWL_WALLS`` flat wall segments on a circle of radius ``r``."""
    base = f"{name}_base"
    body.add_geom(name=base, type=mujoco.mjtGeom.mjGEOM_CYLINDER, size=[r, WALL / 2, 0], pos=[0, 0, WALL / 2],
                  rgba=list(rgba), mass=0.4 * mass, contype=OBJECT_CONTYPE, conaffinity=OBJECT_CONAFFINITY)  # fmt: skip
    geoms = [base]
    seg = r * math.tan(math.pi / BOWL_WALLS) + WALL / 2  # half-width that closes the polygon
    for i in range(BOWL_WALLS):
        a = 2 * math.pi * i / BOWL_WALLS
        quat = [math.cos(a / 2), 0, 0, math.sin(a / 2)]
        pos = [(r - WALL / 2) * math.cos(a), (r - WALL / 2) * math.sin(a), height / 2]
        geoms.append(_box(body, f"{name}_wall{i}", [WALL / 2, seg, height / 2], pos, rgba,
                          0.6 * mass / BOWL_WALLS, quat, (WALL_CONTYPE, WALL_CONAFFINITY)))  # fmt: skip
    return geoms


def _drawer(body: mujoco.MjsBody, name: str, half: np.ndarray, rgba: Any,
            mass: float) -> tuple[list[str], list[str], str]:  # fmt: skip
    """A fixed cabinet open at −x and a sliding drawer (joint ``<name>_slide``, 0 = closed, + = pulled out)."""
    hx, hy, hz = half
    geoms = [
        _box(body, f"{name}_top", [hx, hy, WALL / 2], [0, 0, 2 * hz - WALL / 2], rgba),
        _box(body, f"{name}_bottom", [hx, hy, WALL / 2], [0, 0, WALL / 2], rgba),
        _box(body, f"{name}_back", [WALL / 2, hy, hz], [hx - WALL / 2, 0, hz], rgba),
        _box(body, f"{name}_left", [hx, WALL / 2, hz], [0, hy - WALL / 2, hz], rgba),
        _box(body, f"{name}_right", [hx, WALL / 2, hz], [0, -(hy - WALL / 2), hz], rgba),
    ]
    # The drawer box fits inside the cabinet with 2 mm clearance; its front panel closes the opening with 2 mm
    # to spare too (a panel exactly the opening's size touches the cabinet top and bottom, and that contact's
    # friction jams the slide when a gripper presses on the handle).
    dx, dy, dz = hx - WALL - 0.002, hy - WALL - 0.002, hz - WALL - 0.004
    drawer = body.add_body(name=f"{name}_drawer", pos=[-WALL / 2, 0, hz])
    slide = f"{name}_slide"
    drawer.add_joint(name=slide, type=mujoco.mjtJoint.mjJNT_SLIDE, axis=[-1, 0, 0], range=[0, 1.6 * dx],
                     limited=mujoco.mjtLimited.mjLIMITED_TRUE, damping=2.0, frictionloss=0.2)  # fmt: skip
    inner = [0.8, 0.8, 0.8, 1.0]
    m = mass / 6
    geoms += [
        _box(drawer, f"{name}_drawer_bottom", [dx, dy, WALL / 2], [0, 0, -dz + WALL / 2], inner, m),
        _box(drawer, f"{name}_drawer_back", [WALL / 2, dy, dz * 0.8], [dx - WALL / 2, 0, -dz * 0.2], inner, m),
        _box(drawer, f"{name}_drawer_left", [dx, WALL / 2, dz * 0.8], [0, dy - WALL / 2, -dz * 0.2], inner, m),
        _box(drawer, f"{name}_drawer_right", [dx, WALL / 2, dz * 0.8], [0, -dy + WALL / 2, -dz * 0.2], inner, m),
        _box(drawer, f"{name}_drawer_front", [WALL, hy - WALL - 0.002, hz - WALL - 0.002], [-dx - WALL, 0, 0], rgba, m),
        _box(drawer, f"{name}_handle", [0.01, 0.04, 0.008], [-dx - 2 * WALL - 0.02, 0, 0], [0.2, 0.2, 0.2, 1], m),
        _box(drawer, f"{name}_handle_l", [0.01, 0.005, 0.008], [-dx - 2 * WALL - 0.01, 0.035, 0], [0.2] * 3 + [1]),
        _box(drawer, f"{name}_handle_r", [0.01, 0.005, 0.008], [-dx - 2 * WALL - 0.01, -0.035, 0], [0.2] * 3 + [1]),
    ]  # fmt: skip
    drawer.add_site(name=f"{name}_handle", pos=[-dx - 2 * WALL - 0.02, 0, 0], size=[0.01, 0, 0],
                    rgba=[0, 1, 0, 0.3], group=3)  # fmt: skip
    return geoms, [f"{name}_handle"], slide
