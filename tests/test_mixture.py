"""Mixtures: the registered YAML files (contract), resolution on disk, and the deterministic MixtureSampler."""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from vla.data.mixture import MIXTURES, Mixture, MixtureError, get_mixture, resolve_mixture
from vla.data.mixture_sampler import MixtureSampler, mixture_weights, permute


# ---- contract over every registered mixture ---------------------------------------------------------------------
def _keymap_registry() -> object | None:
    """``vla.data.keymaps.KEYMAPS`` when that module exists (it is written separately), else None."""
    try:
        mod = importlib.import_module("vla.data.keymaps")
    except ImportError:
        return None
    return getattr(mod, "KEYMAPS", None)


@pytest.mark.parametrize("name", MIXTURES.names())
def test_mixture_contract(name: str) -> None:
    m = MIXTURES.get(name)
    assert m.name == name and m.path is not None and m.path.stem == name
    assert m.description and m.source, "every mixture says what it is and cites where its weights come from"
    assert all(e.weight > 0 and np.isfinite(e.weight) for e in m.datasets)
    all_names = [n for e in m.datasets for n in (e.name, *e.aliases)]
    assert len(all_names) == len(set(all_names)), "duplicate dataset names"
    keymaps = _keymap_registry()
    if keymaps is not None:
        for e in m.datasets:
            if e.kind != "sim":
                assert any(n in keymaps for n in (e.name, *e.aliases)), (
                    f"{name}: no key map for dataset {e.name!r}"
                )


def test_published_mixtures_exact_weights() -> None:
    """Spot checks against the published mixtures (openvla/openvla prismatic/vla/datasets/rlds/oxe/mixtures.py,
    octo-models/octo octo/data/oxe/oxe_dataset_mixes.py), unrounded weights included."""
    w = {n: {e.name: e.weight for e in MIXTURES.get(n).datasets} for n in MIXTURES.names()}
    ov, octo = w["oxe_magic_soup"], w["octo_magic_soup"]
    assert len(ov) == 23 and len(octo) == 25 and len(w["oxe_magic_soup_plus"]) == 27
    assert len(w["oxe_magic_soup_plus_minus"]) == 25
    assert ov["fractal20220817_data"] == 0.54087122203 and ov["kuka"] == 0.8341046294
    assert set(octo) - set(ov) == {"nyu_door_opening_surprising_effectiveness", "bc_z"} and set(ov) <= set(
        octo
    )
    assert all(octo[k] == v for k, v in ov.items())
    plus = w["oxe_magic_soup_plus"]
    assert (plus["droid"], plus["bc_z"], plus["dobbe"], plus["fmb_dataset"]) == (0.06, 0.2, 0.2, 1.0)
    pm = w["oxe_magic_soup_plus_minus"]
    assert pm["fractal20220817_data"] == 1.0 and "droid" not in pm and "language_table" not in pm
    assert w["droid"] == {"droid": 1.0} and w["bridge"] == {"bridge_dataset": 1.0}
    assert all(e.kind == "sim" and e.name.startswith("sim_") for e in MIXTURES.get("sim_mix").datasets)
    bcz = next(e for e in MIXTURES.get("oxe_magic_soup_plus").datasets if e.name == "bc_z")
    assert bcz.version == "0.1.0"  # OpenVLA: later bc_z versions are broken


def test_bad_mixture_files_are_clear_errors(tmp_path: Path) -> None:
    cases = {
        "weight": (
            {"name": "m", "datasets": [{"name": "a", "weight": 0}]},
            "weight must be a finite number > 0",
        ),
        "dup": (
            {"name": "m", "datasets": [{"name": "a", "weight": 1}, {"name": "a", "weight": 2}]},
            "appears twice",
        ),
        "kind": (
            {"name": "m", "datasets": [{"name": "a", "weight": 1, "kind": "fake"}]},
            "kind must be one of",
        ),
        "key": ({"name": "m", "datasets": [{"name": "a", "weight": 1}], "wieghts": 1}, "unknown key"),
    }
    for d, match in cases.values():
        with pytest.raises(MixtureError, match=match):
            Mixture.from_dict(d)
    with pytest.raises(KeyError, match="Did you mean 'oxe_magic_soup'"):
        get_mixture("oxe_magic_sop")


# ---- resolution -------------------------------------------------------------------------------------------------
def _rlds(root: Path, name: str, version: str = "1.0.0") -> Path:
    d = root / name / version
    d.mkdir(parents=True)
    (d / "dataset_info.json").write_text(json.dumps({"name": name, "version": version}))
    return d


def _lerobot(root: Path, name: str, frames: int = 123) -> Path:
    d = root / name / "meta"
    d.mkdir(parents=True)
    (d / "info.json").write_text(json.dumps({"total_frames": frames}))
    return d.parent


def _mix(tmp_path: Path, datasets: list[dict], balance: bool = True) -> Path:
    p = tmp_path / "m.yaml"
    p.write_text(
        json.dumps({"name": "m", "description": "t", "balance_by_size": balance, "datasets": datasets})
    )
    return p


