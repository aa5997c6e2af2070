"""``Policy``: a checkpoint plus the exact preprocessing it was trained with, turning robot observations into action
chunks in the robot's units. The server, the in-process policy and closed-loop evaluation all go through it, so
training and serving cannot drift apart:

* images are resized by ``vla.data.transforms.resize_images`` (the loader's own function) to the checkpoint's
  image size, and an observation history shorter than the checkpoint's is padded by repeating its oldest frame
  (what the loader does at an episode start);
* the state is normalized, and the predicted chunk unnormalized, with the stats *saved in the checkpoint*
  (``norm_stats.json``, keyed as training keyed them: ``preprocessing.json``'s ``stats_keys``), never with
  defaults of the caller;
* samples are collated by ``vla.data.collate.collate`` into the same ``Batch`` the loader produces.

Output safety: a chunk with NaN/inf is an ``ActionSafetyError`` (never actions); finite values are clamped to the
spec's per-dim action limits and the clamps are counted per dim (``ActionChunk.clamped``).

Noise: each sample's flow noise ``[H_max, A_max]`` comes from its own ``torch.Generator`` seeded with the
request's seed, so a sample's chunk does not depend on what else is in its batch (micro-batched == one by one).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import torch

from vla.data.collate import collate
from vla.data.normalize import Normalizer, Unnormalizer
from vla.data.transforms import resize_images
from vla.models.run_dir import display_name
from vla.types import Batch, Observation, ObservationError

if TYPE_CHECKING:
    from vla.embodiments.spec import EmbodimentSpec
    from vla.models.policies.flow_vla import FlowVLA
    from vla.predict import Preprocessing


log = logging.getLogger(__name__)


class AmbiguousStatsError(ValueError):
    """An embodiment was trained on several datasets, each normalized with its own stats, and none was picked."""


class ActionSafetyError(RuntimeError):
    """The model produced a non-finite action chunk; such a chunk is never returned to a robot."""


@dataclass
class ActionChunk:
    """One predicted chunk.

    * ``actions`` float32 ``[H, A]`` in the robot's units, clamped to the spec's action limits
    * ``clamped`` int64 ``[A]``: how many of the ``H`` values of each action dim were clamped
    """

    actions: np.ndarray
    embodiment: str
    clamped: np.ndarray


@dataclass(frozen=True)
class _Transforms:
    """Per-embodiment preprocessing: the checkpoint's settings and the state/action normalizer pair."""

    spec: EmbodimentSpec
    pre: Preprocessing
    state: Normalizer | None
    action: Unnormalizer | None
    low: np.ndarray  # [A] float64 action limits (±inf where unbounded)
    high: np.ndarray


