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
