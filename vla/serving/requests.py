"""A decoded request (msgpack or JSON map) -> ``Observation``: the key layouts clients already speak.

Accepted layouts (one per request; ``prompt`` str or UTF-8 bytes; ``embodiment`` picks the head when the server
serves several; optional ``seed`` int fixes the flow noise of this request):

* canonical   ``images: {slot: [h, w, 3] | [T, h, w, 3]}`` with our slots (``primary``, ``secondary``, ``wrist``,
  ``left_wrist``, ``right_wrist``), ``state: [S]``
* openpi LIBERO  ``observation/image`` -> primary, ``observation/wrist_image`` -> wrist, ``observation/state``
* openpi DROID   ``observation/exterior_image_1_left`` -> primary, ``observation/exterior_image_2_left`` ->
  secondary, ``observation/wrist_image_left`` -> wrist, state = ``observation/joint_position`` [7] followed by
  ``observation/gripper_position`` [1]
* openpi ALOHA   ``images: {cam_high, cam_low, cam_left_wrist, cam_right_wrist}`` (channel-first [3, h, w] as
  openpi's ALOHA clients send, or channel-last) -> primary, secondary, left_wrist, right_wrist; ``state: [14]``
* OpenVLA REST   ``image`` -> primary, ``instruction`` as the prompt (plus ``state``)

Images may be channel-first ``[3, h, w]`` in any layout (transposed here); the ``Policy`` resizes them with the
loader's transform. Any other key, a missing one, or a limit broken raises ``RequestError`` naming the key and
what is accepted; the ``Observation`` is then validated against the embodiment's spec by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vla.types import IMAGE_SLOTS, Observation

LIBERO_IMAGES = {"observation/image": "primary", "observation/wrist_image": "wrist"}
DROID_IMAGES = {
    "observation/exterior_image_1_left": "primary",
    "observation/exterior_image_2_left": "secondary",
    "observation/wrist_image_left": "wrist",
}
ALOHA_IMAGES = {
    "cam_high": "primary",
    "cam_low": "secondary",
    "cam_left_wrist": "left_wrist",
    "cam_right_wrist": "right_wrist",
}
_COMMON = ("prompt", "embodiment", "seed")


class RequestError(ValueError):
    """A request's keys or values do not form an observation; the message names the key and the fix."""


@dataclass(frozen=True)
class Limits:
    """What one request may carry (``vla serve`` flags); each refusal names the limit and the flag."""

    max_frame_bytes: int = 64 * 2**20
    max_prompt_chars: int = 2000
    max_image_side: int = 4096
    max_history: int = 16


def expected_keys(cameras: list[str], state_dim: int) -> dict[str, list[str]]:
    """Per layout, the keys a request for a robot with these camera slots uses (sent in the metadata frame)."""
    layouts = {"canonical": [*(f"images/{s}" for s in cameras), "state", "prompt"]}
    libero = [k for k, s in LIBERO_IMAGES.items() if s in cameras]
    if "primary" in cameras:
        layouts["libero"] = [*libero, "observation/state", "prompt"]
    droid = [k for k, s in DROID_IMAGES.items() if s in cameras]
    if "primary" in cameras and state_dim == 8:
        layouts["droid"] = [*droid, "observation/joint_position", "observation/gripper_position", "prompt"]
    aloha = [f"images/{k}" for k, s in ALOHA_IMAGES.items() if s in cameras]
    if aloha:
        layouts["aloha"] = [*aloha, "state", "prompt"]
    return layouts


def to_observation(
    msg: Any, embodiments: list[str], limits: Limits, *, default: str | None = None
) -> tuple[Observation, int | None]:
    """The ``Observation`` and optional noise seed of one decoded request (not yet validated against a spec)."""
    if not isinstance(msg, dict):
        raise RequestError(f"a request must be a map of observation keys, got {type(msg).__name__}")
    msg = {(k.decode("utf-8", "replace") if isinstance(k, bytes) else k): v for k, v in msg.items()}
    embodiment = _embodiment(msg.get("embodiment"), embodiments, default)
    prompt = _prompt(msg.get("prompt", msg.get("instruction")), limits)
    seed = _seed(msg.get("seed"))
    keys = set(msg) - {*_COMMON, "instruction"}
    if keys & set(LIBERO_IMAGES) or "observation/state" in keys:
        images, state = _libero(msg, keys)
    elif keys & set(DROID_IMAGES) or "observation/joint_position" in keys:
        images, state = _droid(msg, keys)
    # OpenVLA's deploy payload; its unnorm_key is taken and ignored: the server's stats apply
    elif "image" in keys:
        _only(keys, {"image", "state", "unnorm_key"}, "an OpenVLA-style")
        images, state = {"primary": msg["image"]}, _required(msg, "state")
    else:
        _only(keys, {"images", "state"}, "a canonical/ALOHA")
        images, state = _images_dict(_required(msg, "images")), _required(msg, "state")
    images = {slot: _image(f"image for slot {slot!r}", img, limits) for slot, img in images.items()}
    return Observation(images=images, state=_state(state), prompt=prompt, embodiment=embodiment), seed


