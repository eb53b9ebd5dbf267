"""Reference architectures for predictions made without the user's model (the ``plan`` CLI).

The predictor (:mod:`lib_vram.core.predict`) runs a model's own code on fake tensors. Inside the WebUI
that is the loaded VAE/upscaler itself. Standalone, there is no model, and the core may not import
``ldm``/``sgm``; so this module describes the networks' layer sequences in plain ``torch.nn``,
in the same operator order as the WebUI's code (the ldm/sgm KL autoencoder, whose activation is
``x * sigmoid(x)`` - two tensors, not one), and the upscalers in the operator order of spandrel's
classes (which the WebUI itself uses) without importing spandrel (its import alone costs seconds:
it pulls in torchvision). ``tests/test_predict.py`` checks that the reference decoder and encoder
produce the same fake peak as the real ldm classes, and the reference upscalers the same as
spandrel's, operator for operator.

Build them inside a ``FakeTensorMode`` (see :func:`build_vae_decoder`): no weight memory is used.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VAEArch:
    """The shape of a KL autoencoder (the SD VAE family)."""

    name: str
    z_channels: int
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    downscale: int = 8
    unet_bytes: int = 0
    """Diffusion model weights in fp16 (resident unless offloaded during VAE/upscale stages)."""
    text_encoder_bytes: int = 0
    """Text encoder weights in fp16."""
    activation: str = "x_sigmoid"
    """``"x_sigmoid"`` (ldm/sgm: ``x * torch.sigmoid(x)``) or ``"silu"`` (fused, one tensor)."""

    def model_bytes(self, itemsize: int = 2) -> tuple[int, int]:
        """(UNet, text encoders) weights at ``itemsize`` bytes a weight (4: the WebUI's --no-half)."""
        return self.unet_bytes * itemsize // 2, self.text_encoder_bytes * itemsize // 2


GB = 10**9

ARCHS: dict[str, VAEArch] = {
    # SD 1.x: VAE ddconfig of v1-inference.yaml; UNet 860 M params, CLIP-L text encoder 123 M.
    "sd15": VAEArch("sd15", z_channels=4, unet_bytes=int(1.72 * GB), text_encoder_bytes=2 * 123_060_480),
    # SDXL: same VAE layout (sgm); UNet 2.6 B params, CLIP-L + OpenCLIP-bigG 817,720,321 (sgm's
    # conditioner's float weights, counted in a checkpoint: the placement decides with them)
    "sdxl": VAEArch("sdxl", z_channels=4, unet_bytes=int(5.14 * GB), text_encoder_bytes=2 * 817_720_321),
    # SD3 medium: 16-channel latent VAE; MMDiT 2 B params; CLIP-L + CLIP-G (T5 not counted: the
    # WebUI loads it optionally, often in fp8).
    "sd3": VAEArch(
        "sd3",
        z_channels=16,
        unet_bytes=int(4.17 * GB),
        text_encoder_bytes=int(1.39 * GB),
        activation="silu",
    ),
}


_DRY_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar("lib_vram_reference_dry_run", default=False)


@contextlib.contextmanager
def dry_run() -> Iterator[None]:
    """Inside: the reference attention computes only one of its equal-shaped query chunks (the
    others are allocated, not computed). For fake runs only: results are not the real output."""
    token = _DRY_RUN.set(True)
    try:
        yield
    finally:
        _DRY_RUN.reset(token)


ATTN_CHUNK_BYTES = 64 * 2**20
"""Most bytes of attention scores the ``"sdpa"`` attention materialises at once (per query chunk)."""


def _act(x: torch.Tensor, kind: str) -> torch.Tensor:
    return F.silu(x) if kind == "silu" else x * torch.sigmoid(x)


def _norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, c, eps=1e-6, affine=True)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, act: str) -> None:
        super().__init__()
        self.act = act
        self.norm1 = _norm(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One operation per line, rebinding ``h``: each intermediate is freed exactly when ldm's is.
        h = self.norm1(x)
        h = _act(h, self.act)
        h = self.conv1(h)
        h = self.norm2(h)
        h = _act(h, self.act)
        h = self.conv2(h)
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head spatial self-attention; ``"sdpa"`` (memory-efficient kernel, what the WebUI uses
    with SDP/xformers optimisations) or ``"vanilla"`` (materialises the tokens² matrix)."""

    def __init__(self, c: int, kind: str = "sdpa") -> None:
        super().__init__()
        self.kind = kind
        self.norm = _norm(c)
        self.q = nn.Conv2d(c, c, 1)
        self.k = nn.Conv2d(c, c, 1)
        self.v = nn.Conv2d(c, c, 1)
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, hh, ww = q.shape
        if self.kind == "vanilla":
            q = q.reshape(b, c, hh * ww).permute(0, 2, 1)
            k = k.reshape(b, c, hh * ww)
            w = torch.bmm(q, k) * (int(c) ** (-0.5))
            w = F.softmax(w, dim=2)
            v = v.reshape(b, c, hh * ww)
            h = torch.bmm(v, w.permute(0, 2, 1)).reshape(b, c, hh, ww)
        else:
            n = hh * ww
            q, k, v = (t.reshape(b, 1, c, n).transpose(2, 3) for t in (q, k, v))
            # Queries in chunks: whichever kernel SDPA picks (flash, memory-efficient or the math
            # fallback that materialises scores), a chunk's scores stay under ATTN_CHUNK_BYTES.
            rows = max(1, ATTN_CHUNK_BYTES // max(1, n * q.element_size()))
            if rows >= n:
                h = F.scaled_dot_product_attention(q, k, v)
            else:
                parts = []
                for i in range(0, n, rows):
                    if parts and _DRY_RUN.get() and i + rows <= n:
                        # Same-shaped chunk as the first: same allocations, so a dry run only
                        # allocates its output (keeps fake runs of big latents fast).
                        parts.append(torch.empty_like(parts[0]))
                    else:
                        parts.append(F.scaled_dot_product_attention(q[:, :, i : i + rows], k, v))
                h = torch.cat(parts, dim=2)
                del parts
            h = h.transpose(2, 3).reshape(b, c, hh, ww)
        h = self.proj_out(h)
        return x + h


class _Mid(nn.Module):
    def __init__(self, c: int, act: str, attn: str) -> None:
        super().__init__()
        self.block_1 = ResBlock(c, c, act)
        self.attn_1 = AttnBlock(c, attn)
        self.block_2 = ResBlock(c, c, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class _Up(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.with_conv = True  # ldm's attribute: tells layout readers (the VAE engine) there is a conv
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Down(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.with_conv = True
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Decoder(nn.Module):
    """KL-VAE decoder with the ldm layout (``conv_in``, ``mid``, ``up[i].block/upsample``, ...)."""

    def __init__(self, arch: VAEArch, attn: str = "sdpa") -> None:
        super().__init__()
        self.act = arch.activation
        mults = arch.ch_mult
        block_in = arch.ch * mults[-1]
        self.conv_in = nn.Conv2d(arch.z_channels, block_in, 3, padding=1)
        self.mid = _Mid(block_in, self.act, attn)
        self.up = nn.ModuleList()
        for level in reversed(range(len(mults))):
            stage = nn.Module()
            block_out = arch.ch * mults[level]
            blocks = []
            for _ in range(arch.num_res_blocks + 1):
                blocks.append(ResBlock(block_in, block_out, self.act))
                block_in = block_out
            stage.block = nn.ModuleList(blocks)
            stage.upsample = _Up(block_in) if level != 0 else None
            self.up.insert(0, stage)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(range(len(self.up))):
            for block in self.up[level].block:
                h = block(h)
            if self.up[level].upsample is not None:
                h = self.up[level].upsample(h)
        h = self.norm_out(h)
        h = _act(h, self.act)
        return self.conv_out(h)


class Encoder(nn.Module):
    """KL-VAE encoder with the ldm layout (double_z: outputs mean and log-variance)."""

    def __init__(self, arch: VAEArch, attn: str = "sdpa") -> None:
        super().__init__()
        self.act = arch.activation
        mults = (1, *arch.ch_mult)
        self.conv_in = nn.Conv2d(3, arch.ch, 3, padding=1)
        self.down = nn.ModuleList()
        block_in = arch.ch
        for level in range(len(arch.ch_mult)):
            stage = nn.Module()
            block_in = arch.ch * mults[level]
            block_out = arch.ch * mults[level + 1]
            blocks = []
            for _ in range(arch.num_res_blocks):
                blocks.append(ResBlock(block_in, block_out, self.act))
                block_in = block_out
            stage.block = nn.ModuleList(blocks)
            stage.downsample = _Down(block_in) if level != len(arch.ch_mult) - 1 else None
            self.down.append(stage)
        self.mid = _Mid(block_in, self.act, attn)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, 2 * arch.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Like ldm/sgm, every level's output stays in a list until the forward returns, so the
        # whole down path's activations are alive at once: that is what the real encoder costs.
        hs = [self.conv_in(x)]
        for stage in self.down:
            for block in stage.block:
                hs.append(block(hs[-1]))
            if stage.downsample is not None:
                hs.append(stage.downsample(hs[-1]))
        h = self.mid(hs[-1])
        h = self.norm_out(h)
        h = _act(h, self.act)
        return self.conv_out(h)


def vae_arch(name: str) -> VAEArch:
    if name not in ARCHS:
        raise ValueError(f"`arch` must be one of {tuple(ARCHS)}, got {name!r}")
    return ARCHS[name]


UPSCALERS: tuple[str, ...] = ("rrdb", "compact")


class _RDB(nn.Module):
    """ESRGAN's residual dense block: five convolutions over the growing concatenation."""

    def __init__(self, nf: int, gc: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(nf, gc, 3, padding=1)
        self.conv2 = nn.Conv2d(nf + gc, gc, 3, padding=1)
        self.conv3 = nn.Conv2d(nf + 2 * gc, gc, 3, padding=1)
        self.conv4 = nn.Conv2d(nf + 3 * gc, gc, 3, padding=1)
        self.conv5 = nn.Conv2d(nf + 4 * gc, nf, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = F.leaky_relu_(self.conv1(x), 0.2)
        x2 = F.leaky_relu_(self.conv2(torch.cat((x, x1), 1)), 0.2)
        x3 = F.leaky_relu_(self.conv3(torch.cat((x, x1, x2), 1)), 0.2)
        x4 = F.leaky_relu_(self.conv4(torch.cat((x, x1, x2, x3), 1)), 0.2)
        x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
        return x5 * 0.2 + x


class _RRDB(nn.Module):
    def __init__(self, nf: int, gc: int) -> None:
        super().__init__()
        self.rdb1, self.rdb2, self.rdb3 = _RDB(nf, gc), _RDB(nf, gc), _RDB(nf, gc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class RRDBNet(nn.Module):
    """ESRGAN (spandrel's old-arch ``RRDBNet``: nearest-upsample + conv upsampler, LeakyReLU 0.2,
    growth 32): the same parameters and operators, in the same order."""

    def __init__(self, num_filters: int = 64, num_blocks: int = 23, scale: int = 4, gc: int = 32) -> None:
        super().__init__()
        nf = num_filters
        self.scale = scale
        self.conv_first = nn.Conv2d(3, nf, 3, padding=1)
        self.body = nn.Sequential(*[_RRDB(nf, gc) for _ in range(num_blocks)])
        self.conv_body = nn.Conv2d(nf, nf, 3, padding=1)
        self.up_factor = 3 if scale == 3 else 2
        n_up = 1 if scale == 3 else max(scale.bit_length() - 1, 0)
        self.ups = nn.ModuleList(nn.Conv2d(nf, nf, 3, padding=1) for _ in range(n_up))
        self.conv_hr = nn.Conv2d(nf, nf, 3, padding=1)
        self.conv_last = nn.Conv2d(nf, 3, 3, padding=1)

    def peak_bytes_per_px(self, itemsize: int) -> float:
        """The forward's peak tensor bytes per input pixel, the input not included, in the order
        its operators allocate and free (what :class:`lib_vram.core.livebytes.LiveBytesCounter`
        counts on fake tensors, without a fake run: ``tests/test_predict.py`` checks the two
        agree). The largest of: the body (the stage input, a block's input, an RDB's input, its
        four growth outputs, their concatenation and its last convolution's output), the body's
        residual, each upsampling (the features and their nearest copy, then the copy and the
        convolution's output) and the head."""
        nf = self.conv_first.out_channels
        gc = self.body[0].rdb1.conv1.out_channels if len(self.body) else 0
        n = len(self.body)
        body = (5 * nf + 8 * gc) if n >= 2 else (4 * nf + 8 * gc) if n == 1 else 0
        terms = [body, 4 * nf]
        px = 1
        for _ in self.ups:
            terms.append(px * nf * (1 + self.up_factor**2))
            px *= self.up_factor**2
            terms.append(2 * px * nf)
        terms += [2 * px * nf, px * (nf + self.conv_last.out_channels)]
        return float(max(terms) * itemsize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fea = self.conv_first(x)
        fea = fea + self.conv_body(self.body(fea))
        # One rebinding per layer, as spandrel's flat nn.Sequential does: the tensor before an
        # upsample is free while the convolution after it runs.
        for conv in self.ups:
            fea = F.interpolate(fea, scale_factor=self.up_factor, mode="nearest")
            fea = F.leaky_relu_(conv(fea), 0.2)
        fea = F.leaky_relu_(self.conv_hr(fea), 0.2)
        return self.conv_last(fea)


class SRVGGNetCompact(nn.Module):
    """Real-ESRGAN's compact network (spandrel's ``SRVGGNetCompact``, PReLU): convolutions at the
    input size, a pixel shuffle, plus the nearest-upsampled input."""

    def __init__(self, num_feat: int = 64, num_conv: int = 16, upscale: int = 4) -> None:
        super().__init__()
        self.upscale = self.scale = upscale
        layers: list[nn.Module] = [nn.Conv2d(3, num_feat, 3, 1, 1), nn.PReLU(num_parameters=num_feat)]
        for _ in range(num_conv):
            layers += [nn.Conv2d(num_feat, num_feat, 3, 1, 1), nn.PReLU(num_parameters=num_feat)]
        layers.append(nn.Conv2d(num_feat, 3 * upscale * upscale, 3, 1, 1))
        self.body = nn.ModuleList(layers)
        self.upsampler = nn.PixelShuffle(upscale)

    def peak_bytes_per_px(self, itemsize: int) -> float:
        """The forward's peak tensor bytes per input pixel (as :meth:`RRDBNet.peak_bytes_per_px`):
        a convolution's input and output (or a PReLU's), the last convolution's output beside
        its input, the pixel shuffle's copy beside its input, then beside the upsampled input."""
        nf = self.body[0].out_channels
        last = self.body[-1].out_channels
        return float(max(2 * nf, nf + last, 2 * last) * itemsize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for layer in self.body:
            out = layer(out)
        out = self.upsampler(out)
        out += F.interpolate(x, scale_factor=self.upscale, mode="nearest")
        return out


def build_upscaler(kind: str, scale: int = 4, *, num_filters: int = 64, num_blocks: int | None = None):
    """A reference upscaler network: ``"rrdb"`` (ESRGAN / RealESRGAN x4plus, 23 blocks of 64
    filters) or ``"compact"`` (RealESRGAN general/anime compact, 16 convs of 64 filters).

    Call inside a fake mode or on the meta device to build it without weight memory.
    """
    if kind == "rrdb":  # (filters, blocks, scale)
        return RRDBNet(num_filters, 23 if num_blocks is None else num_blocks, scale)
    if kind == "compact":
        return SRVGGNetCompact(num_filters, 16 if num_blocks is None else num_blocks, scale)
    raise ValueError(f"`upscaler` must be one of {UPSCALERS}, got {kind!r}")
