"""Tiny real VAE modules for the tiled-VAE tests: the ldm classes the WebUI uses, and diffusers'
AutoencoderKL (the layout Forge uses). Random weights from a seed; small channel counts."""

from __future__ import annotations

import torch

from lib_vram.cli.hostmodels import SD_VAE, build_ldm


def _small(z_channels: int, ch_mult, num_res_blocks: int, **kw) -> dict:
    return {
        **SD_VAE,
        "ch": 32,
        "ch_mult": ch_mult,
        "num_res_blocks": num_res_blocks,
        "resolution": 64,
        "z_channels": z_channels,
        **kw,
    }


def ldm_decoder(z_channels: int = 4, *, ch_mult=(1, 2), num_res_blocks: int = 1, seed: int = 0, **kw):
    return build_ldm("decoder", _small(z_channels, ch_mult, num_res_blocks, **kw), seed)


def ldm_encoder(z_channels: int = 4, *, ch_mult=(1, 2), num_res_blocks: int = 1, seed: int = 0):
    return build_ldm("encoder", _small(z_channels, ch_mult, num_res_blocks), seed)


def diffusers_vae(latent_channels: int = 4, *, seed: int = 0, blocks: int = 2):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=tuple(32 * (i + 1) for i in range(blocks)),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=16,
    )
    return vae.eval()


def smooth_latent(b: int, c: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """Image-like latent: a smooth field plus mild noise, so tiles differ in their statistics."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(b, c, max(2, h // 4), max(2, w // 4), generator=g)
    field = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    return field + 0.3 * torch.randn(b, c, h, w, generator=g)
