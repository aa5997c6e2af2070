"""Models without weights: built on the meta device, then given a checkpoint's tensors, or only inspected.

``from_pretrained`` builds a model's modules inside ``empty_weights()`` (parameters on the meta device: no random
initialisation runs and no memory is spent on weights about to be overwritten; buffers such as RoPE ``inv_freq``,
``pixel_mean`` and the embodiment tables are real, because they are computed, never loaded) and ``load_weights``
then assigns the checkpoint's tensors. ``build_on_meta`` builds a whole model from a ``ModelConfig`` and a HF
config without any weights: parameter counts and shapes of the real-backbone presets, offline
(``vla.models.published`` holds the published configs of the real backbones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from vla.embodiments import EmbodimentSpec
from vla.models.backbone import VLMBackbone, resolve_pretrained
from vla.models.config import ModelConfig
from vla.models.policies import POLICIES

if TYPE_CHECKING:
    from vla.models.policies.flow_vla import FlowVLA


def empty_weights() -> contextlib.AbstractContextManager:
    """Modules built inside get their parameters on the meta device; buffers stay real."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def usable_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this process can use, else a ``ValueError`` saying why (an unknown device
    string, CUDA asked for where torch sees none, a GPU index past the count)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {str(device)!r} is not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r}: torch sees no CUDA GPU here (torch.cuda.is_available() is False: no GPU, "
                f"no driver, or a CPU-only torch build {torch.__version__}); use cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA GPU(s) here")
    return dev


def load_weights(
    model: nn.Module, path: str | Path, *, device: str | torch.device = "cpu", ignore: Sequence[str] = ()
) -> None:
    """Assign the tensors of the safetensors file ``path`` to ``model`` (built with ``empty_weights()``).

    Every entry of the model's state dict must be in the file, and every tensor of the file in the model except
    the names in ``ignore`` (weights an older checkpoint format stored and this model no longer has), and every
    parameter finite. Floating tensors are cast to the model's parameter dtype; ``requires_grad`` stays the
    model's."""
    device = usable_device(device)  # a bad device is not a corrupt file
    try:
        state = load_file(str(path), device=str(device))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: the checkpoint's weights file is missing; restore it") from e
    except SafetensorError as e:  # safetensors' own error for a truncated or corrupt file
        raise ValueError(
            f"{path}: cannot read the weights ({type(e).__name__}: {e}); the file is truncated or corrupt. "
            "Restore it or re-save the checkpoint (an interrupted copy leaves a short file)"
        ) from None
    except Exception as e:  # e.g. out of memory on the device: the file may well be fine
        raise RuntimeError(
            f"{path}: loading the weights onto {device} failed ({type(e).__name__}: {e})"
        ) from e
    expected = model.state_dict()
    for name in set(ignore) & set(state):
        del state[name]
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the architecture in config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    parameters = {n for n, _ in model.named_parameters()}
    for name, tensor in state.items():
        want = expected[name]
        if tensor.shape != want.shape:
            raise ValueError(
                f"{path} does not match the architecture in config.json: {name} is {list(tensor.shape)} in the "
                f"file, {list(want.shape)} in the model"
            )
        # a NaN/inf weight makes every action chunk non-finite: refuse it here, naming the tensor
        if name in parameters and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(
                f"{path}: weight {name} holds {bad} NaN/inf value(s) of {tensor.numel()}; the file is corrupt or "
                "training diverged before it was saved. Restore the checkpoint or use an earlier one"
            )
        if tensor.is_floating_point() and tensor.dtype != want.dtype:
            state[name] = tensor.to(want.dtype)
    model.load_state_dict(state, assign=True)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{path}: no weights for {left[:5]} (still on the meta device after loading)")


def build_on_meta(
    cfg: ModelConfig, specs: Sequence[EmbodimentSpec], *, hf_config: object | None = None
) -> FlowVLA:
    """The model of ``cfg`` for ``specs`` with every parameter on the meta device (nothing downloaded, nothing
    initialised): for parameter counts and shapes. ``hf_config`` is the backbone's HF config (e.g.
    ``vla.models.published.published_config(cfg.backbone.pretrained)``); without it, the config is read from
    ``cfg.backbone.pretrained`` (a local directory, a ``tiny:`` preset or a hub id in the local HF cache)."""
    source = cfg.backbone.pretrained
    if hf_config is None:
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(resolve_pretrained(source))
        except OSError as e:
            raise OSError(
                f"no HF config for model.backbone.pretrained={source!r} offline ({e}); pass hf_config=, e.g. "
                f"vla.models.published.published_config({source!r}) for a published backbone"
            ) from e
    with empty_weights():
        backbone = VLMBackbone.from_hf_config(cfg.backbone, hf_config, source=source)
        return POLICIES.get(cfg.policy)(cfg, list(specs), backbone=backbone)
