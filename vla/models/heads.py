"""Per-embodiment heads: embodiment-indexed weights applied in one batched op over a mixed-embodiment batch.

Every embodiment owns a slot of each table (GR00T's category-specific linear idea, without a shared "new
embodiment" slot). Inputs are zero-padded to the table width (``max_state_dim``/``max_action_dim``), so padded
dims contribute nothing; outputs beyond an embodiment's own action dims are masked by the caller.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vla.types import to_device


class EmbodimentLinear(nn.Module):
    """``y[b] = x[b] @ W[e_b] + bias[e_b]`` for ``x`` ``[B, T, in]`` and embodiment ids ``e`` ``[B]`` -> ``[B, T, out]``."""

    def __init__(self, num_embodiments: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_embodiments, in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(num_embodiments, out_features))
        bound = 1.0 / math.sqrt(in_features)
        nn.init.uniform_(self.weight, -bound, bound)

    @property
    def num_embodiments(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor, ids: torch.Tensor | int) -> torch.Tensor:
        """``ids``: ``[B]`` per-sample slots, or one ``int`` slot for the whole batch (see ``route``)."""
        if isinstance(ids, int):  # one embodiment in the batch: a plain matmul
            return x @ self.weight[ids] + self.bias[ids]
        return torch.bmm(x, self.weight[ids]) + self.bias[ids].unsqueeze(1)

    @torch.no_grad()
    def add_slot(self, init_from: int | None = None) -> None:
        """Append one embodiment slot, copied from slot ``init_from`` (or freshly initialised)."""
        if init_from is None:
            w = torch.empty(
                1, self.in_features, self.out_features, dtype=self.weight.dtype, device=self.weight.device
            )
            nn.init.uniform_(w, -1.0 / math.sqrt(self.in_features), 1.0 / math.sqrt(self.in_features))
            b = torch.zeros(1, self.out_features, dtype=self.bias.dtype, device=self.bias.device)
        else:
            w, b = (
                self.weight[init_from : init_from + 1].clone(),
                self.bias[init_from : init_from + 1].clone(),
            )
        self.weight = nn.Parameter(torch.cat([self.weight.data, w]))
        self.bias = nn.Parameter(torch.cat([self.bias.data, b]))


def route(ids: torch.Tensor, device: torch.device | None = None) -> torch.Tensor | int:
    """How a batch's embodiment ids ``[B]`` are applied: one ``int`` when every sample has the same embodiment
    (plain matmuls), else the ids (one ``bmm``), moved to ``device`` when given. Decided once per batch from the
    ids' values: pass the host copy (reading a CUDA tensor waits for the device to finish its queued work)."""
    if ids.numel() and bool((ids == ids[0]).all()):
        return int(ids[0])
    return ids if device is None else to_device(ids, device)


def sinusoidal_embedding(
    t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0
) -> torch.Tensor:
    """Sine/cosine features of flow time ``t`` ``[B]`` -> ``[B, dim]`` (periods log-spaced, as π0)."""
    half = dim // 2
    fraction = torch.linspace(0.0, 1.0, half, device=t.device, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2 * math.pi / period)[None, :] * t.to(torch.float64)[:, None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1).to(
        t.dtype if t.is_floating_point() else torch.float32
    )


class EmbodimentHeads(nn.Module):
    """State encoder, action encoder (with flow-time embedding) and action decoder, one slot per embodiment.

    * ``encode_state``  ``[B, S_max]`` -> ``[B, 1, width]``
    * ``encode_actions`` noisy actions ``[B, H, A_max]`` + time ``[B]`` -> ``[B, H, width]``
    * ``decode_actions`` expert output ``[B, H, width]`` -> velocity ``[B, H, A_max]``
    """

    def __init__(self, num_embodiments: int, max_state_dim: int, max_action_dim: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.state_in = EmbodimentLinear(num_embodiments, max_state_dim, width)
        self.action_in = EmbodimentLinear(num_embodiments, max_action_dim, width)
        self.action_time = EmbodimentLinear(num_embodiments, 2 * width, width)
        self.action_mix = EmbodimentLinear(num_embodiments, width, width)
        self.action_out = EmbodimentLinear(num_embodiments, width, max_action_dim)

    def encode_state(self, state: torch.Tensor, ids: torch.Tensor | int) -> torch.Tensor:
        return self.state_in(state.unsqueeze(1), ids)

    def encode_actions(self, noisy: torch.Tensor, t: torch.Tensor, ids: torch.Tensor | int) -> torch.Tensor:
        a = self.action_in(noisy, ids)
        tau = sinusoidal_embedding(t, self.width).to(a.dtype).unsqueeze(1).expand(-1, a.shape[1], -1)
        h = F.silu(self.action_time(torch.cat([a, tau], dim=-1), ids))
        return self.action_mix(h, ids)

    def decode_actions(self, hidden: torch.Tensor, ids: torch.Tensor | int) -> torch.Tensor:
        return self.action_out(hidden, ids)

    def add_slot(self, init_from: int | None = None) -> None:
        for m in (self.state_in, self.action_in, self.action_time, self.action_mix, self.action_out):
            m.add_slot(init_from)
