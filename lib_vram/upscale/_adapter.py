"""One view of an upscaling model: a spandrel descriptor or any callable image model.

The engine needs the raw forward (no clamp, so that FP16 overflow stays visible), the scale, the
size requirements, the tiling hint and which reduced precisions the model allows. Spandrel is
recognised by duck typing, so this module does not import it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lib_vram.core.device import capabilities

logger = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class ModelSpec:
    """What the engine knows about a model."""

    forward: Callable[[Tensor], Tensor]
    """The raw forward: ``[N, C, h, w]`` -> ``[N, C', h*s, w*s]``, not clamped."""
    module: nn.Module | None
    """The ``nn.Module`` whose dtype/device the engine may change (and restores), if any."""
    owner: object
    """The object the caller passed (key of the calibration cache)."""
    scale: int
    minimum: int = 0
    multiple_of: int = 1
    square: bool = False
    tiling: str = "supported"
    """``"supported"``, ``"discouraged"`` or ``"internal"`` (spandrel's ``ModelTiling``)."""
    supports_half: bool = False
    supports_bfloat16: bool = False
    input_channels: int | None = None
    name: str = "model"
    grid: int = 1
    """Alignment of every tile window (start and length) in input px: the model's internal window
    grid (window attention, fixed downsampling) and ``multiple_of``; windows on it see the same
    window partition as the whole image."""
    pre_pad: Callable[[Tensor], Tensor] | None = None
    """The model's own padding of its input to ``grid`` (its ``check_image_size``), applied once to
    the whole image so that edge tiles see exactly the padding the whole image gets."""
    one_at_a_time: bool = False
    """The model takes one image per call (a batch fails or mixes images): set by the engine from
    :func:`lib_vram.upscale._calibrate.batching` or from a batch that failed."""

    def pad_to(self, h: int, w: int) -> tuple[int, int]:
        """The smallest ``(h, w)`` at least as large that a forward accepts (``square`` ignored)."""

        def up(n: int) -> int:
            n = max(n, self.minimum)
            return -(-n // self.multiple_of) * self.multiple_of

        return up(h), up(w)

    @contextlib.contextmanager
    def placed(self, device: torch.device, dtype: torch.dtype) -> Iterator[None]:
        """Move the module to ``device``/``dtype`` for the block; put it back afterwards."""
        if self.module is None:
            yield
            return
        first = next(self.module.parameters(), None)
        before = (first.device, first.dtype) if first is not None else None
        was_training = self.module.training
        self.module.to(device=device, dtype=dtype)
        self.module.eval()
        try:
            yield
        finally:
            if before is not None and (before[0] != device or before[1] != dtype):
                self.module.to(device=before[0], dtype=before[1])
            self.module.train(was_training)

    def set_dtype(self, dtype: torch.dtype) -> None:
        if self.module is not None:
            self.module.to(dtype=dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _legal_len(spec: ModelSpec, n: int) -> int:
    n = max(n, spec.minimum, 1)
    return _round_up(n, math.lcm(spec.multiple_of, spec.grid))


GRID_ATTRS = ("window_size", "split_size")
"""Module attributes that name a window grid (window attention, split windows)."""
FIXED_GRID = {"SCUNet": 64}
"""Architectures whose grid is not an attribute: SCUNet's 8-px windows sit after three 2x
downsamplings (its own ``check_image_size`` pads to 64)."""
IMAGE_TO_IMAGE = ("SR", "Restoration")
"""spandrel purposes this engine runs: an image in, the same image larger or cleaner out."""
REFUSED = {
    "FaceSR": "face restoration model (it restores aligned face crops)",
    "Inpainting": "inpainting model (it needs a mask)",
}
NOT_AN_UPSCALER = (
    "not an image-to-image upscaler; use it where the WebUI offers face restoration or inpainting"
)


def _ints(v: object) -> list[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, (tuple, list)) and all(isinstance(i, int) for i in v):
        return list(v)
    return []


def model_grid(net: nn.Module, arch: str, multiple_of: int) -> int:
    """The alignment tile windows need: lcm of ``multiple_of`` and every window/split size of the
    model's modules (or the architecture's fixed grid)."""
    g = max(1, multiple_of)
    g = math.lcm(g, FIXED_GRID.get(arch, 1))
    for m in net.modules():
        for attr in GRID_ATTRS:
            for v in _ints(getattr(m, attr, None)):
                if 1 < v <= 64:
                    g = math.lcm(g, v)
    return g


def _pre_pad(net: nn.Module) -> Callable[[Tensor], Tensor] | None:
    fn = getattr(net, "check_image_size", None)
    if not callable(fn):
        return None

    def pad(x: Tensor) -> Tensor:
        out = fn(x)
        return out[0] if isinstance(out, tuple) else out

    return pad


def _is_descriptor(model: object) -> bool:
    return all(hasattr(model, a) for a in ("model", "scale", "size_requirements", "tiling"))


def as_spec(model: object, scale: int | None = None) -> ModelSpec:
    """Wrap ``model`` (spandrel ``ImageModelDescriptor`` or callable) in a :class:`ModelSpec`.

    For a plain callable, ``scale`` is required, and the optional attributes ``size_requirements``
    (with ``minimum``/``multiple_of``/``square``) and ``supports_half``/``supports_bfloat16`` are
    honoured when present; an ``nn.Module`` callable may be cast to FP16/BF16 when asked explicitly.
    """
    if _is_descriptor(model):
        purpose = getattr(model, "purpose", "SR")
        if purpose not in IMAGE_TO_IMAGE:
            arch = getattr(getattr(model, "architecture", None), "name", None) or type(model.model).__name__  # type: ignore[attr-defined]
            raise ValueError(
                f"`model` is a {arch} {REFUSED.get(purpose, purpose + ' model')}, {NOT_AN_UPSCALER}"
            )
        if getattr(model, "input_channels", 3) is None:
            raise ValueError("`model` has no known input channel count")
        net = model.model  # type: ignore[attr-defined]
        call_fn = getattr(model, "_call_fn", None)
        if call_fn is not None:

            def forward(x: Tensor, _net=net, _fn=call_fn) -> Tensor:
                return _fn(_net, x)
        else:
            forward = net
        desc_scale = int(model.scale)  # type: ignore[attr-defined]
        if scale is not None and scale != desc_scale:
            raise ValueError(f"`scale` ({scale}) differs from the model's scale ({desc_scale})")
        req = model.size_requirements  # type: ignore[attr-defined]
        tiling = getattr(model.tiling, "name", str(model.tiling)).lower()  # type: ignore[attr-defined]
        arch = getattr(getattr(model, "architecture", None), "name", None) or type(net).__name__
        arch_id = getattr(getattr(model, "architecture", None), "id", None) or str(arch)
        return ModelSpec(
            forward=forward,
            module=net,
            owner=model,
            scale=desc_scale,
            minimum=int(req.minimum),
            multiple_of=int(req.multiple_of),
            square=bool(req.square),
            tiling=tiling,
            supports_half=bool(getattr(model, "supports_half", False)),
            supports_bfloat16=bool(getattr(model, "supports_bfloat16", False)),
            input_channels=int(model.input_channels),  # type: ignore[attr-defined]
            name=str(arch),
            grid=model_grid(net, arch_id, int(req.multiple_of)),
            pre_pad=_pre_pad(net),
        )
    if not callable(model):
        raise ValueError(f"`model` must be a spandrel ImageModelDescriptor or a callable, got {type(model)}")
    if scale is None:
        scale = getattr(model, "scale", None)
    if not isinstance(scale, int) or scale < 1:
        raise ValueError(f"`scale` must be given as an int >= 1 for a plain callable model, got {scale!r}")
    req = getattr(model, "size_requirements", None)
    module = model if isinstance(model, nn.Module) else None
    return ModelSpec(
        forward=model,  # type: ignore[arg-type]
        module=module,
        owner=model,
        scale=scale,
        minimum=int(getattr(req, "minimum", 0) or 0),
        multiple_of=int(getattr(req, "multiple_of", 1) or 1),
        square=bool(getattr(req, "square", False)),
        supports_half=bool(getattr(model, "supports_half", module is not None)),
        supports_bfloat16=bool(getattr(model, "supports_bfloat16", module is not None)),
        name=type(model).__name__,
    )


def choose_dtype(precision: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """The compute dtype for ``precision`` on ``device``.

    ``"auto"``: FP32 on the CPU (reduced-precision convolutions are slower there); on an
    accelerator FP16 where model and device allow it, else BF16, else FP32. FP16 comes first
    because an 8-bit image needs more mantissa than BF16's 8 bits; its overflow risk is covered
    by the per-batch non-finite check. An explicit ``"fp16"``/``"bf16"`` the model or device does
    not support is an error, not a silent fallback.
    """
    if precision == "fp32":
        return torch.float32
    caps = capabilities(device)
    if precision == "auto":
        if device.type == "cpu":
            return torch.float32
        if spec.supports_half and caps.fp16:
            return torch.float16
        if spec.supports_bfloat16 and caps.bf16:
            return torch.bfloat16
        return torch.float32
    dtype = _DTYPES[precision]
    model_ok = spec.supports_half if dtype == torch.float16 else spec.supports_bfloat16
    device_ok = caps.fp16 if dtype == torch.float16 else caps.bf16
    if not model_ok:
        raise ValueError(f"`precision`={precision!r}: the model ({spec.name}) does not support it")
    if not device_ok:
        raise ValueError(f"`precision`={precision!r}: device {device} does not support it")
    return dtype
