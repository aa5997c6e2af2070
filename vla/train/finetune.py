"""Fine-tuning a pretrained checkpoint on a (new) robot body: which parameters train in each ``finetune.mode``.

* ``lora``: peft LoRA adapters on the backbone's language layers and the expert (``vla.models.lora``), plus the
  head slots and embodiment tokens of the embodiments in the fine-tuning data; every other tensor frozen.
* ``frozen_backbone``: the expert and those slots.
* ``full``: everything the model config leaves trainable.

Head tables and the token table hold every embodiment in one tensor (``[E, in, out]``), so "only the new slot
trains" is a gradient mask on the other rows; with no weight decay on those tables (see ``masked_tables``), AdamW
leaves the masked rows bitwise unchanged (zero gradient -> zero moments -> zero update). The other embodiments'
actions then change only through the shared adapted layers (LoRA) or the expert (frozen_backbone).
"""

from __future__ import annotations

import logging

import torch

from vla.models.policies.flow_vla import FlowVLA
from vla.train.config import FinetuneConfig

log = logging.getLogger(__name__)


def _row_mask_hook(train_rows: torch.Tensor):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(grad.shape[0], dtype=grad.dtype, device=grad.device)
        mask[train_rows.to(grad.device)] = 1
        return grad * mask.view(-1, *([1] * (grad.dim() - 1)))

    return hook


def masked_tables(model: FlowVLA) -> list[str]:
    """Names of the embodiment-indexed tables (heads, tokens): trained row-wise when fine-tuning."""
    return [n for n, _ in model.named_parameters() if n.startswith(("heads.", "embodiment_tokens."))]


def prepare_finetune(model: FlowVLA, cfg: FinetuneConfig, train_embodiments: list[str]) -> list[str]:
    """Set what trains for ``cfg.mode`` (in place, before the optimizer is built). Returns the names of the
    row-masked tables (they must get no weight decay); empty for ``full``."""
    if cfg.mode == "full":
        model.backbone.set_trainable()
        model.expert.requires_grad_(True)
        model.heads.requires_grad_(True)
        model.embodiment_tokens.requires_grad_(True)
        return []
    model.requires_grad_(False)
    if cfg.mode == "lora":
        from vla.models.lora import apply_lora, has_lora, lora_parameter_names

        if not has_lora(model):  # a resumed LoRA run comes back with its adapters
            apply_lora(model, cfg.lora)
        params = dict(model.named_parameters())
        for name in lora_parameter_names(model):
            params[name].requires_grad_(True)
    if cfg.mode == "frozen_backbone":
        model.expert.requires_grad_(True)
    rows = torch.tensor([model.embodiment_ids[n] for n in train_embodiments], dtype=torch.long)
    names = masked_tables(model)
    params = dict(model.named_parameters())
    for name in names:
        params[name].requires_grad_(True)
        params[name].register_hook(_row_mask_hook(rows))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "fine-tuning (%s): %s trainable parameters, head slots of %s",
        cfg.mode,
        f"{trainable:,}",
        train_embodiments,
    )
    return names
