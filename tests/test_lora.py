"""LoRA adapters (``vla.models.lora``) on the tiny model: what is wrapped and trained, the adapters acting on the
training, cached-prefix sampling and compiled serving paths, exact merge into a plain checkpoint, adapter state
round trip, and the adapter size at the bench_smolvla config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vla.config import ConfigError
from vla.models.compiled import FrozenCompiled
from vla.models.hub import from_pretrained, save_pretrained
from vla.models.lora import (
    TARGETS,
    LoraSettings,
    apply_lora,
    has_lora,
    load_lora_state_dict,
    lora_parameter_names,
    lora_state_dict,
    merge_lora,
)
from vla.models.policies.flow_vla import FlowVLA
from vla.models.testing import synthetic_batch, tiny_model
from vla.types import Batch

BATCH = 2
STEPS = 3  # Euler steps: enough to run the cached expert passes repeatedly, cheap on 2 cores


def _randomize_adapters(model: FlowVLA, seed: int = 1) -> None:
    """Non-zero B matrices (peft starts them at zero), so the adapters change what the model computes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _flow_inputs(model: FlowVLA, batch: Batch) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    t, noise = model.draw_flow_inputs(len(batch.prompt), batch.actions.shape[1], g)
    return {"time": t, "noise": noise}


def _outputs(model: FlowVLA, batch: Batch) -> dict[str, torch.Tensor]:
    """What each eager path computes: the per-sample training error, cached-prefix sampling (``extend`` + ``run`` +
    ``run_layers``) and the uncached joint pass."""
    with torch.no_grad():
        err = model.loss_terms(batch, **_flow_inputs(model, batch)).err
    return {
        "loss_terms": err,
        "sample_actions": model.sample_actions(
            batch, num_steps=STEPS, generator=torch.Generator().manual_seed(3)
        ),
        "sample_actions_uncached": model.sample_actions(
            batch, num_steps=STEPS, generator=torch.Generator().manual_seed(3), reuse_prefix=False
        ),
    }


@pytest.fixture(scope="module")
def base() -> FlowVLA:
    return tiny_model("smolvlm")


@pytest.fixture(scope="module")
def batch(base: FlowVLA) -> Batch:
    return synthetic_batch(base, batch_size=BATCH)


def _adapted(settings: LoraSettings | None = None) -> FlowVLA:
    return apply_lora(tiny_model("smolvlm"), settings or LoraSettings())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("r", 0),
        ("alpha", 0),
        ("dropout", 1.0),
        ("dropout", -0.1),
        ("targets", ()),
        ("targets", ("qkv",)),
        ("modules", ("vision",)),
        ("modules", ()),
    ],
)
def test_settings_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"finetune.lora.{field}"):
        LoraSettings(**{field: value})
    assert LoraSettings(targets=["q_proj"], modules=["expert"]).targets == ("q_proj",)  # YAML lists


def test_wraps_only_language_and_expert_projections_and_freezes_only_their_weights(base: FlowVLA) -> None:
    model = tiny_model("smolvlm")
    model.heads.requires_grad_(False)  # the caller's choice: apply_lora must keep it as it is
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    keys = set(model.state_dict())
    version = model.table_version
    apply_lora(model, LoraSettings(r=4))
    assert has_lora(model) and model.table_version == version + 1
    n_bb, n_ex = model.backbone.num_layers, len(model.expert.layers)
    expected = {f"expert.layers.{i}.{where}.{t}" for i in range(n_ex) for where, t in _places(TARGETS)}
    expected |= {f"backbone.layers.{i}.{where}.{t}" for i in range(n_bb - 1) for where, t in _places(TARGETS)}
    # the backbone's last layer keeps only its key/value projections
    expected |= {f"backbone.layers.{n_bb - 1}.self_attn.{t}" for t in ("k_proj", "v_proj")}
    wrapped = {n for n, m in model.named_modules() if hasattr(m, "base_layer")}
    assert wrapped == expected
    assert not any("vision" in n or "projector" in n for n in lora_parameter_names(model))
    assert len(lora_parameter_names(model)) == 2 * len(expected)
    params = dict(model.named_parameters())
    for name, flag in flags.items():
        owner, _, leaf = name.rpartition(".")
        if owner in expected:  # the wrapped weight moved under base_layer and is frozen
            assert name not in params and params[f"{owner}.base_layer.{leaf}"].requires_grad is False
        else:
            assert params[name].requires_grad is flag, name
    assert all(params[n].requires_grad for n in lora_parameter_names(model))
    # state-dict keys: only the wrapped weights move (under base_layer); the adapters are new
    moved = {k for k in keys if k.rpartition(".")[0] in expected}
    relocated = {f"{k.rpartition('.')[0]}.base_layer.{k.rpartition('.')[2]}" for k in moved}
    assert set(model.state_dict()) == (keys - moved) | relocated | set(lora_parameter_names(model))


