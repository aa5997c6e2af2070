"""The flow-matching VLA on tiny presets of the real HF classes: shapes, masking, prefix cache, golden values,
save/load, adding an embodiment, and overfitting a 2-episode dataset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vla.config import DataConfig, load_config
from vla.data.loader import build_loader
from vla.data.writers.synthetic import make_lerobot_dataset
from vla.embodiments import get_embodiment
from vla.models.hub import from_pretrained, save_pretrained
from vla.models.testing import synthetic_batch, tiny_model

GOLDEN = Path(__file__).parent / "assets" / "flow_vla_tiny_golden.safetensors"


@pytest.fixture(scope="module")
def model():
    return tiny_model("smolvlm")


def test_mixed_batch_shapes_and_masks(model) -> None:
    batch = synthetic_batch(model)
    loss, metrics = model.loss(batch, generator=torch.Generator().manual_seed(0))
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(metrics) == {"loss", "loss/widowx_bridge", "loss/franka_droid"}
    actions = model.sample_actions(batch, generator=torch.Generator().manual_seed(0))
    assert actions.shape == (4, 6, model.cfg.max_action_dim)
    for i, eid in enumerate(batch.embodiment_id.tolist()):
        spec = model.specs[eid]
        assert torch.all(actions[i, :, spec.action_dim :] == 0)  # dims past this embodiment's action dim
        assert torch.all(actions[i, min(spec.chunk_length, 6) :] == 0)  # steps past its chunk length
        assert actions[i, : min(spec.chunk_length, 6), : spec.action_dim].abs().sum() > 0


def test_padded_dims_and_steps_give_zero_loss_and_zero_gradient(model) -> None:
    batch = synthetic_batch(model)
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    base, _ = model.loss(batch, generator=gen())
    # garbage where the masks say "not there": padded action dims and steps past the episode end
    batch.actions = batch.actions.clone()
    batch.actions[~batch.action_mask[:, None, :].expand_as(batch.actions)] = 1e3
    batch.actions[0, -2:] = -1e3  # sample 0's padded steps
    batch.actions.requires_grad_(True)
    loss, _ = model.loss(batch, generator=gen())
    assert torch.allclose(loss, base, atol=1e-6)
    loss.backward()
    grad = batch.actions.grad
    assert torch.all(grad[~batch.action_mask[:, None, :].expand_as(grad)] == 0)
    assert torch.all(grad[0, -2:] == 0)
    assert grad[1].abs().sum() > 0  # real entries do get gradient


def test_cached_prefix_sampling_equals_recomputing_it(model) -> None:
    batch = synthetic_batch(model)
    a = model.sample_actions(batch, generator=torch.Generator().manual_seed(5))
    b = model.sample_actions(batch, generator=torch.Generator().manual_seed(5), reuse_prefix=False)
    assert torch.allclose(a, b, atol=1e-5)


def test_absent_camera_is_masked_not_attended(model) -> None:
    batch = synthetic_batch(model)
    wrist = batch.image_mask["wrist"]
    assert not wrist.all()
    a = model.sample_actions(batch, generator=torch.Generator().manual_seed(1))
    batch.images["wrist"][~wrist] = 255  # pixels of an absent camera must not matter
    b = model.sample_actions(batch, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a[~wrist], b[~wrist])


@pytest.mark.parametrize("family", ["smolvlm", "paligemma"])
def test_golden_loss_and_actions(family: str) -> None:
    golden = load_file(str(GOLDEN))
    m = tiny_model(family)
    batch = synthetic_batch(m)
    with torch.no_grad():
        loss, _ = m.loss(batch, generator=torch.Generator().manual_seed(7))
    actions = m.sample_actions(batch, generator=torch.Generator().manual_seed(11))
    msg = "regenerate with scripts/make_golden.py only if the change in numbers is intended"
    torch.testing.assert_close(loss.reshape(1), golden[f"{family}/loss"], atol=1e-4, rtol=1e-4, msg=msg)
    torch.testing.assert_close(actions, golden[f"{family}/actions"], atol=1e-4, rtol=1e-4, msg=msg)


def test_save_load_gives_identical_outputs(model, tmp_path: Path) -> None:
    batch = synthetic_batch(model)
    out = save_pretrained(model, tmp_path / "ckpt")
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "backbone",
        "embodiments",
        "README.md",
    }
    loaded = from_pretrained(out).eval()
    assert loaded.embodiment_ids == model.embodiment_ids
    g = lambda: torch.Generator().manual_seed(2)  # noqa: E731
    assert torch.equal(
        model.sample_actions(batch, generator=g()), loaded.sample_actions(batch, generator=g())
    )
    with torch.no_grad():
        assert torch.equal(model.loss(batch, generator=g())[0], loaded.loss(batch, generator=g())[0])
    assert "widowx_bridge" in (out / "README.md").read_text()


def test_load_rejects_mismatched_weights(model, tmp_path: Path) -> None:
    out = save_pretrained(model, tmp_path / "ckpt")
    import json

    cfg = json.loads((out / "config.json").read_text())
    cfg["model"]["expert"]["width_ratio"] = 0.5
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match the architecture"):
        from_pretrained(out)


def test_adding_an_embodiment_leaves_the_others_unchanged() -> None:
    m = tiny_model("smolvlm")
    batch = synthetic_batch(m)
    g = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    before = m.sample_actions(batch, generator=g())
    new = get_embodiment("ur5_autolab")
    idx = m.add_embodiment(new)
    assert idx == 2 and m.embodiment_ids["ur5_autolab"] == 2
    assert m.most_similar(get_embodiment("ur5_autolab")) == "ur5_autolab"
    assert torch.equal(m.sample_actions(batch, generator=g()), before)
    # the new slot starts as a copy of the most similar embodiment and runs in a mixed batch
    mixed = synthetic_batch(m, embodiments=["ur5_autolab", "widowx_bridge", "franka_droid", "ur5_autolab"])
    loss, metrics = m.loss(mixed, generator=g())
    assert torch.isfinite(loss) and "loss/ur5_autolab" in metrics
    with pytest.raises(ValueError, match="already in this model"):
        m.add_embodiment(new)


def test_embodiment_id_outside_table_is_a_clear_error(model) -> None:
    batch = synthetic_batch(model)
    batch.embodiment_id = batch.embodiment_id + 5
    with pytest.raises(ValueError, match=r"embodiment_ids=model\.embodiment_ids"):
        model.sample_actions(batch)


def test_tiny_model_overfits_two_episodes(tmp_path: Path) -> None:
    path = make_lerobot_dataset(
        tmp_path / "two",
        num_episodes=2,
        episode_length=8,
        state_dim=7,
        action_dim=7,
        cameras={"primary": (32, 40)},
        robot_type="widowx_bridge",
        fps=5,
    )
    torch.manual_seed(0)
    m = tiny_model("smolvlm", embodiments=("widowx_bridge",), chunk_length=4).train()
    cfg = load_config(
        DataConfig,
        {
            "datasets": [str(path)],
            "normalize": False,
            "batch_size": 16,
            "chunk_length": 4,
            "image_size": 0,
            "shuffle": False,
        },
    )
    batch = next(iter(build_loader(cfg, embodiment_ids=m.embodiment_ids)))
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=2e-3, weight_decay=0.0)

    def eval_loss() -> float:
        with torch.no_grad():
            return float(m.loss(batch, generator=torch.Generator().manual_seed(123))[0])

    initial = eval_loss()
    for _ in range(400):
        loss, _ = m.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert eval_loss() < 0.05 * initial


def test_cli_model_init_and_info(tmp_path: Path, capsys) -> None:
    from vla.cli import main
    from vla.data.stats import write_stats

    data = make_lerobot_dataset(
        tmp_path / "d",
        num_episodes=2,
        episode_length=6,
        state_dim=7,
        action_dim=7,
        cameras={"primary": (32, 40)},
        robot_type="widowx_bridge",
        video=False,
    )
    write_stats(data, progress=False)
    out = tmp_path / "ckpt"
    assert (
        main(
            [
                "model",
                "init",
                "tiny_smolvlm",
                "--out",
                str(out),
                "--embodiment",
                "widowx_bridge",
                "--stats-from",
                str(data),
                "--set",
                "flow.num_steps=4",
            ]
        )
        == 0
    )
    model = from_pretrained(out)
    assert model.cfg.flow.num_steps == 4 and list(model.embodiment_ids) == ["widowx_bridge"]
    assert model.norm_stats is not None and model.norm_stats.get("widowx_bridge", "action") is not None
    capsys.readouterr()
    assert main(["model", "info", str(out), "--json"]) == 0
    import json

    info = json.loads(capsys.readouterr().out)
    counts = info["parameters"]
    assert counts["all"]["total"] == sum(p.numel() for p in model.parameters())
    assert counts["all"]["total"] == sum(v["total"] for k, v in counts.items() if k != "all")
    assert main(["model", "info", "tiny_smolvlm", "--embodiment", "franka_droid"]) == 0
    text = capsys.readouterr().out
    assert "expert" in text and "franka_droid" in text
    assert main(["model", "init", "tiny_smolvl", "--out", str(tmp_path / "x")]) == 2
    assert "Did you mean tiny_smolvlm" in capsys.readouterr().err


def test_gradient_checkpointing_gives_the_same_loss_and_gradients() -> None:
    batch = None
    grads = []
    for ckpt in (False, True):
        m = tiny_model(
            "smolvlm",
            seed=0,
            backbone={"pretrained": "tiny:smolvlm", "freeze_vision": False, "gradient_checkpointing": ckpt},
        ).train()
        batch = batch or synthetic_batch(m)
        loss, _ = m.loss(batch, generator=torch.Generator().manual_seed(9))
        loss.backward()
        grads.append(
            (loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        )
    (l0, g0), (l1, g1) = grads
    assert torch.allclose(l0, l1, atol=1e-6)
    assert g0.keys() == g1.keys() and any(k.startswith("backbone.layers") for k in g0)
    for k in g0:
        torch.testing.assert_close(g0[k], g1[k], atol=1e-5, rtol=1e-4)


def test_frozen_backbone_trains_only_expert_and_heads() -> None:
    m = tiny_model(
        "smolvlm", backbone={"pretrained": "tiny:smolvlm", "freeze_vision": True, "freeze_language": True}
    )
    counts = m.parameter_counts()
    assert counts["vision"]["trainable"] == counts["language"]["trainable"] == 0
    assert counts["embodiment_tokens"]["trainable"] == 0  # unreachable through frozen layers (see FlowVLA)
    assert counts["expert"]["trainable"] == counts["expert"]["total"] > 0
    loss, _ = m.train().loss(synthetic_batch(m), generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert all(p.grad is None for p in m.backbone.parameters())
    assert all(p.grad is not None for p in m.expert.parameters())


@pytest.mark.slow
def test_compiled_expert_matches_eager() -> None:
    eager = tiny_model("smolvlm", seed=0)
    compiled = tiny_model("smolvlm", seed=0, expert={"compile": True})
    batch = synthetic_batch(eager)
    a = eager.sample_actions(batch, generator=torch.Generator().manual_seed(1))
    b = compiled.sample_actions(batch, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_bf16_inference_is_close_to_fp32() -> None:
    m = tiny_model("smolvlm")
    batch = synthetic_batch(m)
    ref = m.sample_actions(batch, generator=torch.Generator().manual_seed(0))
    out = m.prepare_inference("bfloat16").sample_actions(batch, generator=torch.Generator().manual_seed(0))
    assert out.dtype == torch.float32 and next(m.expert.parameters()).dtype == torch.bfloat16
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
