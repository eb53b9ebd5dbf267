"""Code that lives where a WebUI extension's code lives (``extensions/<folder>/scripts/...``).

The sampling guard tells the stock UNet forward from an extension's change by the file the code
comes from (:func:`lib_vram.sampling.origin_of`), as it does in the WebUI. These helpers write a
small module into ``<tmp>/extensions/<folder>/scripts/`` and import it from there, so that what a
test puts into the UNet is found exactly as an installed extension's code is.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

_COUNT = itertools.count()

FRAMES = '''
import torch


class TemporalMix(torch.nn.Module):
    """Mixes each sample with the other frames of its video, as a motion module does: the batch
    is ``(b f)``; a batch that is not a whole number of videos is an error, and a batch cut
    between videos' boundaries computes other videos."""

    def __init__(self, frames):
        super().__init__()
        self.frames = frames
        self.batches = []

    def forward(self, x, *args, **kwargs):
        self.batches.append(int(x.shape[0]))
        if x.shape[0] % self.frames:
            raise RuntimeError(f"(b f) with f={self.frames}: batch {x.shape[0]} is not whole videos")
        v = x.view(x.shape[0] // self.frames, self.frames, *x.shape[1:])
        return (v + 0.5 * v.mean(1, keepdim=True)).view_as(x)


def count_batches(seen):
    def hook(module, args):
        seen.append(int(args[0].shape[0]))

    return hook


def wrap(fn):
    def forward(*args, **kwargs):
        return fn(*args, **kwargs)

    return forward
'''
"""A frame-coupled module (AnimateDiff's kind), a hook factory and a forward wrapper."""


def extension_module(root: Path, folder: str, source: str = FRAMES) -> ModuleType:
    """Import ``source`` as ``<root>/extensions/<folder>/scripts/<name>.py``."""
    path = Path(root) / "extensions" / folder / "scripts" / f"vg_ext_{next(_COUNT)}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


IP_ADAPTER = '''
import types

import torch
import torch.nn.functional as F


def _heads(t, b, h):
    return t.view(b, -1, h, t.shape[-1] // h).transpose(1, 2)


def attention(self, x, context=None, **kwargs):
    """A cross-attention with IP-Adapter's units: the prompt's attention (SDP), then each hack's
    attention of the same queries on its image tokens added."""
    b, h = x.shape[0], self.heads
    q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
    out = F.scaled_dot_product_attention(_heads(q, b, h), _heads(k, b, h), _heads(v, b, h))
    out = out.transpose(1, 2).reshape(b, -1, q.shape[-1])
    del k, v
    for hack in self.ipadapter_hacks:
        out = out + hack(self, x, _heads(q, b, h))
    return self.to_out(out)


class Adapter(torch.nn.Module):
    """An IP-Adapter unit's model as sd-webui-controlnet keeps it: ``ipadapter`` with its layers
    (a key and a value projection of the image tokens per cross-attention, float32, in host
    memory), the image embedding ``image_emb`` (``cond_emb``: 1 x tokens x context), a cache of
    the layers' outputs made at the first forward."""

    disable_memory_management = True

    def __init__(self, widths, tokens, ctx, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ipadapter = torch.nn.Module()
        self.ipadapter.is_pulid = False
        pairs = [torch.nn.Linear(ctx, w, bias=False) for w in widths for _ in range(2)]
        self.ipadapter.ip_layers = torch.nn.ModuleList(pairs)
        with torch.no_grad():
            for p in self.ipadapter.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        emb = torch.randn(1, tokens, ctx, generator=g)
        self.image_emb = types.SimpleNamespace(cond_emb=emb, uncond_emb=torch.zeros_like(emb))
        self.cache = {}

    def hack(self, i):
        def image_part(attn, x, qh):
            b, h = x.shape[0], attn.heads
            if i not in self.cache:  # (cond rows first, then uncond: the test's batches)
                e = self.image_emb
                emb = torch.cat([e.cond_emb.expand(b // 2, -1, -1), e.uncond_emb.expand(b // 2, -1, -1)])
                self.cache[i] = tuple(self.ipadapter.ip_layers[2 * i + j](emb) for j in (0, 1))
            k, v = (_heads(t, b, h) for t in self.cache[i])
            out = F.scaled_dot_product_attention(qh, k, v).transpose(1, 2).reshape(b, -1, x.shape[-1])
            return out * 0.8

        return image_part


def install(unet, adapters):
    """Each adapter's hack on every cross-attention of ``unet``; undone by ``remove``."""
    layers = [m for n, m in unet.named_modules() if n.endswith("attn2")]
    for i, m in enumerate(layers):
        m.ipadapter_hacks = [a.hack(i) for a in adapters]
        m.forward = types.MethodType(attention, m)
    return layers


def remove(layers):
    for m in layers:
        del m.forward, m.ipadapter_hacks
'''
"""IP-Adapter's decoupled cross-attention as sd-webui-controlnet v1.1.455 runs it (this project's
own code: ``scripts/ipadapter/plugable_ipadapter.py`` read, not copied)."""
