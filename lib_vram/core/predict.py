"""Predict a stage's peak memory before it runs, by running its code on fake tensors.

How it works (activations counted by :class:`LiveBytesCounter` inside a ``FakeTensorMode``,
weights and input apart, a per-backend convolution scratch term :data:`WORKSPACE_TERMS`, the rest in
:class:`Calibration`): docs/how-it-works.md, "How the predictor works". A real module is predicted
with fake stand-ins for its weights (:func:`fake_state`); the module itself is not touched.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .livebytes import LiveBytesCounter, WorkspaceTerm, itemsize, tensors_of

__all__ = ["LiveBytesCounter", "WorkspaceTerm"]  # re-exported: callers import them from here

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """``"fp16"`` -> ``torch.float16`` (dtypes pass through)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"`dtype` must be one of {tuple(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _nbytes(shape: tuple[int, ...] | torch.Size, elem: int) -> int:
    return math.prod(int(d) for d in shape) * elem


def cpu_conv_workspace_bytes(
    input_shape: tuple[int, ...],
    weight_shape: tuple[int, ...],
    output_shape: tuple[int, ...],
    elem: int,
    input_contiguous: bool = True,
) -> int:
    """Scratch bytes the CPU convolution allocates besides its output.

    oneDNN (torch's CPU backend for these 2-D float convolutions) reorders the plain input, or the
    output it then copies back, into a blocked buffer of the larger of the two, and reorders the
    weights. Measured per convolution in a fresh process (``VmHWM`` around one warmed-up call): peak
    above the output = ``max(input, output) + weight`` within ~1 MiB for 3..512 channels at
    64²-512², all freed after the call. A non-contiguous input (a cropped view) is first copied
    inside the operator: ``+ input``. (oneDNN's ~15 MiB of lazy state is a one-time process cost.)
    """
    in_bytes = _nbytes(input_shape, elem)
    copy = 0 if input_contiguous else in_bytes
    return copy + max(in_bytes, _nbytes(output_shape, elem)) + _nbytes(weight_shape, elem)


def cuda_conv_workspace_bytes(*args: object) -> int:
    """cuDNN's convolution workspace (per algorithm, up to its limit, freed after the call): not
    modelled (0) until a GPU measurement calibrates it; a term of its own so one can replace it."""
    return 0


WORKSPACE_TERMS: dict[str, WorkspaceTerm] = {
    "cpu": cpu_conv_workspace_bytes,
    "cuda": cuda_conv_workspace_bytes,
    "rocm": cuda_conv_workspace_bytes,
}
"""Per-backend convolution scratch terms; backends not listed have none (0)."""


def new_fake_mode() -> FakeTensorMode:
    """A fake mode that also accepts real tensors (converted to fake on use, never copied)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_state(module: torch.nn.Module, fake_mode: FakeTensorMode, dtype: torch.dtype | None = None) -> dict:
    """Fake stand-ins (no memory) for ``module``'s parameters and buffers, floating ones at ``dtype``.

    Used with ``torch.func.functional_call`` so that the module itself is never modified: a real
    model loaded in the WebUI keeps its weights, device and dtype.
    """
    state = {}
    with fake_mode:
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
            state[name] = torch.empty(tuple(t.shape), dtype=dt)
    return state


def fake_call(module: torch.nn.Module, state: dict) -> Callable[..., object]:
    """``module``'s forward with ``state`` (from :func:`fake_state`) in place of its tensors."""

    def call(*args: object, **kwargs: object) -> object:
        return torch.func.functional_call(module, state, args, kwargs, strict=False)

    call.__name__ = type(module).__name__
    return call


