"""Tiled VAE engine: exact and fast tiled decode/encode in bounded memory.

Public API (usage and what each mode promises: docs/how-it-works.md, "Tiled VAE"): :func:`tiled_decode`
and :func:`tiled_encode` with a :class:`TiledVAEConfig`, reporting into a :class:`VAEReport` (exact
mode's bound: :data:`EXACT_MAX_ABS_ERR`); :func:`plan_vae`/:func:`plan_pass` (what ``mode="auto"``
decides, without running) and :func:`estimate_peak_bytes`; the layout checks; the errors
:class:`Interrupted` and :class:`VAEOutOfMemory`; :func:`parked_bytes`; :func:`attention`. Out-of-memory
retries and finished passes are learned in :data:`lib_vram.planning.planner.MEMORY`.

The package never imports ``ldm``, ``sgm`` or ``diffusers``: layouts are recognised by attribute
names.
"""

from __future__ import annotations

from ._api import is_supported_decoder, is_supported_encoder, plan_pass, tiled_decode, tiled_encode
from ._attention import attention, query_chunk
from ._config import (
    EXACT_MAX_ABS_ERR,
    Interrupted,
    Recompute,
    TiledVAEConfig,
    VAEOutOfMemory,
    VAEReport,
)
from ._engine import parked_bytes
from ._layout import UnsupportedLayout, decoder_spec, encoder_spec
from ._plan import VAEPlan, estimate_peak_bytes, plan_vae

__all__ = [
    "EXACT_MAX_ABS_ERR",
    "Interrupted",
    "Recompute",
    "TiledVAEConfig",
    "UnsupportedLayout",
    "VAEOutOfMemory",
    "VAEPlan",
    "VAEReport",
    "attention",
    "decoder_spec",
    "encoder_spec",
    "estimate_peak_bytes",
    "is_supported_decoder",
    "is_supported_encoder",
    "parked_bytes",
    "plan_pass",
    "plan_vae",
    "query_chunk",
    "tiled_decode",
    "tiled_encode",
]
