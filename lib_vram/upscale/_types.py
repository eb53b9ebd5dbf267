"""Configuration, report and error types of the tiled upscaler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PRECISIONS = ("auto", "fp16", "bf16", "fp32")
ACCUMULATE = ("auto", "device", "cpu")

EXACT_MAX_LSB = 1
"""The tiled upscaler's promise when :attr:`UpscaleReport.exact` is True: the output, as 8-bit
levels (``round(x * 255)``), differs from the model's own untiled output by at most this many levels.
Only float rounding separates them (a tile's convolutions sum over its own extent; the cross-fade
weights sum to one up to rounding), and a value that sits on a rounding edge can land one level
either side. The tests compare against this constant."""


class UpscaleError(RuntimeError):
    """An upscale that cannot be done: unreadable/unsupported model file, unusable model, OOM even
    at the smallest tile. The message names the file (when there is one) and the reason."""


class TileError(UpscaleError):
    """The model fails on tiles or on the small calibration probes for a reason other than memory
    (the whole image may still work: :func:`lib_vram.upscale.upscale_tensor` then runs it untiled
    where it fits). The message names the model and the reason in one line."""


class Interrupted(RuntimeError):
    """``should_interrupt()`` returned True between two batches.

    The tiles finished so far stay reachable through the :class:`UpscaleReport` passed in
    (``report.partial``: the output accumulator, with unfinished regions black).
    """


@dataclass(frozen=True)
class UpscaleConfig:
    """How to upscale. Every field has a safe automatic default.

    Args:
        tile: core size of a tile in input pixels (the part of the output a tile owns); ``None``
            picks it from free memory and the model's bytes per pixel (and skips tiling when the
            whole image fits).
        batch: tiles per forward pass; ``None`` picks it from free memory.
        overlap: input pixels of context each tile reads beyond its core on every side (the halo;
            neighbouring windows share twice this). ``None`` derives it from the model (measured
            effective receptive field, see :func:`lib_vram.upscale.measure_context`).
        precision: ``"auto"`` (FP16, else BF16, where model and device support them; FP32 on the
            CPU), ``"fp16"``, ``"bf16"`` or ``"fp32"``.
        device: where the model runs; ``None`` = the best available device.
        budget_bytes: memory the upscale may use on the device; ``None`` = 80 % of what is free.
        accumulate_on: where the output is blended: ``"device"``, ``"cpu"`` or ``"auto"`` (the
            device when the output fits the budget beside the tiles).
        check_finite: check every batch computed in FP16/BF16 for NaN/Inf and recompute it in FP32.
            Turn off only to run under ``FakeTensorMode`` (the check reads a value).
        calibrate: measure bytes per pixel and the effective receptive field on first use of a model
            (a few small forward passes, cached per model). Off: predicted from defaults.
    """

    tile: int | None = None
    batch: int | None = None
    overlap: int | None = None
    precision: str = "auto"
    device: torch.device | str | None = None
    budget_bytes: int | None = None
    accumulate_on: str = "auto"
    check_finite: bool = True
    calibrate: bool = True

    def __post_init__(self) -> None:
        for name, low in (("tile", 8), ("batch", 1), ("overlap", 0)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(f"`{name}` must be None or an int >= {low}, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"`precision` must be one of {PRECISIONS}, got {self.precision!r}")
        if self.accumulate_on not in ACCUMULATE:
            raise ValueError(f"`accumulate_on` must be one of {ACCUMULATE}, got {self.accumulate_on!r}")
        bad_budget = not isinstance(self.budget_bytes, int) or self.budget_bytes < 1
        if self.budget_bytes is not None and bad_budget:
            raise ValueError(f"`budget_bytes` must be None or a positive int, got {self.budget_bytes!r}")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"`device` must be None, a torch.device or a device name like 'cpu', 'cuda' or "
                    f"'cuda:1', got {self.device!r}"
                ) from None


@dataclass
class UpscaleReport:
    """What one upscale did; pass one in to read it afterwards (also after an error)."""

    tiled: bool = False
    tile: int = 0
    """Core size (input px) in use at the end (smaller than planned after an OOM)."""
    batch: int = 0
    overlap: int = 0
    feather: int = 0
    """Width (input px) of the cross-fade centred on each boundary between tile cores."""
    dtype: str = ""
    device: str = ""
    accumulate_on: str = ""
    tiles_total: int = 0
    tiles_done: int = 0
    forward_calls: int = 0
    """Forward passes of the model (including failed and recomputed ones)."""
    ooms: int = 0
    recomputed_batches: int = 0
    """Batches recomputed in FP32 after a non-finite FP16/BF16 result."""
    flop_ratio: float = 1.0
    """Input pixels processed over image pixels (halo and padding overhead)."""
    bytes_per_px: float = 0.0
    """Working-set bytes per input pixel used for the plan (measured or predicted)."""
    budget_bytes: int = 0
    seconds: float = 0.0
    plan: str = ""
    """The plan that finished (after any out-of-memory retries); ends in ``inexact`` when the tiled
    result may differ from the untiled model (see ``notes``)."""
    exact: bool = True
    """False when the run was tiled although the model's output depends on the whole image (global
    pooling, grid attention, a context beyond the largest probe): then ``notes`` says why."""
    notes: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    partial: torch.Tensor | None = None
    """After :class:`Interrupted`: the accumulator ``[B, C, H*s, W*s]`` (finished tiles only)."""