class Policy:
    """A checkpoint + its training preprocessing: ``Observation`` -> ``ActionChunk`` (see the module docstring)."""

    def __init__(
        self,
        model: FlowVLA,
        *,
        embodiments: Sequence[str] | None = None,
        stats_datasets: dict[str, str] | None = None,
        num_steps: int | None = None,
        name: str = "",
    ) -> None:
        self.model = model
        self.name = name
        self.num_steps = num_steps
        self.device = model.embodiment_tokens.weight.device
        served = list(embodiments) if embodiments is not None else _default_embodiments(model, name)
        unknown = [e for e in served if e not in model.embodiment_ids]
        if unknown:
            raise ValueError(
                f"{name or 'checkpoint'}: no embodiment {unknown} in this checkpoint; it has "
                f"{sorted(model.embodiment_ids)}"
            )
        if not served:
            raise ValueError(f"{name or 'checkpoint'}: no embodiment to serve")
        chosen = stats_datasets or {}
        unknown = sorted(set(chosen) - set(model.embodiment_ids))
        if unknown:
            raise ValueError(
                f"{name or 'checkpoint'}: stats dataset chosen for {unknown}, which this checkpoint does not have; "
                f"it has {sorted(model.embodiment_ids)}"
            )
        self._transforms = {}
        for e in served:
            try:
                self._transforms[e] = _transforms(model, e, chosen.get(e), name)
            except AmbiguousStatsError as err:
                if embodiments is not None:  # asked for by name: refused
                    raise
                log.warning("%s; %r is not served", err, e)  # the others still can be
        if not self._transforms:
            raise ValueError(
                f"{name or 'checkpoint'}: no embodiment can be served without choosing stats: "
                f"{[e for e in served if e not in chosen]} each have several datasets' own stats "
                "(vla serve --stats-dataset EMBODIMENT=DATASET; Policy(..., stats_datasets={...}))"
            )
        self.embodiments = list(self._transforms)
        self._max_horizon = int(model.chunk_lengths.max())

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        embodiments: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        compile: bool = False,
        attention: str = "sdpa",
        num_steps: int | None = None,
        stats_datasets: dict[str, str] | None = None,
    ) -> Policy:
        """Load ``path`` (a checkpoint folder, a ``vla train`` run or step folder, a merged or adapter export) ready
        for inference in ``dtype`` (compiled graphs with ``compile``, attention kernel ``attention``: "sdpa" or
        "explicit", see ``FlowVLA.prepare_inference``). ``embodiments`` defaults to every
        embodiment of the checkpoint that has stats; one named explicitly without stats is an error here, at load
        time, not at the first request. ``stats_datasets`` picks, per embodiment, the dataset whose own stats to
        use when training normalized several datasets of that embodiment with their own stats."""
        from vla.models.hub import from_pretrained
        from vla.models.lora import has_lora, merge_lora
        from vla.models.run_dir import resolve_checkpoint

        ckpt = resolve_checkpoint(path)
        model = from_pretrained(ckpt, map_location=device)
        if has_lora(model):  # an adapter checkpoint: serve the merged weights (same outputs, plain modules)
            model = merge_lora(model)
        model.prepare_inference(dtype, compile=compile, attention=attention)
        return cls(
            model, embodiments=embodiments, stats_datasets=stats_datasets, num_steps=num_steps, name=str(ckpt)
        )

    # ---- description -----------------------------------------------------------------------------------------
    def spec(self, name: str) -> EmbodimentSpec:
        return self._get(name).spec

    def chunk_length(self, name: str) -> int:
        """``H``: the number of actions a chunk of ``name`` has."""
        return self._get(name).pre.chunk_length

    def metadata(self) -> dict[str, Any]:
        """JSON-able description of what is served: per embodiment its spec, chunk length, control rate, state and
        action names and camera slots; the model's image size and observation history."""
        first = self._transforms[self.embodiments[0]].pre
        out: dict[str, Any] = {
            # no server paths to clients: the run/step or folder name
            "model": display_name(self.name) if self.name else "",
            "image_size": first.image_size,
            "obs_history": first.obs_history,
            "embodiments": {},
        }
        for name, tr in self._transforms.items():
            spec = tr.spec
            out["embodiments"][name] = {
                "spec": spec.to_dict(),
                "chunk_length": tr.pre.chunk_length,
                "control_hz": spec.control_hz,
                "state_dim": spec.state_dim,
                "action_dim": spec.action_dim,
                "state_names": spec.state_names(),
                "action_names": spec.action_names(),
                "cameras": sorted(spec.cameras),
            }
        return out

    def _get(self, name: str) -> _Transforms:
        tr = self._transforms.get(name)
        if tr is None:
            raise ObservationError(
                f"embodiment {name!r} is not served here; served: {self.embodiments}"
                + (
                    " (the checkpoint has it but it was not selected)"
                    if name in self.model.embodiment_ids
                    else ""
                )
            )
        return tr

    # ---- observation -> model input --------------------------------------------------------------------------
    def prepare(self, observations: Sequence[Observation]) -> Batch:
        """The model input for ``observations`` (validated): images resized as the loader resizes them, history
        padded to the checkpoint's, state normalized with the checkpoint's stats; collated like a loader batch
        (``actions`` are zeros, marked as padding)."""
        if not observations:
            raise ValueError("Policy.prepare: no observations")
        samples = [self._sample(obs) for obs in observations]
        batch = collate(samples, self.model.embodiment_ids)
        assert isinstance(batch, Batch)
        return batch

    def check(self, obs: Observation) -> None:
        """Refuse ``obs`` (``ObservationError`` naming the field) where ``infer`` would: its spec's shapes and
        finiteness, and a state that overflows float32 once normalized. A server checks each request with this
        before queueing it, so one bad request never fails a batch of others."""
        self._checked(obs)

    def _checked(self, obs: Observation) -> tuple[_Transforms, np.ndarray]:
        """``obs``'s transforms and its state as the model reads it (float32 ``[S]``, normalized with the
        checkpoint's stats), or the ``ObservationError`` that refuses it."""
        if not isinstance(obs, Observation):
            raise ObservationError(f"expected a vla.types.Observation, got {type(obs).__name__}")
        tr = self._get(obs.embodiment)
        obs.validate(tr.spec)
        state = np.asarray(obs.state, dtype=np.float32)
        if tr.state is None:
            return tr, state
        with np.errstate(over="ignore"):
            state = np.asarray(tr.state(state.astype(np.float64)), dtype=np.float32)
        if not np.isfinite(state).all():  # in float32 range, but not once divided by a tiny spread
            names = [tr.spec.state_names()[i] for i in np.flatnonzero(~np.isfinite(state))]
            raise ObservationError(
                f"state in observation for {obs.embodiment!r}: value(s) at {names} overflow float32 once "
                f"normalized with the checkpoint's stats: {np.asarray(obs.state)[~np.isfinite(state)].tolist()}"
            )
        return tr, state

    def _sample(self, obs: Observation) -> dict[str, Any]:
        tr, state = self._checked(obs)
        t_obs = tr.pre.obs_history
        images = {}
        for slot, img in obs.images.items():
            frames = img[None] if img.ndim == 3 else img  # [T, h, w, 3]
            if len(frames) < t_obs:  # the loader repeats the first frame before an episode start
                frames = np.concatenate([np.repeat(frames[:1], t_obs - len(frames), axis=0), frames])
            frames = frames[-t_obs:]
            if (
                not frames.flags.writeable or not frames.flags.c_contiguous
            ):  # torch wants its own writable memory
                frames = np.array(frames, copy=True, order="C")
            images[slot] = resize_images(frames, tr.pre.image_size)
        horizon, width = tr.pre.chunk_length, tr.spec.action_dim
        return {
            "images": images,
            "state": state,
            "actions": np.zeros((horizon, width), np.float32),
            "action_is_pad": np.ones(horizon, dtype=bool),
            "prompt": obs.prompt,
            "embodiment": obs.embodiment,
            "dataset": "",
            "episode": 0,
            "frame": 0,
        }

    # ---- inference -------------------------------------------------------------------------------------------
    def infer(self, obs: Observation, *, seed: int | None = None) -> ActionChunk:
        """One observation's chunk (see ``infer_batch``)."""
        return self.infer_batch([obs], seeds=[seed])[0]

    @overload
    def infer_batch(
        self,
        observations: Sequence[Observation],
        *,
        seeds: Sequence[int | None] | None = ...,
        return_exceptions: Literal[False] = ...,
    ) -> list[ActionChunk]: ...

    @overload
    def infer_batch(
        self,
        observations: Sequence[Observation],
        *,
        seeds: Sequence[int | None] | None = ...,
        return_exceptions: Literal[True],
    ) -> list[ActionChunk | ActionSafetyError]: ...

    def infer_batch(
        self,
        observations: Sequence[Observation],
        *,
        seeds: Sequence[int | None] | None = None,
        return_exceptions: bool = False,
    ) -> list[ActionChunk] | list[ActionChunk | ActionSafetyError]:
        """Chunks for ``observations`` (mixed embodiments and prompts) in one forward pass. ``seeds[i]`` seeds
        sample ``i``'s flow noise (None: a fresh random seed), so the result of a sample does not depend on the
        batch it ran in. A non-finite chunk raises ``ActionSafetyError``; with ``return_exceptions`` the error takes
        that sample's place in the list instead and the other samples' chunks are returned (samples never mix in
        the model, so one sample's failure says nothing about the others: a server answers them all from one
        pass)."""
        seeds = list(seeds) if seeds is not None else [None] * len(observations)
        if len(seeds) != len(observations):
            raise ValueError(f"infer_batch: {len(observations)} observations but {len(seeds)} seeds")
        batch = self.prepare(observations)
        noise = self._noise(seeds, batch)
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        with torch.inference_mode():
            out = self.model.sample_actions(batch, num_steps=self.num_steps, noise=noise)  # [B, H_max, A_max]
        out = out.float().cpu().numpy()
        if not return_exceptions:
            return [self._chunk(obs, out[i]) for i, obs in enumerate(observations)]
        results: list[ActionChunk | ActionSafetyError] = []
        for i, obs in enumerate(observations):
            try:
                results.append(self._chunk(obs, out[i]))
            except ActionSafetyError as e:
                results.append(e)
        return results

    def _noise(self, seeds: Sequence[int | None], batch: Batch) -> torch.Tensor:
        """``[B, H, A_max]`` noise, each row from its own generator drawn at the model's full chunk length (so a
        row does not depend on the batch's horizon)."""
        rows = []
        for seed in seeds:
            gen = torch.Generator().manual_seed(int(seed) if seed is not None else secrets.randbits(63))
            rows.append(torch.randn((self._max_horizon, self.model.cfg.max_action_dim), generator=gen))
        horizon = int(self.model.chunk_lengths[batch.embodiment_id.to(self.model.chunk_lengths.device)].max())
        return torch.stack(rows)[:, :horizon]

    def _chunk(self, obs: Observation, predicted: np.ndarray) -> ActionChunk:
        """``predicted`` ``[H_max, A_max]`` (model units) -> the robot's clamped ``[H, A]``."""
        tr = self._transforms[obs.embodiment]
        actions = predicted[: tr.pre.chunk_length, : tr.spec.action_dim].astype(np.float64)
        if tr.action is not None and np.isfinite(actions).all():
            actions = np.asarray(tr.action(actions), dtype=np.float64)
        if not np.isfinite(actions).all():
            bad = sorted({tr.spec.action_names()[j] for j in np.argwhere(~np.isfinite(actions))[:, 1]})
            raise ActionSafetyError(
                f"{self.name or 'policy'}: non-finite action chunk for {obs.embodiment!r} (dims {bad}); no actions "
                "were returned"
            )
        clamped = ((actions < tr.low) | (actions > tr.high)).sum(axis=0).astype(np.int64)
        actions = np.clip(actions, tr.low, tr.high)
        return ActionChunk(actions=actions.astype(np.float32), embodiment=obs.embodiment, clamped=clamped)


