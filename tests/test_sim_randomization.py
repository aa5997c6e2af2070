"""vla.sim.randomization: records equal the randomized model, ``none`` is the identity, levels nest, the held-out
``reality_proxy`` lies outside ``high``, act/observe shape actions and images, overrides and errors."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco is imported (conftest sets it too)

import dataclasses
import itertools
import json
from typing import Any

import mujoco
import numpy as np
import pytest

from vla.config import ConfigError
from vla.paths import config_dir
from vla.sim import build_world
from vla.sim.randomization import LEVELS, SECTIONS, RandomizationConfig, Randomizer, load_randomization

OBJECTS = ("cube", "bowl", "drawer")
TRAIN_LEVELS = ("none", "low", "medium", "high")


def _world(seed: int = 0, robot: str = "panda"):
    return build_world(robot, seed=seed, image_size=48, objects=OBJECTS)


def _values(x: Any) -> np.ndarray:
    """All numbers inside a record entry (number, list, nested lists, dict of those)."""
    if isinstance(x, dict):
        parts = [_values(v) for v in x.values()]
        return np.concatenate(parts) if parts else np.zeros(0)
    return np.ravel(np.asarray(x, dtype=np.float64))


def _range_fields(cfg: RandomizationConfig):
    """(section, field name, (lo, hi)) of every range in a config."""
    for sec in SECTIONS:
        sub = getattr(cfg, sec)
        for f in dataclasses.fields(sub):
            v = getattr(sub, f.name)
            if isinstance(v, tuple):
                yield sec, f.name, v


@pytest.mark.parametrize("level", ["low", "medium", "high", "reality_proxy"])
def test_record_equals_randomized_model(level: str) -> None:
    rand = Randomizer.from_level(level)
    for seed in (0, 1, 2):
        world = _world(seed)
        nominal = _world(seed).model  # the same world, never randomized
        rec = rand.sample(np.random.default_rng(seed), world)
        rand.apply(world, rec)
        m = world.model
        dyn, per, act, sys_ = rec["dynamics"], rec["perception"], rec["actuation"], rec["system"]
        # every sampled value lies in its configured range (record key == config field name)
        for sec, name, (lo, hi) in _range_fields(rand.config):
            if sec == "perception" and name in ("shadowsize", "offsamples"):
                continue  # recorded under perception.render
            v = _values(rec[sec][name])
            assert np.all((v >= lo) & (v <= hi)), (level, sec, name, v, lo, hi)
        # dynamics
        np.testing.assert_array_equal(m.geom_friction, dyn["geom_friction"])
        scale = np.stack([dyn["friction_scale"], dyn["torsional_scale"], dyn["rolling_scale"]], -1)
        np.testing.assert_allclose(m.geom_friction, nominal.geom_friction * scale)
        assert not np.allclose(m.geom_friction, nominal.geom_friction)
        for obj in world.objects.values():
            bid = m.body(obj.body).id
            assert m.body_mass[bid] == dyn["body_mass"][obj.body]
            np.testing.assert_array_equal(m.body_inertia[bid], dyn["body_inertia"][obj.body])
            assert m.body_mass[bid] == pytest.approx(nominal.body_mass[bid] * dyn["mass_scale"][obj.name])
        for attr in ("dof_damping", "dof_armature", "dof_frictionloss"):
            np.testing.assert_array_equal(getattr(m, attr), dyn[attr])
        # actuation
        for a, (kp, bias) in act["kp"].items():
            i = m.actuator(a).id
            assert (m.actuator_gainprm[i, 0], m.actuator_biasprm[i, 1]) == (kp, bias)
            assert kp == pytest.approx(nominal.actuator_gainprm[i, 0] * act["gain_scale"][a])
        for a, fr in act["gripper_forcerange"].items():
            np.testing.assert_array_equal(m.actuator_forcerange[m.actuator(a).id], fr)
        # perception: lights, colours, cameras, render quality
        active = [m.light(i).name for i in range(m.nlight) if m.light_active[i]]
        assert sorted(active) == sorted(light["name"] for light in per["lights"])
        assert len(active) == nominal.nlight + per["extra_lights"]
        for light in per["lights"]:
            lid = m.light(light["name"]).id
            np.testing.assert_array_equal(m.light_pos[lid], light["pos"])
            np.testing.assert_array_equal(m.light_dir[lid], light["dir"])
            np.testing.assert_array_equal(m.light_diffuse[lid], light["diffuse"])
        np.testing.assert_array_equal(m.vis.headlight.ambient, per["headlight_ambient"])
        for geom, rgba in per["geom_rgba"].items():
            np.testing.assert_array_equal(m.geom_rgba[m.geom(geom).id], np.asarray(rgba, np.float32))
        for cam, c in per["cameras"].items():
            cid = m.camera(cam).id
            np.testing.assert_array_equal(m.cam_pos[cid], c["pos"])
            np.testing.assert_array_equal(m.cam_quat[cid], c["quat"])
            assert m.cam_fovy[cid] == c["fovy"]
            assert c["fovy"] == pytest.approx(nominal.cam_fovy[cid] + per["fovy_jitter"][cam])
        r = per["render"]
        assert world.render_settings.shadows == r["shadows"]
        assert m.vis.quality.shadowsize == (r["shadowsize"] if r["shadows"] else 0)
        assert m.vis.quality.offsamples == r["offsamples"]
        # system: object placement offsets, reset offsets
        cube = world.objects["cube0"]
        adr = m.joint(cube.joint).qposadr[0]
        dxy = sys_["object_xy_jitter"]["cube0"]
        np.testing.assert_allclose(m.qpos0[adr : adr + 2], nominal.qpos0[adr : adr + 2] + dxy)
        np.testing.assert_allclose(world.data.qpos[adr : adr + 2], m.qpos0[adr : adr + 2])
        assert len(sys_["reset_joint_offset"]) == world.robot.dof
    img = world.render("primary")  # the randomized world still renders
    assert img.shape == (48, 48, 3) and img.dtype == np.uint8


def _model_arrays(m: mujoco.MjModel) -> dict[str, np.ndarray]:
    out = {
        k: getattr(m, k) for k in dir(m) if not k.startswith("_") and isinstance(getattr(m, k), np.ndarray)
    }
    for group in ("quality", "headlight", "global_", "map"):
        obj = getattr(m.vis, group)
        for k in dir(obj):
            v = getattr(obj, k)
            if not k.startswith("_") and isinstance(v, np.ndarray | int | float):
                out[f"vis.{group}.{k}"] = np.asarray(v)
    return out


def test_none_is_identity_and_leaves_model_bit_identical() -> None:
    rand = Randomizer.from_level("none")
    for seed in (0, 5):
        world, ref = _world(seed), _world(seed)
        rec = rand.sample(np.random.default_rng(seed), world)
        rand.apply(world, rec)
        a, b = _model_arrays(world.model), _model_arrays(ref.model)
        assert a.keys() == b.keys() and len(a) > 100
        for k in a:
            assert a[k].tobytes() == b[k].tobytes(), k
        np.testing.assert_array_equal(world.data.qpos, ref.data.qpos)
        assert world.render_settings == ref.render_settings
        dyn, act, sys_ = rec["dynamics"], rec["actuation"], rec["system"]
        assert set(_values(dyn["friction_scale"])) == {1.0} and set(_values(dyn["mass_scale"])) == {1.0}
        assert set(_values(act["gain_scale"])) == {1.0} and act["latency_steps"] == 0
        assert sys_["control_period_scale"] == 1.0 and set(_values(sys_["reset_joint_offset"])) == {0.0}
        # act and observe are the identity
        action = np.linspace(-1, 1, world.robot.state_dim)
        np.testing.assert_array_equal(rand.act(action, 0, np.random.default_rng(0)), action)
        img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        np.testing.assert_array_equal(
            rand.observe({"primary": img}, np.random.default_rng(0))["primary"], img
        )


def test_same_seed_same_record_and_resampling_never_compounds() -> None:
    rand = Randomizer.from_level("high")
    world = _world(0)
    r1 = rand.sample(np.random.default_rng(7), world)
    assert r1 == rand.sample(np.random.default_rng(7), _world(0))
    assert r1 != rand.sample(np.random.default_rng(8), world)
    rand.apply(world, r1)
    # a second episode on the same (already randomized) world scales the built values again, not the randomized
    r2 = rand.sample(np.random.default_rng(7), world)
    assert r2 == r1
    none = Randomizer.from_level("none").sample(np.random.default_rng(0), world)
    np.testing.assert_array_equal(none["dynamics"]["geom_friction"], _world(0).model.geom_friction)
    Randomizer.from_level("none").apply(world, none)
    assert world.model.light_active.sum() == _world(0).model.nlight  # extra lights switched off again


def test_levels_widen_monotonically() -> None:
    cfgs = [load_randomization(level) for level in TRAIN_LEVELS]
    assert [c.name for c in cfgs] == list(TRAIN_LEVELS)
    for narrow, wide in itertools.pairwise(cfgs):
        for (sec, name, (lo, hi)), (_, _, (wlo, whi)) in zip(_range_fields(narrow), _range_fields(wide)):
            assert wlo <= lo and hi <= whi, (narrow.name, wide.name, sec, name)
        assert narrow.perception.shadow_prob <= wide.perception.shadow_prob
        strictly = [n for (_, n, r), (_, _, w) in zip(_range_fields(narrow), _range_fields(wide)) if r != w]
        assert len(strictly) >= 10, (narrow.name, wide.name)  # each level really widens most ranges


def test_reality_proxy_lies_outside_high() -> None:
    proxy, high = load_randomization("reality_proxy"), load_randomization("high")
    assert len(proxy.held_out) >= 6
    for key in proxy.held_out:
        sec, name = key.split(".")
        (plo, phi), (hlo, hhi) = getattr(getattr(proxy, sec), name), getattr(getattr(high, sec), name)
        assert phi < hlo or plo > hhi, key
    held = set(proxy.held_out)
    for sec, name, r in _range_fields(proxy):  # everything not held out is high's
        if f"{sec}.{name}" not in held:
            assert r == getattr(getattr(high, sec), name), (sec, name)
    rand = Randomizer(proxy)
    for seed in range(3):
        rec = rand.sample(np.random.default_rng(seed), _world(seed))
        for key in proxy.held_out:
            sec, name = key.split(".")
            hlo, hhi = getattr(getattr(high, sec), name)
            v = _values(rec[sec][name])
            assert v.size and np.all((v < hlo) | (v > hhi)), (key, v)


def _applied(overrides: list[str], seed: int = 0) -> Randomizer:
    rand = Randomizer.from_level("none", overrides)
    world = _world(seed)
    rand.apply(world, rand.sample(np.random.default_rng(seed), world))
    return rand


@pytest.mark.parametrize("k", [0, 1, 3])
def test_latency_delays_actions_by_exactly_k_steps(k: int) -> None:
    rand = _applied([f"actuation.latency_steps=[{k},{k}]"])
    rng = np.random.default_rng(0)
    for _episode in range(2):  # reset clears the FIFO between episodes
        rand.reset()
        actions = [np.full(8, float(t + 1)) for t in range(10)]
        out = [rand.act(a, t, rng) for t, a in enumerate(actions)]
        for t in range(10):
            np.testing.assert_array_equal(out[t], actions[max(t - k, 0)])


def test_dead_zone_and_action_noise() -> None:
    rand = _applied(["actuation.dead_zone=[0.05,0.05]"])
    rng = np.random.default_rng(0)
    a0 = np.zeros(8)
    np.testing.assert_array_equal(rand.act(a0, 0, rng), a0)
    small = a0 + np.array([0.01, -0.04, 0, 0, 0, 0, 0, 0.2])
    np.testing.assert_array_equal(rand.act(small, 1, rng), [0, 0, 0, 0, 0, 0, 0, 0.2])  # only 0.2 passes
    creep = a0 + 0.03  # changes below the dead zone never accumulate into motion
    np.testing.assert_array_equal(rand.act(creep, 2, rng)[:7], 0.0)
    np.testing.assert_array_equal(rand.act(creep + 0.03, 3, rng)[:7], 0.06)

    rand = _applied(["actuation.action_noise_std=[0.01,0.01]"])
    base = np.linspace(-1, 1, 8)
    outs = np.stack([rand.act(base, t, rng) for t in range(2000)])
    noise = outs - base
    assert abs(noise.mean()) < 1e-3 and noise.std() == pytest.approx(0.01, rel=0.05)


def test_observe_corrupts_images_and_drops_frames() -> None:
    world = _world(0)
    images = {"primary": world.render("primary"), "wrist": world.render("wrist")}
    for override in (
        "perception.noise_std=[4,4]",
        "perception.blur_sigma=[1,1]",
        "perception.jpeg_quality=[20,20]",
    ):
        rand = _applied([override])
        out = rand.observe(images, np.random.default_rng(0))
        for cam, img in images.items():
            assert out[cam].shape == img.shape and out[cam].dtype == np.uint8
            assert np.any(out[cam] != img), override
            assert np.abs(out[cam].astype(int) - img).mean() < 20  # corrupted, not destroyed
    rand = _applied(["system.drop_frame_prob=[1,1]", "perception.noise_std=[4,4]"])
    rng = np.random.default_rng(0)
    first = rand.observe(images, rng)
    other = {k: 255 - v for k, v in images.items()}
    again = rand.observe(other, rng)  # dropped: the previous (corrupted) frame comes back
    for cam in images:
        np.testing.assert_array_equal(again[cam], first[cam])
    rand.reset()
    assert np.abs(rand.observe(other, rng)["primary"].astype(int) - other["primary"]).mean() < 10


def test_overrides_yaml_dict_and_dotted(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nactuation:\n  latency_steps: [2, 4]\ndynamics:\n  per_element: false\n")
    cfg = load_randomization(path, ["dynamics.mass_scale=[0.8,1.2]"])
    assert (
        cfg.name == "mine" and cfg.actuation.latency_steps == (2, 4) and cfg.dynamics.mass_scale == (0.8, 1.2)
    )
    rec = Randomizer(cfg).sample(np.random.default_rng(0), _world(0))
    assert len(rec["dynamics"]["friction_scale"]) == 1  # one global scale
    rand = Randomizer.from_level(
        "high", {"perception": {"blur_sigma": [0.0, 0.2]}, "system": {"drop_frame_prob": [0, 0]}}
    )
    assert rand.config.perception.blur_sigma == (0.0, 0.2) and rand.config.dynamics.friction_scale == (
        0.5,
        1.5,
    )
    rand = Randomizer.from_level("medium", ["actuation.gain_scale=[0.9,1.1]"])
    assert rand.config.actuation.gain_scale == (0.9, 1.1)
    with pytest.raises(ConfigError, match=r"Did you mean actuation\.latency_steps"):
        Randomizer.from_level("low", ["actuation.latency=[1,2]"])
    with pytest.raises(ConfigError, match=r"Did you mean perception"):
        Randomizer.from_level("low", {"perceptoin": {"noise_std": [0, 1]}})
    with pytest.raises(ConfigError, match="lo <= hi"):
        Randomizer.from_level("low", ["dynamics.friction_scale=[1.5,0.5]"])
    with pytest.raises(ConfigError, match="Did you mean high"):
        Randomizer.from_level("hihg")
    assert set(LEVELS) <= {p.stem for p in (config_dir() / "sim").glob("*.yaml")}


@pytest.mark.parametrize("robot", ["aloha", "procedural"])
def test_record_is_json_and_works_for_other_robots(robot: str) -> None:
    world = _world(1, robot)
    rand = Randomizer.from_level("reality_proxy")
    rec = rand.sample(np.random.default_rng(1), world)
    assert json.loads(json.dumps(rec)) == rec
    assert set(rec) == {"level", *SECTIONS}
    rand.apply(world, rec)
    assert len(rec["actuation"]["gripper_forcerange"]) == len(world.robot.arms)
    world.step(10)
    assert np.all(np.isfinite(world.data.qpos))


def _gaps(world) -> dict[tuple[str, str], float]:
    """Distance (m) between the footprints (``ObjectHandles.radius``) of every pair of colliding objects, where
    the objects are now."""
    objs = [o for o in world.objects.values() if o.kind != "marker"]
    xy = {o.name: world.data.body(o.body).xpos[:2] for o in objs}
    return {(a.name, b.name): float(np.linalg.norm(xy[a.name] - xy[b.name]) - a.radius - b.radius)
            for i, a in enumerate(objs) for b in objs[i + 1 :]}  # fmt: skip


def _on_table(world) -> bool:
    half = np.asarray(world.params["table_half"])
    return all(np.all(np.abs(world.data.body(o.body).xpos[:2]) + o.radius <= half + 1e-9)
               for o in world.objects.values())  # fmt: skip


@pytest.mark.parametrize("task", ["pick_place", "stack"])
def test_object_jitter_never_overlaps_objects_at_high(task: str) -> None:
    """At ``high`` (±3 cm per axis, objects placed 5 cm apart) the applied jitter keeps colliding footprints
    apart and on the table, the record is exactly what is applied, and nothing explodes at the first steps."""
    from vla.sim.randomization import JITTER_MARGIN
    from vla.sim.tasks import TASKS, Workspace

    rand, moved = Randomizer.from_level("high"), 0
    for seed in range(30):
        probe = build_world("panda", seed=seed, image_size=32)
        setup = TASKS.get(task).setup(np.random.default_rng([seed, 1]), Workspace.of(probe))
        world = build_world("panda", seed=seed, image_size=32, objects=setup.objects)
        rec = rand.sample(np.random.default_rng(seed), world)
        assert rec == rand.sample(np.random.default_rng(seed), world)  # deterministic per seed
        rand.apply(world, rec)
        jitter = rec["system"]["object_xy_jitter"]
        for obj in setup.objects:
            start = world.data.body(obj["name"]).xpos[:2]
            np.testing.assert_allclose(start - np.asarray(obj["pos"][:2]), jitter[obj["name"]], atol=1e-12)
        moved += sum(bool(np.any(v)) for v in jitter.values())
        assert min(_gaps(world).values()) >= JITTER_MARGIN - 1e-9, (seed, _gaps(world))
        assert _on_table(world), seed
        world.step(50)  # 0.1 s: objects at rest stay at rest (interpenetrating ones would fly off)
        for obj in world.objects.values():
            speed = np.linalg.norm(world.data.joint(obj.joint).qvel[:3])
            assert speed < 0.05, (seed, obj.name, speed)
    assert moved > 0.9 * 30 * len(setup.objects)  # the fallback (no offset) stays rare


def test_object_jitter_keeps_crowded_objects_apart() -> None:
    """Objects built 1 cm apart with ±3 cm jitter per axis: independent offsets would overlap them in many draws;
    the sampled ones never do, and the ones built overlapping (user positions) keep their built place."""
    from vla.sim.randomization import JITTER_MARGIN, sample_object_jitter

    c = np.asarray(_world(0).params["workspace_center"])
    cubes = [{"kind": "cube", "size": (0.02,), "pos": (c[0] + i * (0.04 * np.sqrt(2) + 0.01), c[1], 0.0)}
             for i in range(3)]  # fmt: skip
    world = build_world("panda", seed=0, image_size=32, objects=cubes)
    names = list(world.objects)
    for seed in range(100):
        jitter = sample_object_jitter((-0.03, 0.03), np.random.default_rng(seed), world)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                pa, pb = (np.asarray(world.objects[n].params["pos"][:2]) + jitter[n] for n in (a, b))
                gap = np.linalg.norm(pa - pb) - world.objects[a].radius - world.objects[b].radius
                assert gap >= JITTER_MARGIN - 1e-9, (seed, a, b, gap)
    overlapping = build_world("panda", seed=0, image_size=32, objects=[cubes[0], cubes[0]])
    jitter = sample_object_jitter((-0.03, 0.03), np.random.default_rng(0), overlapping)
    assert all(v == [0.0, 0.0] for v in jitter.values())