def _places(targets: tuple[str, ...]) -> list[tuple[str, str]]:
    return [("mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn", t) for t in targets]


def test_modules_and_targets_select_where_adapters_go() -> None:
    model = _adapted(LoraSettings(targets=("v_proj",), modules=("expert",)))
    names = lora_parameter_names(model)
    assert names and all(n.startswith("expert.layers.") and ".v_proj.lora_" in n for n in names)
    assert len(names) == 2 * len(model.expert.layers)


def test_refuses_a_second_set_a_wrapper_and_an_fsdp2_sharded_model(tmp_path: Path) -> None:
    model = _adapted()
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, LoraSettings())
    with pytest.raises(TypeError, match="takes the FlowVLA itself"):
        apply_lora(torch.nn.Sequential(tiny_model("smolvlm")), LoraSettings())
    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge_lora(tiny_model("smolvlm"))

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        sharded = tiny_model("smolvlm")
        fully_shard(sharded.expert.layers[0])
        with pytest.raises(RuntimeError, match="apply_lora on a model sharded with FSDP2"):
            apply_lora(sharded, LoraSettings())
    finally:
        dist.destroy_process_group()


def test_fresh_adapters_compute_bitwise_what_the_base_computes(base: FlowVLA, batch: Batch) -> None:
    ref = _outputs(base, batch)
    got = _outputs(_adapted(), batch)
    for path, value in ref.items():
        assert torch.equal(got[path], value), path  # B = 0: the adapter adds exact zeros


@pytest.mark.parametrize("modules", [("backbone",), ("expert",)])
def test_adapters_act_on_every_eager_path_and_merge_exactly(
    base: FlowVLA, batch: Batch, modules: tuple[str, ...]
) -> None:
    """Each stack's adapters alone change the training error and both sampling paths; the merged plain model
    computes the same within 1e-4."""
    model = _adapted(LoraSettings(modules=modules))
    _randomize_adapters(model)
    ref, adapted = _outputs(base, batch), _outputs(model, batch)
    merged = merge_lora(model)
    assert not has_lora(merged) and "peft_config" not in vars(merged)
    got = _outputs(merged, batch)
    for path in ref:
        assert (adapted[path] - ref[path]).abs().max() > 1e-3, path
        torch.testing.assert_close(got[path], adapted[path], atol=1e-4, rtol=1e-4, msg=path)


