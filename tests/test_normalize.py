"""Normalization stats (streaming, mergeable, versioned) and the strict invertible Normalizer/Unnormalizer."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from vla.data.normalize import (
    DEGENERATE_TOL,
    STATIC_TOL,
    STATS_FORMAT_VERSION,
    Normalizer,
    NormStats,
    StatsError,
    StatsFile,
    Unnormalizer,
    make_normalize_fn,
    validate_stats,
)
from vla.data.readers.base import DatasetReader, FeatureInfo, RawEpisode
from vla.data.standardize import StdEpisode
from vla.data.stats import RunningStats, compute_stats, default_stats_paths, find_stats, write_stats
from vla.embodiments.spec import EmbodimentSpec

from fakes import FakeReader

BINS = 2048  # fewer bins than the default, so the accuracy bound below is actually exercised


def _distributions(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Columns that stress the histogram: smooth, skewed, heavy-tailed, discrete, bimodal grippers, constants."""
    gripper = np.where(rng.random(n) < 0.35, 0.0, 1.0)  # exactly binary, 35% closed
    noisy_gripper = np.where(rng.random(n) < 0.5, rng.normal(0.02, 0.01, n), rng.normal(0.98, 0.01, n))
    return {
        "normal": rng.normal(0.3, 2.0, n),
        "uniform": rng.uniform(-0.05, 0.05, n),
        "lognormal": rng.lognormal(0.0, 1.0, n),
        "student_t": rng.standard_t(3, n),
        "gripper": gripper,
        "noisy_gripper": noisy_gripper,
        "rare_close": np.where(rng.random(n) < 0.005, 0.0, 1.0),
        "integers": rng.integers(-3, 4, n).astype(np.float64),
        "constant": np.full(n, 0.7),
        "big_offset": 1e4 + rng.normal(0, 1e-3, n),
    }


def _data(n: int = 40_000, seed: int = 0) -> tuple[list[str], np.ndarray]:
    cols = _distributions(np.random.default_rng(seed), n)
    return list(cols), np.stack(list(cols.values()), axis=1)


def _one_pass(x: np.ndarray, batch: int = 997) -> RunningStats:
    rs = RunningStats(x.shape[1], num_bins=BINS)
    for i in range(0, len(x), batch):
        rs.update(x[i : i + batch])
    return rs


