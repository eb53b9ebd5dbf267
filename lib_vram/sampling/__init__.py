"""The sampling stage: the memory of the UNet's forward, its plan, and micro-batching.

Public API:

* :class:`UNetSpec`, :func:`unet_spec` (from a live ldm/sgm ``UNetModel``, duck-typed),
  :func:`reference_spec` (``"sd15"``, ``"sd2"``, ``"sdxl"``: no weights, no ldm); a cldm
  ControlNet's (``is_control``; :func:`reference_control`): a pass's ``controls``.
* :data:`ATTENTIONS`, :data:`ATTENTION_WORDS`, :func:`attention_of`: the WebUI's cross-attention
  optimizations.
* :func:`estimate_sampling` -> :class:`SamplingEstimate`: closed-form weights, activations and
  peak of one UNet forward (no fitted factors; checked against the real ldm ``UNetModel`` on fake
  tensors in ``tests/test_sampling_estimate.py``).
* :func:`plan_sampling` -> :class:`SamplingPlan`: the largest micro-batch that fits a budget,
  through :data:`lib_vram.planning.planner.MEMORY`; a one-line suggestion when nothing fits.
* :func:`micro_batched`: a forward that splits its batch, halving it on an out-of-memory error.
* :class:`SelfAttention` (:class:`HyperTile`, :class:`TokenMerging`): the WebUI's own options that
  shrink the self-attention's tokens, an option of the estimate, the plan and the streamed plan.
* :func:`inspect_unet` -> :class:`ForwardCheck`: what of a UNet's forward is not the stock one
  (modules, replaced forwards, hooks of other extensions), per-sample or not, modelled or not.
* :func:`plan_stream` -> :class:`StreamPlan`, :class:`StreamedUNet`: when the step does not fit
  even at micro-batch 1, keep the largest UNet units resident within the budget and stream the
  others with prefetch (units ``_units``, plan ``_stream_plan``, copies ``_copy``, hooks
  ``_stream``); :func:`unit_bytes`, :func:`lowvram_bytes_per_forward`.

The package never imports ``ldm``, ``sgm`` or the WebUI.
"""

from __future__ import annotations

from ._attention import ATTENTION_WORDS, ATTENTIONS, attention_of
from ._copy import StreamStats
from ._estimate import MAX_BATCH, MAX_LATENT_SIDE, SamplingEstimate, estimate_sampling
from ._forward import KNOWN, Finding, ForwardCheck, Known, finding, inspect_unet, origin_of
from ._micro import MicroBatched, micro_batched
from ._plan import SamplingPlan, plan_sampling
from ._spec import CONTROLS, REFERENCES, UNetSpec, param_count, reference_control, reference_spec, unet_spec
from ._stream import StreamedUNet
from ._stream_plan import (
    StreamPlan,
    choose_resident,
    lowvram_bytes_per_forward,
    more_streamed,
    more_streamed_pass,
    plan_stream,
)
from ._tokens import HyperTile, SelfAttention, TokenMerging
from ._units import UNIT_PARTS, unet_units, unit_bytes

__all__ = [
    "ATTENTIONS",
    "ATTENTION_WORDS",
    "CONTROLS",
    "KNOWN",
    "Finding",
    "HyperTile",
    "SelfAttention",
    "TokenMerging",
    "ForwardCheck",
    "Known",
    "finding",
    "inspect_unet",
    "origin_of",
    "MAX_BATCH",
    "MAX_LATENT_SIDE",
    "REFERENCES",
    "MicroBatched",
    "SamplingEstimate",
    "SamplingPlan",
    "UNIT_PARTS",
    "StreamPlan",
    "StreamStats",
    "StreamedUNet",
    "UNetSpec",
    "attention_of",
    "choose_resident",
    "lowvram_bytes_per_forward",
    "more_streamed",
    "more_streamed_pass",
    "plan_stream",
    "unet_units",
    "unit_bytes",
    "estimate_sampling",
    "micro_batched",
    "param_count",
    "plan_sampling",
    "reference_control",
    "reference_spec",
    "unet_spec",
]
