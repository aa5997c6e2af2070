"""``vla.policy.Policy``: observations -> action chunks with the checkpoint's own preprocessing.

Train/serve parity is checked against the training path itself: a stored frame goes through the loader
(``WindowDataset`` + ``collate`` with the checkpoint's stats, as ``vla model predict`` builds it) and, as a raw
``Observation``, through ``Policy.prepare``; the model inputs must be identical. Datasets and checkpoints are
written here (``make_lerobot_dataset``, ``vla model init``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vla.cli import main
from vla.data.norm_stats import NormStats, StatsFile
from vla.data.writers.synthetic import make_lerobot_dataset
from vla.embodiments import get_embodiment
from vla.models.testing import tiny_model
from vla.policy import ActionSafetyError, Policy
from vla.types import Observation, ObservationError

EMBODIMENT = "widowx_bridge"
SPEC = get_embodiment(EMBODIMENT)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_lerobot_dataset(
        tmp_path_factory.mktemp("policy") / "widowx",
        num_episodes=2,
        episode_length=[7, 5],
        cameras={"front": (24, 32)},
        state_dim=SPEC.state_dim,
        action_dim=SPEC.action_dim,
        fps=5,
        video=False,
        robot_type=EMBODIMENT,
    )
    assert main(["data", "stats", str(root)]) == 0
    return root


@pytest.fixture(scope="module")
def checkpoint(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert main(["model", "init", "tiny_smolvlm", "--out", str(out), "--embodiment", EMBODIMENT,
                 "--stats-from", str(dataset)]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def policy(checkpoint: Path) -> Policy:
    return Policy.from_checkpoint(checkpoint)


def observation(
    rng: np.random.Generator, spec=SPEC, prompt: str = "pick up the cup", size=(40, 56)
) -> Observation:
    images = {slot: rng.integers(0, 256, (*size, 3), dtype=np.uint8) for slot in spec.cameras}
    lo, hi = spec.limits("state")
    bounded = np.isfinite(lo) & np.isfinite(hi)
    centre = np.where(bounded, (np.where(bounded, lo, 0) + np.where(bounded, hi, 0)) / 2, 0.0)
    state = centre + rng.normal(0, 0.01, spec.state_dim)
    return Observation(images=images, state=state.astype(np.float32), prompt=prompt, embodiment=spec.name)


def test_prepare_matches_the_training_loader(policy: Policy, checkpoint: Path, dataset: Path) -> None:
    """A stored frame as the loader gives it to the model == the same raw frame through ``Policy.prepare``."""
    from vla.data.collate import collate
    from vla.data.readers import open_dataset
    from vla.data.standardize import standardize_episode
    from vla.data.windows import build_source
    from vla.models.hub import from_pretrained
    from vla.predict import _data_config, _window, checkpoint_preprocessing

    model = from_pretrained(checkpoint)
    reader = open_dataset(dataset)
    source = build_source(reader, "train")
    pre = checkpoint_preprocessing(model, EMBODIMENT)
    episode, frame = 1, 3
    sample, _, _ = _window(model, source, _data_config(reader.path, "train", pre), pre, episode, frame)
    expected = collate([sample], model.embodiment_ids)

    std = standardize_episode(reader, "train", episode, source.keymap, options=source.options)
    pos = int(np.flatnonzero(std.frames == frame)[0])
    decoded = reader.read_images("train", episode, [frame], list(std.cameras.values()))
    images = {slot: decoded[key][0] for slot, key in std.cameras.items()}  # [h, w, 3] native size
    assert next(iter(images.values())).shape[:2] == (24, 32)
    obs = Observation(images=images, state=std.state[pos], prompt=std.prompt[pos], embodiment=EMBODIMENT)
    got = policy.prepare([obs])

    assert got.prompt == expected.prompt
    assert torch.equal(got.embodiment_id, expected.embodiment_id)
    assert torch.equal(got.state, expected.state) and torch.equal(got.state_mask, expected.state_mask)
    assert sorted(got.images) == sorted(expected.images)
    for slot in got.images:
        assert got.images[slot].shape == (1, pre.obs_history, pre.image_size, pre.image_size, 3)
        assert torch.equal(got.images[slot], expected.images[slot]), slot
        assert torch.equal(got.image_mask[slot], expected.image_mask[slot])


def test_chunk_is_in_robot_units_and_seeded(policy: Policy) -> None:
    obs = observation(np.random.default_rng(0))
    a, b, c = policy.infer(obs, seed=3), policy.infer(obs, seed=3), policy.infer(obs, seed=4)
    h = policy.chunk_length(EMBODIMENT)
    assert a.actions.shape == (h, SPEC.action_dim) and a.actions.dtype == np.float32
    assert a.clamped.shape == (SPEC.action_dim,) and a.clamped.dtype == np.int64
    np.testing.assert_array_equal(a.actions, b.actions)
    assert not np.allclose(a.actions, c.actions)
    # unnormalized with the checkpoint's stats: normalizing the chunk back gives the model's own output
    from vla.data.normalize import Normalizer

    batch = policy.prepare([obs])
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn((policy._max_horizon, policy.model.cfg.max_action_dim), generator=gen)[None, :h]
    raw = policy.model.sample_actions(batch, noise=noise)[0, :h, : SPEC.action_dim].numpy()
    back = Normalizer.from_spec(policy.model.norm_stats, SPEC, "action")(a.actions.astype(np.float64))
    lo, hi = SPEC.limits("action")
    inside = (a.actions > lo) & (a.actions < hi)  # clamped values cannot map back
    np.testing.assert_allclose(back[inside], raw[inside], atol=1e-4)


def test_metadata_describes_what_is_served(policy: Policy) -> None:
    meta = policy.metadata()
    emb = meta["embodiments"][EMBODIMENT]
    assert emb["action_dim"] == SPEC.action_dim and emb["state_names"] == SPEC.state_names()
    assert emb["chunk_length"] == policy.chunk_length(EMBODIMENT)
    assert emb["cameras"] == sorted(SPEC.cameras) and emb["control_hz"] == SPEC.control_hz
    assert meta["image_size"] == policy.model.backbone.image_size


def _stats(spec, which: str, rng: np.random.Generator) -> NormStats:
    """Stats of plausible data for ``spec``'s field ``which`` (binary dims see only 0 and 1)."""
    modes = spec.norm_modes(which)
    x = rng.uniform(-1.0, 1.0, (500, len(modes)))
    for j, mode in enumerate(modes):
        if mode == "binary":
            x[:, j] = rng.integers(0, 2, 500)
    return NormStats(
        mean=x.mean(0), std=x.std(0), min=x.min(0), max=x.max(0),
        q01=np.quantile(x, 0.01, axis=0), q99=np.quantile(x, 0.99, axis=0), count=len(x),
    )  # fmt: skip


