"""The embodiment table of a policy: one slot per embodiment in every head table, one embodiment token each.

``EmbodimentTable`` is a base class of a policy module that sets ``cfg`` (``ModelConfig``) and ``specs``, then
calls ``_build_tables``. It owns the tables (``heads``: ``EmbodimentHeads``, ``embodiment_tokens``), maps names
to slots, checks ids, and grows the table: ``add_embodiment`` gives a new body a slot of its own, initialised
from the most similar existing one (GR00T's category-specific layers, without a shared "new embodiment" slot).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from vla.embodiments import EmbodimentSpec
from vla.models.config import ModelConfig
from vla.models.heads import EmbodimentHeads
from vla.models.sharding import check_not_sharded
from vla.types import to_device


def check_fits(cfg: ModelConfig, spec: EmbodimentSpec) -> None:
    """``spec``'s state and action dims must fit the model's head tables."""
    if spec.state_dim > cfg.max_state_dim or spec.action_dim > cfg.max_action_dim:
        raise ValueError(
            f"embodiment {spec.name!r} has state_dim {spec.state_dim} / action_dim {spec.action_dim}, more than "
            f"model.max_state_dim {cfg.max_state_dim} / model.max_action_dim {cfg.max_action_dim}; raise them"
        )


class EmbodimentTable(nn.Module):
    """Name -> slot lookups and table growth of a policy (see the module docstring).

    ``table_version`` counts ``add_embodiment`` calls: each replaces the embodiment tables' parameters, so build the
    optimizer and any wrapper (DDP, FSDP2, peft) after every ``add_embodiment``, and check ``table_version`` is
    unchanged before stepping an optimizer built earlier."""

    cfg: ModelConfig
    specs: list[EmbodimentSpec]
    heads: EmbodimentHeads
    embodiment_tokens: nn.Embedding
    chunk_lengths: torch.Tensor  # [num_embodiments] min(spec.chunk_length, model.chunk_length)
    action_dims: torch.Tensor  # [num_embodiments]
    table_version: int

    def _build_tables(self, hidden_size: int, expert_width: int) -> None:
        """The embodiment tokens ``[E, hidden_size]`` and head tables (``expert_width`` wide) for ``self.specs``."""
        self.table_version = 0
        self.embodiment_tokens = nn.Embedding(len(self.specs), hidden_size)
        nn.init.normal_(self.embodiment_tokens.weight, std=0.02)
        self.heads = EmbodimentHeads(
            len(self.specs), self.cfg.max_state_dim, self.cfg.max_action_dim, expert_width
        )
        self._refresh_tables()
        self._set_token_trainable()

    def _refresh_tables(self) -> None:
        dev = self.embodiment_tokens.weight.device
        if dev.type == "meta":  # built without weights (vla.models.meta): the tables are computed, so real
            dev = torch.device("cpu")
        self.register_buffer("chunk_lengths", self.host_chunk_lengths().to(dev), persistent=False)
        self.register_buffer(
            "action_dims", torch.tensor([s.action_dim for s in self.specs], device=dev), persistent=False
        )

    def host_chunk_lengths(self) -> torch.Tensor:
        """``chunk_lengths`` ``[E]`` computed on the host from the specs: for code that needs the values in Python
        (a loop bound, a host-side mask) without waiting for the device to catch up."""
        return torch.tensor([min(s.chunk_length, self.cfg.chunk_length) for s in self.specs])

    def _table_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's embodiment ids ``[B]`` checked against the table (see ``_check_ids``), on the host and on the
        model's device. The check reads the host copy: reading device ids would stall the host until the device
        has caught up (the loader's ids are on the host)."""
        host = ids.cpu()
        self._check_ids(host)
        return host, to_device(host, self.embodiment_tokens.weight.device)

    def _set_token_trainable(self) -> None:
        # Always trained: with a frozen backbone only the token's own row runs with autograd
        # (VLMBackbone.refresh_summary_token), so it costs one token per sample.
        self.embodiment_tokens.requires_grad_(True)

    @property
    def embodiment_ids(self) -> dict[str, int]:
        return {s.name: i for i, s in enumerate(self.specs)}

    def spec(self, name: str) -> EmbodimentSpec:
        return self.specs[self._index(name)]

    def _index(self, name: str) -> int:
        ids = self.embodiment_ids
        if name not in ids:
            raise KeyError(
                f"embodiment {name!r} is not in this model (it has {sorted(ids)}); use add_embodiment(spec)"
            )
        return ids[name]

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= len(self.specs)):
            raise ValueError(
                f"embodiment_id {ids.tolist()} outside this model's table of {len(self.specs)} "
                f"({list(self.embodiment_ids)}); build the loader with embodiment_ids=model.embodiment_ids"
            )

    def most_similar(self, spec: EmbodimentSpec) -> str:
        """The existing embodiment a new one is initialised from: same robot, then same action/state widths."""

        def score(s: EmbodimentSpec) -> tuple:
            return (
                bool(spec.robot) and s.robot == spec.robot,
                s.action_dim == spec.action_dim,
                s.state_dim == spec.state_dim,
                -abs(s.control_hz - spec.control_hz),
            )

        return max(self.specs, key=score).name

    @torch.no_grad()
    def add_embodiment(self, spec: EmbodimentSpec, init_from: str | None = None) -> int:
        """Give ``spec`` its own slot in every head table and its own token, copied from ``init_from`` (default:
        ``most_similar``). Other embodiments' outputs are unchanged. Returns the new index.

        The grown tables are new ``Parameter`` objects (an optimizer's state for the old ones cannot carry over), so
        ``table_version`` goes up: build the optimizer and wrappers after this call. Refused on a model already
        sharded with FSDP2."""
        if spec.name in self.embodiment_ids:
            raise ValueError(f"embodiment {spec.name!r} is already in this model")
        check_fits(self.cfg, spec)
        check_not_sharded(self, "add_embodiment")
        src = self._index(init_from or self.most_similar(spec))
        self.heads.add_slot(src)
        w = self.embodiment_tokens.weight.data
        self.embodiment_tokens = nn.Embedding(len(self.specs) + 1, w.shape[1]).to(w.device, w.dtype)
        self.embodiment_tokens.weight.data = torch.cat([w, w[src : src + 1]])
        self.specs.append(spec)
        self.cfg = dataclasses.replace(self.cfg, embodiments=tuple(s.name for s in self.specs))
        self._refresh_tables()
        self._set_token_trainable()
        self.table_version += 1
        return len(self.specs) - 1
