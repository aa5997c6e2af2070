"""Image transforms shared by the loader (training) and the Policy (serving), so both see identical pixels.

All functions take and return uint8 images ``[..., H, W, 3]`` (channels last, as stored). Deterministic given
their ``torch.Generator``: the loader seeds one per sample from (seed, epoch, sample index), so a sample's
augmentation does not depend on worker count or order.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from vla.config import AugmentConfig


def resize_images(images: np.ndarray | torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
    """Resize uint8 ``[N, H, W, 3]`` to ``[N, h, w, 3]`` (bilinear, antialiased); a no-op at the same size."""
    x = torch.as_tensor(images)
    h, w = (size, size) if isinstance(size, int) else size
    if tuple(x.shape[-3:-1]) == (h, w):
        return x
    lead = x.shape[:-3]
    y = x.reshape(-1, *x.shape[-3:]).permute(0, 3, 1, 2).float()  # [N, 3, H, W]
    y = F.interpolate(y, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    return y.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).reshape(*lead, h, w, 3)


def _uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=gen))


def augment_images(images: torch.Tensor, cfg: AugmentConfig, gen: torch.Generator) -> torch.Tensor:
    """Random crop (same window for every frame of the history) + color jitter on uint8 ``[T, H, W, 3]``.

    Output keeps the input size (the crop is resized back), so it composes with ``resize_images``.
    """
    if not cfg.enabled:
        return images
    _, h, w, _ = images.shape
    x = images.permute(0, 3, 1, 2).float() / 255.0  # [T, 3, H, W]
    if cfg.crop_scale < 1.0:
        ch, cw = max(1, round(h * cfg.crop_scale)), max(1, round(w * cfg.crop_scale))
        top = int(torch.randint(0, h - ch + 1, (), generator=gen))
        left = int(torch.randint(0, w - cw + 1, (), generator=gen))
        x = x[:, :, top : top + ch, left : left + cw]
        x = F.interpolate(x, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    gray_weights = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    if cfg.brightness > 0:
        x = x * _uniform(gen, 1 - cfg.brightness, 1 + cfg.brightness)
    if cfg.contrast > 0:
        mean = (x * gray_weights).sum(1, keepdim=True).mean(dim=(2, 3), keepdim=True)
        x = (x - mean) * _uniform(gen, 1 - cfg.contrast, 1 + cfg.contrast) + mean
    if cfg.saturation > 0:
        gray = (x * gray_weights).sum(1, keepdim=True)
        x = (x - gray) * _uniform(gen, 1 - cfg.saturation, 1 + cfg.saturation) + gray
    if cfg.hue > 0:
        x = _rotate_hue(x, _uniform(gen, -cfg.hue, cfg.hue) * 2 * math.pi)
    return (x.clamp(0, 1) * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


# RGB <-> YIQ: a hue shift is a rotation of the (I, Q) chroma plane (cheap, linear, no HSV branches).
_RGB2YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ2RGB = torch.linalg.inv(_RGB2YIQ)


def _rotate_hue(x: torch.Tensor, angle: float) -> torch.Tensor:
    c, s = math.cos(angle), math.sin(angle)
    rot = torch.tensor([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])
    m = _YIQ2RGB @ rot @ _RGB2YIQ  # [3, 3] acting on the channel axis
    return torch.einsum("ij,tjhw->tihw", m, x)