# ---- streaming accuracy ---------------------------------------------------------------------------------------
def test_mean_std_min_max_exact() -> None:
    _, x = _data()
    s = _one_pass(x).finalize()
    np.testing.assert_allclose(s.mean, x.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.std, x.std(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(s.min, x.min(0))
    np.testing.assert_array_equal(s.max, x.max(0))
    assert s.count == len(x)


@pytest.mark.parametrize("q", [0.01, 0.99])
def test_quantiles_match_numpy(q: float) -> None:
    names, x = _data()
    rs = _one_pass(x)
    got, want = rs.quantile(q), np.quantile(x, q, axis=0)
    width = x.max(0) - x.min(0)
    bound = 2 * width / (BINS - 1)  # one bin width (documented worst case)
    for i, name in enumerate(names):
        assert abs(got[i] - want[i]) <= bound[i] + 1e-12, (name, got[i], want[i], bound[i])
        assert abs(got[i] - want[i]) <= 1e-3 * max(width[i], 1e-12) + 1e-12, (name, got[i], want[i])
    # point masses are exact: a binary gripper's quantiles are exactly 0 and 1, constants are the constant
    for name in ("gripper", "rare_close", "integers", "constant"):
        i = names.index(name)
        assert got[i] == want[i], (name, got[i], want[i])


def test_quantiles_when_range_grows_during_the_pass() -> None:
    """Sorted data forces a re-bin on almost every batch; re-binning is exact so accuracy must not degrade."""
    x = np.sort(np.random.default_rng(1).normal(0, 1, (30_000, 1)), axis=0)
    for order in (x, x[::-1]):
        rs = _one_pass(order, batch=100)
        for q in (0.01, 0.99):
            assert abs(rs.quantile(q)[0] - np.quantile(x, q)) <= 2 * np.ptp(x) / (BINS - 1)


def test_merge_equals_one_pass() -> None:
    _, x = _data(seed=3)
    whole = _one_pass(x)
    a, b, c = _one_pass(x[:7000], 300), _one_pass(x[7000:7001]), _one_pass(x[7001:], 5000)
    merged = RunningStats(x.shape[1], BINS).merge(a).merge(b).merge(c)
    whole.flush()
    # the histogram grid is a function of the data only: merged histograms are bit-identical to one pass
    np.testing.assert_array_equal(merged.counts, whole.counts)
    np.testing.assert_array_equal(merged.exp, whole.exp)
    np.testing.assert_array_equal(merged.start, whole.start)
    sm, sw = merged.finalize(), whole.finalize()
    for k in ("min", "max", "q01", "q99"):
        np.testing.assert_array_equal(getattr(sm, k), getattr(sw, k))
    np.testing.assert_allclose(sm.mean, sw.mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sm.std, sw.std, rtol=1e-10, atol=1e-12)
    assert sm.count == sw.count


def test_nonfinite_values_are_counted_and_excluded() -> None:
    x = np.random.default_rng(0).normal(0, 1, (1000, 2))
    x[5, 0], x[7, 0], x[9, 1] = np.nan, np.inf, -np.inf
    s = _one_pass(x).finalize()
    assert s.num_nonfinite.tolist() == [2, 1]
    ok = np.isfinite(x[:, 0])
    assert s.mean[0] == pytest.approx(x[ok, 0].mean(), rel=1e-12)
    assert np.isfinite([s.q01, s.q99, s.std]).all()


# ---- the stats file ---------------------------------------------------------------------------------------------
def _stats(x: np.ndarray) -> NormStats:
    return _one_pass(np.asarray(x, dtype=np.float64)).finalize()


def test_stats_file_roundtrip_and_versioning(tmp_path: Path) -> None:
    _, x = _data(2000)
    sf = StatsFile(
        stats={"bot": {"state": _stats(x[:, :3]), "action": _stats(x[:, 3:6])}},
        sources=[{"dataset": "d", "path": "/x", "episodes": 3, "frames": 2000}],
    )
    path = sf.save(tmp_path / "s.json")
    raw = json.loads(path.read_text())
    assert raw["format_version"] == STATS_FORMAT_VERSION and raw["created_by"].startswith("vla ")
    assert set(raw["stats"]["bot"]) == {"state", "action"} and raw["sources"][0]["frames"] == 2000
    back = StatsFile.load(path)
    for f in ("state", "action"):
        for k in ("mean", "std", "min", "max", "q01", "q99"):
            np.testing.assert_array_equal(getattr(back.get("bot", f), k), getattr(sf.get("bot", f), k))
    raw["format_version"] = STATS_FORMAT_VERSION + 1
    path.write_text(json.dumps(raw))
    with pytest.raises(StatsError, match="newer than this vla"):
        StatsFile.load(path)
    with pytest.raises(StatsError, match="vla data stats"):
        StatsFile.load(tmp_path / "missing.json")


def test_old_format_versions_are_upgraded_on_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulate a future format 2 that renamed q01/q99: a version-1 file must still load through _UPGRADES."""
    import vla.data.norm_stats as norm_mod

    v1 = StatsFile(stats={"bot": {"state": _stats(np.arange(20.0)[:, None])}}).save(tmp_path / "v1.json")

    def upgrade_1_to_2(d: dict) -> dict:
        for fields in d["stats"].values():
            for s in fields.values():
                s["p01"], s["p99"] = s.pop("q01"), s.pop("q99")
        return {**d, "format_version": 2}

    monkeypatch.setattr(norm_mod, "STATS_FORMAT_VERSION", 2)
    monkeypatch.setitem(norm_mod._UPGRADES, 1, upgrade_1_to_2)
    back = StatsFile.load(v1)
    assert back.format_version == 2 and back.get("bot", "state").q99[0] == pytest.approx(
        np.quantile(np.arange(20.0), 0.99)
    )


def test_missing_stats_error_names_field_and_fix() -> None:
    sf = StatsFile(stats={"other_bot": {}})
    with pytest.raises(StatsError) as e:
        sf.get("widowx_bridge", "state")
    assert "'widowx_bridge/state'" in str(e.value) and "vla data stats" in str(e.value)


def test_dataset_key_preferred_then_embodiment_key() -> None:
    a, b = _stats(np.array([[1.0], [2.0], [3.0], [4.0]])), _stats(np.arange(10.0)[:, None])
    sf = StatsFile(stats={"bot": {"state": a}, "bot@ds2": {"state": b}})
    assert sf.get("bot", "state", dataset="ds2") is b
    assert sf.get("bot", "state", dataset="ds1") is a
    assert sf.get("bot", "state") is a


# ---- transforms -------------------------------------------------------------------------------------------------
def _spec(modes: list[str]) -> EmbodimentSpec:
    return EmbodimentSpec.from_dict(
        {
            "name": "bot",
            "control_hz": 10,
            "chunk_length": 4,
            "state": [
                {"name": f"s{i}", "kind": "other", "dims": ["v"], "normalization": m}
                for i, m in enumerate(modes)
            ],
            "action": [
                {"name": f"a{i}", "kind": "other", "dims": ["v"], "normalization": m}
                for i, m in enumerate(modes)
            ],
        }
    )


MODES = ["quantile", "mean_std", "min_max", "binary", "identity", "quantile"]


def _field_data(n: int = 5000) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.stack(
        [
            rng.normal(1, 2, n),
            rng.uniform(-3, 5, n),
            rng.lognormal(0, 0.5, n),
            (rng.random(n) < 0.4).astype(float),
            rng.normal(0, 9, n),
            np.full(n, 0.25),
        ],
        axis=1,
    )


def test_modes_formulas_and_roundtrip() -> None:
    x = _field_data().astype(np.float32)
    s = _stats(x)
    norm = Normalizer(s, MODES, name="bot/state")
    y = norm(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(
        y[:, 0], 2 * (x64[:, 0] - s.q01[0]) / (s.q99[0] - s.q01[0]) - 1, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(y[:, 1], (x64[:, 1] - s.mean[1]) / s.std[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        y[:, 2], 2 * (x64[:, 2] - s.min[2]) / (s.max[2] - s.min[2]) - 1, rtol=1e-5, atol=1e-5
    )
    assert set(np.unique(y[:, 3])) == {-1.0, 1.0} and np.array_equal(y[:, 3] > 0, x[:, 3] > 0.5)
    np.testing.assert_array_equal(y[:, 4], x[:, 4])
    np.testing.assert_array_equal(y[:, 5], 0.0)  # constant dim -> 0, like OpenVLA
    back = norm.inverse()(y)
    assert isinstance(norm.inverse(), Unnormalizer)
    np.testing.assert_allclose(back, x, rtol=1e-6, atol=1e-6)
    # quantile endpoints land on -1/+1; no clipping by default (openpi), so tails go beyond
    ends = norm(np.array([[s.q01[0], 0, 0, 0, 0, 0.25], [s.q99[0], 0, 0, 1, 0, 0.25]], dtype=np.float32))
    np.testing.assert_allclose(ends[:, 0], [-1, 1], atol=1e-6)
    assert np.abs(y[:, 0]).max() > 1.0


def test_torch_matches_numpy_and_roundtrips() -> None:
    x = _field_data(300).astype(np.float32)
    norm = Normalizer(_stats(x), MODES, name="bot/state")
    y_np = norm(x)
    y_t = norm(torch.from_numpy(x).reshape(3, 100, 6))
    assert isinstance(y_t, torch.Tensor) and y_t.dtype == torch.float32 and y_t.shape == (3, 100, 6)
    np.testing.assert_allclose(y_t.reshape(300, 6).numpy(), y_np, rtol=1e-6, atol=1e-6)
    back = norm.inverse()(y_t)
    np.testing.assert_allclose(back.reshape(300, 6).numpy(), x, rtol=1e-6, atol=1e-6)


def test_nonfinite_values_stay_nonfinite_in_every_mode() -> None:
    """NaN/inf must reach the loader's finiteness check: a binary dim must not threshold NaN into -1 or 0."""
    x = _field_data(50).astype(np.float32)
    norm = Normalizer(_stats(x), MODES, name="bot/state")
    bad = np.tile(x[:1], (2, 1))
    bad[0, :], bad[1, :] = np.nan, np.inf
    for y in (norm(bad), norm(torch.from_numpy(bad)).numpy()):
        assert not np.isfinite(y).any(), y
    assert not np.isfinite(norm.inverse()(bad)).any()
    np.testing.assert_array_equal(norm(x)[:, 3], np.where(x[:, 3] > 0.5, 1.0, -1.0))  # finite: unchanged


def test_clip_option_and_normalize_mask() -> None:
    x = _field_data().astype(np.float32)
    s = _stats(x)
    y = Normalizer(s, MODES, clip=1.0)(x)
    assert np.abs(y[:, :3]).max() <= 1.0 and np.abs(y[:, 4]).max() > 1.0  # identity dims are never clipped
    mask = [True, False, True, True, True, True]
    ym = Normalizer(s, MODES, normalize_mask=mask)(x)
    np.testing.assert_array_equal(ym[:, 1], x[:, 1])  # masked dim passes through


def test_dim_mismatch_is_an_error() -> None:
    norm = Normalizer(_stats(_field_data()), MODES, name="bot/action")
    with pytest.raises(StatsError, match=r"'bot/action'.*\[\.\.\., 6\]"):
        norm(np.zeros((2, 7), np.float32))


def test_degenerate_stats_refused_and_reported() -> None:
    n = 10_000
    rare = np.ones((n, 1))
    rare[:20] = 0.0  # a gripper that closes in 0.2% of frames: q01 == q99 == 1 but min != max
    s = _stats(rare)
    assert s.q01[0] == s.q99[0] == 1.0 and s.min[0] == 0.0
    with pytest.raises(StatsError) as e:
        Normalizer(s, ["quantile"], name="widowx_bridge/action", dim_names=["gripper.open"])
    msg = str(e.value)
    assert (
        "'widowx_bridge/action'[0] (gripper.open)" in msg and "degenerate" in msg and "normalization" in msg
    )
    Normalizer(s, ["min_max"])  # another mode works
    Normalizer(s, ["binary"])
    # constant dims are not degenerate: they map to 0
    assert (
        Normalizer(_stats(np.full((50, 1), 3.0)), ["quantile"])(np.full((1, 1), 3.0, np.float32))[0, 0] == 0.0
    )
    # ... nor are dims that only jitter (an idle arm held within 1e-5 rad by its servos): they map to ~0, not to +-1
    jitter = 0.5 + 3e-7 * np.random.default_rng(0).normal(size=(1000, 1))
    spread = _stats(jitter).q99[0] - _stats(jitter).q01[0]
    assert spread < 2 * DEGENERATE_TOL  # degenerate if it counted as moving
    y = Normalizer(_stats(jitter), ["quantile"])(jitter.astype(np.float32))
    assert np.abs(y).max() < STATIC_TOL
    # ... and a model's error on such a dim is not passed through at unit scale: it stays in the data's range
    both = np.concatenate([jitter, np.random.default_rng(1).normal(size=(1000, 1))], axis=1)
    un = Normalizer(_stats(both), ["quantile", "quantile"]).inverse()
    lo, hi = _stats(both).min[0], _stats(both).max[0]
    out = un(np.array([[0.8, 0.8], [-0.8, -0.8], [np.nan, 0.0]]))
    assert lo <= out[0, 0] <= hi and lo <= out[1, 0] <= hi and np.isnan(out[2, 0])
    assert out[0, 1] > 1.0 and out[1, 1] < -1.0  # moving dims: the exact affine inverse, unclamped
    out_t = un(torch.tensor([[0.8, 0.8]], dtype=torch.float64))
    np.testing.assert_allclose(out_t.numpy(), out[:1])
    np.testing.assert_allclose(un(Normalizer(_stats(both), ["quantile"] * 2)(both)), both, atol=1e-12)
    # non-finite stats are refused
    bad = NormStats(mean=[np.nan], std=[1.0], min=[0.0], max=[1.0], q01=[0.0], q99=[np.nan], count=3)
    with pytest.raises(StatsError, match="non-finite"):
        Normalizer(bad, ["quantile"], name="bot/state")


def test_validate_stats_lists_every_problem() -> None:
    spec = _spec(["quantile", "mean_std"])
    rare = np.ones((1000, 2))
    rare[:3, 0] = 0.0
    rare[:, 1] = np.random.default_rng(0).normal(size=1000)
    rare[10, 1] = np.nan
    sf = StatsFile(stats={"bot": {"state": _stats(rare)}})
    problems = validate_stats(sf, spec)
    text = [str(p) for p in problems]
    assert any("'bot/state'[0] (s0.v)" in t and "degenerate" in t for t in text), text
    assert any(p.severity == "warning" and p.dim == 1 and "non-finite" in p.message for p in problems), text
    assert any(p.where == "bot/action" and "vla data stats" in p.fix for p in problems), text  # missing field
    ramp = np.arange(1000.0)[:, None].repeat(2, 1)
    good = StatsFile(stats={"bot": {f: _stats(ramp) for f in ("state", "action")}})
    assert validate_stats(good, spec) == []


def test_make_normalize_fn_caches_per_embodiment_and_dataset() -> None:
    spec = _spec(["quantile", "quantile"])
    x = np.random.default_rng(0).normal(size=(500, 2))
    sf = StatsFile(
        stats={
            "bot": {"state": _stats(x), "action": _stats(x)},
            "bot@scaled": {"state": _stats(x * 10), "action": _stats(x * 10)},
        }
    )
    a = make_normalize_fn(sf, {"bot": spec})("bot", "plain", "state", x[:4].astype(np.float32))
    for per_dataset in (True, ["scaled"]):
        fn = make_normalize_fn(sf, {"bot": spec}, per_dataset=per_dataset)
        b = fn("bot", "scaled", "state", (x[:4] * 10).astype(np.float32))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    embodiment_level = make_normalize_fn(sf, {"bot": spec})(
        "bot", "scaled", "state", (x[:4] * 10).astype(np.float32)
    )
    assert not np.allclose(embodiment_level, a)  # default: the embodiment's stats, not the dataset's


# ---- compute_stats over (fake) datasets ------------------------------------------------------------------------
def fake_standardize(reader: DatasetReader, split: str, episode: int) -> StdEpisode:
    x = reader.read_episode(split, episode).steps["x"]
    return StdEpisode(
        reader.name, split, episode, "bot", np.arange(len(x)), x[:, :3], x[:, 3:], [""] * len(x), {}
    )


def _reader(tmp_path: Path, name: str = "ds", seed: int = 0, n_eps: int = 12) -> FakeReader:
    rng = np.random.default_rng(seed)
    eps = {
        s: [
            rng.normal(seed, 1 + seed, (int(rng.integers(5, 60)), 5)).astype(np.float32) for _ in range(n_eps)
        ]
        for s in ("train", "val")
    }
    (tmp_path / name).mkdir(exist_ok=True)
    episodes = {s: [RawEpisode(s, i, len(x), {"x": x}) for i, x in enumerate(xs)] for s, xs in eps.items()}
    features = {"x": FeatureInfo("x", "tensor", "float32", (5,))}  # 3 state dims, 2 action dims
    return FakeReader(name, episodes, features, path=tmp_path / name)


def _all(reader: FakeReader) -> np.ndarray:
    return np.concatenate([e.steps["x"] for s in reader.splits() for e in reader.episodes[s]]).astype(
        np.float64
    )


def test_compute_stats_one_pass_over_all_splits(tmp_path: Path) -> None:
    r = _reader(tmp_path)
    sf = compute_stats(r, episode_fn=fake_standardize, progress=False)
    x = _all(r)
    assert set(sf.stats) == {"bot", "bot@ds"}
    st = sf.get("bot", "state")
    np.testing.assert_allclose(st.mean, x[:, :3].mean(0), rtol=1e-9)
    np.testing.assert_allclose(
        sf.get("bot", "action").q99,
        np.quantile(x[:, 3:], 0.99, axis=0),
        atol=2 * np.ptp(x[:, 3:], 0).max() / 8191,
    )
    src = sf.sources[0]
    assert (src["dataset"], src["episodes"], src["frames"], src["total_episodes"]) == ("ds", 24, len(x), 24)


def test_compute_stats_workers_and_multiple_datasets(tmp_path: Path) -> None:
    r1, r2 = _reader(tmp_path, "ds1", 0), _reader(tmp_path, "ds2", 1)
    serial = compute_stats([r1, r2], episode_fn=fake_standardize, progress=False)
    forked = compute_stats([r1, r2], episode_fn=fake_standardize, progress=False, workers=2)
    assert set(serial.stats) == {"bot", "bot@ds1", "bot@ds2"}
    for key in serial.stats:
        for f in ("state", "action"):
            a, b = serial.stats[key][f], forked.stats[key][f]
            for k in ("min", "max", "q01", "q99"):
                np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
            np.testing.assert_allclose(a.std, b.std, rtol=1e-10)
    x = np.concatenate([_all(r1), _all(r2)])  # the embodiment key merges both datasets exactly
    np.testing.assert_allclose(serial.get("bot", "state").mean, x[:, :3].mean(0), rtol=1e-9)
    assert serial.get("bot", "state", dataset="ds2").mean[0] == pytest.approx(_all(r2)[:, 0].mean())


def test_compute_stats_max_episodes(tmp_path: Path) -> None:
    sf = compute_stats(_reader(tmp_path), episode_fn=fake_standardize, progress=False, max_episodes=5)
    assert sf.sources[0]["episodes"] == 5 and sf.sources[0]["max_episodes"] == 5


def test_write_stats_locations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vla.data.stats as stats_mod

    r = _reader(tmp_path)
    monkeypatch.setattr(
        stats_mod,
        "compute_stats",
        lambda p, **kw: compute_stats(r, episode_fn=fake_standardize, progress=False),
    )
    monkeypatch.setenv("VLA_CACHE_DIR", str(tmp_path / "cache"))
    local = write_stats(r.path)
    assert local == r.path.resolve() / "meta" / "vla_stats.json" and find_stats(r.path) == local
    out = write_stats(r.path, out=tmp_path / "elsewhere.json")
    assert StatsFile.load(out).get("bot", "action").dim == 2
    # a read-only dataset folder (even for root) falls back to the cache
    ro = _reader(tmp_path, "readonly")
    os.chmod(ro.path, stat.S_IRUSR | stat.S_IXUSR)
    try:
        cached = write_stats(ro.path)
        assert cached == default_stats_paths(ro.path)[1] and cached.is_relative_to(tmp_path / "cache")
        assert not (ro.path / "meta").exists() and find_stats(ro.path) == cached
    finally:
        os.chmod(ro.path, stat.S_IRWXU)


def test_compute_stats_on_bridge_fixture(
    bridge_fixture: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real pipeline (open_dataset + standardize) on the team's RLDS fixture, written to the cache."""
    monkeypatch.setenv("VLA_CACHE_DIR", str(tmp_path))
    path = write_stats(bridge_fixture, max_episodes=6, progress=False)
    assert path.is_relative_to(tmp_path)  # the fixture is read-only
    sf = StatsFile.load(path)
    from vla.embodiments import get_embodiment

    spec = get_embodiment("widowx_bridge")
    assert sf.get("widowx_bridge", "action").dim == spec.action_dim
    assert sf.sources[0]["episodes"] == 6
