"""VRAM Guard library: memory-bounded VAE, upscaling and memory planning for Stable Diffusion.

The core of this package is plain PyTorch + numpy + PIL: it never imports the WebUI (``modules``),
gradio, ``ldm`` or ``sgm``. WebUI-facing code lives in :mod:`lib_vram.webui` (imported only by the
extension's ``scripts/``) and the gradio UI builder in :mod:`lib_vram.webui.ui`.
"""

from __future__ import annotations

from lib_vram.core.device import (
    Backend,
    Capabilities,
    MemoryInfo,
    ReleaseResult,
    capabilities,
    free_bytes,
    is_oom_error,
    memory_info,
    release,
    resolve_device,
)
from lib_vram.core.tracker import StageRecord, StageTracker
from lib_vram.planning.tiers import tier_for_total, tier_label

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Capabilities",
    "MemoryInfo",
    "ReleaseResult",
    "StageRecord",
    "StageTracker",
    "__version__",
    "capabilities",
    "free_bytes",
    "is_oom_error",
    "memory_info",
    "release",
    "resolve_device",
    "tier_for_total",
    "tier_label",
]
