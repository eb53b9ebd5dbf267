"""The numeric bounds the tests compare against, each derived from what the code promises.

Never a number fitted to one machine: CPUs differ (AVX2, AVX-512, AVX512-FP16, torch's portable
kernels) and so do thread counts, and each picks its own summation order inside a convolution or a
reduction. CI runs the ``numeric`` tests a second time with ``ATEN_CPU_CAPABILITY=default`` and one
thread (docs/development.md) so that a bound fitted to one machine fails there, not on a user's.

Which comparison where:

* ``torch.equal`` (bit-identity) only where both sides run the same operations in the same order on
  the same shapes: a hook that calls the original forward unchanged, a feature that is off, the same
  call twice.
* :data:`VAE_EXACT`: exact tiled VAE (and fast mode with whole-image statistics) against the untiled
  pass: the engine's documented bound.
* :data:`UPSCALE_LSB`: tiled upscale against the model's own untiled output, in 8-bit levels: the
  upscaler's documented bound.
* :func:`rounding`: float32 results that differ only by the rounding of a few elementwise
  operations (a blend of weights that sum to one, a sum taken in another order).
* :func:`reduced_precision`: a float16/bfloat16 computation against another one (or float32).
"""

from __future__ import annotations

import torch

from lib_vram.upscale._types import EXACT_MAX_LSB
from lib_vram.vae._config import EXACT_MAX_ABS_ERR

VAE_EXACT = EXACT_MAX_ABS_ERR
"""Exact tiled VAE vs untiled, max abs (lib_vram.vae, ``EXACT_MAX_ABS_ERR``)."""

UPSCALE_LSB = EXACT_MAX_LSB
"""Tiled upscale vs untiled, 8-bit levels (lib_vram.upscale, ``EXACT_MAX_LSB``)."""

F32_EPS = torch.finfo(torch.float32).eps
"""float32's machine epsilon, 2**-23 (one rounding is at most half of it, relative)."""


def rounding(ops: int, magnitude: float = 1.0) -> float:
    """Max abs difference of two float32 results of size ``magnitude`` that differ by at most
    ``ops`` roundings (each <= F32_EPS / 2 relative; counted generously as a full epsilon)."""
    return ops * F32_EPS * magnitude


REDUCED_ULPS = 16
"""A float16/bfloat16 pass against another pass of the same model (another tiling, or float32), in
units of the reduced type's epsilon at the output's magnitude: every layer rounds its result and the
next layer's input to the reduced type (2 roundings per layer), and the tiny test models have about
8 layers between a GroupNorm (or the input) and the output. Measured 2-3 units (VAE decoder, fp16
and bf16; Compact upscaler), on AVX2 and on torch's portable kernels alike."""


def reduced_precision(dtype: torch.dtype, magnitude: float = 1.0) -> float:
    """Max abs difference allowed between a ``dtype`` (float16/bfloat16) result of size
    ``magnitude`` and another computation of the same thing (see :data:`REDUCED_ULPS`)."""
    return REDUCED_ULPS * torch.finfo(dtype).eps * magnitude


def levels(abs_bound: float, data_range: float = 1.0) -> int:
    """An abs bound on values in ``[0, data_range]`` as 8-bit levels: the bound's own levels, plus
    one for a value on a rounding edge."""
    return int(abs_bound * 255.0 / data_range) + 1


def lsb(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> int:
    """Max difference of two images in 8-bit levels (``round(x * 255 / data_range)``)."""
    to8 = 255.0 / data_range
    return int(((a.float() * to8).round() - (b.float() * to8).round()).abs().max())


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())
