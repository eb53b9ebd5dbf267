"""The reference UNets' unit sizes for ``plan``, without ldm/sgm and without weights.

The checkpoint placement decides which UNet units stay on the card from their sizes
(:func:`lib_vram.sampling.unit_bytes`). ``plan`` has no checkpoint, so :func:`reference_unet`
builds the module tree of a :class:`~lib_vram.sampling.UNetSpec` in plain ``torch.nn`` on the meta
device with the names, registration order and parameter shapes of ldm's/sgm's ``UNetModel``
(checked against the real one in ``tests/test_cli_plan.py``).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from lib_vram.sampling import UNetSpec, reference_spec, unit_bytes


def _norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(32, c), c)


def _resblock(cin: int, cout: int, emb: int) -> nn.Module:
    m = nn.Module()
    m.in_layers = nn.Sequential(_norm(cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1))
    m.h_upd = m.x_upd = nn.Identity()
    m.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb, cout))
    m.out_layers = nn.Sequential(_norm(cout), nn.SiLU(), nn.Dropout(0.0), nn.Conv2d(cout, cout, 3, padding=1))
    m.skip_connection = nn.Identity() if cin == cout else nn.Conv2d(cin, cout, 1)
    return m


def _attention(dim: int, ctx: int) -> nn.Module:
    m = nn.Module()
    m.to_q = nn.Linear(dim, dim, bias=False)
    m.to_k = nn.Linear(ctx, dim, bias=False)
    m.to_v = nn.Linear(ctx, dim, bias=False)
    m.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.0))
    return m


def _block(dim: int, ctx: int) -> nn.Module:
    """ldm's ``BasicTransformerBlock`` (registration order: attn1, ff, attn2, norm1..3)."""
    m = nn.Module()
    m.attn1 = _attention(dim, dim)
    ff = nn.Module()
    geglu = nn.Module()
    geglu.proj = nn.Linear(dim, dim * 8)
    ff.net = nn.Sequential(geglu, nn.Dropout(0.0), nn.Linear(dim * 4, dim))
    m.ff = ff
    m.attn2 = _attention(dim, ctx)
    m.norm1, m.norm2, m.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
    return m


def _transformer(c: int, depth: int, ctx: int, linear: bool) -> nn.Module:
    m = nn.Module()
    m.norm = _norm(c)
    m.proj_in = nn.Linear(c, c) if linear else nn.Conv2d(c, c, 1)
    m.transformer_blocks = nn.ModuleList([_block(c, ctx) for _ in range(depth)])
    m.proj_out = nn.Linear(c, c) if linear else nn.Conv2d(c, c, 1)
    return m


def _conv_block(cin: int, cout: int, *, down: bool = False) -> nn.Module:
    """ldm's ``Downsample`` (``op``) or ``Upsample`` (``conv``) with conv resampling."""
    m = nn.Module()
    setattr(m, "op" if down else "conv", nn.Conv2d(cin, cout, 3, stride=2 if down else 1, padding=1))
    return m


def _build(spec: UNetSpec) -> nn.Module:
    mc = spec.model_channels
    emb = 4 * mc
    ctx = spec.context_dim

    def level(cin: int, cout: int, depth: int) -> list[nn.Module]:
        """A ResBlock from ``cin`` to ``cout`` channels, then a transformer of ``depth`` blocks if any."""
        layers = [_resblock(cin, cout, emb)]
        return (layers + [_transformer(cout, depth, ctx, spec.use_linear)]) if depth else layers

    unet = nn.Module()
    unet.time_embed = nn.Sequential(nn.Linear(mc, emb), nn.SiLU(), nn.Linear(emb, emb))
    if spec.adm_in_channels:
        unet.label_emb = nn.Sequential(
            nn.Sequential(nn.Linear(spec.adm_in_channels, emb), nn.SiLU(), nn.Linear(emb, emb))
        )
    blocks = [nn.Sequential(nn.Conv2d(spec.in_channels, mc, 3, padding=1))]
    chans = [mc]
    ch = mc
    for lv in range(spec.levels):
        for _ in range(spec.num_res_blocks[lv]):
            blocks.append(nn.Sequential(*level(ch, spec.channels(lv), spec.depth[lv])))
            ch = spec.channels(lv)
            chans.append(ch)
        if lv != spec.levels - 1:
            blocks.append(nn.Sequential(_conv_block(ch, ch, down=True)))
            chans.append(ch)
    unet.input_blocks = nn.ModuleList(blocks)
    unet.middle_block = nn.Sequential(*level(ch, ch, spec.depth_middle), _resblock(ch, ch, emb))
    out_blocks = []
    for lv in reversed(range(spec.levels)):
        for i in range(spec.num_res_blocks[lv] + 1):
            layers = level(ch + chans.pop(), spec.channels(lv), spec.depth[lv])
            ch = spec.channels(lv)
            if lv and i == spec.num_res_blocks[lv]:
                layers.append(_conv_block(ch, ch))
            out_blocks.append(nn.Sequential(*layers))
    unet.output_blocks = nn.ModuleList(out_blocks)
    unet.out = nn.Sequential(_norm(mc), nn.SiLU(), nn.Conv2d(mc, spec.out_channels, 3, padding=1))
    return unet


def reference_unet(spec: UNetSpec | str) -> nn.Module:
    """The module tree of ``spec`` (or a reference architecture's name: ``"sd15"``, ``"sd2"``,
    ``"sdxl"``) on the meta device, float32 (see the module docstring)."""
    if isinstance(spec, str):
        spec = reference_spec(spec)
    with torch.device("meta"):
        return _build(spec)


@functools.lru_cache(maxsize=8)
def _units_fp32(arch: str) -> tuple[tuple[str, int], ...]:
    return tuple(unit_bytes(reference_unet(arch)))


def reference_units(arch: str, itemsize: int = 2) -> list[tuple[str, int]]:
    """(name, bytes) of each unit of the reference UNet of ``arch`` at ``itemsize`` bytes per
    weight, in forward order (:func:`lib_vram.sampling.unit_bytes` of :func:`reference_unet`)."""
    return [(n, b // 4 * itemsize) for n, b in _units_fp32(reference_spec(arch).name)]
