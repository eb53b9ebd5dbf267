"""Random-weight spandrel models and seeded images for tests and benchmarks (no downloads).

The spandrel architecture classes are imported here only (0.3.4 names; 0.4 renamed Compact's
class), so a version bump touches one place. ``tests/conftest.py`` uses these helpers.
"""

from __future__ import annotations

import torch


def compact_class():
    from spandrel.architectures.Compact import SRVGGNetCompact

    return SRVGGNetCompact


def rrdb_class():
    from spandrel.architectures.ESRGAN import RRDBNet

    return RRDBNet


def rrdb_net(filters: int = 8, blocks: int = 1, scale: int = 4) -> torch.nn.Module:
    """A random ESRGAN ``RRDBNet`` (made image-like at x4, :func:`make_imagelike_rrdb`)."""
    net = rrdb_class()(in_nc=3, out_nc=3, num_filters=filters, num_blocks=blocks, scale=scale)
    return make_imagelike_rrdb(net) if scale == 4 else net


def compact_net(feat: int = 8, conv: int = 4, scale: int = 4) -> torch.nn.Module:
    """A random ``SRVGGNetCompact``, made image-like (:func:`make_imagelike_compact`)."""
    net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=feat, num_conv=conv, upscale=scale)
    return make_imagelike_compact(net)


def image_like(h: int, w: int, channels: int = 3, seed: int = 0) -> torch.Tensor:
    """A seeded image-like tensor ``[1, C, H, W]`` in [0, 1]: smooth colour fields plus texture."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, channels, max(2, h // 8), max(2, w // 8), generator=g)
    smooth = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    return (0.7 * smooth + 0.3 * torch.rand(1, channels, h, w, generator=g)).clamp(0, 1)


def picture(n: int, seed: int = 0):
    """A generated test picture in [-1, 1]: gradients, a sine pattern, discs, fine texture."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, n), torch.linspace(0, 1, n), indexing="ij")
    img = torch.stack([yy, xx, 0.5 + 0.5 * torch.sin(8 * xx + 4 * yy)])
    for _ in range(16):
        cy, cx, r = torch.rand(3, generator=g)
        col = torch.rand(3, 1, 1, generator=g)
        m = ((yy - cy) ** 2 + (xx - cx) ** 2 < (0.25 * r) ** 2).float()
        img = img * (1 - m) + col * m
    img = img + 0.05 * torch.randn(3, n, n, generator=g)
    return (img.clamp(0, 1) * 2 - 1)[None]


def image_latent(px: int, channels: int = 4, seed: int = 0):
    """The picture pooled to latent size, mixed to ``channels`` by a fixed random matrix, plus texture."""
    g = torch.Generator().manual_seed(seed + 1)
    pooled = torch.nn.functional.avg_pool2d(picture(px, seed), 8)
    z = torch.einsum("oc,bchw->bohw", torch.randn(channels, 3, generator=g), pooled)
    z = z + 0.2 * torch.randn(z.shape, generator=g)
    return (z - z.mean()) / z.std()


def _scale_output_std(net: torch.nn.Module, conv: torch.nn.Conv2d, std: float) -> None:
    """Scale ``conv`` so that its output has standard deviation ``std`` on a probe image."""
    seen: list[torch.Tensor] = []
    handle = conv.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    net(image_like(32, 32))
    handle.remove()
    factor = std / max(float(seen[0].std()), 1e-8)
    conv.weight.mul_(factor)
    if conv.bias is not None:
        conv.bias.mul_(factor)


@torch.no_grad()
def make_imagelike_compact(net: torch.nn.Module, detail_std: float = 0.1) -> torch.nn.Module:
    """Give a random Compact the signal flow of a trained one.

    PyTorch's default init shrinks activations layer by layer, so a random Compact barely looks
    past its neighbours (a measured context of 2 px), which would make every tiling scheme look
    exact. Variance-preserving (Kaiming, PReLU slope 0.25) body convs keep the whole receptive
    field alive (measured context 16 px); the last conv is scaled so the residual added to the
    nearest upscale has standard deviation ``detail_std``.
    """
    convs = [m for m in net.body if isinstance(m, torch.nn.Conv2d)]
    for conv in convs:
        torch.nn.init.kaiming_normal_(conv.weight, a=0.25, mode="fan_in", nonlinearity="leaky_relu")
        conv.bias.zero_()
    _scale_output_std(net, convs[-1], detail_std)
    return net


@torch.no_grad()
def make_imagelike_rrdb(
    net: torch.nn.Module, detail: float = 0.3, trunk_std: float = 0.05
) -> torch.nn.Module:
    """Bias a random RRDBNet toward a nearest x4 upscale plus random detail.

    A random RRDBNet outputs near-black or saturated values, where PSNR means nothing. The dense
    block convs get ESRGAN's own initialisation (Kaiming normal x 0.1, as its reference code
    does); every conv outside the trunk gets an identity centre tap on the first three channels
    (random weights scaled by ``detail``), so the image flows through the upsampling path; the
    trunk's last conv is scaled so that its contribution has standard deviation ``trunk_std``.
    """
    trunk = next(m for m in net.model.modules() if type(m).__name__ == "ShortcutBlock")
    trunk_convs = [c for c in trunk.modules() if isinstance(c, torch.nn.Conv2d)]
    trunk_ids = {id(c) for c in trunk_convs}
    for conv in trunk_convs[:-1]:
        torch.nn.init.kaiming_normal_(conv.weight, a=0.2, mode="fan_in", nonlinearity="leaky_relu")
        conv.weight.mul_(0.1)
        if conv.bias is not None:
            conv.bias.zero_()
    for conv in net.model.modules():
        if not isinstance(conv, torch.nn.Conv2d) or id(conv) in trunk_ids:
            continue
        conv.weight.mul_(detail)
        if conv.bias is not None:
            conv.bias.mul_(detail)
        k = conv.kernel_size[0] // 2
        for c in range(min(3, conv.in_channels, conv.out_channels)):
            conv.weight[c, c, k, k] += 1.0
    _scale_output_std(net, trunk_convs[-1], trunk_std)
    return net
