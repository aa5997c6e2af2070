"""Perception randomization: lights, colours, cameras, rendering quality and image corruptions.

Used by ``vla.sim.randomization.Randomizer``; split out so each file stays readable. Three steps, as there:

- ``sample_perception`` draws every value for one episode into a JSON-serializable dict. By convention each
  range field ``x`` of ``PerceptionRandomization`` has its sampled value(s) under ``record["x"]`` (a number, a list
  per light, or a dict per camera/object); absolute results (``lights``, ``geom_rgba``, ``cameras``, ``render``)
  are stored too, so ``apply_perception`` only writes values and is idempotent.
- ``apply_perception`` writes them into ``world.model`` (adding directional lights to ``world.spec`` and
  recompiling when more lights are asked for than the spec has) and sets the world's ``RenderSettings``.
- ``corrupt_images`` blurs, adds noise and JPEG-compresses rendered frames (uint8 in, uint8 out).

Rendering quality is a randomized parameter with a cost. Measured at 128 px with CPU EGL rendering:
shadows off 1.4 ms/frame; shadows on 4.9 / 7.9 / 15.9 / 38.6 ms with shadowsize 256 / 1024 / 2048 / 4096;
MSAA ``offsamples=4`` +2 ms. ``render_cost_ms`` turns that into the estimate recorded per episode.
"""

from __future__ import annotations

import colorsys
import dataclasses
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mujoco
import numpy as np
from PIL import Image, ImageFilter

from vla.config import ConfigError

Range = tuple[float, float]
IntRange = tuple[int, int]
EXTRA_LIGHT = "rand_light"  # name prefix of lights added by randomization
EXTRA_DIFFUSE = 0.35  # nominal diffuse of an added light (the key light has 0.7)
SCENE_GEOMS = ("table", "floor")  # "textures": their colours are jittered with table_rgb_delta


