"""Core contracts: registry errors, config loading/overrides/validation, Batch/Frame validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vla.config import AugmentConfig, ConfigError, DataConfig, load_config, parse_overrides
from vla.registry import Registry, RegistryError
from vla.types import Batch, Frame, ShapeError


def test_registry_did_you_mean_and_duplicates() -> None:
    reg: Registry[int] = Registry("widget", hint="Add one in widgets.py.")
    reg.register("franka_droid", 1)
    reg.register("widowx_bridge", 2)
    assert reg.get("widowx_bridge") == 2
    assert reg.names() == ["franka_droid", "widowx_bridge"]
    with pytest.raises(RegistryError) as e:
        reg.get("widowx_brige")
    assert "Did you mean 'widowx_bridge'" in str(e.value) and "Add one in widgets.py." in str(e.value)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("franka_droid", 3)
    reg.register("franka_droid", 3, overwrite=True)
    assert reg.get("franka_droid") == 3


def test_registry_lazy_loader_runs_once() -> None:
    calls = []
    reg: Registry[str] = Registry("thing")
    reg.add_loader(lambda: (calls.append(1), reg.register("a", "A")))
    assert "a" in reg and reg.get("a") == "A" and len(reg) == 1
    assert calls == [1]


def test_parse_overrides_nested_and_typed() -> None:
    assert parse_overrides(["a.b=1", "--c=x", "d=[1, 2]", "e=true"]) == {
        "a": {"b": 1},
        "c": "x",
        "d": [1, 2],
        "e": True,
    }
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["batch_size"])


def test_load_config_from_yaml_with_overrides(tmp_path) -> None:
    p = tmp_path / "data.yaml"
    p.write_text("datasets: [a, b]\nbatch_size: 4\naugment: {enabled: true, hue: 0.1}\n")
    cfg = load_config(DataConfig, p, ["batch_size=16", "augment.crop_scale=0.8"])
    assert cfg.datasets == ("a", "b") and cfg.batch_size == 16
    assert cfg.augment == AugmentConfig(enabled=True, hue=0.1, crop_scale=0.8)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("batch_sise=3", "Did you mean batch_size"),
        ("augment.hue=0.9", "augment.hue must be in [0, 0.5], got 0.9"),
        ("on_bad_sample=ignore", "data.on_bad_sample must be 'raise' or 'skip', got 'ignore'"),
        ("augment.crop=0.5", "Did you mean augment.crop_scale"),
        ("obs_history=0", "data.obs_history must be >= 1, got 0"),
    ],
)
def test_config_errors_name_field_and_fix(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DataConfig, {"datasets": ["x"]}, [override])
    assert message in str(e.value)


def test_config_requires_one_data_source() -> None:
    with pytest.raises(ConfigError, match=r"exactly one of data\.datasets or data\.mixture"):
        load_config(DataConfig, {})


def test_unknown_preset_suggests(tmp_path, monkeypatch) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "bridge.yaml").write_text("datasets: [x]\n")
    monkeypatch.setenv("VLA_CONFIG_DIR", str(tmp_path))
    assert load_config(DataConfig, "bridge", kind="data").datasets == ("x",)
    with pytest.raises(ConfigError, match="Did you mean bridge"):
        load_config(DataConfig, "bridg", kind="data")


def _batch(b: int = 2, s: int = 3, h: int = 4, a: int = 2) -> Batch:
    return Batch(
        images={"primary": torch.zeros(b, 1, 8, 8, 3, dtype=torch.uint8)},
        image_mask={"primary": torch.ones(b, dtype=torch.bool)},
        state=torch.zeros(b, s),
        state_mask=torch.ones(b, s, dtype=torch.bool),
        actions=torch.zeros(b, h, a),
        action_mask=torch.ones(b, a, dtype=torch.bool),
        action_is_pad=torch.zeros(b, h, dtype=torch.bool),
        prompt=["x"] * b,
        embodiment_id=torch.zeros(b, dtype=torch.int64),
    )


def test_batch_validate_accepts_contract_and_names_bad_key() -> None:
    _batch().validate()
    bad = _batch()
    bad.action_is_pad = torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(ShapeError, match=r"action_is_pad: expected shape \[2, 4\], got \[2, 5\]"):
        bad.validate()
    bad = _batch()
    bad.state = bad.state.double()
    with pytest.raises(ShapeError, match=r"state: expected dtype torch\.float32, got torch\.float64"):
        bad.validate()
    bad = _batch()
    bad.images = {"top": bad.images["primary"]}
    bad.image_mask = {"top": bad.image_mask["primary"]}
    with pytest.raises(ShapeError, match="unknown camera slot"):
        bad.validate()


def test_batch_to_moves_tensors() -> None:
    b = _batch().to("cpu")
    assert b.state.device.type == "cpu" and b.prompt == ["x", "x"]


def test_frame_validate_names_location() -> None:
    f = Frame(
        images={"wrist": np.zeros((4, 4, 3), np.uint8)},
        state=np.zeros(3, np.float32),
        action=np.zeros(2, np.float64),
        prompt="p",
        embodiment="e",
        dataset="d",
        episode=1,
        frame=2,
    )
    with pytest.raises(ShapeError, match="action in d episode 1 frame 2: expected dtype float32"):
        f.validate()


def test_registry_failed_loader_rolls_back_and_raises_again() -> None:
    reg: Registry[int] = Registry("thing")

    def loader() -> None:
        reg.register("ok", 1)
        raise ValueError("bad file things/b.yaml")

    reg.add_loader(loader)
    for _ in range(2):
        with pytest.raises(ValueError, match="bad file"):
            reg.get("ok")


@pytest.mark.parametrize(
    "name", sorted(p.stem for p in (Path(__file__).parents[1] / "configs" / "data").glob("*.yaml"))
)
def test_every_data_preset_loads_and_names_a_known_mixture(name: str) -> None:
    from vla.data.mixture import get_mixture

    cfg = load_config(DataConfig, name, kind="data")
    assert cfg.mixture is not None and get_mixture(cfg.mixture).datasets
