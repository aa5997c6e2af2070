"""Simulation: MuJoCo robots and tabletop worlds built in code with ``mujoco.MjSpec``.

Modules, one job each:

- ``arms``       kinematic descriptions (data) of the published arms: Panda, UR5e, WidowX 250, Kinova Gen3, ViperX
- ``procedural`` randomly generated 4–7-DoF arms, every sampled value recorded
- ``robots``     ``build_robot`` / ``ROBOTS`` registry (``panda``, ``ur5e``, ``widowx``, ``kinova_gen3``, ``aloha``,
                 ``procedural``) and ``load_mjcf_robot`` for a user's MJCF file
- ``handles``    names, limits and the state/action map of a built robot (``RobotHandles`` → ``BoundRobot``)
- ``objects``    ``add_object``: cubes, cylinders, bowls, a drawer with randomized size/colour/mass
- ``world``      ``build_world``: table, lights, robot, ``primary`` + wrist cameras, objects → ``World``
- ``embodiment`` ``EmbodimentSpec`` of each simulated robot (``configs/embodiments/sim_*.yaml``; procedural: ``sim_procedural_<dof>dof``)
- ``tasks``      ``TASKS``: reach, reach_slots, reach_fixed_slots, pick_place, push, stack, drawer — instructions with paraphrases, success detectors
- ``ik`` / ``expert``  damped-least-squares IK on MuJoCo Jacobians; waypoint scripted experts per task
- ``randomization`` / ``perception``  the four reality-gap sources, levels none..high + held-out reality_proxy
- ``env``        ``make(embodiment, task, randomization=, seed=)``: the Gymnasium environment
- ``generate``   ``vla sim generate`` (parallel, sharded, resumable; ``vla data merge`` joins shards); ``preview``

Set ``MUJOCO_GL=egl`` before importing mujoco for headless rendering. ``vla.sim`` never imports ``vla.models``.
"""

from __future__ import annotations

import os

# Headless offscreen rendering by default (CI, clusters); a user with a display may set MUJOCO_GL=glfw first.
os.environ.setdefault("MUJOCO_GL", "egl")

from vla.sim.embodiment import (
    embodiment_for,
    procedural_embodiment_spec,
    procedural_family_spec,
    sim_embodiment_spec,
)
from vla.sim.handles import ArmHandles, BoundRobot, RobotHandles
from vla.sim.objects import OBJECT_KINDS, ObjectHandles, add_object
from vla.sim.robots import ROBOTS, MjcfRobot, build_robot, load_mjcf_robot
from vla.sim.world import RenderSettings, World, build_world


def make(*args, **kwargs):
    """``vla.sim.make(embodiment, task, randomization=..., seed=...)``: see ``vla.sim.env.make``."""
    from vla.sim.env import make as _make

    return _make(*args, **kwargs)


__all__ = [
    "OBJECT_KINDS",
    "ROBOTS",
    "ArmHandles",
    "BoundRobot",
    "MjcfRobot",
    "ObjectHandles",
    "RenderSettings",
    "RobotHandles",
    "World",
    "add_object",
    "build_robot",
    "build_world",
    "embodiment_for",
    "load_mjcf_robot",
    "make",
    "procedural_embodiment_spec",
    "procedural_family_spec",
    "sim_embodiment_spec",
]
