"""Canonical data types shared by every layer: the standardized frame and the training/serving ``Batch``.

Shape conventions (B = batch, T = observation history ``T_obs``, H = action-chunk length, S/A = state/action
width padded to the batch maximum, h/w = image height/width):

* ``images[slot]``      uint8   ``[B, T, h, w, 3]`` (channels last, RGB, 0..255)
* ``image_mask[slot]``  bool    ``[B]``            True where the sample has this camera slot
* ``state``             float32 ``[B, S]``         current (last) observation's state, zero-padded
* ``state_mask``        bool    ``[B, S]``         True on the sample's real state dims
* ``actions``           float32 ``[B, H, A]``      future action chunk, zero-padded on both axes
* ``action_mask``       bool    ``[B, A]``         True on the sample's real action dims
* ``action_is_pad``     bool    ``[B, H]``         True on steps past the end of the episode
* ``embodiment_id``     int64   ``[B]``            index into the model's embodiment table
* ``prompt``            list[str] of length B      language instruction
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: Camera slots every dataset's cameras are mapped onto.
IMAGE_SLOTS: tuple[str, ...] = ("primary", "secondary", "wrist", "left_wrist", "right_wrist")

# Batch key names (used by the loader, the model and the server).
IMAGES = "images"
IMAGE_MASK = "image_mask"
STATE = "state"
STATE_MASK = "state_mask"
ACTIONS = "actions"
ACTION_MASK = "action_mask"
ACTION_IS_PAD = "action_is_pad"
PROMPT = "prompt"
EMBODIMENT_ID = "embodiment_id"


class ShapeError(ValueError):
    """A tensor/array has the wrong shape or dtype; the message names the key, expected and received."""


def check_array(key: str, value: Any, shape: tuple[int | None, ...], dtype: Any, where: str = "") -> None:
    """Validate ``value`` (numpy array or torch tensor) against ``shape`` (None = any size) and ``dtype``.

    Raises ``ShapeError`` naming ``key`` (and ``where``, e.g. a file or episode) with what was expected and received.
    """
    loc = f" in {where}" if where else ""
    if not isinstance(value, np.ndarray | torch.Tensor):
        raise ShapeError(
            f"{key}{loc}: expected an array of dtype {dtype} and shape {_fmt(shape)}, got {type(value).__name__}"
        )
    got_shape = tuple(value.shape)
    if len(got_shape) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got_shape)):
        raise ShapeError(
            f"{key}{loc}: expected shape {_fmt(shape)}, got {list(got_shape)} (dtype {value.dtype})"
        )
    if dtype is not None and value.dtype != dtype:
        want = np.dtype(dtype) if isinstance(value, np.ndarray) else dtype
        raise ShapeError(f"{key}{loc}: expected dtype {want}, got {value.dtype} (shape {list(got_shape)})")


def _fmt(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


@dataclass
class Frame:
    """One standardized time step of one episode (what ``standardize`` produces from a raw dataset frame).

    ``images[slot]`` uint8 ``[h, w, 3]`` for the slots the dataset has; ``state`` float32 ``[S]`` and ``action``
    float32 ``[A]`` in the embodiment's field order (see ``EmbodimentSpec``); ``prompt`` the instruction.
    """

    images: dict[str, np.ndarray]
    state: np.ndarray
    action: np.ndarray
    prompt: str
    embodiment: str
    dataset: str = ""
    episode: int = 0
    frame: int = 0
    timestamp: float = 0.0

    def validate(self, state_dim: int | None = None, action_dim: int | None = None) -> None:
        where = f"{self.dataset or 'frame'} episode {self.episode} frame {self.frame}"
        for slot, img in self.images.items():
            if slot not in IMAGE_SLOTS:
                raise ShapeError(
                    f"images[{slot!r}] in {where}: unknown camera slot; expected one of {IMAGE_SLOTS}"
                )
            check_array(f"images[{slot!r}]", img, (None, None, 3), np.uint8, where)
        check_array("state", self.state, (state_dim,), np.float32, where)
        check_array("action", self.action, (action_dim,), np.float32, where)
        if not isinstance(self.prompt, str):
            raise ShapeError(f"prompt in {where}: expected str, got {type(self.prompt).__name__}")

    def summary(self) -> dict[str, Any]:
        """A JSON-serializable view (images summarized by shape and mean), used by ``vla data show``."""
        return {
            "embodiment": self.embodiment,
            "prompt": self.prompt,
            "state": self.state.tolist(),
            "action": self.action.tolist(),
            "images": {k: image_summary(v) for k, v in self.images.items()},
        }


def image_summary(img: np.ndarray) -> dict[str, Any]:
    """``{"shape": [H, W, C], "mean": mean pixel value (0-255)}`` of a decoded uint8 image."""
    return {"shape": list(img.shape), "mean": float(np.asarray(img, dtype=np.float64).mean())}


@dataclass
class Batch:
    """A collated, possibly mixed-embodiment batch (see the module docstring for shapes).

    ``meta`` carries per-sample bookkeeping that the model ignores (dataset name, episode, frame).
    """

    images: dict[str, torch.Tensor]
    image_mask: dict[str, torch.Tensor]
    state: torch.Tensor
    state_mask: torch.Tensor
    actions: torch.Tensor
    action_mask: torch.Tensor
    action_is_pad: torch.Tensor
    prompt: list[str]
    embodiment_id: torch.Tensor
    meta: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.embodiment_id.shape[0])

    def rows(self, sel: slice) -> Batch:
        """The samples ``sel`` of this batch (every camera slot kept, present or not; per-sample ``meta`` too)."""
        return Batch(
            images={k: v[sel] for k, v in self.images.items()},
            image_mask={k: v[sel] for k, v in self.image_mask.items()},
            state=self.state[sel],
            state_mask=self.state_mask[sel],
            actions=self.actions[sel],
            action_mask=self.action_mask[sel],
            action_is_pad=self.action_is_pad[sel],
            prompt=self.prompt[sel],
            embodiment_id=self.embodiment_id[sel],
            meta={
                k: v[sel] for k, v in self.meta.items() if isinstance(v, list) and len(v) == self.batch_size
            },
        )

    def validate(self) -> None:
        """Check every key's shape and dtype against the contract; raises ``ShapeError`` naming the key."""
        b = self.batch_size
        check_array(EMBODIMENT_ID, self.embodiment_id, (b,), torch.int64)
        if set(self.images) != set(self.image_mask):
            raise ShapeError(
                f"images and image_mask must have the same slots, got {sorted(self.images)} vs {sorted(self.image_mask)}"
            )
        t = None
        for slot, img in self.images.items():
            if slot not in IMAGE_SLOTS:
                raise ShapeError(f"images[{slot!r}]: unknown camera slot; expected one of {IMAGE_SLOTS}")
            check_array(f"images[{slot!r}]", img, (b, t, None, None, 3), torch.uint8)
            t = int(img.shape[1])
            check_array(f"image_mask[{slot!r}]", self.image_mask[slot], (b,), torch.bool)
        check_array(STATE, self.state, (b, None), torch.float32)
        s = int(self.state.shape[1])
        check_array(STATE_MASK, self.state_mask, (b, s), torch.bool)
        check_array(ACTIONS, self.actions, (b, None, None), torch.float32)
        h, a = int(self.actions.shape[1]), int(self.actions.shape[2])
        check_array(ACTION_MASK, self.action_mask, (b, a), torch.bool)
        check_array(ACTION_IS_PAD, self.action_is_pad, (b, h), torch.bool)
        if len(self.prompt) != b or not all(isinstance(p, str) for p in self.prompt):
            raise ShapeError(
                f"{PROMPT}: expected a list of {b} strings, got {type(self.prompt).__name__} of length {len(self.prompt)}"
            )

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """This batch with ``fn`` applied to every tensor (prompt and meta kept as they are)."""
        return Batch(
            images={k: fn(v) for k, v in self.images.items()},
            image_mask={k: fn(v) for k, v in self.image_mask.items()},
            state=fn(self.state),
            state_mask=fn(self.state_mask),
            actions=fn(self.actions),
            action_mask=fn(self.action_mask),
            action_is_pad=fn(self.action_is_pad),
            prompt=list(self.prompt),
            embodiment_id=fn(self.embodiment_id),
            meta=self.meta,
        )

    def pin_memory(self) -> Batch:
        """This batch with every tensor in page-locked host memory (what ``DataLoader(pin_memory=True)`` calls on
        each batch), so copies to a CUDA device run asynchronously. Needs an accelerator."""
        return self._map(torch.Tensor.pin_memory)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Move every tensor to ``device`` (prompt and meta are kept as they are)."""
        return self._map(lambda x: x.to(device, non_blocking=non_blocking))


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``x`` on ``device``. A host-to-device copy does not make the host wait for the device's queued work (a
    blocking copy synchronizes the CUDA stream: the model's several per forward stalled the host mid-step). Safe
    from pageable memory too (CUDA stages it before returning); from a pinned batch the copy is fully async."""
    return x.to(device, non_blocking=x.device.type == "cpu")


