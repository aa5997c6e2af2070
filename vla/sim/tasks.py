"""Tabletop tasks with language instructions: ``TASKS`` registry of ``reach``, ``pick_place``, ``push``, ``stack``,
``drawer``.

A task is stateless; one episode's draw is a ``TaskSetup``:

- ``task.setup(rng, workspace)`` samples the objects (a target plus distractors of other colours, so the
  instruction is needed to know which one) as ``build_world`` entries with explicit sizes/colours/positions,
  and the goal (``goal["target"]`` names the object the instruction refers to);
- ``task.instruction(setup, rng)`` picks one of several paraphrases naming the target;
- ``task.initialize(world, setup)`` runs after ``World.reset`` (records start positions, opens the drawer for
  "close the drawer");
- ``task.success(world, setup)`` reads MuJoCo state only (positions, contacts, the drawer's slide joint);
- ``task.set_goal_state(world, setup)`` puts the world in a goal state by hand (tests).

Directions ("left"/"right") are the robot's: single arms face +x, so left is +y; for ALOHA they are as seen
from the ``primary`` camera behind the table (left = −x, toward the left arm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(frozen=True)
class Workspace:
    """Where a robot can work, world frame: ``center`` / ``half`` (m, xy), ``base`` (m), ``reach`` (m)."""

    center: np.ndarray
    half: np.ndarray
    base: np.ndarray
    reach: float
    robot: str

    @staticmethod
    def of(world: World) -> Workspace:
        p = world.params
        return Workspace(np.asarray(p["workspace_center"], float), np.asarray(p["workspace_half"], float),
                         np.asarray(p["robot_base"], float), float(world.robot.reach), str(p["robot"]))  # fmt: skip


@dataclass
class TaskSetup:
    """One episode's draw: ``objects`` for ``build_world``, ``goal`` for the success detector and the expert."""

    task: str
    objects: list[dict[str, Any]]
    goal: dict[str, Any]
    descriptions: dict[str, str] = field(default_factory=dict)  # object name -> "red cube"


def _size(kind: str, rng: np.random.Generator) -> tuple[tuple[float, ...], float, float]:
    """(size, footprint radius, height) for a graspable object or a bowl."""
    if kind == "cube":
        h = float(rng.uniform(*CUBE_HALF))
        return (h,), h * math.sqrt(2), 2 * h
    if kind == "cylinder":
        r, hh = float(rng.uniform(*CYLINDER_RADIUS)), float(rng.uniform(*CYLINDER_HALF_HEIGHT))
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
    """build_world entries (name ``<colour>_<kind>``), their descriptions and heights."""
    sizes = [_size(kind, rng) for _, kind in items]
    xys = _place(rng, ws, [r for _, r, _ in sizes])
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


def set_free_pos(world: World, name: str, pos: np.ndarray) -> None:
    """Teleport a free object (bottom centre at ``pos``, upright, at rest); call ``mj_forward`` afterwards."""
    j = world.model.joint(f"{name}_joint")
    world.data.qpos[j.qposadr[0] : j.qposadr[0] + 7] = [*pos, 1.0, 0.0, 0.0, 0.0]
    world.data.qvel[j.dofadr[0] : j.dofadr[0] + 6] = 0.0


class Task:
    """Base class: subclasses fill ``name``, ``templates``, ``max_steps`` (at 10 Hz) and the hooks."""

    name: str = ""
    templates: tuple[str, ...] = ()
    max_steps: int = 100

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

    def set_goal_state(self, world: World, setup: TaskSetup) -> None:
        """Put the world in a goal state by hand (for tests of ``success``)."""
        raise NotImplementedError


TASKS: Registry[Task] = Registry("sim task", hint="Register a Task in vla/sim/tasks.py.")


class Reach(Task):
    name = "reach"
    templates = ("touch the {target}", "reach for the {target}", "move your gripper to the {target}",
                 "put the gripper on the {target}", "tap the {target}")  # fmt: skip
    max_steps = 60

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        objs, desc, heights = _entries(rng, workspace, _graspables(rng, 3))
        return TaskSetup(self.name, objs, {"target": objs[0]["name"], "heights": heights}, desc)

    def success(self, world: World, setup: TaskSetup) -> bool:
        return robot_touches(world, setup.goal["target"])

    def set_goal_state(self, world: World, setup: TaskSetup) -> None:
        # Centre the object on a finger pad, so they overlap whatever the gripper's orientation.
        finger = world.model.body(world.robot.arms[-1].gripper_joints[0]).id
        pad = int(np.flatnonzero(world.model.geom_bodyid == finger)[0])
        half_height = setup.goal["heights"][setup.goal["target"]] / 2
        set_free_pos(world, setup.goal["target"], world.data.geom_xpos[pad] - [0.0, 0.0, half_height])
        mujoco.mj_forward(world.model, world.data)


class PickPlace(Task):
    name = "pick_place"
    templates = ("put the {target} in the bowl", "place the {target} into the bowl", "pick up the {target} and "
                 "drop it in the bowl", "move the {target} to the bowl", "put the {target} inside the bowl")  # fmt: skip
    max_steps = 150

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        items = [*_graspables(rng, 3), ("white", "bowl")]
        objs, desc, heights = _entries(rng, workspace, items)
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


PUSH_DISTANCE = 0.12  # m the expert pushes; success needs 2/3 of it


class Push(Task):
    name = "push"
    templates = ("push the {target} to the {direction}", "slide the {target} {direction}ward",
                 "nudge the {target} toward the {direction}", "shove the {target} to the {direction}")  # fmt: skip
    max_steps = 120

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        objs, desc, heights = _entries(rng, workspace, _graspables(rng, 3, target_kind="cube"))
        direction = str(rng.choice(["left", "right"]))
        sign = 1.0 if direction == "left" else -1.0
        vec = [-sign, 0.0] if workspace.robot == "aloha" else [0.0, sign]
        goal = {"target": objs[0]["name"], "direction": direction, "vector": vec, "heights": heights}
        return TaskSetup(self.name, objs, goal, desc)

    def displacement(self, world: World, setup: TaskSetup) -> float:
        start = np.asarray(setup.goal["start"][setup.goal["target"]])
        return float((body_pos(world, setup.goal["target"]) - start)[:2] @ np.asarray(setup.goal["vector"]))

    def success(self, world: World, setup: TaskSetup) -> bool:
        return self.displacement(world, setup) > PUSH_DISTANCE * 2 / 3

    def set_goal_state(self, world: World, setup: TaskSetup) -> None:
        start = np.asarray(setup.goal["start"][setup.goal["target"]])
        set_free_pos(
            world, setup.goal["target"], start + PUSH_DISTANCE * np.array([*setup.goal["vector"], 0.0])
        )
        mujoco.mj_forward(world.model, world.data)


class Stack(Task):
    name = "stack"
    templates = ("stack the {target} on the {place}", "put the {target} on top of the {place}",
                 "place the {target} onto the {place}", "pick up the {target} and set it on the {place}")  # fmt: skip
    max_steps = 150

    def setup(self, rng: np.random.Generator, workspace: Workspace) -> TaskSetup:
        items = _graspables(rng, 3, kinds=("cube",), target_kind="cube")
        objs, desc, heights = _entries(rng, workspace, items)
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


for _task in (Reach(), PickPlace(), Push(), Stack(), Drawer()):
    TASKS.register(_task.name, _task)


__all__ = ["COLORS", "TASKS", "Task", "TaskSetup", "Workspace", "body_pos", "robot_touches", "set_free_pos"]
