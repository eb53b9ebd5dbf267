"""PIL front end: any image mode in, the matching mode out.

| input | what is upscaled | output |
|---|---|---|
| RGB | the image | RGB |
| RGBA, LA, PA, P/L with transparency | colour as RGB (or L) + alpha (see below) | RGBA / LA |
| L, 1 | grey replicated to RGB (or fed as is to a 1-channel model), result converted back to L | L |
| I;16, I (16-bit grey) | value / 65535 as grey, full 16-bit precision on the way back | same mode |
| F | value clamped to [0, 1] | F |
| P, CMYK, YCbCr, LAB, HSV | converted to RGB first | RGB |

Alpha is **upscaled by the model too** (as a grey image, batched with the colour) unless
``alpha="resize"`` (Lanczos resize, then re-attached).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from lib_vram.core import emulate

from ._adapter import as_spec
from ._engine import upscale_tensor
from ._types import UpscaleConfig, UpscaleReport

logger = logging.getLogger(__name__)

ALPHA_MODES = ("model", "resize")


def _to_float(arr: np.ndarray, scale: float) -> Tensor:
    t = torch.from_numpy(np.array(arr)).float()  # a writable copy (PIL arrays are read-only)
    if t.dim() == 2:
        t = t[None]
    else:
        t = t.permute(2, 0, 1)
    return (t / scale).clamp_(0, 1)


def _channels(t: Tensor, n: int) -> Tensor:
    """``[C, H, W]`` grey/colour to ``n`` channels (grey replicated, colour averaged to grey)."""
    if t.shape[0] == n:
        return t
    if n == 1:
        return t.mean(0, keepdim=True)
    if t.shape[0] == 1:
        return t.expand(n, -1, -1)
    raise ValueError(f"cannot feed a {t.shape[0]}-channel image to a {n}-channel model")


def _quantize(t: Tensor, maximum: int, dtype: torch.dtype) -> np.ndarray:
    """``[C, H, W]`` float [0, 1] -> ``H x W (x C)`` integers, rounded on t's device."""
    q = (t * maximum).round_().clamp_(0, maximum).to(dtype)
    q = q[0] if q.shape[0] == 1 else q.permute(1, 2, 0)
    return q.cpu().numpy()


def upscale_image(
    model: object,
    img: Image.Image,
    *,
    config: UpscaleConfig | None = None,
    scale: int | None = None,
    alpha: str = "model",
    should_interrupt: Callable[[], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
    tracker: object | None = None,
    report: UpscaleReport | None = None,
) -> Image.Image:
    """Upscale a PIL image of any mode (see the module table); the result has the same mode family.

    ``alpha="model"`` upscales the alpha channel with the model (batched with the colour);
    ``"resize"`` resizes it with Lanczos instead (cheaper; softer edges).
    """
    if alpha not in ALPHA_MODES:
        raise ValueError(f"`alpha` must be one of {ALPHA_MODES}, got {alpha!r}")
    if not isinstance(img, Image.Image):
        raise ValueError(f"`img` must be a PIL image, got {type(img)}")
    spec = as_spec(model, scale)
    n_in = spec.input_channels or 3
    mode = img.mode
    has_key = "transparency" in img.info
    if mode == "P":
        img = img.convert("RGBA" if has_key else "RGB")
    elif mode in ("L", "RGB") and has_key:
        img = img.convert("LA" if mode == "L" else "RGBA")
    elif mode == "PA":
        img = img.convert("RGBA")
    elif mode == "1":
        img = img.convert("L")
    elif mode not in ("RGB", "RGBA", "L", "LA", "I;16", "I", "F"):
        img = img.convert("RGB")
    mode = img.mode
    a_img: Image.Image | None = None
    if mode in ("RGBA", "LA"):
        a_img = img.getchannel("A")
        img = img.convert("RGB" if mode == "RGBA" else "L")

    use_model_alpha = a_img is not None and alpha == "model"
    with emulate.host_work():  # image <-> tensor conversions live in host memory (on a GPU too)
        if mode in ("I;16", "I"):
            colour = _to_float(np.asarray(img).astype(np.float32), 65535.0)
        elif mode == "F":
            colour = _to_float(np.asarray(img, dtype=np.float32), 1.0)
        else:
            colour = _to_float(np.asarray(img), 255.0)
        batch = [_channels(colour, n_in)]
        if use_model_alpha:
            batch.append(_channels(_to_float(np.asarray(a_img), 255.0), n_in))
        x = torch.stack(batch)
        del batch, colour
    y = upscale_tensor(
        model, x, config=config, scale=scale, should_interrupt=should_interrupt, progress=progress,
        tracker=tracker, report=report,
    )  # fmt: skip
    with emulate.host_work():
        return _to_image(y, mode, a_img, use_model_alpha)


def _to_image(y: Tensor, mode: str, a_img: Image.Image | None, use_model_alpha: bool) -> Image.Image:
    grey_out = mode in ("L", "LA", "I;16", "I", "F")
    rgb = y[0].mean(0, keepdim=True) if grey_out and y.shape[1] != 1 else y[0]
    if mode == "I;16":
        out = Image.fromarray(_quantize(rgb, 65535, torch.int32).astype(np.uint16), "I;16")
    elif mode == "I":
        out = Image.fromarray(_quantize(rgb, 65535, torch.int32), "I")
    elif mode == "F":
        out = Image.fromarray(rgb[0].float().cpu().numpy(), "F")
    else:
        out = Image.fromarray(_quantize(rgb, 255, torch.uint8), "L" if rgb.shape[0] == 1 else "RGB")
    if a_img is not None:
        if use_model_alpha:
            a = y[1].mean(0, keepdim=True)
            a_out = Image.fromarray(_quantize(a, 255, torch.uint8), "L")
        else:
            a_out = a_img.resize(out.size, Image.LANCZOS)
        out = out.convert("RGBA" if mode == "RGBA" else "LA")
        out.putalpha(a_out)
    return out