def test_merged_model_is_a_plain_checkpoint(base: FlowVLA, batch: Batch, tmp_path: Path) -> None:
    model = tiny_model("smolvlm")
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    apply_lora(model, LoraSettings())
    _randomize_adapters(model)
    adapted = model.sample_actions(batch, num_steps=STEPS, generator=torch.Generator().manual_seed(3))
    merge_lora(model)
    assert list(model.state_dict()) == list(base.state_dict())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    save_pretrained(model, tmp_path / "merged")
    loaded = from_pretrained(tmp_path / "merged")
    assert not has_lora(loaded)
    actions = loaded.sample_actions(batch, num_steps=STEPS, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(actions, adapted, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # each serving compile takes ~1 minute on 2 CPU cores; the eager paths run above
def test_compiled_serving_uses_the_adapters(base: FlowVLA, batch: Batch, tmp_path: Path) -> None:
    model = _adapted()
    _randomize_adapters(model)
    eager = model.sample_actions(batch, num_steps=STEPS, generator=torch.Generator().manual_seed(3))
    ref = base.sample_actions(batch, num_steps=STEPS, generator=torch.Generator().manual_seed(3))
    model.prepare_inference(compile=True)
    assert isinstance(model._serving_step, FrozenCompiled)
    assert isinstance(model.backbone._run_layers, FrozenCompiled)
    compiled = model.sample_actions(batch, num_steps=STEPS, generator=torch.Generator().manual_seed(3))
    assert (compiled - ref).abs().max() > 1e-3
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    save_pretrained(merge_lora(model), tmp_path / "merged")
    loaded = from_pretrained(tmp_path / "merged").prepare_inference(compile=True)
    assert isinstance(loaded._serving_step, FrozenCompiled)
    actions = loaded.sample_actions(batch, num_steps=STEPS, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(actions, eager, atol=1e-4, rtol=1e-4)


def test_adapter_state_rebuilds_the_adapted_model_bitwise(batch: Batch) -> None:
    model = _adapted()
    _randomize_adapters(model)
    state = {k: v.clone() for k, v in lora_state_dict(model).items()}
    assert list(state) == lora_parameter_names(model) and all(".lora_" in k for k in state)
    rebuilt = _adapted()
    assert lora_parameter_names(rebuilt) == list(state)  # stable names
    load_lora_state_dict(rebuilt, state)
    ref, got = _outputs(model, batch), _outputs(rebuilt, batch)
    for path in ref:
        assert torch.equal(got[path], ref[path]), path

    with pytest.raises(ValueError, match="missing"):
        load_lora_state_dict(rebuilt, dict(list(state.items())[1:]))
    with pytest.raises(ValueError, match="rank r"):
        load_lora_state_dict(_adapted(LoraSettings(r=4)), state)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        load_lora_state_dict(tiny_model("smolvlm"), state)


def test_training_step_reaches_only_the_adapters_with_a_config_frozen_backbone(batch: Batch) -> None:
    """bench_smolvla-style config (vision and language frozen), adapters and embodiment tokens trained: the
    backbone's adapters get the full gradient (the same as with an unfrozen config, not only the summary token's
    share), every trainable tensor gets one (DDP's condition without find_unused_parameters), and an AdamW step
    changes no frozen tensor."""
    model = apply_lora(
        tiny_model("smolvlm", backbone={"freeze_vision": True, "freeze_language": True}).train(),
        LoraSettings(),
    )
    unfrozen = apply_lora(tiny_model("smolvlm", backbone={"freeze_vision": True}).train(), LoraSettings())
    _randomize_adapters(model)
    unfrozen.load_state_dict(model.state_dict())
    for m in (model, unfrozen):
        m.requires_grad_(False)
        for name in [*lora_parameter_names(m), "embodiment_tokens.weight"]:
            m.get_parameter(name).requires_grad_(True)
    inputs = _flow_inputs(model, batch)
    for m in (model, unfrozen):
        m.loss_terms(batch, **inputs).mean().backward()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(trainable) == sorted([*lora_parameter_names(model), "embodiment_tokens.weight"])
    for name in trainable:
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.abs().max() > 0, name
        torch.testing.assert_close(grad, unfrozen.get_parameter(name).grad, atol=1e-6, rtol=1e-5, msg=name)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1).step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) is (not p.requires_grad), name


def test_adapters_are_at_most_a_tenth_of_the_bench_model() -> None:
    """At the bench_smolvla config with r=16 the adapters are 2.8 % of what model.safetensors holds: 2.24M
    parameters (8.5 MiB in float32) vs 80.9M (309 MiB). Counted on the meta device: nothing is allocated."""
    from vla.embodiments import get_embodiment
    from vla.models.config import load_model_config
    from vla.models.meta import build_on_meta

    model = build_on_meta(load_model_config("bench_smolvla"), [get_embodiment("widowx_bridge")])
    full = sum(p.numel() for p in model.state_dict().values())  # what model.safetensors holds
    apply_lora(model, LoraSettings(r=16))
    adapters = sum(model.get_parameter(n).numel() for n in lora_parameter_names(model))
    assert adapters / full <= 0.10, (adapters, full)