def weights_bytes(module: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``module``'s parameters and buffers (floating ones counted at ``dtype`` if given)."""
    return sum(
        t.numel() * (itemsize(dtype) if dtype is not None and t.is_floating_point() else t.element_size())
        for t in tensors_of([module])
    )


@dataclass(frozen=True)
class Calibration:
    """Maps a fake count to device memory: ``activation * scale + offset_bytes``.

    ``scale`` covers kernels' scratch space that grows with the tensors (im2col buffers, layout
    reorders, cuDNN workspaces); ``offset_bytes`` a fixed per-stage cost (allocator segments,
    library handles). ``source`` says which measurement the numbers come from.
    """

    scale: float = 1.0
    offset_bytes: int = 0
    source: str = "uncalibrated"

    def apply(self, activation_bytes: int) -> int:
        return int(activation_bytes * self.scale) + self.offset_bytes


CALIBRATIONS: dict[str, Calibration] = {
    # Measured on this project's CPU runs (ldm decoder, RRDB, Compact, the engines; see
    # docs/benchmarks.md, "Planner"): the fake count plus the oneDNN convolution term
    # (cpu_conv_workspace_bytes) lands near the process's RSS high-water mark, so no further
    # correction is applied (no fitted residual).
    "cpu": Calibration(
        1.0, 0, "CPU RSS high-water mark, docs/benchmarks.md (Planner): oneDNN conv term, no residual"
    ),
    # No GPU measurement yet: the fake count is used as is. CUDA's caching allocator rounds
    # allocations to 512 B (negligible here); cuDNN workspaces are not modelled.
    "cuda": Calibration(1.0, 0, "uncalibrated: no GPU measurement yet"),
    "rocm": Calibration(1.0, 0, "uncalibrated: no GPU measurement yet"),
}
"""Per-backend calibrations; other backends (MPS, XPU) get the uncalibrated default."""


@dataclass(frozen=True)
class PeakPrediction:
    """Predicted memory of one stage, in bytes, split by what holds it."""

    weights_bytes: int
    """Model parameters and buffers (resident before the stage starts)."""
    input_bytes: int
    """The stage's input tensors (also resident before it starts)."""
    activation_bytes: int
    """Peak of the bytes the stage's operators allocate (the fake count, calibrated)."""
    raw_activation_bytes: int
    """The fake count before calibration."""
    calibration: str = "uncalibrated"

    @property
    def total_bytes(self) -> int:
        """Weights + input + activations: the device memory in use at the stage's peak."""
        return self.weights_bytes + self.input_bytes + self.activation_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def count_peak(
    fn: Callable[..., object],
    *args: object,
    fake_mode: FakeTensorMode | None = None,
    workspace: WorkspaceTerm | None = None,
    **kwargs: object,
) -> tuple[int, int]:
    """Run ``fn(*args, **kwargs)`` under a fake mode; return ``(peak_bytes, ops)`` allocated by it.

    ``args`` may be fake tensors of ``fake_mode``, real tensors (converted on use) or anything else.
    The result of ``fn`` is dropped inside the count, so an output that stays alive is part of the
    peak but not of what remains. ``workspace`` adds each convolution's scratch (see
    :data:`WORKSPACE_TERMS`).
    """
    mode = fake_mode or new_fake_mode()
    counter = LiveBytesCounter(workspace)
    with torch.no_grad(), mode, counter:
        result = fn(*args, **kwargs)
        del result
    return counter.peak_bytes, counter.ops


def predict_callable(
    fn: Callable[..., object],
    input_shapes: tuple[tuple[int, ...], ...],
    *,
    dtype: torch.dtype | str = torch.float32,
    weights: int = 0,
    backend: str = "cpu",
    fake_mode: FakeTensorMode | None = None,
) -> PeakPrediction:
    """Predict ``fn(*inputs)`` where ``inputs`` are fresh fake tensors of ``input_shapes``."""
    dt = dtype_of(dtype)
    mode = fake_mode or new_fake_mode()
    with mode:
        inputs = [torch.empty(s, dtype=dt) for s in input_shapes]
    input_bytes = sum(t.numel() * t.element_size() for t in inputs)
    raw, ops = count_peak(fn, *inputs, fake_mode=mode, workspace=WORKSPACE_TERMS.get(backend))
    cal = CALIBRATIONS.get(backend, Calibration())
    logger.debug("fake run of %s: %d ops, peak %.1f MiB", getattr(fn, "__name__", fn), ops, raw / 2**20)
    return PeakPrediction(
        weights_bytes=weights,
        input_bytes=input_bytes,
        activation_bytes=cal.apply(raw),
        raw_activation_bytes=raw,
        calibration=cal.source,
    )


def predict_module_peak(
    module: torch.nn.Module,
    input_shape: tuple[int, ...],
    dtype: torch.dtype | str = torch.float32,
    *,
    backend: str = "cpu",
    fake_mode: FakeTensorMode | None = None,
) -> PeakPrediction:
    """Predict the peak of ``module(x)`` for an input of ``input_shape`` at ``dtype`` (untiled).

    ``module`` may hold real weights (they are copied as fake tensors, nothing is allocated) or be
    built inside ``fake_mode``.
    """
    dt = dtype_of(dtype)
    mode = fake_mode or new_fake_mode()
    call = fake_call(module, fake_state(module, mode, dt))
    return predict_callable(
        call,
        (tuple(input_shape),),
        dtype=dt,
        weights=weights_bytes(module, dt),
        backend=backend,
        fake_mode=mode,
    )
