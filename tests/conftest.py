"""Shared test helpers.

Spandrel architecture classes are imported here only, so that a spandrel version bump touches one
place (0.3.4: ``spandrel.architectures.Compact.SRVGGNetCompact``; 0.4: ``...Compact.Compact``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def compact_class():
    from spandrel.architectures.Compact import SRVGGNetCompact

    return SRVGGNetCompact


def rrdb_class():
    from spandrel.architectures.ESRGAN import RRDBNet

    return RRDBNet


def save_and_load(net: torch.nn.Module, path: Path):
    """Save ``net``'s weights as safetensors and load them back through spandrel's ModelLoader."""
    import spandrel
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return spandrel.ModelLoader().load_from_file(str(path))


def make_imagelike_rrdb(net: torch.nn.Module, detail: float = 0.3) -> torch.nn.Module:
    """Bias a random RRDBNet toward a plain nearest upscale plus random detail.

    A random RRDBNet outputs near-black (clamped negatives), where PSNR means nothing. Every conv
    outside the trunk gets an identity centre tap on the first three channels and its random
    weights scaled by ``detail``, so the image flows through the upsampling path while the
    (untouched) trunk adds texture with the real receptive field.
    """
    from spandrel.architectures.ESRGAN.arch.RRDB import RRDBNet  # noqa: F401 (version check)

    convs = [m for m in net.model.modules() if isinstance(m, torch.nn.Conv2d)]
    trunk_ids = set()
    for m in net.model.modules():
        if type(m).__name__ == "ShortcutBlock":
            trunk_ids = {id(c) for c in m.modules() if isinstance(c, torch.nn.Conv2d)}
    with torch.no_grad():
        for conv in convs:
            if id(conv) in trunk_ids:
                continue
            conv.weight.mul_(detail)
            if conv.bias is not None:
                conv.bias.mul_(detail)
            k = conv.kernel_size[0] // 2
            for c in range(min(3, conv.in_channels, conv.out_channels)):
                conv.weight[c, c, k, k] += 1.0
    return net


@pytest.fixture
def tiny_compact(tmp_path):
    """A real spandrel Compact x2 (8 features, 2 convs), random weights, loaded from a file."""
    torch.manual_seed(0)
    net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=8, num_conv=2, upscale=2)
    return save_and_load(net, tmp_path / "tiny_compact.safetensors")


@pytest.fixture
def tiny_rrdb(tmp_path):
    """A real spandrel ESRGAN (RRDBNet x4, 8 filters, 1 block), image-like, loaded from a file."""
    torch.manual_seed(0)
    net = make_imagelike_rrdb(rrdb_class()(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=4))
    return save_and_load(net, tmp_path / "tiny_rrdb.safetensors")


def image_like(h: int, w: int, channels: int = 3, seed: int = 0) -> torch.Tensor:
    """A seeded image-like tensor [1, C, H, W] in [0, 1]: smooth colour plus texture."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, channels, max(2, h // 8), max(2, w // 8), generator=g)
    smooth = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    return (0.7 * smooth + 0.3 * torch.rand(1, channels, h, w, generator=g)).clamp(0, 1)
