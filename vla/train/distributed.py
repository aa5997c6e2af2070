"""Processes, devices and how the model is spread over them (single, DDP, FSDP2), behind one small interface the
loop uses. accelerate sets up the process group and device (``torchrun`` or ``accelerate launch`` environments,
one or many nodes) and wraps DDP; FSDP2 shards every decoder layer with ``fully_shard``
(``vla.models.sharding.apply_fsdp2``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vla.train.config import DistributedConfig


@dataclasses.dataclass
class Runtime:
    """This process's place in the run: ``rank`` of ``world_size``, its ``device`` and the ``strategy``."""

    rank: int
    world_size: int
    device: torch.device
    strategy: str
    accelerator: Any
    # the process's TF32 settings before set_tf32, for close()
    tf32_before: tuple[str, Any, Any] | None = None

    @classmethod
    def start(cls, cfg: DistributedConfig) -> Runtime:
        import datetime
        import os

        from accelerate import Accelerator
        from accelerate.utils import DistributedType

        # `accelerate launch` with an FSDP config (configs/accelerate/fsdp2.yaml) sets ACCELERATE_USE_FSDP
        fsdp_env = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
        if fsdp_env and cfg.strategy not in ("auto", "fsdp2"):
            raise ValueError(
                f"launched with an FSDP accelerate config (ACCELERATE_USE_FSDP=true, e.g. "
                f"configs/accelerate/fsdp2.yaml) but distributed.strategy={cfg.strategy} (the preset's); pass "
                "--set distributed.strategy=fsdp2 (or auto), or launch with configs/accelerate/ddp.yaml"
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        backend = cfg.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if world > 1 and not dist.is_initialized():
            device_id = None
            if torch.cuda.is_available():
                device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(device_id)
            dist.init_process_group(
                backend,
                timeout=datetime.timedelta(minutes=cfg.timeout_minutes),
                # NCCL binds the group to this rank's GPU at once (barriers then know their device)
                device_id=device_id if backend == "nccl" else None,
            )
        elif cfg.strategy == "fsdp2" and not dist.is_initialized():
            # FSDP2 on one device (e.g. resuming a sharded run on one GPU) still needs a process group: one of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        acc = Accelerator(cpu=not torch.cuda.is_available())
        strategy = cfg.strategy
        if strategy == "auto":
            # on CPU accelerate's state still says MULTI_CPU under an FSDP config: the variable decides
            if acc.distributed_type == DistributedType.FSDP or fsdp_env:
                strategy = "fsdp2"
            else:
                strategy = "ddp" if acc.num_processes > 1 else "single"
        if strategy == "ddp" and acc.num_processes == 1:
            strategy = "single"
        return cls(acc.process_index, acc.num_processes, acc.device, strategy, acc)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        # the process's own settings back (a notebook trains, then evaluates)
        if self.tf32_before is not None:
            restore_cuda_tf32(self.tf32_before)
            self.tf32_before = None
        self.barrier()

    # ---- the model ----------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module, precision: str) -> nn.Module:
        """The module the loop calls: the model itself, its DDP wrapper, or the model sharded in place."""
        model.to(self.device)
        if self.strategy == "ddp":
            return self.accelerator.prepare_model(model)
        if self.strategy == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            from vla.models.sharding import apply_fsdp2

            mp = (
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                if (precision == "bf16" and self.device.type == "cuda")
                else None
            )
            apply_fsdp2(model, mp_policy=mp)
        return model

    def set_tf32(self, enabled: bool) -> None:
        """TF32 tensor cores for float32 matmuls and convolutions on this runtime's CUDA device (``train.tf32``);
        nothing on CPU, whose float32 math (and bitwise resume) stays as it is."""
        if self.device.type == "cuda":
            before = set_cuda_tf32(enabled)
            self.tf32_before = self.tf32_before or before

    def autocast(self, precision: str) -> contextlib.AbstractContextManager:
        if precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def no_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Gradient all-reduce only on the last micro-batch of an optimizer step."""
        if sync or self.world_size == 1:
            return _set_fsdp_sync(model, True) if self.strategy == "fsdp2" else contextlib.nullcontext()
        if self.strategy == "ddp":
            return model.no_sync()
        if self.strategy == "fsdp2":
            return _set_fsdp_sync(model, False)
        return contextlib.nullcontext()

    def all_true(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a collective: every rank calls it)."""
        if self.world_size == 1:
            return ok
        backend_device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([int(ok)], device=backend_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        backend_device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        x = t.detach().to(backend_device).clone()
        dist.all_reduce(x)
        return x.to(t.device)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Total gradient norm before clipping (``max_norm`` 0 = measure only)."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def memory_stats(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return {"gpu_peak_mb": round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)}
        return {}

    # ---- state ----------------------------------------------------------------------------------------------
    def state_dicts(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Model (trainable parameters only) and optimizer state dicts, sharded under FSDP2, for DCP."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(wrapped, optimizer, options=StateDictOptions(ignore_frozen_params=True))

    def load_state_dicts(
        self, wrapped: nn.Module, optimizer: torch.optim.Optimizer, msd: dict, osd: dict
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            wrapped,
            optimizer,
            model_state_dict=msd,
            optim_state_dict=osd,
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )

    def save_model_folder(
        self, model: nn.Module, wrapped: nn.Module, out: Path, *, adapter: dict[str, Any] | None = None
    ) -> None:
        """Collective: rank 0 writes ``out`` as a ``from_pretrained`` folder with one consolidated
        model.safetensors (under FSDP2 the full weights are gathered to rank 0's CPU first), or, with ``adapter``
        (a fine-tune's base reference), as an adapter folder holding only the trainable tensors."""
        from vla.models.hub import save_pretrained

        if self.strategy == "fsdp2":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(
                wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if self.is_main:
                save_pretrained(model, out, state_dict=full)
            return
        if self.is_main:
            save_pretrained(model, out, adapter=adapter)


@contextlib.contextmanager
def _set_fsdp_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(sync)
    yield


def set_cuda_tf32(enabled: bool) -> tuple[str, Any, Any]:
    """CUDA float32 matmuls and cuDNN convolutions in TF32 (``enabled``) or IEEE float32; process-wide, CUDA only.
    Returns the settings before, for ``restore_cuda_tf32``.

    Set through ``allow_tf32``, as LeRobot's trainer does: torch >= 2.9 also has ``fp32_precision``, but once that
    is set, reading ``allow_tf32`` (user code, older libraries) raises, while the reverse reads fine. A process
    that already chose through ``fp32_precision`` (reading ``allow_tf32`` raises) is set through it instead."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        before: tuple[str, Any, Any] = ("allow_tf32", matmul.allow_tf32, cudnn.allow_tf32)
    except RuntimeError:
        before = ("fp32_precision", matmul.fp32_precision, cudnn.conv.fp32_precision)
        matmul.fp32_precision = cudnn.conv.fp32_precision = "tf32" if enabled else "ieee"
        return before
    matmul.allow_tf32 = cudnn.allow_tf32 = enabled
    return before


def restore_cuda_tf32(before: tuple[str, Any, Any]) -> None:
    """Put back the settings ``set_cuda_tf32`` returned, through the API they were read from."""
    api, matmul, conv = before
    if api == "allow_tf32":
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv
    else:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = matmul, conv