def test_resolve_finds_rlds_versions_aliases_and_lerobot(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _rlds(root, "a", "0.1.0")
    newest = _rlds(root, "a", "0.10.0")  # numeric version order, not string order
    _rlds(root, "bridge_orig", "1.0.0")
    flat = root / "c"
    flat.mkdir(parents=True)
    (flat / "dataset_info.json").write_text("{}")
    lr = _lerobot(root, "sim_x", 500)
    pinned = _rlds(root, "p", "0.1.0")
    _rlds(root, "p", "2.0.0")
    mix = _mix(
        tmp_path,
        [
            {"name": "a", "weight": 1},
            {"name": "bridge_dataset", "weight": 1, "aliases": ["bridge_orig"]},
            {"name": "c", "weight": 1},
            {"name": "sim_x", "weight": 2, "kind": "sim"},
            {"name": "p", "weight": 1, "version": "0.1.0"},
        ],
    )
    r = resolve_mixture(mix, root)
    got = {d.name: (d.path, d.format, d.num_frames) for d in r.datasets}
    assert got["a"] == (newest, "rlds", None)
    assert got["bridge_dataset"][0] == root / "bridge_orig" / "1.0.0"
    assert got["c"] == (flat, "rlds", None)
    assert got["sim_x"] == (lr, "lerobot", 500)
    assert got["p"][0] == pinned
    assert not r.dropped and r.message == ""


def test_resolve_missing_is_one_error_listing_every_path(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _rlds(root, "a")
    mix = _mix(tmp_path, [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}, {"name": "c", "weight": 3}])
    with pytest.raises(MixtureError) as e:
        resolve_mixture(mix, root)
    msg = str(e.value)
    assert "2 of 3 dataset(s) not found" in msg and "allow_missing" in msg
    for n in ("b", "c"):
        assert f"  {n}: looked at" in msg
        assert str(root / n / "dataset_info.json") in msg and str(root / n / "meta" / "info.json") in msg


def test_resolve_allow_missing_renormalizes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "data"
    _rlds(root, "a")
    _rlds(root, "c")
    mix = _mix(
        tmp_path, [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}, {"name": "c", "weight": 3}], False
    )
    with caplog.at_level(logging.WARNING):
        r = resolve_mixture(mix, root, allow_missing=True)
    assert r.names == ["a", "c"] and r.dropped == ["b"]
    np.testing.assert_allclose(r.weights(), [0.25, 0.75])
    assert (
        "dropped 1 missing dataset(s): b" in r.message and "a=0.2500" in r.message and "c=0.7500" in r.message
    )
    assert r.message in caplog.text
    with pytest.raises(MixtureError, match="3 of 3"):  # nothing at all is still an error
        resolve_mixture(mix, tmp_path / "empty", allow_missing=True)


def test_resolve_explicit_path_on_fixture(bridge_fixture: Path, tmp_path: Path) -> None:
    """The fixture's folder is not named after its builder, so an explicit relative ``path:`` finds it."""
    fixtures = bridge_fixture.parent.parent  # .../fixtures/oxe_bridge_dataset_octo_debug/1.0.0
    mix = _mix(tmp_path, [{"name": "bridge_dataset", "weight": 1, "path": bridge_fixture.parent.name}])
    r = resolve_mixture(mix, [tmp_path / "nothing_here", fixtures])
    assert [(d.name, d.path, d.format) for d in r.datasets] == [("bridge_dataset", bridge_fixture, "rlds")]


def test_balance_by_size() -> None:
    np.testing.assert_allclose(mixture_weights([1, 1], [100, 300], balance_by_size=True), [0.25, 0.75])
    np.testing.assert_allclose(mixture_weights([2, 1], [100, 300], balance_by_size=False), [2 / 3, 1 / 3])
    np.testing.assert_allclose(mixture_weights([0.5, 2.0], [400, 100], balance_by_size=True), [0.5, 0.5])
    with pytest.raises(MixtureError, match="sizes"):
        mixture_weights([1, 1], None, balance_by_size=True)


# ---- sampler ----------------------------------------------------------------------------------------------------
NAMES, PROBS, SIZES = ["alpha", "beta", "gamma", "delta"], [0.1, 0.2, 0.3, 0.4], [50, 1000, 7, 20_000]


def _sampler(**kw: object) -> MixtureSampler:
    args = {"names": NAMES, "probs": PROBS, "sizes": SIZES, "seed": 7} | kw
    return MixtureSampler(args.pop("names"), args.pop("probs"), args.pop("sizes"), **args)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 1023, 1025, 99_991])
def test_permute_is_a_bijection(n: int) -> None:
    p = permute(np.arange(n), n, key=123)
    assert sorted(p.tolist()) == list(range(n))
    if n > 64:
        assert not np.array_equal(p, np.arange(n)) and not np.array_equal(
            p, permute(np.arange(n), n, key=124)
        )


def test_sampler_is_deterministic_and_in_range() -> None:
    a, b = _sampler().take(5000), _sampler().take(5000)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, _sampler(seed=8).take(5000))
    for d, s in a:
        assert 0 <= s < SIZES[d]
    it = _sampler()  # the iterator protocol yields the same stream as take()
    assert [next(it) for _ in range(3000)] == [tuple(x) for x in a[:3000].tolist()]