# ---- construction helpers ----------------------------------------------------------------------------------------
def _default_embodiments(model: FlowVLA, name: str) -> list[str]:
    """Every embodiment of the checkpoint that can be served: with stats for state and action (or no
    normalization at all)."""
    from vla.predict import checkpoint_preprocessing

    out = []
    for emb in model.embodiment_ids:
        if not checkpoint_preprocessing(model, emb).normalize or _has_stats(model, emb):
            out.append(emb)
    if not out:
        raise ValueError(
            f"{name or 'checkpoint'}: none of its embodiments {sorted(model.embodiment_ids)} has normalization "
            "stats (norm_stats.json), so no action chunk can be turned into robot units. 'vla train' and "
            "'vla finetune' save them; for 'vla model init' pass --stats-from DATASET."
        )
    skipped = sorted(set(model.embodiment_ids) - set(out))
    if skipped:
        log.warning(
            "%s: not serving %s: no normalization stats for them in the checkpoint (norm_stats.json); "
            "serving %s",
            name or "checkpoint",
            skipped,
            out,
        )
    return out


def _has_stats(model: FlowVLA, emb: str) -> bool:
    """Stats for both fields under the embodiment's key or one of its per-dataset keys."""
    stats = model.norm_stats
    if stats is None:
        return False
    keys = [k for k in stats.stats if k == emb or k.startswith(f"{emb}@")]
    return any(all(f in stats.stats[k] for f in ("state", "action")) for k in keys)


