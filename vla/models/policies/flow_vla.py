"""``flow_vla``: VLM backbone prefix + shared flow-matching action expert + per-embodiment heads.

The architecture of π0 (Black et al., 2024, "π0: A Vision-Language-Action Flow Model for General Robot Control",
arXiv:2410.24164): the action expert attends to the VLM prefix's keys/values, so the prefix is computed once per
observation and reused at every denoising step.

Training: ``loss(batch)`` draws t ~ Beta(1.5, 1) (scaled into [t_min, 1]) and noise, forms
x_t = t * noise + (1 - t) * actions, and regresses the expert's velocity onto u = noise - actions with a masked
MSE over each sample's valid action dims and non-padded steps (reported per embodiment).
Inference: ``sample_actions(batch)`` computes the prefix once, then integrates dx/dt = v from t = 1 (noise) to
t = 0 with ``num_steps`` Euler steps, reusing the prefix keys/values at every step.

Each embodiment has its own slot in every head table and its own embodiment token (``vla.models.embodiment_table``);
it predicts its own action dims and its own chunk length (``min(spec.chunk_length, model.chunk_length)``), masked
to the batch maximum. Serving preparation and compiled graphs: ``vla.models.serving_graphs``. Checkpoint folders:
``vla.models.hub`` (``save_pretrained(model, dir)`` / ``from_pretrained(dir)``).

Settings that are not architecture (not saved in config.json): ``autocast_dtype`` (None = no autocast; e.g.
``torch.bfloat16``, on any device: AMX on recent Xeons, tensor cores on GPUs) and ``preprocessing`` (how the training
data was prepared, saved with the checkpoint as preprocessing.json). Distributed training: ``vla.models.sharding``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vla.embodiments import EmbodimentSpec
from vla.models.backbone import Prefix, VLMBackbone
from vla.models.config import ModelConfig
from vla.models.embodiment_table import EmbodimentTable, check_fits
from vla.models.expert import ActionExpert, ExpertPlan
from vla.models.heads import route
from vla.models.policies import POLICIES
from vla.models.serving_graphs import ServingGraphs
from vla.types import Batch, to_device

if TYPE_CHECKING:
    from vla.data.normalize import StatsFile


class FlowVLA(EmbodimentTable, ServingGraphs):
    """The VLA policy. ``embodiment_ids`` (name -> table index) is what the loader must use for ``embodiment_id``;
    ``add_embodiment`` and ``table_version``: ``vla.models.embodiment_table``; ``prepare_inference`` and the
    compiled serving graphs: ``vla.models.serving_graphs``."""

    def __init__(
        self,
        cfg: ModelConfig,
        specs: Sequence[EmbodimentSpec],
        *,
        backbone: VLMBackbone | None = None,
        norm_stats: StatsFile | None = None,
    ) -> None:
        super().__init__()
        if not specs:
            raise ValueError("a model needs at least one embodiment spec (model.embodiments)")
        for spec in specs:
            check_fits(cfg, spec)
        self.cfg = dataclasses.replace(cfg, embodiments=tuple(s.name for s in specs))
        self.specs: list[EmbodimentSpec] = list(specs)
        self.norm_stats = norm_stats
        self.preprocessing: dict[str, Any] | None = None  # saved as preprocessing.json (vla.models.hub)
        self.autocast_dtype: torch.dtype | None = None  # loss and sample_actions run under this autocast
        self.backbone = backbone or VLMBackbone.from_config(cfg.backbone)
        d = self.backbone.hidden_size
        n_layers = cfg.expert.num_layers or self.backbone.num_layers
        self.expert = ActionExpert(
            self.backbone.layers[0],
            self.backbone.text_config,
            self.backbone.rotary,
            num_layers=n_layers,
            backbone_layers=self.backbone.num_layers,
            width_ratio=cfg.expert.width_ratio,
            mlp_ratio=cfg.expert.mlp_ratio,
            gradient_checkpointing=cfg.backbone.gradient_checkpointing,
        )
        self._build_tables(d, self.expert.width)
        self._expert_forward = (
            torch.compile(self.expert.forward, dynamic=True) if cfg.expert.compile else self.expert.forward
        )

    # ---- forward pieces ----------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:  # an autocast the caller entered still applies
            return contextlib.nullcontext()
        return torch.autocast(self.embodiment_tokens.weight.device.type, dtype=self.autocast_dtype)

    def compute_prefix(self, batch: Batch) -> Prefix:
        """Backbone keys/values of the batch's observation (images, prompt, embodiment token)."""
        self._check_serving()
        _, ids = self._table_ids(batch.embodiment_id)
        token = self.embodiment_tokens(ids)
        grad = torch.is_grad_enabled()
        # a config-frozen backbone with trainable language-layer weights (LoRA adapters) runs with autograd
        frozen = self.backbone.frozen and not any(p.requires_grad for p in self.backbone.layers.parameters())
        with torch.set_grad_enabled(grad and not frozen):
            tokens, valid = self.backbone.embed_prefix(batch.images, batch.image_mask, batch.prompt, token)
            prefix = self.backbone(tokens, valid)
        if grad and frozen and token.requires_grad:
            prefix = self.backbone.refresh_summary_token(prefix, token)  # the token's row with autograd
        return prefix

    def _padded(self, x: torch.Tensor, mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-pad the last axis of ``x`` (and its mask ``[B, D]``) to the head table ``width``."""
        d = x.shape[-1]
        if d > width:
            raise ValueError(
                f"batch has {d} state/action dims but the model's head tables are {width} wide; raise "
                "model.max_state_dim / model.max_action_dim (and re-initialise) or check the batch's embodiment"
            )
        out = x.new_zeros(*x.shape[:-1], width)
        out[..., :d] = x
        m = mask.new_zeros(mask.shape[0], width)
        m[:, :d] = mask
        return out * m.view(m.shape[0], *([1] * (x.dim() - 2)), width), m

    def velocity(
        self,
        prefix: Prefix,
        state: torch.Tensor,
        ids: torch.Tensor,
        x_t: torch.Tensor,
        t: torch.Tensor,
        step_valid: torch.Tensor,
        slots: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Expert velocity ``[B, H, A_max]`` for noisy actions ``x_t`` ``[B, H, A_max]`` at flow time ``t`` ``[B]``.

        Inputs are cast to the heads' dtype, so a model cast to bfloat16 for inference (``model.to(torch.bfloat16)``)
        takes the float32 integration state as it is. ``slots``: ``route`` of the ids' host copy (else read from
        ``ids``)."""
        dtype = self.heads.action_in.weight.dtype
        slots = route(ids) if slots is None else slots
        s = self.heads.encode_state(state.to(dtype), slots)
        a = self.heads.encode_actions(x_t.to(dtype), t, slots)  # t stays float32: it is only embedded
        valid = torch.cat([step_valid.new_ones(step_valid.shape[0], 1), step_valid], dim=1)
        h = self._expert_forward(torch.cat([s, a], dim=1), prefix, valid)
        return self.heads.decode_actions(h[:, 1:], slots)

    def flow_step(
        self, plan: ExpertPlan, slots: torch.Tensor | int, x: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """One denoising step of ``sample_actions``: velocity ``[B, H, A_max]`` of noisy actions ``x`` at time ``t``
        ``[B]``, the state's keys/values already in ``plan`` (``ActionExpert.extend``). What serving compiles."""
        a = self.heads.encode_actions(x.to(self.heads.action_in.weight.dtype), t, slots)
        return self.heads.decode_actions(self.expert.run(a, plan), slots)

    def _step_valid(self, ids: torch.Tensor, horizon: int) -> torch.Tensor:
        return torch.arange(horizon, device=ids.device)[None] < self.chunk_lengths[ids][:, None]

    # ---- API --------------------------------------------------------------------------------------------------
    def loss_terms(
        self,
        batch: Batch,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        time: torch.Tensor | None = None,
    ) -> LossTerms:
        """Per-sample flow-matching squared error and weights (see ``LossTerms``).

        ``noise`` ``[B, H, A_max]`` and ``time`` ``[B]`` (flow time in [t_min, 1]) may be given, e.g. drawn per
        sample by the trainer so a sample's loss does not depend on which process or micro-batch it lands in;
        otherwise they are drawn from ``generator`` (or the global RNG)."""
        dev = self.embodiment_tokens.weight.device
        # checked before any table lookup (on CUDA a bad index is a device-side assert)
        host_ids, ids = self._table_ids(batch.embodiment_id)
        state, _ = self._padded(
            to_device(batch.state, dev), to_device(batch.state_mask, dev), self.cfg.max_state_dim
        )
        actions, dim_mask = self._padded(
            to_device(batch.actions, dev), to_device(batch.action_mask, dev), self.cfg.max_action_dim
        )
        is_pad = to_device(batch.action_is_pad, dev)
        b, h, _ = actions.shape
        step_valid = self._step_valid(ids, h)
        with self._autocast():
            prefix = self.compute_prefix(batch)
            if time is None:
                beta = torch.distributions.Beta(self.cfg.flow.beta_alpha, self.cfg.flow.beta_beta)
                u01 = _rand(torch.rand, (b,), generator, dev) if generator is not None else None
                t = _beta_sample(beta, u01, b, dev) * (1 - self.cfg.flow.t_min) + self.cfg.flow.t_min
            else:
                t = to_device(time, dev).float()
            if noise is None:
                noise = _rand(torch.randn, actions.shape, generator, dev)
            noise = to_device(noise[:, :h, : actions.shape[-1]], dev).float() * dim_mask[:, None, :]
            x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
            v = self.velocity(prefix, state, ids, x_t, t, step_valid, route(host_ids, dev))
        weight = (dim_mask[:, None, :] & step_valid[:, :, None] & ~is_pad[:, :, None]).float()
        err = (v.float() - (noise - actions)) ** 2 * weight
        return LossTerms(err=err.sum(dim=(1, 2)), weight=weight.sum(dim=(1, 2)), embodiment_id=ids)

    def draw_flow_inputs(
        self, batch_size: int, horizon: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flow time ``[B]`` (Beta, scaled into [t_min, 1]) and noise ``[B, horizon, A_max]`` from ``generator``:
        what ``loss_terms`` draws itself when not given them."""
        beta = torch.distributions.Beta(self.cfg.flow.beta_alpha, self.cfg.flow.beta_beta)
        u01 = torch.rand((batch_size,), generator=generator, device=generator.device)
        t = (
            _beta_sample(beta, u01, batch_size, generator.device) * (1 - self.cfg.flow.t_min)
            + self.cfg.flow.t_min
        )
        noise = torch.randn(
            (batch_size, horizon, self.cfg.max_action_dim), generator=generator, device=generator.device
        )
        return t, noise

    def loss(
        self, batch: Batch, *, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Masked flow-matching MSE (scalar) and metrics: ``loss`` and ``loss/<embodiment>`` per embodiment."""
        # through __call__, not loss_terms: FSDP2's root hooks gather the root's weights (vla.models.sharding)
        terms = self(batch, generator=generator)
        return terms.mean(), terms.metrics(self.cfg.embodiments)

    @torch.no_grad()
    def sample_actions(
        self,
        batch: Batch,
        *,
        num_steps: int | None = None,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        reuse_prefix: bool = True,
    ) -> torch.Tensor:
        """Action chunks ``[B, H, A_max]`` (normalized space) for the batch's observations; each sample's steps past
        its embodiment's chunk length and dims past its action dim are 0. ``reuse_prefix=False`` recomputes the
        prefix at every step (slower; same result — kept to test the cache)."""
        dev = self.embodiment_tokens.weight.device
        host_ids, ids = self._table_ids(batch.embodiment_id)
        steps = self.cfg.flow.num_steps if num_steps is None else num_steps
        if steps < 1:
            raise ValueError(f"sample_actions: num_steps must be >= 1, got {steps}")
        horizon = int(self.host_chunk_lengths()[host_ids].max())
        slots = route(host_ids, dev)
        state, _ = self._padded(
            to_device(batch.state, dev), to_device(batch.state_mask, dev), self.cfg.max_state_dim
        )
        dim_mask = torch.arange(self.cfg.max_action_dim, device=dev)[None] < self.action_dims[ids][:, None]
        step_valid = self._step_valid(ids, horizon)
        out_mask = (step_valid[:, :, None] & dim_mask[:, None, :]).float()
        if noise is None:
            noise = _rand(torch.randn, (len(ids), horizon, self.cfg.max_action_dim), generator, dev)
        x = to_device(noise, dev) * dim_mask[:, None, :]
        dt = -1.0 / steps
        with self._autocast():
            if reuse_prefix:  # prefix and state keys/values, RoPE and masks once; each step runs the actions
                ctx = self.expert.context(self.compute_prefix(batch))
                s = self.heads.encode_state(state.to(self.heads.state_in.weight.dtype), slots)
                plan = self.expert.plan(self.expert.extend(ctx, s), step_valid, isolate_first=False)
                step = self._serving_step or self.flow_step
            for k in range(steps):
                t = torch.full((len(ids),), 1.0 + k * dt, device=dev)
                if reuse_prefix:
                    v = step(plan, slots, x, t)
                else:  # everything from scratch: the joint [state, actions] pass training uses
                    v = self.velocity(self.compute_prefix(batch), state, ids, x, t, step_valid, slots)
                x = (x + dt * v.float()) * dim_mask[:, None, :]
        return x * out_mask

    def forward(self, batch: Batch, **kwargs: object) -> LossTerms:
        """``loss_terms`` (what DDP/FSDP wrappers call during training)."""
        return self.loss_terms(batch, **kwargs)

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    def parameter_counts(self) -> dict[str, dict[str, int]]:
        """Total and trainable parameters per component (what ``vla model info`` prints)."""
        parts = {
            "vision": [self.backbone.vision, self.backbone.projector],
            "language": [self.backbone.embed_tokens, self.backbone.layers],
            "expert": [self.expert],
            "heads": [self.heads],
            "embodiment_tokens": [self.embodiment_tokens],
        }
        out = {}
        for name, mods in parts.items():
            params = [p for m in mods for p in m.parameters()]
            out[name] = {
                "total": sum(p.numel() for p in params),
                "trainable": sum(p.numel() for p in params if p.requires_grad),
            }
        out["all"] = {k: sum(v[k] for v in out.values()) for k in ("total", "trainable")}
        return out


@dataclasses.dataclass
class LossTerms:
    """Per-sample pieces of the flow-matching loss: ``err`` ``[B]`` summed squared velocity error over the sample's
    valid (step, dim) entries, ``weight`` ``[B]`` their count, ``embodiment_id`` ``[B]``. The loss is
    ``err.sum() / weight.sum()``; a trainer can form the same mean over several processes or micro-batches."""

    err: torch.Tensor
    weight: torch.Tensor
    embodiment_id: torch.Tensor

    def mean(self) -> torch.Tensor:
        return self.err.sum() / self.weight.sum().clamp(min=1)

    def metrics(self, names: Sequence[str]) -> dict[str, float]:
        """``loss`` and ``loss/<embodiment>`` (masked means) as floats."""
        err, weight = self.err.detach(), self.weight.detach()
        out = {"loss": float(err.sum() / weight.sum().clamp(min=1))}
        for i in self.embodiment_id.unique().tolist():
            sel = self.embodiment_id == i
            out[f"loss/{names[i]}"] = float(err[sel].sum() / weight[sel].sum().clamp(min=1))
        return out


def _rand(
    fn: Callable[..., torch.Tensor],
    shape: tuple[int, ...],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """``fn`` (``torch.rand``/``torch.randn``) drawn on the generator's own device, then moved to ``device``: a CPU
    generator (seeded tests, serving) drives a CUDA model too, and a CUDA generator draws on the GPU directly."""
    where = generator.device if generator is not None else device
    return fn(shape, generator=generator, device=where).to(device)


def _beta_sample(
    beta: torch.distributions.Beta, u01: torch.Tensor | None, n: int, device: torch.device
) -> torch.Tensor:
    """Beta samples; with ``u01`` (uniforms from the caller's generator) through the inverse CDF, so seeded losses
    are reproducible (torch's Beta sampler takes no generator). Beta(a, 1) has CDF x^a (exact inverse); other
    shapes invert a fine numeric CDF."""
    if u01 is None:
        return beta.sample((n,)).to(device)
    a, b = float(beta.concentration1), float(beta.concentration0)
    if b == 1.0:
        return u01.clamp(1e-12, 1.0) ** (1.0 / a)
    grid = torch.linspace(0.0, 1.0, 8193, device=u01.device, dtype=torch.float64)[1:-1]
    cdf = torch.cumsum(grid ** (a - 1) * (1 - grid) ** (b - 1), 0)
    idx = torch.searchsorted(cdf / cdf[-1], u01.double()).clamp(max=len(grid) - 1)
    return grid[idx].to(u01.dtype)


POLICIES.register("flow_vla", FlowVLA)