class ObservationError(ShapeError):
    """An observation does not fit the embodiment it names; the message names the key and the fix."""


@dataclass
class Observation:
    """One robot's observation at one control step, in the robot's own units (serving and closed-loop eval).

    * ``images[slot]`` uint8 ``[h, w, 3]`` (the current frame, any size: it is resized exactly as the loader
      resizes) or ``[T, h, w, 3]`` (an observation history, oldest first); ``slot`` is one of ``IMAGE_SLOTS``
      and one of the embodiment's camera slots; a slot the robot has but the observation lacks is masked out
    * ``state``  float ``[S]`` in the embodiment spec's state order and units
    * ``prompt`` the language instruction; ``embodiment`` the name of the robot's spec
    """

    images: dict[str, np.ndarray]
    state: np.ndarray
    prompt: str
    embodiment: str

    def validate(self, spec: Any) -> None:
        """Check every field against ``spec`` (an ``EmbodimentSpec``); raises ``ObservationError`` naming the key,
        what was expected and what was received."""
        where = f"observation for {self.embodiment!r}"
        if self.embodiment != spec.name:
            raise ObservationError(f"{where}: validated against spec {spec.name!r}")
        if not isinstance(self.prompt, str):
            raise ObservationError(f"prompt in {where}: expected str, got {type(self.prompt).__name__}")
        if not isinstance(self.images, dict):
            raise ObservationError(
                f"images in {where}: expected a dict of camera slot -> image, got {type(self.images).__name__}"
            )
        for slot, img in self.images.items():
            if slot not in spec.cameras:
                raise ObservationError(
                    f"images[{slot!r}] in {where}: the robot has no camera slot {slot!r}; its slots are "
                    f"{sorted(spec.cameras)}"
                )
            if not isinstance(img, np.ndarray) or img.ndim not in (3, 4) or img.shape[-1] != 3:
                got = f"shape {list(img.shape)}" if hasattr(img, "shape") else type(img).__name__
                raise ObservationError(
                    f"images[{slot!r}] in {where}: expected uint8 [h, w, 3] or [T, h, w, 3] (RGB, channels last), "
                    f"got {got}"
                )
            if img.dtype != np.uint8:
                raise ObservationError(
                    f"images[{slot!r}] in {where}: expected dtype uint8 (0..255), got {img.dtype}; convert "
                    "float images with (img * 255).round().astype(np.uint8)"
                )
            if min(img.shape[-3:-1]) < 1 or img.shape[0] < 1:
                raise ObservationError(f"images[{slot!r}] in {where}: empty image of shape {list(img.shape)}")
        state = self.state
        if not isinstance(state, np.ndarray) or state.ndim != 1 or state.shape[0] != spec.state_dim:
            got = f"shape {list(state.shape)}" if hasattr(state, "shape") else type(state).__name__
            raise ObservationError(
                f"state in {where}: expected [{spec.state_dim}] ({', '.join(spec.state_names())}), got {got}"
            )
        if not np.issubdtype(state.dtype, np.floating) and not np.issubdtype(state.dtype, np.integer):
            raise ObservationError(f"state in {where}: expected a float array, got dtype {state.dtype}")
        values = state.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            names = spec.state_names()
            raise ObservationError(
                f"state in {where}: non-finite value(s) at {[names[i] for i in bad]}: {state[bad].tolist()}"
            )
        # the model runs float32: a larger value would turn into inf there and come back as unsafe actions
        huge = np.flatnonzero(np.abs(values) > np.finfo(np.float32).max)
        if huge.size:
            names = spec.state_names()
            raise ObservationError(
                f"state in {where}: value(s) at {[names[i] for i in huge]} beyond float32's range "
                f"(|x| <= {float(np.finfo(np.float32).max):.4g}): {state[huge].tolist()}"
            )
