"""Tiled upscaling with ESRGAN-family models (anything spandrel loads) or any callable image model.

Public API: the names in ``__all__`` below (how it works: docs/how-it-works.md, "Tiled upscaling").
See :mod:`lib_vram.upscale._engine` for the algorithm (geometry, blending, OOM continuation),
:mod:`lib_vram.upscale._calibrate` for how tile size and overlap are derived, and
:mod:`lib_vram.upscale._image` for the PIL mode table.
"""

from __future__ import annotations

from ._adapter import ModelSpec, as_spec, choose_dtype
from ._calibrate import (
    bytes_per_px,
    clear_calibration,
    context,
    measure_bytes_per_px,
    measure_context,
)
from ._engine import upscale_tensor
from ._image import upscale_image
from ._models import ModelCache, default_cache, load_model
from ._plan import UpscalePlan, plan_upscale
from ._types import Interrupted, TileError, UpscaleConfig, UpscaleError, UpscaleReport

__all__ = [
    "Interrupted",
    "TileError",
    "ModelCache",
    "ModelSpec",
    "UpscaleConfig",
    "UpscaleError",
    "UpscalePlan",
    "UpscaleReport",
    "as_spec",
    "bytes_per_px",
    "context",
    "measure_bytes_per_px",
    "choose_dtype",
    "clear_calibration",
    "default_cache",
    "load_model",
    "measure_context",
    "plan_upscale",
    "upscale_image",
    "upscale_tensor",
]