def test_sampler_resume_equals_continuation() -> None:
    full = _sampler()
    ref = [next(full) for _ in range(4000)]
    first = _sampler()
    head = [next(first) for _ in range(1234)]  # stop mid-buffer
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = _sampler()
    resumed.load_state_dict(state)
    tail = [next(resumed) for _ in range(4000 - 1234)]
    assert head + tail == ref
    with pytest.raises(MixtureError, match="world_size"):
        _sampler(world_size=2).load_state_dict(state)


def test_sampler_epoch_sized_iteration_resumes_mid_epoch() -> None:
    s = _sampler(num_samples=100)
    assert len(s) == 100 and len(list(s)) == 100 and len(list(s)) == 100
    r = _sampler(num_samples=100)
    it = iter(r)
    [next(it) for _ in range(30)]
    r2 = _sampler(num_samples=100)
    r2.load_state_dict(r.state_dict())
    assert len(list(r2)) == 70  # the rest of the epoch


def test_ranks_are_disjoint_within_a_pass() -> None:
    world = 4
    seen: dict[int, set[int]] = {}
    for rank in range(world):
        pairs = _sampler(rank=rank, world_size=world, probs=[0.25] * 4, sizes=[5000] * 4).take(3000)
        for d in range(4):
            mine = set(pairs[pairs[:, 0] == d, 1].tolist())
            assert len(mine) == (pairs[:, 0] == d).sum()  # no repeats within a rank's pass
            assert not (seen.setdefault(d, set()) & mine), f"ranks share samples of dataset {d}"
            seen[d] |= mine
    # ranks still differ in which dataset they pick when
    a = _sampler(rank=0, world_size=2).take(100)[:, 0]
    b = _sampler(rank=1, world_size=2).take(100)[:, 0]
    assert not np.array_equal(a, b)


def test_every_sample_once_per_pass() -> None:
    pairs = _sampler(probs=[1, 1, 1, 1], sizes=[10, 10, 10, 10]).take(4000)
    stream = pairs[pairs[:, 0] == 2, 1]
    for p in range(len(stream) // 10):
        assert sorted(stream[p * 10 : (p + 1) * 10].tolist()) == list(range(10))


def test_empirical_proportions_match_weights() -> None:
    n = 200_000
    counts = np.bincount(_sampler().take(n)[:, 0], minlength=4)
    expected = n * np.asarray(PROBS)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, expected, chi2)  # df = 3, p = 0.001


def test_name_seeding_invariant_to_order_and_to_other_datasets() -> None:
    base = _sampler().take(3000)
    as_names = [(NAMES[d], s) for d, s in base.tolist()]
    perm = [2, 0, 3, 1]
    shuffled = _sampler(
        names=[NAMES[i] for i in perm], probs=[PROBS[i] for i in perm], sizes=[SIZES[i] for i in perm]
    ).take(3000)
    assert [([NAMES[i] for i in perm][d], s) for d, s in shuffled.tolist()] == as_names
    # adding a dataset (and changing the others' weights) leaves each dataset's own sample stream unchanged
    more = _sampler(names=[*NAMES, "epsilon"], probs=[0.3, 0.1, 0.1, 0.2, 0.3], sizes=[*SIZES, 99]).take(6000)
    for d, name in enumerate(NAMES):
        old = [s for n, s in as_names if n == name]
        new = more[more[:, 0] == d, 1].tolist()
        k = min(len(old), len(new))
        assert k > 0 and old[:k] == new[:k], name


def test_resolved_mixture_sampler_balances_by_size(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _rlds(root, "a")
    _rlds(root, "b")
    r = resolve_mixture(_mix(tmp_path, [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}]), root)
    s = r.sampler([100, 300], seed=0)
    np.testing.assert_allclose(s.probs, [0.25, 0.75])
    np.testing.assert_allclose(r.sampler([100, 300], balance_by_size=False).probs, [0.5, 0.5])


def test_sim_fraction_splits_the_mass_between_sim_and_real() -> None:
    from vla.data.mixture import split_by_kind
    from vla.data.mixture_sampler import MixtureError

    probs = np.array([0.5, 0.3, 0.1, 0.1])  # real, real, sim, sim
    out = split_by_kind(probs, ["real", "real", "sim", "sim"], 0.5, "m")
    np.testing.assert_allclose(out, [0.3125, 0.1875, 0.25, 0.25])  # each group keeps its internal proportions
    np.testing.assert_allclose(split_by_kind(probs, ["real"] * 2 + ["sim"] * 2, 0.0, "m")[2:], 0.0)
    with pytest.raises(MixtureError, match=r"sim_fraction=0\.3 asks for sim samples but no sim dataset"):
        split_by_kind(probs[:2] / probs[:2].sum(), ["real", "real"], 0.3, "m")
    mix = get_mixture("oxe_droid_sim")
    assert {e.kind for e in mix.datasets} == {"real", "sim"}
    assert {e.name for e in mix.datasets if e.kind == "sim"} == {
        e.name for e in get_mixture("sim_mix").datasets
    }