def check_ranges(section: str, cfg: Any) -> None:
    """Validate every ``(lo, hi)`` field of a config dataclass: two numbers, ``lo <= hi``."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, tuple):
            if len(v) != 2 or not all(isinstance(x, int | float) for x in v):
                raise ConfigError(f"{section}.{f.name} must be a (lo, hi) pair of numbers, got {v!r}")
            if v[0] > v[1]:
                raise ConfigError(f"{section}.{f.name} must have lo <= hi, got {list(v)}")


@dataclass(frozen=True)
class PerceptionRandomization:
    """What the cameras see. Ranges are ``(lo, hi)``; identities (the defaults) change nothing.

    Lights: ``extra_lights`` directional lights added to the scene (count); every light's direction is turned by
    ``light_dir_jitter`` rad about a random axis, its position offset per axis by ``light_pos_jitter`` m, its
    colour drawn with a uniform hue and ``light_saturation`` (0 = white), its diffuse scaled by
    ``light_intensity``; the headlight's ambient by ``ambient_scale``.
    Colours: each object's rgb shifted per channel by ``object_rgb_delta``, table and floor by
    ``table_rgb_delta`` (clipped to [0, 1]).
    Cameras (all of the world's slots): position offset per axis ``camera_pos_jitter`` m (camera frame's parent
    body), rotation ``camera_rot_jitter`` rad per camera axis, field of view ``fovy_jitter`` deg.
    Images (``observe``): Gaussian ``noise_std`` (0–255 units) per pixel, Gaussian ``blur_sigma`` px,
    ``jpeg_quality`` (100 = no compression).
    Rendering quality (only when ``randomize_render``; otherwise the world's settings are kept and recorded):
    shadows on with probability ``shadow_prob``, ``shadowsize`` a power of two in the range, ``offsamples``
    MSAA samples.
    """

    extra_lights: IntRange = (0, 0)
    light_dir_jitter: Range = (0.0, 0.0)
    light_pos_jitter: Range = (0.0, 0.0)
    light_saturation: Range = (0.0, 0.0)
    light_intensity: Range = (1.0, 1.0)
    ambient_scale: Range = (1.0, 1.0)
    object_rgb_delta: Range = (0.0, 0.0)
    table_rgb_delta: Range = (0.0, 0.0)
    camera_pos_jitter: Range = (0.0, 0.0)
    camera_rot_jitter: Range = (0.0, 0.0)
    fovy_jitter: Range = (0.0, 0.0)
    noise_std: Range = (0.0, 0.0)
    blur_sigma: Range = (0.0, 0.0)
    jpeg_quality: IntRange = (100, 100)
    randomize_render: bool = False
    shadow_prob: float = 0.0
    shadowsize: IntRange = (1024, 1024)
    offsamples: IntRange = (0, 0)

    def __post_init__(self) -> None:
        check_ranges("perception", self)
        s = "perception."
        for name in ("extra_lights", "offsamples", "light_dir_jitter", "light_saturation", "light_intensity",
                     "ambient_scale", "noise_std", "blur_sigma"):  # fmt: skip
            if getattr(self, name)[0] < 0:
                raise ConfigError(f"{s}{name} must be >= 0, got {list(getattr(self, name))}")
        if self.light_saturation[1] > 1:
            raise ConfigError(f"{s}light_saturation must lie in [0, 1], got {list(self.light_saturation)}")
        if self.jpeg_quality[0] < 1 or self.jpeg_quality[1] > 100:
            raise ConfigError(f"{s}jpeg_quality must lie in [1, 100], got {list(self.jpeg_quality)}")
        if not 0.0 <= self.shadow_prob <= 1.0:
            raise ConfigError(f"{s}shadow_prob must be in [0, 1], got {self.shadow_prob}")
        if self.shadowsize[0] < 64 or self.shadowsize[1] > 8192:
            raise ConfigError(f"{s}shadowsize must lie in [64, 8192], got {list(self.shadowsize)}")


# ---- helpers ---------------------------------------------------------------------------------------------
def js(x: Any) -> Any:
    """Plain-Python (JSON-serializable) copy of numpy scalars/arrays inside lists/dicts."""
    if isinstance(x, dict):
        return {str(k): js(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [js(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x


def uniform(rng: np.random.Generator, r: Range, size: int | tuple[int, ...] | None = None) -> Any:
    """``rng.uniform`` over ``(lo, hi)``; returns exactly ``lo`` when the range is a point (no drift)."""
    lo, hi = float(r[0]), float(r[1])
    if lo == hi:
        return lo if size is None else np.full(size, lo)
    return float(rng.uniform(lo, hi)) if size is None else rng.uniform(lo, hi, size)


def integer(rng: np.random.Generator, r: tuple[int, int]) -> int:
    """Uniform integer in the closed range ``[lo, hi]``."""
    return int(r[0]) if r[0] == r[1] else int(rng.integers(int(r[0]), int(r[1]) + 1))


def f32(x: Any) -> list[float]:
    """Values rounded to float32 (the dtype MuJoCo stores colours in) as plain floats."""
    return np.asarray(x, np.float32).astype(np.float64).tolist()


def cached_nominal(world: Any, key: str, read: Callable[[mujoco.MjModel], dict[str, Any]]) -> dict[str, Any]:
    """The world's values before any randomization, read once and kept on the world object.

    Randomizing twice from the same world (re-sampling per episode without a rebuild) then never compounds.
    The cache is refreshed when the model's element counts changed (e.g. objects added and recompiled).
    """
    m = world.model
    sig = (m.ngeom, m.nbody, m.nv, m.nu, m.ncam, m.nq)
    cache = world.__dict__.setdefault("_randomization_nominal", {})
    if key not in cache or cache[key][0] != sig:
        cache[key] = (sig, read(m))
    return cache[key][1]


def _rot(axis: np.ndarray, angle: float) -> np.ndarray:
    q = np.zeros(4)
    mujoco.mju_axisAngle2Quat(q, np.asarray(axis, float), float(angle))
    return q


def render_cost_ms(shadows: bool, shadowsize: int, offsamples: int) -> float:
    """Estimated time per 128 px frame (ms, CPU EGL, measured here; see the module docstring)."""
    cost = 1.4 + 0.5 * offsamples
    if shadows:
        cost += 3.5 + 2.1 * (shadowsize / 1024) ** 2
    return round(cost, 2)


def _read_nominal(m: mujoco.MjModel) -> dict[str, Any]:
    lights = {}
    for i in range(m.nlight):
        name = m.light(i).name
        if not name.startswith(EXTRA_LIGHT):
            lights[name] = {"pos": m.light_pos[i].copy(), "dir": m.light_dir[i].copy(),
                            "diffuse": m.light_diffuse[i].copy(), "castshadow": bool(m.light_castshadow[i])}  # fmt: skip
    return {
        "lights": lights,
        "ambient": m.vis.headlight.ambient.copy(),
        "geom_rgba": m.geom_rgba.copy(),
        "cam_pos": m.cam_pos.copy(),
        "cam_quat": m.cam_quat.copy(),
        "cam_fovy": m.cam_fovy.copy(),
    }


# ---- sample ----------------------------------------------------------------------------------------------
def sample_perception(cfg: PerceptionRandomization, rng: np.random.Generator, world: Any) -> dict[str, Any]:
    """Draw every perception value of one episode (see the module docstring for the record's layout)."""
    nom = cached_nominal(world, "perception", _read_nominal)
    m = world.model
    rec: dict[str, Any] = {}

    # rendering quality first: the key light's castshadow follows it
    rs = world.__dict__.setdefault("_randomization_render0", world.render_settings)
    if cfg.randomize_render:
        shadows = bool(rng.random() < cfg.shadow_prob)
        lo, hi = (int(math.log2(s)) for s in cfg.shadowsize)
        size = 2 ** integer(rng, (lo, hi)) if shadows else int(cfg.shadowsize[0])
        size = int(np.clip(size, *cfg.shadowsize))
        offsamples = integer(rng, cfg.offsamples)
    else:
        shadows, size, offsamples = rs.shadows, rs.shadowsize, rs.offsamples
    rec["render"] = {"randomized": cfg.randomize_render, "shadows": shadows, "shadowsize": size,
                     "offsamples": offsamples, "est_ms_per_frame": render_cost_ms(shadows, size, offsamples)}  # fmt: skip

    n_extra = integer(rng, cfg.extra_lights)
    rec["extra_lights"] = n_extra
    lights: list[dict[str, Any]] = []
    bases = [(name, v) for name, v in nom["lights"].items()]
    for i in range(n_extra):
        az, el = rng.uniform(0, 2 * math.pi), rng.uniform(math.radians(30), math.radians(80))
        d = np.array([-math.cos(el) * math.cos(az), -math.cos(el) * math.sin(az), -math.sin(el)])
        bases.append((f"{EXTRA_LIGHT}{i}", {"pos": -2.5 * d, "dir": d, "diffuse": np.full(3, EXTRA_DIFFUSE),
                                           "castshadow": False}))  # fmt: skip
    for key in ("light_dir_jitter", "light_pos_jitter", "light_saturation", "light_intensity"):
        rec[key] = []
    for name, base in bases:
        angle = uniform(rng, cfg.light_dir_jitter)
        d = np.asarray(base["dir"], float)
        if angle != 0.0:
            axis = np.cross(d, rng.normal(size=3))
            q = _rot(axis / np.linalg.norm(axis), angle)
            out = np.zeros(3)
            mujoco.mju_rotVecQuat(out, d, q)
            d = out / np.linalg.norm(out)
        dpos = uniform(rng, cfg.light_pos_jitter, 3)
        sat = uniform(rng, cfg.light_saturation)
        hue = float(rng.uniform()) if sat > 0 else 0.0
        color = np.asarray(colorsys.hsv_to_rgb(hue, sat, 1.0))
        intensity = uniform(rng, cfg.light_intensity)
        rec["light_dir_jitter"].append(angle)
        rec["light_pos_jitter"].append(js(dpos))
        rec["light_saturation"].append(sat)
        rec["light_intensity"].append(intensity)
        lights.append({"name": name, "hue": hue, "color": color.tolist(),
                       "pos": (np.asarray(base["pos"], float) + dpos).tolist(), "dir": d.tolist(),
                       "diffuse": f32(np.asarray(base["diffuse"], float) * color * intensity),
                       "castshadow": bool(shadows) if cfg.randomize_render and name in nom["lights"]
                       else bool(base["castshadow"])})  # fmt: skip
    rec["lights"] = lights
    rec["ambient_scale"] = uniform(rng, cfg.ambient_scale)
    rec["headlight_ambient"] = f32(nom["ambient"] * rec["ambient_scale"])

    # colours: one rgb shift per object (all its geoms), one for the table and floor
    geom_rgba: dict[str, list[float]] = {}
    rec["object_rgb_delta"] = {}

    def shift(geom: str, delta: np.ndarray) -> None:
        gid = m.geom(geom).id
        rgba = nom["geom_rgba"][gid].astype(np.float64)
        rgba[:3] = np.clip(rgba[:3] + delta, 0.0, 1.0)
        geom_rgba[geom] = f32(rgba)

    for name, obj in world.objects.items():
        delta = uniform(rng, cfg.object_rgb_delta, 3)
        rec["object_rgb_delta"][name] = js(delta)
        for g in obj.geoms:
            shift(g, delta)
    delta = uniform(rng, cfg.table_rgb_delta, 3)
    rec["table_rgb_delta"] = js(delta)
    for g in [m.geom(i).name for i in range(m.ngeom)]:
        if g in SCENE_GEOMS or g.startswith("table_leg"):
            shift(g, delta)
    rec["geom_rgba"] = geom_rgba

    cams: dict[str, Any] = {}
    for key in ("camera_pos_jitter", "camera_rot_jitter", "fovy_jitter"):
        rec[key] = {}
    for cam in dict.fromkeys(world.cameras.values()):
        cid = m.camera(cam).id
        dpos, drot, dfov = (uniform(rng, cfg.camera_pos_jitter, 3), uniform(rng, cfg.camera_rot_jitter, 3),
                            uniform(rng, cfg.fovy_jitter))  # fmt: skip
        quat = nom["cam_quat"][cid].copy()
        if np.any(drot):
            angle = float(np.linalg.norm(drot))
            out = np.zeros(4)
            mujoco.mju_mulQuat(out, quat, _rot(drot / angle, angle))
            quat = out / np.linalg.norm(out)
        rec["camera_pos_jitter"][cam], rec["camera_rot_jitter"][cam] = js(dpos), js(drot)
        rec["fovy_jitter"][cam] = dfov
        fovy = float(np.clip(nom["cam_fovy"][cid] + dfov, 5.0, 170.0))
        cams[cam] = {"pos": (nom["cam_pos"][cid] + dpos).tolist(), "quat": quat.tolist(), "fovy": fovy}
    rec["cameras"] = cams

    rec["noise_std"] = uniform(rng, cfg.noise_std)
    rec["blur_sigma"] = uniform(rng, cfg.blur_sigma)
    rec["jpeg_quality"] = integer(rng, cfg.jpeg_quality)
    return rec


# ---- apply -----------------------------------------------------------------------------------------------
def apply_perception(world: Any, rec: dict[str, Any]) -> None:
    """Write a perception record into ``world`` (model, spec for added lights, render settings)."""
    extra = [light["name"] for light in rec["lights"] if light["name"].startswith(EXTRA_LIGHT)]
    names = {world.model.light(i).name for i in range(world.model.nlight)}
    missing = [n for n in extra if n not in names]
    if missing:  # structural change: add them to the spec and recompile (before any value is written)
        for n in missing:
            world.spec.worldbody.add_light(name=n, type=mujoco.mjtLightType.mjLIGHT_DIRECTIONAL,
                                           pos=[0, 0, 2.5], dir=[0, 0, -1], castshadow=False)  # fmt: skip
        world.recompile()
    m = world.model
    wanted = {light["name"] for light in rec["lights"]}
    for i in range(m.nlight):  # lights added for an earlier episode and not wanted now are switched off
        name = m.light(i).name
        if name.startswith(EXTRA_LIGHT) and name not in wanted:
            m.light_active[i] = False
    for light in rec["lights"]:
        lid = m.light(light["name"]).id
        m.light_active[lid] = True
        m.light_pos[lid] = light["pos"]
        m.light_dir[lid] = light["dir"]
        m.light_diffuse[lid] = light["diffuse"]
        m.light_castshadow[lid] = light["castshadow"]
    m.vis.headlight.ambient = rec["headlight_ambient"]
    for geom, rgba in rec["geom_rgba"].items():
        m.geom_rgba[m.geom(geom).id] = rgba
    for cam, c in rec["cameras"].items():
        cid = m.camera(cam).id
        m.cam_pos[cid], m.cam_quat[cid], m.cam_fovy[cid] = c["pos"], c["quat"], c["fovy"]

    r = rec["render"]
    new = dataclasses.replace(world.render_settings, shadows=r["shadows"], shadowsize=r["shadowsize"],
                              offsamples=r["offsamples"])  # fmt: skip
    size = r["shadowsize"] if r["shadows"] else 0
    if (new != world.render_settings or m.vis.quality.shadowsize != size
            or m.vis.quality.offsamples != r["offsamples"]):  # fmt: skip
        m.vis.quality.shadowsize = size
        m.vis.quality.offsamples = r["offsamples"]
        world.render_settings = new
        world.close()  # the GL context (shadow map, MSAA buffers) is rebuilt on the next render


# ---- observe ---------------------------------------------------------------------------------------------
def corrupt_image(img: np.ndarray, rec: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """Blur (optics), add Gaussian noise (sensor), JPEG-compress (transport); uint8 [H, W, 3] in and out."""
    sigma, std, quality = float(rec["blur_sigma"]), float(rec["noise_std"]), int(rec["jpeg_quality"])
    if sigma <= 0 and std <= 0 and quality >= 100:
        return img
    out = np.ascontiguousarray(img, dtype=np.uint8)
    if sigma > 0:
        out = np.asarray(Image.fromarray(out).filter(ImageFilter.GaussianBlur(radius=sigma)))
    if std > 0:
        noisy = out.astype(np.float32) + np.float32(std) * rng.standard_normal(out.shape, dtype=np.float32)
        out = np.clip(np.rint(noisy), 0, 255).astype(np.uint8)
    if quality < 100:
        buf = io.BytesIO()
        Image.fromarray(out).save(buf, format="JPEG", quality=quality)
        buf.seek(0)
        out = np.asarray(Image.open(buf).convert("RGB"))
    return out


__all__ = [
    "PerceptionRandomization",
    "apply_perception",
    "corrupt_image",
    "render_cost_ms",
    "sample_perception",
]
