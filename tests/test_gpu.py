"""What a CUDA machine must pass (marker ``gpu``; ``make test-gpu`` runs them, every other run skips them):
CPU/GPU numerical agreement, a bf16-autocast training step (and one that never waits on the GPU), compiled serving
on CUDA, masked grouped-query attention on the efficient kernel, and `vla train` checkpointing and resuming on the
GPU.

Tiny seeded models as everywhere else; noise and flow time come from CPU generators, so both devices see the same
draws."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from vla.models.policies.flow_vla import FlowVLA
from vla.models.testing import synthetic_batch, tiny_model
from vla.types import Batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"
    ),
]

FAMILIES = ("smolvlm", "paligemma")


def _draws(model: FlowVLA, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    return model.draw_flow_inputs(len(batch.prompt), batch.actions.shape[1], torch.Generator().manual_seed(1))


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    """Full float32 matmuls on CUDA (TF32 would differ from the CPU by ~1e-3 relative)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _on_cuda(model: FlowVLA) -> FlowVLA:
    cuda = tiny_model(model.cfg.backbone.family, seed=0).cuda()
    cuda.load_state_dict(model.state_dict())
    return cuda


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_and_cuda_agree_in_float32(family: str) -> None:
    """Same weights and draws: loss, expert gradients and sampled chunks agree between CPU and CUDA (TF32 off)."""
    cpu = tiny_model(family, seed=0)
    batch = synthetic_batch(cpu)
    time, noise = _draws(cpu, batch)
    with _no_tf32():
        cuda = _on_cuda(cpu)
        losses, grads, chunks = [], [], []
        for m in (cpu, cuda):
            m.train()
            terms = m.loss_terms(batch, noise=noise, time=time)
            loss = terms.err.sum() / terms.weight.sum()
            loss.backward()
            losses.append(loss.detach().cpu())
            grads.append([p.grad.detach().cpu() for p in m.expert.parameters() if p.grad is not None])
            m.eval()
            chunks.append(m.sample_actions(batch, noise=noise.clone()).cpu())
    torch.testing.assert_close(losses[1], losses[0], atol=1e-4, rtol=1e-4)
    assert len(grads[0]) == len(grads[1]) > 0
    for g_cuda, g_cpu in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g_cuda, g_cpu, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(chunks[1], chunks[0], atol=1e-3, rtol=1e-3)


def test_bf16_autocast_training_step_on_cuda() -> None:
    """One optimizer step under bf16 autocast on CUDA: a finite loss within bf16 tolerance of the float32 loss,
    float32 master weights that all receive gradients and move."""
    m = tiny_model("smolvlm", seed=0).cuda().train()
    batch = synthetic_batch(m)
    time, noise = _draws(m, batch)
    with torch.no_grad():
        ref = m.loss_terms(batch, noise=noise, time=time)
        ref_loss = ref.err.sum() / ref.weight.sum()
    m.autocast_dtype = torch.bfloat16
    before = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    terms = m.loss_terms(batch, noise=noise, time=time)
    loss = terms.err.sum() / terms.weight.sum()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.float(), ref_loss, atol=5e-2, rtol=5e-2)
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32, name
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    moved = [n for n, p in m.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert len(moved) > 0.9 * len(before), f"only {len(moved)} of {len(before)} trainable tensors moved"


def test_a_training_step_from_a_pinned_batch_never_waits_on_the_gpu() -> None:
    """A pinned batch (what the loader yields on CUDA) through the forward and backward, bf16 autocast, with
    torch's sync debug mode raising on any host-device synchronization; the CPU-side stand-in is
    ``test_a_step_reads_nothing_back_from_the_device`` (meta device)."""
    m = tiny_model("smolvlm", seed=0).cuda().train()
    batch = synthetic_batch(m).pin_memory()
    assert all(
        t.is_pinned() for t in (batch.state, batch.actions, batch.embodiment_id, *batch.images.values())
    )
    time, noise = _draws(m, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            terms = m.loss_terms(batch, noise=noise.pin_memory(), time=time.pin_memory())
        (terms.err.sum() / terms.weight.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(terms.err).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_serving_on_cuda_matches_eager(dtype: str) -> None:
    """prepare_inference(compile=True) on CUDA: the compiled flow step, vision tower and language layers give the
    eager chunks of the same dtype, with either attention kernel, and the compiled step is what runs."""
    eager = tiny_model("smolvlm", seed=0).cuda().prepare_inference(dtype)
    batch = synthetic_batch(eager)
    noise = torch.randn(4, 6, eager.cfg.max_action_dim, generator=torch.Generator().manual_seed(2))
    ref = eager.sample_actions(batch, noise=noise)
    tol = 1e-4 if dtype == "float32" else 3e-2
    for attention in ("sdpa", "explicit"):
        compiled = tiny_model("smolvlm", seed=0).cuda()  # same weights
        compiled.prepare_inference(dtype, compile=True, attention=attention)
        assert compiled._serving_step is not None
        out = compiled.sample_actions(batch, noise=noise)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_masked_grouped_query_attention_on_cuda_matches_cpu_and_avoids_the_math_kernel() -> None:
    """``attend`` repeats K/V for a masked grouped-query call on CUDA (``enable_gqa`` with a mask can only take
    SDPA's math kernel there): the values equal the CPU's, and the memory-efficient kernel alone can run it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vla.models.attention import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, t, 16, generator=g) for h, t in ((6, 5), (2, 9), (2, 9)))
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True
    ref = attend("sdpa", q, k, v, mask, 0.25)
    with _no_tf32(), sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # raises when no efficient kernel applies
        out = attend("sdpa", q.cuda(), k.cuda(), v.cuda(), mask.cuda(), 0.25)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-4)


def test_vla_train_on_cuda_saves_one_devices_rng_and_resumes(tmp_path: object) -> None:
    """``vla train debug`` on the GPU in bf16 with EMA: a checkpoint whose RNG file holds this device's generator
    only (a resume on a node with fewer GPUs must not index GPUs that are not there), then a resume to step 4."""
    import math
    from pathlib import Path

    from train_helpers import tiny_dataset

    from vla.train.config import load_train_config
    from vla.train.trainer import train

    root = Path(str(tmp_path))
    ds = tiny_dataset(root)
    over = [f"data.datasets=[{ds}]", "train.save_every=2", "logging.progress=false", "train.precision=bf16",
            "ema.decay=0.5"]  # fmt: skip
    first = train(load_train_config("debug", [*over, "train.steps=2"]), root / "run")
    rng = torch.load(first.last_checkpoint / "train_state" / "rng0.pt", weights_only=False)
    assert isinstance(rng["cuda"], torch.Tensor)
    resumed = train(load_train_config("debug", [*over, "train.steps=4"]), root / "run")
    assert resumed.step == 4 and resumed.final_loss is not None and math.isfinite(resumed.final_loss)
