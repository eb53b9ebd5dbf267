"""Configuration, report and errors of the tiled VAE engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

MODES = ("auto", "exact", "fast")
OFFLOAD = ("auto", "device", "cpu")
_ALLOWED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

EXACT_MAX_ABS_ERR = 1e-4
"""Exact mode's promise in float32: the tiled output differs from the untiled pass of the same
module by at most this (max abs), on the decoder's image (about [-1, 1]) and the encoder's moments.
Only float rounding separates them: a tile sums each convolution over its own extent, the GroupNorm
statistics are combined from per-tile sums (in float64), and the CPU's kernels (AVX2, AVX-512, the
portable ones) and thread count pick their own summation orders. Measured 1e-6 to 9e-6 on small and
full-size SD/SDXL decoders (docs/sgm-run.md); 1e-4 is 1/78 of an 8-bit step of the [-1, 1] image
(2/255), so an exact tile can move a saved pixel by at most one level, and only where the untiled
value sits on a rounding edge. The tests compare against this constant; do not loosen it to fit a
machine."""


class Interrupted(RuntimeError):
    """Raised between tiles when ``should_interrupt()`` returned True.

    A ``RuntimeError`` subclass so that hosts that treat any runtime error as "job failed" keep
    working; catch it by type to tell an interrupt from a failure. Nothing is left patched or
    allocated when it propagates.
    """


class VAEOutOfMemory(RuntimeError):
    """Even the smallest tile ran out of memory. Its message contains "out of memory" so that
    :func:`lib_vram.core.device.is_oom_error` recognises it."""


@dataclass(frozen=True)
class TiledVAEConfig:
    """How to run a VAE decode/encode.

    Attributes:
        mode: ``"auto"`` (untiled when the whole pass fits ``budget_bytes``, else exact tiles),
            ``"exact"`` (tiles whose output equals the untiled pass up to float rounding) or
            ``"fast"`` (one pass, independent tiles, GroupNorm statistics estimated once from a
            downsampled pass; seamless, not exact).
        tile: core size of a tile in **latent** pixels, for decode and encode alike (an encoder
            tile covers ``tile * 8`` image pixels for SD). ``None``: the largest that fits the
            budget (or what an earlier out-of-memory retry learned for this shape).
        budget_bytes: memory the pass may use on the compute device. ``None``: the device's free
            memory minus a safety margin, read when the pass starts.
        dtype: compute dtype. ``None``: the module's own dtype. ``torch.float16``/``bfloat16`` run
            in reduced precision (the module's weights are cast on the fly, the module is not
            changed).
        guard: check every tile segment for NaN/Inf and recompute only that segment in a wider
            dtype (``guard_dtype``). Off: no data-dependent checks at all (the engine then runs
            under ``FakeTensorMode``).
        guard_dtype: the wider dtype; ``None`` = bfloat16 where the device supports it (when
            computing in float16), else float32.
        state_offload: where tiles waiting at a GroupNorm keep their activations: ``"device"``,
            ``"cpu"`` (pinned memory on accelerators) or ``"auto"`` (device when it fits the budget).
        fast_sample: fast mode estimates the GroupNorm statistics of the tiled part once, from
            ``1/fast_sample`` of each axis (``1/fast_sample**2`` of the area); 1 = from the whole
            image (exact statistics, but two passes). ``None`` (default): decoder: subsample until
            the latent's short side is ~32 px, at least 2x (the estimate then costs a few percent
            of a large decode); encoder: 2.
        fast_estimate: ``"downsample"`` (the whole image subsampled by ``fast_sample`` per axis;
            for the decoder this continues from the exactly computed first level),
            ``"crops"`` (full-scale crops spread over the image) or ``"auto"`` (downsample for
            the decoder, crops for the encoder).
    """

    mode: str = "auto"
    tile: int | None = None
    budget_bytes: int | None = None
    dtype: torch.dtype | None = None
    guard: bool = True
    guard_dtype: torch.dtype | None = None
    state_offload: str = "auto"
    fast_sample: int | None = None
    fast_estimate: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {self.mode!r}")
        if self.tile is not None and (not isinstance(self.tile, int) or self.tile < 1):
            raise ValueError(f"`tile` must be a positive int (latent pixels) or None, got {self.tile!r}")
        if self.budget_bytes is not None and (
            not isinstance(self.budget_bytes, int) or self.budget_bytes < 1
        ):
            raise ValueError(f"`budget_bytes` must be a positive int or None, got {self.budget_bytes!r}")
        if self.dtype is not None and self.dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"`dtype` must be a floating dtype or None, got {self.dtype!r}")
        if self.guard_dtype is not None and self.guard_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"`guard_dtype` must be torch.float32, torch.bfloat16 or None, got {self.guard_dtype!r}"
            )
        if self.state_offload not in OFFLOAD:
            raise ValueError(f"`state_offload` must be one of {OFFLOAD}, got {self.state_offload!r}")
        if self.fast_estimate not in ("auto", "crops", "downsample"):
            raise ValueError(
                f"`fast_estimate` must be 'auto', 'crops' or 'downsample', got {self.fast_estimate!r}"
            )
        if self.fast_sample is not None and (not isinstance(self.fast_sample, int) or self.fast_sample < 1):
            raise ValueError(f"`fast_sample` must be an int >= 1, got {self.fast_sample!r}")


@dataclass
class Recompute:
    """One segment recomputed in a wider dtype by the precision guard."""

    stage: str
    """``"global"`` (conv_in/mid block/encoder end) or ``"tiles"``."""
    tile: int
    step: int
    """Index of the segment in the tile's program."""
    from_dtype: str
    to_dtype: str
    kept_wide: bool
    """True when the result did not fit the narrow dtype and the tile continued in the wide one."""


@dataclass
class VAEReport:
    """What one :func:`tiled_decode`/:func:`tiled_encode` call did (read it afterwards)."""

    kind: str = ""
    layout: str = ""
    mode: str = ""
    """What ran: ``"untiled"`` (host forward), ``"exact"``, ``"fast"``."""
    tile: int | None = None
    tiles: int = 0
    halo: int = 0
    """Latent (decode) or image (encode) pixels of context around each tile core."""
    dtype: str = ""
    state_offload: str = ""
    fast_sample: int | None = None
    """Fast mode: the statistics estimate's subsampling factor that was used."""
    parked_peak_bytes: int = 0
    """Most tile-state bytes parked off the compute device at once (exact mode, offload ``cpu``)."""
    oom_retries: list[int] = field(default_factory=list)
    """Tile sizes that ran out of memory, in the order tried (0 = the untiled attempt)."""
    attention_chunk: int | None = None
    """Queries per attention call in the mid block (all of them where one fused call runs it)."""
    recomputed: list[Recompute] = field(default_factory=list)
    peak_estimate_bytes: int = 0
    budget_bytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def plan(self) -> str:
        """Short plan label for the tracker and the infotext, e.g. ``"exact t64 x4"``."""
        if self.mode == "untiled" or not self.tile:
            return self.mode
        return f"{self.mode} t{self.tile} x{self.tiles}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plan"] = self.plan
        return d
