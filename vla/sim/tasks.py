"""Tabletop tasks with language instructions: ``TASKS`` registry of ``reach``, ``reach_slots``,
``reach_fixed_slots``, ``pick_place``, ``push``, ``stack``, ``drawer``.

A task is stateless; one episode's draw is a ``TaskSetup``:

- ``task.setup(rng, workspace)`` samples the objects (a target plus distractors of other colours, so the
  instruction is needed to know which one) as ``build_world`` entries with explicit sizes/colours/positions,
  and the goal (``goal["target"]`` names the object the instruction refers to);
- ``task.instruction(setup, rng)`` picks one of several paraphrases naming the target;
- ``task.initialize(world, setup)`` runs after ``World.reset`` (records start positions, opens the drawer for
  "close the drawer");
- ``task.success(world, setup)`` reads MuJoCo state only (positions, contacts, the drawer's slide joint);
- ``task.set_goal_state(world, setup)`` puts the world in a goal state by hand (tests).

Graspable objects are sized to fit the robot's open jaw (``Workspace.graspable``); with several arms (ALOHA) a
task that carries an object somewhere draws both on one arm's side of the table (``Workspace.one_arm``). ``push``
moves an object onto a flat coloured marker (a second marker is a distractor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import mujoco
import numpy as np

from vla.registry import Registry
from vla.sim.objects import (
    BOWL_HEIGHT,
    BOWL_RADIUS,
    CUBE_HALF,
    CYLINDER_HALF_HEIGHT,
    CYLINDER_RADIUS,
    DRAWER_HALF,
    MARKER_RADIUS,
)
from vla.sim.world import World

COLORS: dict[str, tuple[float, float, float, float]] = {
    "red": (0.85, 0.1, 0.1, 1.0),
    "green": (0.1, 0.7, 0.2, 1.0),
    "blue": (0.15, 0.3, 0.9, 1.0),
    "yellow": (0.95, 0.85, 0.1, 1.0),
    "purple": (0.55, 0.2, 0.75, 1.0),
    "orange": (0.95, 0.5, 0.1, 1.0),
}
CLEARANCE = 0.05  # m between object footprints (room for open fingers)


GRASP_MARGIN = 0.008  # m of open jaw left on each side of a graspable object (approach error)
REACH_XY_MARGIN = 0.02  # m beyond an object's footprint radius the TCP may be for reach to count ("on" it)
REACH_Z_MARGIN = 0.03  # m above an object's top the TCP may be for reach to count


@dataclass(frozen=True)
class Workspace:
    """Where a robot can work, world frame: ``center`` / ``half`` (m, xy), ``base`` (m), ``reach`` (m), and
    ``jaw`` (m): the widest gap between the finger pads that every arm opens to (sizes graspable objects)."""

    center: np.ndarray
    half: np.ndarray
    base: np.ndarray
    reach: float
    robot: str
    jaw: float = 0.08
    arm_bases: tuple[tuple[float, float], ...] = ()  # xy of each arm's base (m), for several arms

    @staticmethod
    def of(world: World) -> Workspace:
        p = world.params
        jaw = min(arm.jaw_range[1] for arm in world.robot.arms)
        bases = tuple(
            tuple(float(v) for v in world.data.body(a.base_body).xpos[:2]) for a in world.robot.arms
        )
        return Workspace(np.asarray(p["workspace_center"], float), np.asarray(p["workspace_half"], float),
                         np.asarray(p["robot_base"], float), float(world.robot.reach), str(p["robot"]),
                         float(jaw), bases)  # fmt: skip

    def one_arm(self, rng: np.random.Generator) -> Workspace:
        """The part of the workspace one arm reaches comfortably: with several arms (ALOHA, whose workspace spans
        the table between them) the half nearest a randomly chosen arm; a single arm's workspace as is.

        Tasks that carry an object to a place draw both there, so one arm can do the whole task.
        """
        if len(self.arm_bases) < 2:
            return self
        base = np.asarray(self.arm_bases[int(rng.integers(len(self.arm_bases)))])
        axis = int(np.argmax(np.abs(base - self.center)))  # the table axis that points at the arm
        center, half = self.center.copy(), self.half.copy()
        center[axis] += 0.5 * half[axis] * np.sign(base[axis] - self.center[axis])
        half[axis] *= 0.5
        return Workspace(center, half, self.base, self.reach, self.robot, self.jaw, self.arm_bases)

    def graspable(self, bounds: tuple[float, float]) -> tuple[float, float]:
        """``bounds`` of an object's half-width (m) shrunk to fit the open jaw with ``GRASP_MARGIN`` a side.

        Grippers that open wide enough keep the default range; smaller ones get proportionally smaller objects.
        """
        hi = min(bounds[1], self.jaw / 2 - GRASP_MARGIN)
        return min(bounds[0], 0.7 * hi), hi


@dataclass
class TaskSetup:
    """One episode's draw: ``objects`` for ``build_world``, ``goal`` for the success detector and the expert."""

    task: str
    objects: list[dict[str, Any]]
    goal: dict[str, Any]
    descriptions: dict[str, str] = field(default_factory=dict)  # object name -> "red cube"


