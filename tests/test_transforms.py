"""Image transforms: resize shapes/values, augmentation determinism and consistency across history frames."""

from __future__ import annotations

import numpy as np
import torch

from vla.config import AugmentConfig
from vla.data.transforms import augment_images, resize_images


def test_resize_shape_and_constant_image() -> None:
    img = np.full((2, 3, 96, 128, 3), 77, np.uint8)
    out = resize_images(img, 64)
    assert out.shape == (2, 3, 64, 64, 3) and out.dtype == torch.uint8
    assert int(out.min()) == 77 and int(out.max()) == 77
    assert resize_images(img, (96, 128)).data_ptr() == torch.as_tensor(img).data_ptr()  # no-op, no copy


def test_resize_preserves_gradient_direction() -> None:
    ramp = np.tile(np.linspace(0, 255, 128, dtype=np.float32)[None, :, None], (96, 1, 3)).astype(np.uint8)
    out = resize_images(ramp[None], (48, 64))[0].float()
    assert torch.all(out[:, 1:, 0] >= out[:, :-1, 0])  # still increasing left to right


def _frames() -> torch.Tensor:
    rng = np.random.default_rng(0)
    one = rng.integers(0, 255, (32, 40, 3), dtype=np.uint8)
    return torch.as_tensor(np.stack([one, one]))  # two identical history frames


def test_augment_deterministic_per_seed_and_same_for_history() -> None:
    cfg = AugmentConfig(enabled=True, crop_scale=0.8, brightness=0.3, contrast=0.3, saturation=0.3, hue=0.1)
    a = augment_images(_frames(), cfg, torch.Generator().manual_seed(1))
    b = augment_images(_frames(), cfg, torch.Generator().manual_seed(1))
    c = augment_images(_frames(), cfg, torch.Generator().manual_seed(2))
    assert a.shape == (2, 32, 40, 3) and a.dtype == torch.uint8
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[0], a[1])  # one crop/jitter for the whole observation history
    assert not torch.equal(a, _frames())


def test_augment_disabled_is_identity_and_zero_strength_hue_is_identity() -> None:
    x = _frames()
    assert torch.equal(augment_images(x, AugmentConfig(enabled=False), torch.Generator()), x)
    cfg = AugmentConfig(enabled=True, crop_scale=1.0, brightness=0.0, contrast=0.0, saturation=0.0, hue=0.0)
    y = augment_images(x, cfg, torch.Generator().manual_seed(0))
    assert (y.int() - x.int()).abs().max() <= 1  # only float round-trip rounding