# ---- steps -----------------------------------------------------------------------------------------------------
def _embodiment(value: Any, served: list[str], default: str | None) -> str:
    if value is None:
        if default is not None:
            return default
        raise RequestError(f"missing key 'embodiment': this server serves {served}; name one per request")
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str) or value not in served:
        raise RequestError(f"unknown embodiment {value!r}: this server serves {served}")
    return value


def _prompt(value: Any, limits: Limits) -> str:
    if value is None:
        raise RequestError("missing key 'prompt': send the language instruction as a str")
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("'prompt' bytes are not valid UTF-8") from None
    if isinstance(value, np.ndarray) and value.dtype.kind in "SU" and value.size == 1:
        value = str(value.item())
    if not isinstance(value, str):
        raise RequestError(f"'prompt' must be a str (or UTF-8 bytes), got {type(value).__name__}")
    if len(value) > limits.max_prompt_chars:
        raise RequestError(
            f"'prompt' has {len(value)} characters, over the limit of {limits.max_prompt_chars} "
            "(the server's --max-prompt-chars)"
        )
    return value


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, np.integer):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise RequestError(f"'seed' must be an int in [0, 2**63), got {value!r}")
    return value


def _only(keys: set[str], allowed: set[str], layout: str) -> None:
    extra = sorted(keys - allowed, key=str)  # a msgpack map may have int keys next to str ones
    if extra:
        raise RequestError(
            f"unexpected key(s) {extra} in {layout} request; accepted keys are {sorted(allowed)} plus "
            f"{list(_COMMON)} (see the server's metadata frame 'observation_keys')"
        )


def _required(msg: dict[str, Any], key: str) -> Any:
    if key not in msg:
        raise RequestError(f"missing key {key!r} (see the server's metadata frame 'observation_keys')")
    return msg[key]


def _libero(msg: dict[str, Any], keys: set[str]) -> tuple[dict[str, Any], Any]:
    _only(keys, {*LIBERO_IMAGES, "observation/state"}, "a LIBERO-style")
    images = {LIBERO_IMAGES[k]: msg[k] for k in LIBERO_IMAGES if k in msg}
    _some_image(images, LIBERO_IMAGES, "LIBERO-style")
    return images, _required(msg, "observation/state")


def _droid(msg: dict[str, Any], keys: set[str]) -> tuple[dict[str, Any], Any]:
    _only(
        keys, {*DROID_IMAGES, "observation/joint_position", "observation/gripper_position"}, "a DROID-style"
    )
    images = {DROID_IMAGES[k]: msg[k] for k in DROID_IMAGES if k in msg}
    _some_image(images, DROID_IMAGES, "DROID-style")
    joints = _state(_required(msg, "observation/joint_position"), "observation/joint_position")
    gripper = _state(
        _required(msg, "observation/gripper_position"), "observation/gripper_position", scalar=True
    )
    for key, part in (("observation/joint_position", joints), ("observation/gripper_position", gripper)):
        if part.ndim != 1:  # the two are joined into one state vector
            raise RequestError(
                f"'{key}' must be a 1-D float array (joint_position [7], gripper_position [1] or one number), "
                f"got shape {list(part.shape)}"
            )
    return images, np.concatenate([joints, gripper])


def _some_image(images: dict[str, Any], layout_keys: dict[str, str], layout: str) -> None:
    """A request without any image would run the model blind (every camera masked): refused, as the canonical
    layout's empty ``images`` is."""
    if not images:
        raise RequestError(f"a {layout} request needs at least one image, under {list(layout_keys)}")