def _size(kind: str, rng: np.random.Generator, ws: Workspace) -> tuple[tuple[float, ...], float, float]:
    """(size, footprint radius, height) for a graspable object (sized to fit ``ws.jaw``) or a bowl."""
    if kind == "cube":
        h = float(rng.uniform(*ws.graspable(CUBE_HALF)))
        return (h,), h * math.sqrt(2), 2 * h
    if kind == "cylinder":
        r, hh = float(rng.uniform(*ws.graspable(CYLINDER_RADIUS))), float(rng.uniform(*CYLINDER_HALF_HEIGHT))
        return (r, hh), r, 2 * hh
    r, h = float(rng.uniform(*BOWL_RADIUS)), float(rng.uniform(*BOWL_HEIGHT))
    return (r, h), r, h


def _place(rng: np.random.Generator, ws: Workspace, radii: list[float]) -> list[np.ndarray]:
    """xy positions for footprints ``radii`` inside the workspace, ``CLEARANCE`` apart (region grows if full)."""
    for grow in (1.0, 1.2, 1.4, 1.7, 2.0):
        placed: list[np.ndarray] = []
        for r in radii:
            for _ in range(200):
                xy = ws.center + rng.uniform(-1, 1, 2) * np.maximum(ws.half * grow - r, 0.01)
                if all(np.linalg.norm(xy - p) >= r + q + CLEARANCE for p, q in zip(placed, radii)):
                    placed.append(xy)
                    break
            else:
                break
        if len(placed) == len(radii):
            return placed
    raise RuntimeError(f"could not place {len(radii)} objects in the {ws.robot} workspace")


def _graspables(rng: np.random.Generator, n: int, kinds: tuple[str, ...] = ("cube", "cylinder"),
                target_kind: str | None = None) -> list[tuple[str, str]]:  # fmt: skip
    """``n`` (colour, kind) pairs with distinct colours; the first is the target."""
    colors = rng.permutation(list(COLORS))[:n]
    out = []
    for i, c in enumerate(colors):
        kind = target_kind if (i == 0 and target_kind) else str(rng.choice(kinds))
        out.append((str(c), kind))
    return out


def _entries(rng: np.random.Generator, ws: Workspace, items: list[tuple[str, str]]
             ) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, float]]:  # fmt: skip
    """build_world entries (name ``<colour>_<kind>``), their descriptions and heights, placed freely."""
    sizes = [_size(kind, rng, ws) for _, kind in items]
    return _entries_at(items, sizes, _place(rng, ws, [r for _, r, _ in sizes]))