def mixed_policy() -> Policy:
    """Two embodiments of different widths and chunk lengths in one tiny model, with stats for both."""
    model = tiny_model(embodiments=("widowx_bridge", "franka_droid"), seed=1)
    rng = np.random.default_rng(0)
    model.norm_stats = StatsFile(
        stats={
            n: {f: _stats(model.spec(n), f, rng) for f in ("state", "action")} for n in model.embodiment_ids
        }
    )
    return Policy(model)


def test_batched_equals_one_by_one_over_mixed_embodiments() -> None:
    policy = mixed_policy()
    rng = np.random.default_rng(1)
    specs = [policy.spec(n) for n in ("widowx_bridge", "franka_droid", "widowx_bridge", "franka_droid")]
    observations = [observation(rng, s, prompt=f"task {i}", size=(30 + i, 44)) for i, s in enumerate(specs)]
    seeds = [10, 11, 12, 13]
    batched = policy.infer_batch(observations, seeds=seeds)
    assert {c.actions.shape for c in batched} == {
        (policy.chunk_length(s.name), s.action_dim) for s in specs
    }, "each chunk has its own embodiment's shape"
    for obs, seed, chunk in zip(observations, seeds, batched):
        alone = policy.infer(obs, seed=seed)
        assert alone.embodiment == chunk.embodiment == obs.embodiment
        np.testing.assert_allclose(chunk.actions, alone.actions, atol=1e-4, rtol=0)