def _stats_dataset(model: FlowVLA, emb: str, chosen: str | None, name: str) -> str | None:
    """Which dataset's own stats (``"<emb>@<dataset>"``) to use for ``emb``; None = the embodiment's.

    Training records per dataset which stats key it normalized with (``preprocessing.json`` ``stats_keys``).
    When every dataset of ``emb`` used its own key, serving must use one of them: the only one, or ``chosen``."""
    keys: dict[str, dict[str, str]] = (getattr(model, "preprocessing", None) or {}).get("stats_keys") or {}
    own = sorted(ds for ds, k in keys.items() if k.get("action") == f"{emb}@{ds}")
    shared = [ds for ds, k in keys.items() if k.get("action") == emb]
    if chosen is not None:
        if chosen not in own:
            raise ValueError(
                f"{name or 'checkpoint'}: no stats of dataset {chosen!r} for {emb!r}; datasets with their own stats: "
                f"{own or 'none'}"
            )
        return chosen
    if own and not shared:
        if len(own) == 1:
            return own[0]
        raise AmbiguousStatsError(
            f"{name or 'checkpoint'}: {emb!r} was trained on datasets {own}, each normalized with its own stats; "
            f"pick the one whose conventions the robot follows (vla serve --stats-dataset {emb}={own[0]}; "
            f"stats_datasets={{{emb!r}: {own[0]!r}}} in Python)"
        )
    return None


def _transforms(model: FlowVLA, emb: str, chosen: str | None, name: str) -> _Transforms:
    """The checkpoint's preprocessing for ``emb``; an embodiment without stats is refused here (load time)."""
    from vla.data.norm_stats import StatsError
    from vla.predict import checkpoint_preprocessing

    spec = model.spec(emb)
    pre = checkpoint_preprocessing(model, emb)
    low, high = spec.limits("action")
    state = action = None
    if pre.normalize:
        dataset = _stats_dataset(model, emb, chosen, name)
        if model.norm_stats is None:
            raise ValueError(
                f"{name or 'checkpoint'} has no normalization stats (norm_stats.json), so its outputs cannot be "
                f"turned into {emb!r} units. 'vla train' and 'vla finetune' save them; for 'vla model init' pass "
                "--stats-from DATASET."
            )
        try:
            state = Normalizer.from_spec(model.norm_stats, spec, "state", dataset=dataset, clip=pre.clip)
            action = Unnormalizer.from_spec(model.norm_stats, spec, "action", dataset=dataset)
        except StatsError as e:
            raise ValueError(f"{name or 'checkpoint'}: cannot serve {emb!r}: {e}") from None
    return _Transforms(spec=spec, pre=pre, state=state, action=action, low=low, high=high)


__all__ = ["ActionChunk", "ActionSafetyError", "AmbiguousStatsError", "Policy"]