def _entries_at(items: list[tuple[str, str]], sizes: list[tuple[tuple[float, ...], float, float]],
                xys: list[np.ndarray]) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, float]]:  # fmt: skip
    """``_entries`` of ``items`` with their drawn ``sizes`` (``_size``) at table positions ``xys`` (m)."""
    objs, desc, heights = [], {}, {}
    for (color, kind), (size, _, height), xy in zip(items, sizes, xys):
        name = f"{color}_{kind}"
        rgba = COLORS.get(color, (0.8, 0.8, 0.8, 1.0))
        objs.append(
            {"kind": kind, "name": name, "size": size, "rgba": rgba, "pos": (float(xy[0]), float(xy[1]), 0.0)}
        )
        desc[name] = f"{color} {kind}" if kind != "bowl" else "bowl"
        heights[name] = height
    return objs, desc, heights


def body_pos(world: World, name: str) -> np.ndarray:
    """World position of body ``name`` (an object's bottom centre)."""
    return world.data.body(name).xpos.copy()


def robot_touches(world: World, body: str) -> bool:
    """True if any robot geom is in contact with a geom of ``body`` (or its sub-bodies)."""
    m, d = world.model, world.data
    robot_root = m.body(world.robot.root_body).id
    target_root = m.body(body).id
    for c in d.contact[: d.ncon]:
        b1, b2 = m.geom_bodyid[c.geom1], m.geom_bodyid[c.geom2]
        roots = {m.body_rootid[b1], m.body_rootid[b2]}
        if robot_root in roots and target_root in {m.body_rootid[b1], m.body_rootid[b2], b1, b2}:
            return True
    return False


def gripper_over(world: World, name: str, height: float) -> bool:
    """True if some arm's TCP (``ee`` site) is over object ``name``: horizontally within its footprint radius
    (``ObjectHandles.radius``) + ``REACH_XY_MARGIN`` of its centre and at most ``REACH_Z_MARGIN`` above its top
    (``height`` m above its bottom)."""
    pos = body_pos(world, name)
    radius = world.objects[name].radius
    for arm in world.robot.arms:
        tcp = world.data.site(arm.ee_site).xpos
        near = np.linalg.norm(tcp[:2] - pos[:2]) <= radius + REACH_XY_MARGIN
        if near and tcp[2] <= pos[2] + height + REACH_Z_MARGIN:
            return True
    return False


def set_free_pos(world: World, name: str, pos: np.ndarray) -> None:
    """Teleport a free object (bottom centre at ``pos``, upright, at rest); call ``mj_forward`` afterwards."""
    j = world.model.joint(f"{name}_joint")
    world.data.qpos[j.qposadr[0] : j.qposadr[0] + 7] = [*pos, 1.0, 0.0, 0.0, 0.0]
    world.data.qvel[j.dofadr[0] : j.dofadr[0] + 6] = 0.0


