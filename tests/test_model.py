"""The flow-matching VLA on tiny presets of the real HF classes: shapes, masking, prefix cache, golden values,
save/load, adding an embodiment, and overfitting a 2-episode dataset."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vla.config import DataConfig, load_config
from vla.data.loader import build_loader
from vla.data.writers.synthetic import make_lerobot_dataset
from vla.embodiments import get_embodiment
from vla.models.hub import from_pretrained, save_pretrained
from vla.models.policies.flow_vla import FlowVLA
from vla.models.testing import synthetic_batch, tiny_model
from vla.types import Batch

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


def test_load_refuses_other_checkpoint_format_versions(model, tmp_path: Path) -> None:
    import json

    out = save_pretrained(model, tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    for version, message in (
        (1, "before the embodiment token became a summary token"),
        (99, "not supported"),
    ):
        cfg["vla_format_version"] = version
        (out / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=message):
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
    with pytest.raises(ValueError, match=r"embodiment_ids=model\.embodiment_ids"):
        model.loss(batch)


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
    assert counts["embodiment_tokens"]["trainable"] == counts["embodiment_tokens"]["total"] > 0
    assert counts["expert"]["trainable"] == counts["expert"]["total"] > 0
    batch = synthetic_batch(m)
    loss, _ = m.train().loss(batch, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert all(p.grad is None for p in m.backbone.parameters())
    assert all(p.grad is not None for p in m.expert.parameters())
    # The embodiment token learns through the frozen layers (its own row re-run with autograd), with exactly the
    # gradient full backpropagation through the backbone gives.
    full = tiny_model("smolvlm")
    full.load_state_dict(m.state_dict())
    ref, _ = full.train().loss(batch, generator=torch.Generator().manual_seed(0))
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    grad = m.embodiment_tokens.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    torch.testing.assert_close(grad, full.embodiment_tokens.weight.grad, atol=1e-6, rtol=1e-4)


def test_embodiment_token_is_a_summary_token_images_and_prompt_do_not_see_it(model) -> None:
    batch = synthetic_batch(model)
    with torch.no_grad():
        a = model.compute_prefix(batch)
        model.embodiment_tokens.weight.add_(1.0)
        b = model.compute_prefix(batch)
        model.embodiment_tokens.weight.sub_(1.0)
    for ka, kb in zip(a.keys + a.values, b.keys + b.values, strict=True):
        torch.testing.assert_close(ka[:, :, :-1], kb[:, :, :-1], atol=0, rtol=0)  # images + prompt unchanged
        assert not torch.allclose(ka[:, :, -1], kb[:, :, -1])  # the token itself changed


def _loss_and_expert_grads(m: FlowVLA, batch: Batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    m.train()
    loss, _ = m.loss(batch, generator=torch.Generator().manual_seed(1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.expert.parameters() if p.grad is not None]


def _compiled_with(monkeypatch, backend: Callable) -> FlowVLA:
    """A tiny model with ``model.expert.compile``, its ``torch.compile`` given ``backend``."""
    real_compile = torch.compile
    with monkeypatch.context() as patch:
        patch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=backend, **kw))
        return tiny_model("smolvlm", seed=0, expert={"compile": True})


def test_expert_compile_is_the_training_path(monkeypatch) -> None:
    """``model.expert.compile`` compiles the expert forward of the training path (``loss`` -> ``velocity``): a
    recording backend sees its graph and gives eager's loss, and a deliberately wrong backend (outputs negated)
    changes the loss, so a comparison of compiled against eager would catch a bad compile."""
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    def negating(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(*args: torch.Tensor) -> object:
            out = gm.forward(*args)
            return type(out)(-o if isinstance(o, torch.Tensor) else o for o in out)

        return run

    eager = tiny_model("smolvlm", seed=0)
    batch = synthetic_batch(eager)
    ref, _ = _loss_and_expert_grads(eager, batch)
    loss, _ = _loss_and_expert_grads(_compiled_with(monkeypatch, recording), batch)
    assert len(graphs) >= 1, "the compiled expert forward never ran"
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    wrong, _ = _loss_and_expert_grads(_compiled_with(monkeypatch, negating), batch)
    assert (wrong - ref).abs() > 1e-3


@pytest.mark.slow
def test_compiled_expert_matches_eager(monkeypatch) -> None:
    """Inductor's compile of the expert forward (what ``model.expert.compile`` gives) matches eager in loss and
    expert gradients (slow: an Inductor forward + backward compile takes minutes on 2 CPU cores)."""
    from torch._inductor.compile_fx import compile_fx

    graphs: list[torch.fx.GraphModule] = []

    def recording_inductor(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    eager = tiny_model("smolvlm", seed=0)
    batch = synthetic_batch(eager)
    ref_loss, ref_grads = _loss_and_expert_grads(eager, batch)
    loss, grads = _loss_and_expert_grads(_compiled_with(monkeypatch, recording_inductor), batch)
    assert len(graphs) >= 1, "the compiled expert forward never ran"
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert len(grads) == len(ref_grads) > 0
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-4)


def test_compiled_serving_matches_eager_and_never_serves_stale_weights() -> None:
    """prepare_inference(compile=True) freezes weights into the compiled graphs: changed weights must never be
    served from them (train() drops them; a second prepare_inference and any in-place update recompile). Dropping
    them leaves every other compiled function of the process its graphs (e.g. a compiled training step). Two
    language and expert layers (of the tiny model's four): a stack, at two thirds of the compile time (three
    compiles here, their Inductor lowering the bulk of this test's minutes on a slow CPU)."""
    layers = {"backbone": {"num_vlm_layers": 2}, "expert": {"num_layers": 2}}
    graphs = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=counting_backend)
    def unrelated(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2

    unrelated(torch.ones(3))
    assert len(graphs) == 1
    m = tiny_model("smolvlm", seed=0, **layers)
    batch = synthetic_batch(m)
    original = {k: v.clone() for k, v in m.state_dict().items()}

    def sample(model: FlowVLA) -> torch.Tensor:
        return model.sample_actions(batch, generator=torch.Generator().manual_seed(1))

    def eager(state: dict) -> torch.Tensor:
        fresh = tiny_model("smolvlm", seed=0, **layers)
        fresh.load_state_dict(state)
        return sample(fresh)

    ref = sample(m)
    m.prepare_inference("float32", compile=True)
    torch.testing.assert_close(sample(m), ref, atol=1e-4, rtol=1e-4)
    m.train()  # e.g. a fine-tuning step after serving
    with torch.no_grad():
        m.heads.action_out.bias.add_(0.5)
        m.expert.layers[0].mlp.down_proj.weight.mul_(2.0)
        m.backbone.layers[0].mlp.down_proj.weight.mul_(2.0)
    m.eval()
    new = sample(m)
    assert (new - ref).abs().max() > 0.1
    torch.testing.assert_close(new, eager(m.state_dict()))
    # compiled again, with the explicit attention kernel: must not reuse the first graphs
    m.prepare_inference("float32", compile=True, attention="explicit")
    torch.testing.assert_close(sample(m), new, atol=1e-4, rtol=1e-4)
    # ... and Inductor does not turn the explicit form back into SDPA (the vision tower's included): on CPUs where
    # the fused kernel is the slower one, that rewrite undid the choice
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sample(m)
    ops = {e.key for e in prof.key_averages()}
    assert not {op for op in ops if "scaled_dot_product" in op} and "aten::baddbmm" in ops, sorted(ops)
    with pytest.raises(ValueError, match="compiled serving graphs run the kernel they were compiled with"):
        m.set_inference_attention("sdpa")  # the graphs were traced with "explicit"
    m.load_state_dict(original)  # hot reload without train(): recompiled on the next call
    torch.testing.assert_close(sample(m), ref, atol=1e-4, rtol=1e-4)
    m.prepare_inference("float32")  # not compiled any more, the backbone included
    assert m._serving_step is None and m.backbone._run_layers == m.backbone.run_layers
    unrelated(torch.ones(3))
    assert len(graphs) == 1  # compiled once, still cached through every serving (re)compile and drop


def test_inference_attention_kernel_is_set_by_prepare_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_inference(attention="explicit") runs every language layer's attention with the explicit three-op
    form (the same chunk as SDPA within float32 rounding, within bf16's in bf16); train() puts "auto" back (a
    measured kernel for passes without a gradient); an unknown kernel is refused, naming the allowed ones."""
    from train_helpers import count_attention_kernels

    from vla.models.attention import INFERENCE_ATTENTION

    calls = count_attention_kernels(monkeypatch)
    m = tiny_model("smolvlm").eval()
    batch = synthetic_batch(m)
    noise = torch.randn(4, 6, m.cfg.max_action_dim, generator=torch.Generator().manual_seed(2))

    def chunk(attention: str, dtype: str = "float32") -> torch.Tensor:
        calls.update(dict.fromkeys(calls, 0))
        out = m.prepare_inference(dtype, attention=attention).sample_actions(batch, noise=noise)
        assert m.inference_attention == attention
        assert calls[attention] > 0 and sum(calls.values()) == calls[attention], calls
        return out

    ref = chunk("sdpa")
    torch.testing.assert_close(chunk("explicit"), ref, atol=1e-5, rtol=1e-5)
    # the vision tower's attention layers run the chosen kernel too (HF attention implementation "vla")
    vision_layers = [x for x in m.backbone.vision.modules() if getattr(x, "vla_vision_attention", False)]
    assert vision_layers and m.backbone.vision.config._attn_implementation == "vla"
    # whole images only: the tower attends over every patch (no mask); a padded patch mask is refused, not ignored
    from vla.models.attention import full_image_mask

    assert full_image_mask(attention_mask=torch.ones(2, 16, dtype=torch.bool)) is None
    with pytest.raises(ValueError, match="whole images only"):
        full_image_mask(attention_mask=torch.tensor([[True, False]]))
    for kernel in INFERENCE_ATTENTION:
        m.prepare_inference("float32", attention=kernel)
        calls.update(dict.fromkeys(calls, 0))
        with torch.no_grad():
            m.backbone.encode_pixels(torch.zeros(2, 3, m.backbone.image_size, m.backbone.image_size))
        assert calls == {**dict.fromkeys(calls, 0), kernel: len(vision_layers)}, calls
    # an eager serving model switches kernels in place (vla serve's interleaved timing), not preparing again
    m.prepare_inference("float32", attention="sdpa").set_inference_attention("explicit")
    calls.update(dict.fromkeys(calls, 0))
    torch.testing.assert_close(m.sample_actions(batch, noise=noise), ref, atol=1e-5, rtol=1e-5)
    assert m.inference_attention == "explicit" and calls["explicit"] > 0 == calls["sdpa"], calls
    with pytest.raises(ValueError, match="attention must be one of"):
        m.set_inference_attention("flash")
    assert (chunk("explicit", "bfloat16") - chunk("sdpa", "bfloat16")).abs().max() < 0.02 * ref.abs().max()
    m.train()
    assert m.inference_attention == "auto"
    with pytest.raises(ValueError, match=r"attention must be one of \('sdpa', 'explicit'\), got 'flash'"):
        m.prepare_inference("float32", attention="flash")


def test_bf16_inference_is_close_to_fp32() -> None:
    m = tiny_model("smolvlm")
    batch = synthetic_batch(m)
    ref = m.sample_actions(batch, generator=torch.Generator().manual_seed(0))
    out = m.prepare_inference("bfloat16").sample_actions(batch, generator=torch.Generator().manual_seed(0))
    assert out.dtype == torch.float32 and next(m.expert.parameters()).dtype == torch.bfloat16
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def _sample(batch: Batch, i: int) -> Batch:
    """Sample ``i`` of ``batch`` as a batch of one (every camera slot kept, present or not)."""
    return batch.rows(slice(i, i + 1))


@pytest.mark.parametrize("family", ["smolvlm", "paligemma", "paligemma2"])
def test_a_sample_is_independent_of_the_rest_of_its_batch(family: str) -> None:
    """Padded prompt tokens, other samples' cameras and other embodiments' heads never reach a sample."""
    model = tiny_model(family)
    batch = synthetic_batch(model)
    lengths = {int(model.backbone.tokenize([p], torch.device("cpu"))[1].sum()) for p in batch.prompt}
    assert len(lengths) > 1  # the mixed batch pads some prompts
    assert not batch.image_mask["wrist"].all()  # and masks an absent camera slot
    noise = torch.randn(4, 6, model.cfg.max_action_dim, generator=torch.Generator().manual_seed(6))
    mixed = model.sample_actions(batch, noise=noise)
    for i in range(batch.batch_size):
        h = int(model.chunk_lengths[batch.embodiment_id[i]])
        alone = model.sample_actions(_sample(batch, i), noise=noise[i : i + 1, :h])
        torch.testing.assert_close(alone[0], mixed[i, :h], atol=1e-5, rtol=1e-4)


def test_expert_mask_state_sees_no_actions_and_nobody_sees_invalid_steps(model) -> None:
    batch = synthetic_batch(model)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        prefix = model.compute_prefix(batch)
        x = torch.randn(4, 7, model.expert.width, generator=g)  # [state, 6 actions]
        valid = torch.ones(4, 7, dtype=torch.bool)
        valid[:, 5:] = False  # the last two action steps are past the chunk
        out = model.expert(x, prefix, valid)
        y = x.clone()
        y[:, 1:] += torch.randn(
            4, 6, model.expert.width, generator=g
        )  # other actions: the state must not care
        torch.testing.assert_close(model.expert(y, prefix, valid)[:, 0], out[:, 0], atol=0, rtol=0)
        z = x.clone()
        z[:, 5:] = 1e3  # invalid steps: no valid token may care
        torch.testing.assert_close(model.expert(z, prefix, valid)[:, :5], out[:, :5], atol=0, rtol=0)


def test_embodiment_linear_mixed_batch_gradients_match_per_sample_ones() -> None:
    from vla.models.heads import EmbodimentLinear, route

    torch.manual_seed(0)
    lin = EmbodimentLinear(3, 5, 4)
    x, ids = torch.randn(4, 2, 5), torch.tensor([2, 0, 2, 0])  # slot 1 absent from the batch
    r = torch.randn(4, 2, 4)
    (lin(x, ids) * r).sum().backward()
    mixed = lin.weight.grad.clone(), lin.bias.grad.clone()
    lin.zero_grad()
    for i in range(4):  # one sample at a time: the single-embodiment (plain matmul) path
        (lin(x[i : i + 1], route(ids[i : i + 1])) * r[i : i + 1]).sum().backward()
    torch.testing.assert_close(mixed[0], lin.weight.grad)
    torch.testing.assert_close(mixed[1], lin.bias.grad)
    assert torch.all(mixed[0][1] == 0) and torch.all(mixed[1][1] == 0)


def test_loss_is_masked_mse_on_the_flow_velocity(model, monkeypatch) -> None:
    """x_t = t * noise + (1 - t) * actions, target u = noise - actions = (x_t - actions) / t, averaged over valid
    dims and non-padded steps only (sample 1's last step is padding inside its chunk)."""
    batch = synthetic_batch(model)
    batch.action_is_pad[1, -1] = True
    seen = {}
    velocity = model.velocity

    def spy(prefix, state, ids, x_t, t, step_valid, slots=None):
        v = velocity(prefix, state, ids, x_t, t, step_valid, slots)
        seen.update(x_t=x_t, t=t, v=v, step_valid=step_valid)
        return v

    monkeypatch.setattr(model, "velocity", spy)
    with torch.no_grad():
        loss, _ = model.loss(batch, generator=torch.Generator().manual_seed(5))
    t = seen["t"][:, None, None]
    assert torch.all((seen["t"] >= model.cfg.flow.t_min) & (seen["t"] <= 1))
    a = batch.state.new_zeros(4, 6, model.cfg.max_action_dim)
    a[..., : batch.actions.shape[-1]] = batch.actions
    dims = torch.zeros(4, model.cfg.max_action_dim, dtype=torch.bool)
    dims[:, : batch.action_mask.shape[1]] = batch.action_mask
    w = dims[:, None, :] & seen["step_valid"][:, :, None] & ~batch.action_is_pad[:, :, None]
    err = (seen["v"] - (seen["x_t"] - a) / t) ** 2
    torch.testing.assert_close(loss, err[w].mean(), atol=1e-5, rtol=1e-4)


def test_euler_sampling_runs_from_noise_at_t1_to_actions_at_t0(model, monkeypatch) -> None:
    """With the exact velocity of a straight path to ``target`` (v = (x - target) / t), Euler lands on it."""
    batch = synthetic_batch(model)
    target = torch.randn(4, 6, model.cfg.max_action_dim, generator=torch.Generator().manual_seed(2))
    times = []

    def exact(plan, slots, x, t):
        times.append(float(t[0]))
        return (x - target) / t[:, None, None]

    monkeypatch.setattr(model, "flow_step", exact)
    out = model.sample_actions(batch, num_steps=4, generator=torch.Generator().manual_seed(0))
    assert times == [1.0, 0.75, 0.5, 0.25]
    ids = batch.embodiment_id
    step_valid = torch.arange(6)[None] < model.chunk_lengths[ids][:, None]
    dims = torch.arange(model.cfg.max_action_dim)[None] < model.action_dims[ids][:, None]
    torch.testing.assert_close(
        out, target * (step_valid[:, :, None] & dims[:, None, :]), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        model.sample_actions(batch, num_steps=0)


def test_save_load_after_add_embodiment_rebuilds_exactly(tmp_path: Path, monkeypatch) -> None:
    m = tiny_model("smolvlm")
    m.add_embodiment(get_embodiment("ur5_autolab"))
    with torch.no_grad():  # make the new slot differ from its source, so a wrong slot order shows
        m.heads.action_out.bias[2] += 0.5
        m.embodiment_tokens.weight[2] += 0.1
    out = save_pretrained(m, tmp_path / "ckpt")
    assert (out / "backbone" / "tokenizer.json").is_file() and (
        out / "embodiments" / "ur5_autolab.yaml"
    ).is_file()
    from vla.models import tiny

    # everything comes from the folder: no tiny preset (or hub download) is needed to load it
    monkeypatch.setattr(tiny, "make_tiny_backbone", lambda *a, **k: pytest.fail("preset rebuilt"))
    loaded = from_pretrained(out).eval()
    assert loaded.embodiment_ids == m.embodiment_ids and loaded.cfg == m.cfg
    assert (
        loaded.backbone.tokenizer("pick up the cup").input_ids
        == m.backbone.tokenizer("pick up the cup").input_ids
    )
    batch = synthetic_batch(m, embodiments=["ur5_autolab", "widowx_bridge", "franka_droid", "ur5_autolab"])
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    assert torch.equal(m.sample_actions(batch, generator=g()), loaded.sample_actions(batch, generator=g()))


def test_bf16_inference_keeps_rope_frequencies_in_float32() -> None:
    m = tiny_model("smolvlm")
    before = m.backbone.rotary.inv_freq.clone()
    m.prepare_inference("bfloat16")
    assert m.backbone.rotary.inv_freq.dtype == torch.float32 and torch.equal(
        m.backbone.rotary.inv_freq, before
    )
    assert m.expert.rotary is m.backbone.rotary


def test_smolvlm_image_size_must_pixel_shuffle_evenly() -> None:
    with pytest.raises(ValueError, match=r"multiple of patch_size x scale_factor = 16 px"):
        tiny_model("smolvlm", backbone={"pretrained": "tiny:smolvlm", "image_size": 72})
    assert (
        tiny_model("smolvlm", backbone={"pretrained": "tiny:smolvlm", "image_size": 96}).backbone.image_size
        == 96
    )


@pytest.mark.parametrize("family", ["smolvlm", "paligemma", "paligemma2"])
def test_hand_driven_decoder_layer_equals_the_hf_layer(family: str) -> None:
    """vla.models.attention's forward of a HF layer (SDPA, Gemma2 sandwich norms and logit soft-capping): same
    output as the layer's own eager forward under the same mask, with the same parameters."""
    import copy

    from transformers import AutoModelForImageTextToText

    from vla.models.attention import shared_kv
    from vla.models.tiny import tiny_backbone_path

    hf = AutoModelForImageTextToText.from_pretrained(tiny_backbone_path(family), attn_implementation="eager")
    text = hf.model.text_model if family == "smolvlm" else hf.model.language_model
    layer = text.layers[1]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-trivial norms and large logits, so every norm and the soft-cap matter
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    if family == "paligemma2":
        layer.self_attn.attn_logit_softcapping = 1.0
    h = 3 * torch.randn(2, 10, 64, generator=g)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, 7:] = False
    mask = (valid[:, None, :] | torch.eye(10, dtype=torch.bool)[None]).unsqueeze(1)
    positions = torch.arange(10)[None].expand(2, -1)
    cos, sin = text.rotary_emb(h, positions)
    ours_layer = shared_kv(copy.deepcopy(layer))
    assert dict(ours_layer.named_parameters()).keys() == dict(layer.named_parameters()).keys()
    with torch.no_grad():
        ours, _ = ours_layer(h, cos, sin, mask)
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        theirs = layer(h, attention_mask=additive, position_embeddings=(cos, sin), position_ids=positions)
    torch.testing.assert_close(ours, theirs[0] if isinstance(theirs, tuple) else theirs, atol=1e-5, rtol=1e-5)


def test_sequences_longer_than_a_sliding_window_are_refused() -> None:
    from types import SimpleNamespace

    from vla.models.attention import check_window

    gemma2 = SimpleNamespace(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    check_window(gemma2, 8, "the prefix")
    with pytest.raises(
        ValueError, match="the prefix has 9 tokens, more than the backbone's sliding_window 8"
    ):
        check_window(gemma2, 9, "the prefix")
    check_window(SimpleNamespace(sliding_window=None), 10**6, "the prefix")  # Llama / Gemma: no window


def test_grouped_attention_equals_sdpa_values_and_gradients() -> None:
    import torch.nn.functional as F

    from vla.models.attention import grouped_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 9, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 9, 8, generator=g, requires_grad=True)
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True  # every row sees something
    r = torch.randn(2, 6, 5, 8, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    grads_ref = torch.autograd.grad((ref * r).sum(), (q, k, v))
    out = grouped_attention(q, k, v, mask, 0.3)
    grads = torch.autograd.grad((out * r).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # bf16 (inputs, and autocast on float32 inputs): SDPA's values within bf16 rounding, in the compute dtype
    with torch.no_grad():
        lo = grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = grouped_attention(q, k, v, mask, 0.3)
    assert lo.dtype == auto.dtype == torch.bfloat16
    torch.testing.assert_close(lo.float(), ref.detach(), atol=0.03, rtol=0.03)
    torch.testing.assert_close(auto.float(), ref.detach(), atol=0.03, rtol=0.03)
    # a row with no key allowed gets uniform weights (HF's eager attention): the mean of the values
    mask[0, 0, 2] = False
    out = grouped_attention(q, k, v, mask, 0.3).detach()
    torch.testing.assert_close(out[0, :, 2], v[0].detach().mean(1).repeat_interleave(3, 0))


def test_masked_grouped_query_sdpa_repeats_kv_where_the_device_needs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA a masked ``enable_gqa`` call can only take SDPA's math kernel, so ``attend`` repeats K/V there; the
    values and gradients must equal the grouped call's (checked here by taking that path on CPU)."""
    from vla.models import attention

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 5, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 9, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 9, 8, generator=g, requires_grad=True)
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True
    r = torch.randn(2, 6, 5, 8, generator=g)

    def run() -> tuple[torch.Tensor, ...]:
        outs = [attention.attend(kernel, q, k, v, mask, 0.3) for kernel in ("sdpa", "sdpa_fp32")]
        return (*outs, *torch.autograd.grad((outs[0] * r).sum(), (q, k, v)))

    assert not attention._repeat_kv_for_masked_sdpa("cpu") and attention._repeat_kv_for_masked_sdpa("cuda")
    grouped = run()
    calls: list[str] = []
    monkeypatch.setattr(attention, "_repeat_kv_for_masked_sdpa", lambda device: calls.append(device) or True)
    repeated = run()
    assert calls == ["cpu", "cpu"]
    for a, b in zip(repeated, grouped, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
