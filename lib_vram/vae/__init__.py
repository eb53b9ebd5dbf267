"""Tiled VAE engine: exact and fast tiled decode/encode in bounded memory.

Public API (see ``docs/how-it-works.md``, "Tiled VAE"):

* :func:`tiled_decode`, :func:`tiled_encode` with a :class:`TiledVAEConfig`; what ran is written
  into a :class:`VAEReport`. Exact mode's promise: :data:`EXACT_MAX_ABS_ERR` (max abs, float32).
* :func:`is_supported_decoder`, :func:`is_supported_encoder`: layout checks (ldm/sgm, diffusers).
* :func:`plan_vae`: the plan a pass runs (what ``mode="auto"`` decides) and its predicted peak,
  without running it; :func:`estimate_peak_bytes`: the analytic peak of one plan.
* Learning: out-of-memory retries and finished passes are recorded in :data:`lib_vram.planning.planner.MEMORY`
  (or the ``memory`` passed in); ``mode="auto"`` and the automatic tile consult it.
* :class:`Interrupted`, :class:`VAEOutOfMemory`: the errors it raises besides ``ValueError``.
* :func:`parked_bytes`: tile state parked off the compute device right now (exact mode).
* :func:`attention`: the chunked, memory-efficient attention used for the mid block.

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