class Task:
    """Base class: subclasses fill ``name``, ``templates``, ``max_steps`` (at 10 Hz) and the hooks.

    ``names_object``: the instruction picks the goal's object among distractors (by colour or shape), so success
    needs the instruction to be grounded (the drawer task names no object).
    """

    name: str = ""
    templates: tuple[str, ...] = ()
    max_steps: int = 100
    names_object: bool = False

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        raise NotImplementedError

    def instruction(self, setup: TaskSetup, rng: np.random.Generator) -> str:
        """One paraphrase, with the target (and reference) objects' descriptions filled in."""
        words = {k: setup.descriptions.get(v, v) for k, v in setup.goal.items() if isinstance(v, str)}
        return str(rng.choice(self.templates)).format(**words)

    def initialize(self, world: World, setup: TaskSetup) -> None:
        """Called after ``World.reset``: remember start positions (and set a non-default start state)."""
        setup.goal["start"] = {n: body_pos(world, n).tolist() for n in world.objects}

    def success(self, world: World, setup: TaskSetup) -> bool:
        raise NotImplementedError

    def target_distance(self, world: World, setup: TaskSetup) -> float | None:
        """Distance (m) from the nearest arm's TCP to the top centre of the object the instruction names, or None
        when the goal names no object. A graded measure of "went to the right object" next to binary success."""
        target = setup.goal.get("target")
        heights = setup.goal.get("heights", {})
        if target not in heights:
            return None
        top = body_pos(world, target)
        top[2] += heights[target]
        return min(float(np.linalg.norm(world.data.site(arm.ee_site).xpos - top)) for arm in world.robot.arms)

    def nearest_object(self, world: World, setup: TaskSetup) -> tuple[str, float] | None:
        """The object a TCP is over, horizontally nearest (so a tall object does not win by its height), and that
        horizontal distance (m): among the named object and its distractors (a destination such as the bowl or the
        base of a stack is not a candidate); None when the goal names no object. Tells a policy that went to the
        wrong object (grounding) from one that missed the right one (localisation)."""
        heights = setup.goal.get("heights", {})
        if setup.goal.get("target") not in heights:
            return None
        names = [
            n for n in heights if n != setup.goal.get("place")
        ]  # the graspable objects (markers are flat)
        tcps = [world.data.site(arm.ee_site).xpos[:2] for arm in world.robot.arms]
        dist = {n: min(float(np.linalg.norm(t - body_pos(world, n)[:2])) for t in tcps) for n in names}
        return min(dist.items(), key=lambda x: x[1])

    def set_goal_state(self, world: World, setup: TaskSetup) -> None:
        """Put the world in a goal state by hand (for tests of ``success``)."""
        raise NotImplementedError


TASKS: Registry[Task] = Registry("sim task", hint="Register a Task in vla/sim/tasks.py.")


class Reach(Task):
    name = "reach"
    names_object = True
    templates = ("touch the {target}", "reach for the {target}", "move your gripper to the {target}",
                 "put the gripper on the {target}", "tap the {target}")  # fmt: skip
    max_steps = 60

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        objs, desc, heights = _entries(rng, workspace, _graspables(rng, 3))
        return TaskSetup(self.name, objs, {"target": objs[0]["name"], "heights": heights}, desc)

    def success(self, world: World, setup: TaskSetup) -> bool:
        """The gripper is on the named object: the robot touches it with its TCP over it (a sweep of some link
        through the object, which a random policy often makes, does not count)."""
        target = setup.goal["target"]
        return robot_touches(world, target) and gripper_over(world, target, setup.goal["heights"][target])

    def set_goal_state(self, world: World, setup: TaskSetup) -> None:
        # Put the object under a finger pad, its centre moved from the pad's towards the TCP by its half-width
        # and half the pad's thickness: the pad still overlaps it (contact) and the TCP is over it.
        target = setup.goal["target"]
        obj = next(o for o in setup.objects if o["name"] == target)
        arm = world.robot.arms[-1]
        finger = world.model.body(arm.gripper_joints[0]).id
        geom = int(np.flatnonzero(world.model.geom_bodyid == finger)[0])
        pad = world.data.geom_xpos[geom].copy()
        tcp = world.data.site(arm.ee_site).xpos
        towards = tcp[:2] - pad[:2]
        dist = float(np.linalg.norm(towards))
        shift = min(dist, float(obj["size"][0]) + 0.5 * float(world.model.geom_size[geom].min()))
        pad[:2] += towards / dist * shift if dist > 0 else 0.0
        set_free_pos(world, target, pad - [0.0, 0.0, setup.goal["heights"][target] / 2])
        mujoco.mj_forward(world.model, world.data)