def _images_dict(images: Any) -> dict[str, Any]:
    if not isinstance(images, dict) or not images:
        raise RequestError(
            f"'images' must be a non-empty map of camera -> image, got {type(images).__name__}"
        )
    names = [k.decode() if isinstance(k, bytes) else k for k in images]
    values = list(images.values())
    if all(n in ALOHA_IMAGES for n in names):
        return {ALOHA_IMAGES[n]: v for n, v in zip(names, values)}
    unknown = [n for n in names if n not in IMAGE_SLOTS]
    if unknown:
        raise RequestError(
            f"unknown camera(s) {unknown} in 'images': use the slots {list(IMAGE_SLOTS)} "
            f"(or openpi's ALOHA names {list(ALOHA_IMAGES)})"
        )
    return dict(zip(names, values))


def _image(what: str, img: Any, limits: Limits) -> np.ndarray:
    if isinstance(img, list):  # JSON's plain nested lists of 0..255 ints
        img = _uint8_list(what, img)
    if not isinstance(img, np.ndarray):
        raise RequestError(f"{what}: expected a uint8 numpy array [h, w, 3], got {type(img).__name__}")
    if img.ndim in (3, 4) and img.shape[-1] != 3 and img.shape[-3] == 3:  # channel-first [.., 3, h, w]
        img = np.moveaxis(img, -3, -1)
    if img.ndim == 4 and img.shape[0] > limits.max_history:
        raise RequestError(
            f"{what}: history of {img.shape[0]} frames, over the limit of {limits.max_history}"
        )
    if img.ndim >= 2 and max(img.shape[-3:-1]) > limits.max_image_side:
        raise RequestError(
            f"{what}: {img.shape[-3]}x{img.shape[-2]} pixels, over the limit of {limits.max_image_side} per side "
            "(the server's --max-image-side); downscale on the robot"
        )
    return np.require(img, requirements=["C", "W"])  # frames decoded off the wire are read-only views


def _uint8_list(what: str, value: list[Any]) -> np.ndarray | list[Any]:
    try:
        arr = np.asarray(value)
    except ValueError:
        raise RequestError(f"{what}: nested lists of unequal lengths") from None
    if arr.dtype.kind not in "iu" or (arr.size and (arr.min() < 0 or arr.max() > 255)):
        raise RequestError(f"{what}: a list image must hold ints in 0..255, got dtype {arr.dtype}")
    return arr.astype(np.uint8)


def _state(value: Any, key: str = "state", *, scalar: bool = False) -> np.ndarray:
    """``value`` as a number array (``scalar``: a single number becomes ``[1]``); a list of non-numbers or a ragged
    list is a ``RequestError`` naming ``key`` (the shape is checked against the spec by ``Observation.validate``)."""
    if isinstance(value, list | tuple | int | float) and not isinstance(value, bool):
        # every leaf a number: a float64 conversion would parse strings ("1_0" is 10.0) and take bools and bytes
        try:
            value = np.asarray(value) if _numbers_only(value) else None
        except ValueError:  # ragged nesting
            value = None
        if value is None or value.dtype.kind not in "iuf":
            raise RequestError(
                f"'{key}' must be a flat list of numbers (a float array [S]); got a list holding non-numbers "
                f"(strings, bools, bytes), nested lists of unequal lengths, or nested over {_MAX_LIST_DEPTH} deep"
            ) from None
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf":
        kind = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
        raise RequestError(f"'{key}' must be a float array, got {kind}")
    if scalar and value.ndim == 0:
        value = value.reshape(1)
    return value


#: deepest nesting of a list state accepted ([S], [T, S] and a little room): a deeper one is refused before numpy
#: or a recursive walk meets it (a 330-deep list made a RecursionError, a 500 and 100 KB of log per request)
_MAX_LIST_DEPTH = 4


def _numbers_only(value: Any) -> bool:
    """Whether every leaf of nested lists/tuples (at most ``_MAX_LIST_DEPTH`` deep) is an int or float (not a
    bool), or a numpy array of ints or floats (e.g. a 0-d gripper value next to the joints). Iterative: no depth
    reaches Python's recursion limit."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, list | tuple):
            if depth >= _MAX_LIST_DEPTH:
                return False
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, np.ndarray):
            if v.dtype.kind not in "iuf":
                return False
        elif not isinstance(v, int | float | np.integer | np.floating) or isinstance(v, bool | np.bool_):
            return False
    return True