def test_actions_are_clamped_to_the_spec_limits() -> None:
    """A robot whose spec allows only ±0.01 per action dim: every value ends inside, and clamps are counted."""
    from vla.embodiments import EmbodimentSpec, register_embodiment

    d = SPEC.to_dict()
    d["name"] = "policy_test_tight_widowx"
    for f in d["action"]:
        f["low"], f["high"] = [-0.01] * len(f["dims"]), [0.01] * len(f["dims"])
    spec = register_embodiment(EmbodimentSpec.from_dict(d))
    model = tiny_model(embodiments=(spec.name,), seed=2)
    rng = np.random.default_rng(0)
    model.norm_stats = StatsFile(stats={spec.name: {f: _stats(spec, f, rng) for f in ("state", "action")}})
    chunk = Policy(model).infer(observation(np.random.default_rng(2), spec), seed=0)
    assert np.all(np.abs(chunk.actions) <= 0.01 + 1e-7)
    at_limit = np.abs(chunk.actions) >= 0.01 - 1e-7  # every clamped value sits on a limit
    assert chunk.clamped.sum() > 0 and np.all(chunk.clamped <= at_limit.sum(0))


def test_non_finite_chunk_is_an_error_never_actions() -> None:
    policy = mixed_policy()
    with torch.no_grad():
        policy.model.heads.action_out.weight.fill_(float("nan"))
    with pytest.raises(ActionSafetyError, match="non-finite action chunk for 'widowx_bridge'"):
        policy.infer(observation(np.random.default_rng(0), policy.spec("widowx_bridge")), seed=0)


def test_embodiment_without_stats_is_refused_at_load(tmp_path: Path) -> None:
    out = tmp_path / "nostats"
    assert main(["model", "init", "tiny_smolvlm", "--out", str(out), "--embodiment", EMBODIMENT]) == 0
    with pytest.raises(ValueError, match=r"none of its embodiments .* has normalization stats.*--stats-from"):
        Policy.from_checkpoint(out)
    with pytest.raises(ValueError, match=r"has no normalization stats .*'widowx_bridge' units.*--stats-from"):
        Policy.from_checkpoint(out, embodiments=[EMBODIMENT])
    with pytest.raises(ValueError, match="no embodiment \\['panda'\\]"):
        Policy(mixed_policy().model, embodiments=["panda"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda o: setattr(o, "state", o.state[:-1]), r"state .*expected \[7\]"),
        (lambda o: o.state.__setitem__(2, np.nan), r"non-finite value\(s\) at \['.*'\]"),
        # finite in float64, inf in the model's float32: refused naming the state, not reported as unsafe actions
        (lambda o: setattr(o, "state", np.where(np.arange(7) == 2, np.float64(1e300), o.state)), r"state .*at \['.*'\] beyond float32's range"),
        # in float32's range, but not once normalized with the checkpoint's stats
        (lambda o: o.state.__setitem__(2, 3.4e38), r"state .*at \['.*'\] overflow float32 once normalized"),
        (lambda o: o.images.__setitem__("left_wrist", o.images["primary"]), "no camera slot 'left_wrist'"),
        (lambda o: o.images.__setitem__("primary", o.images["primary"].astype(np.float32)), "expected dtype uint8"),
        (lambda o: o.images.__setitem__("primary", o.images["primary"][..., 0]), r"expected uint8 \[h, w, 3\]"),
        (lambda o: setattr(o, "embodiment", "panda"), "'panda' is not served here; served: \\['widowx_bridge'\\]"),
        (lambda o: setattr(o, "prompt", b"bytes"), "prompt .*expected str"),
    ],
)  # fmt: skip
def test_bad_observations_get_named_errors(policy: Policy, change, message: str) -> None:
    obs = observation(np.random.default_rng(0))
    change(obs)
    with pytest.raises(ObservationError, match=message):
        policy.check(obs)  # what a server runs on each request before queueing it with others
    with pytest.raises(ObservationError, match=message):
        policy.infer(obs, seed=0)