class ReachSlots(Reach):
    """``reach`` with the three objects on fixed slots: across the workspace's middle, one slot left, one centre,
    one right (``SLOT_JITTER`` m of jitter), colours and kinds drawn as in ``reach``, the target on a random slot.

    What separates success from failure is then *which* object the instruction names (grounding: a colour word to a
    place in the image), not centimetre-exact localisation of a freely placed object. The transfer study uses it to
    ask whether that grounding, learned on other robots, carries over to an unseen one.
    """

    name = "reach_slots"
    SLOT_JITTER = 0.01  # m, uniform per axis around each slot

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        # several arms (ALOHA): the row on one arm's half, so which arm reaches is clear from the scene
        workspace = workspace.one_arm(rng)
        items = self._items(rng)
        sizes = [_size(kind, rng, workspace) for _, kind in items]
        radii = sorted((r for _, r, _ in sizes), reverse=True)
        gap = max(0.6 * float(workspace.half[1]), radii[0] + radii[1] + CLEARANCE + 2 * self.SLOT_JITTER)
        slots = [workspace.center + np.array([0.0, k * gap]) for k in (-1, 0, 1)]
        order = self._slots(rng, items)
        xys = [slots[int(k)] + rng.uniform(-self.SLOT_JITTER, self.SLOT_JITTER, 2) for k in order]
        objs, desc, heights = _entries_at(items, sizes, xys)
        return TaskSetup(self.name, objs, {"target": objs[0]["name"], "heights": heights}, desc)

    def _items(self, rng: np.random.Generator) -> list[tuple[str, str]]:
        """The three (colour, kind) pairs, the target first."""
        return _graspables(rng, 3)

    def _slots(self, rng: np.random.Generator, items: list[tuple[str, str]]) -> list[int]:
        """Each item's slot index: 0 towards -y, 1 the centre, 2 towards +y (the workspace's frame)."""
        return [int(k) for k in rng.permutation(3)]


class ReachFixedSlots(ReachSlots):
    """``reach_slots`` with each colour always on the same slot: red towards -y, green at the centre, blue towards
    +y (kinds still drawn, the target a random one of the three).

    The instruction alone then says where to reach; nothing has to be found in the image. The transfer study uses
    it to separate language conditioning (a colour word mapped to a place, re-expressed in a new arm's joints) from
    visual grounding, which the tiny model was not found to learn from scratch on ``reach_slots``.
    """

    name = "reach_fixed_slots"
    SLOT_OF: ClassVar[dict[str, int]] = {"red": 0, "green": 1, "blue": 2}

    def _items(self, rng: np.random.Generator) -> list[tuple[str, str]]:
        colors = rng.permutation(list(self.SLOT_OF))
        return [(str(c), str(rng.choice(("cube", "cylinder")))) for c in colors]

    def _slots(self, rng: np.random.Generator, items: list[tuple[str, str]]) -> list[int]:
        return [self.SLOT_OF[color] for color, _ in items]


class PickPlace(Task):
    name = "pick_place"
    names_object = True
    templates = ("put the {target} in the bowl", "place the {target} into the bowl", "pick up the {target} and "
                 "drop it in the bowl", "move the {target} to the bowl", "put the {target} inside the bowl")  # fmt: skip
    max_steps = 150

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        items = [*_graspables(rng, 3), ("white", "bowl")]
        objs, desc, heights = _entries(rng, workspace.one_arm(rng), items)
        bowl = objs[-1]
        bowl["rgba"] = (0.9, 0.9, 0.9, 1.0)
        return TaskSetup(self.name, objs, {"target": objs[0]["name"], "place": bowl["name"], "heights": heights},
                         desc)  # fmt: skip

    def success(self, world: World, setup: TaskSetup) -> bool:
        g = setup.goal
        obj, bowl = body_pos(world, g["target"]), body_pos(world, g["place"])
        radius = world.objects[g["place"]].radius
        rim = g["heights"][g["place"]]
        inside = np.linalg.norm(obj[:2] - bowl[:2]) < radius and obj[2] - bowl[2] < rim
        return bool(inside and not robot_touches(world, g["target"]))

    def set_goal_state(self, world: World, setup: TaskSetup) -> None:
        set_free_pos(
            world, setup.goal["target"], body_pos(world, setup.goal["place"]) + np.array([0, 0, 0.008])
        )
        mujoco.mj_forward(world.model, world.data)


PUSH_DISTANCE = (0.1, 0.15)  # m from the object's centre to the target marker's


class Push(Task):
    """Push an object (a cube) across the table onto a flat target marker; a second marker of another colour is
    a distractor, so the instruction must be read for both the object and the marker."""

    name = "push"
    names_object = True
    templates = ("push the {target} to the {place}", "slide the {target} onto the {place}",
                 "nudge the {target} into the {place}", "shove the {target} over to the {place}")  # fmt: skip
    max_steps = 120

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        objs, desc, heights = _entries(rng, workspace, _graspables(rng, 3, target_kind="cube"))
        used = {o["name"].split("_")[0] for o in objs}
        colors = [str(c) for c in rng.permutation([c for c in COLORS if c not in used])[:2]]
        markers = self._markers(rng, workspace, objs, colors)
        for color, (xy, r) in zip(colors, markers):
            name = f"{color}_marker"
            objs.append({"kind": "marker", "name": name, "size": (r,), "rgba": COLORS[color],
                         "pos": (float(xy[0]), float(xy[1]), 0.0)})  # fmt: skip
            desc[name] = f"{color} circle"
        goal = {"target": objs[0]["name"], "place": f"{colors[0]}_marker", "heights": heights}
        return TaskSetup(self.name, objs, goal, desc)

    @staticmethod
    def _markers(rng: np.random.Generator, ws: Workspace, objs: list[dict[str, Any]],
                 colors: list[str]) -> list[tuple[np.ndarray, float]]:  # fmt: skip
        """The target marker a push away from the target object, clear of the other objects (and the path to
        it clear of them too, so the push moves only the target), then a distractor marker elsewhere."""
        xy = [np.asarray(o["pos"][:2]) for o in objs]
        radii = [o["size"][0] * math.sqrt(2) if o["kind"] == "cube" else o["size"][0] for o in objs]
        sizes = [float(rng.uniform(*MARKER_RADIUS)) for _ in colors]
        out: list[tuple[np.ndarray, float]] = []
        for grow in (1.0, 1.3, 1.6, 2.0):
            for _ in range(200):
                angle, dist = rng.uniform(-math.pi, math.pi), rng.uniform(*PUSH_DISTANCE)
                u = np.array([math.cos(angle), math.sin(angle)])
                p = xy[0] + dist * u
                if np.any(np.abs(p - ws.center) > ws.half * grow):
                    continue
                # distance of every other object from the segment the target travels along (plus the pusher)
                seg = [
                    np.linalg.norm(q - (xy[0] + np.clip((q - xy[0]) @ u, -0.08, dist) * u)) for q in xy[1:]
                ]
                if all(d >= r + radii[0] + 0.02 for d, r in zip(seg, radii[1:])):
                    out.append((p, sizes[0]))
                    break
            if out:
                break
        else:
            raise RuntimeError(f"could not place a push target in the {ws.robot} workspace")
        for _ in range(400):
            p = ws.center + rng.uniform(-1, 1, 2) * ws.half * 1.2
            if all(
                np.linalg.norm(p - q) >= r + sizes[1] for q, r in [*zip(xy, radii), (out[0][0], sizes[0])]
            ):
                out.append((p, sizes[1]))
                break
        else:
            raise RuntimeError(f"could not place a distractor marker in the {ws.robot} workspace")
        return out

    def success(self, world: World, setup: TaskSetup) -> bool:
        g = setup.goal
        d = body_pos(world, g["target"])[:2] - body_pos(world, g["place"])[:2]
        return bool(np.linalg.norm(d) < world.objects[g["place"]].radius)

    def set_goal_state(self, world: World, setup: TaskSetup) -> None:
        set_free_pos(world, setup.goal["target"], body_pos(world, setup.goal["place"]) * [1, 1, 0])
        mujoco.mj_forward(world.model, world.data)


class Stack(Task):
    name = "stack"
    names_object = True
    templates = ("stack the {target} on the {place}", "put the {target} on top of the {place}",
                 "place the {target} onto the {place}", "pick up the {target} and set it on the {place}")  # fmt: skip
    max_steps = 150

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        items = _graspables(rng, 3, kinds=("cube",), target_kind="cube")
        objs, desc, heights = _entries(rng, workspace.one_arm(rng), items)
        # The base cube is the larger of the first two, so the top one fits on it.
        a, b = objs[0], objs[1]
        if a["size"][0] > b["size"][0]:
            a["size"], b["size"] = b["size"], a["size"]
            heights[a["name"]], heights[b["name"]] = 2 * a["size"][0], 2 * b["size"][0]
        return TaskSetup(self.name, objs, {"target": a["name"], "place": b["name"], "heights": heights}, desc)

    def success(self, world: World, setup: TaskSetup) -> bool:
        g = setup.goal
        top, base = body_pos(world, g["target"]), body_pos(world, g["place"])
        on = abs(top[2] - base[2] - g["heights"][g["place"]]) < 0.01
        centred = np.linalg.norm(top[:2] - base[:2]) < 0.5 * g["heights"][g["place"]]
        return bool(on and centred and not robot_touches(world, g["target"]))

    def set_goal_state(self, world: World, setup: TaskSetup) -> None:
        g = setup.goal
        base = body_pos(world, g["place"])
        set_free_pos(world, g["target"], base + np.array([0, 0, g["heights"][g["place"]]]))
        mujoco.mj_forward(world.model, world.data)


class Drawer(Task):
    name = "drawer"
    templates = ("{action} the drawer", "{action} the {color} drawer", "please {action} the drawer",
                 "can you {action} the drawer")  # fmt: skip
    max_steps = 150
    OPEN_FRACTION = 0.4  # of the drawer's depth, for "open"
    CLOSED = 0.015  # m, for "close"

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        half = tuple(float(rng.uniform(*b)) for b in DRAWER_HALF)
        action = str(rng.choice(["open", "close"]))
        color = str(rng.choice(list(COLORS)))
        # Front (−x side, toward a single arm; toward ALOHA's left arm) a little behind the workspace centre.
        x = workspace.center[0] + half[0] + (0.0 if workspace.robot == "aloha" else 0.02)
        y = workspace.center[1] + float(rng.uniform(-0.3, 0.3)) * workspace.half[1]
        obj = {"kind": "drawer", "name": "drawer", "size": half, "rgba": COLORS[color], "pos": (x, y, 0.0)}
        goal = {"target": "drawer", "action": action, "color": color, "depth": half[0]}
        return TaskSetup(self.name, [obj], goal, {"drawer": f"{color} drawer"})

    def instruction(self, setup: TaskSetup, rng: np.random.Generator) -> str:
        return str(rng.choice(self.templates)).format(action=setup.goal["action"], color=setup.goal["color"])

    def slide(self, world: World) -> float:
        """Drawer opening (m, 0 = closed)."""
        return float(world.data.joint("drawer_slide").qpos[0])

    def initialize(self, world: World, setup: TaskSetup) -> None:
        super().initialize(world, setup)
        if setup.goal["action"] == "close":
            world.data.joint("drawer_slide").qpos[0] = 1.2 * setup.goal["depth"]
            mujoco.mj_forward(world.model, world.data)

    def success(self, world: World, setup: TaskSetup) -> bool:
        s = self.slide(world)
        if setup.goal["action"] == "open":
            return s > self.OPEN_FRACTION * setup.goal["depth"]
        return s < self.CLOSED

    def set_goal_state(self, world: World, setup: TaskSetup) -> None:
        open_ = setup.goal["action"] == "open"
        world.data.joint("drawer_slide").qpos[0] = setup.goal["depth"] if open_ else 0.0
        mujoco.mj_forward(world.model, world.data)


for _task in (Reach(), ReachSlots(), ReachFixedSlots(), PickPlace(), Push(), Stack(), Drawer()):
    TASKS.register(_task.name, _task)


__all__ = [
    "COLORS",
    "TASKS",
    "Task",
    "TaskSetup",
    "Workspace",
    "body_pos",
    "gripper_over",
    "robot_touches",
    "set_free_pos",
]
