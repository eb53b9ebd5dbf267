"""Helpers shared by the sub-commands: up-front option checks that end in one clear line."""

from __future__ import annotations

import math

DEVICE_HINT = "use cpu, cuda, cuda:N, mps or xpu"


class UsageError(ValueError):
    """A bad option or argument: ``main`` prints ``error: <message>`` and exits 2."""


def check_device(text: str | None, option: str = "--device") -> str | None:
    """Check a ``--device`` value before any work: a known device type that this PyTorch can use.

    Returns ``text`` unchanged (``None`` = the best available); raises :class:`UsageError` naming
    the option, the value and the reason.
    """
    if text is None:
        return None
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError(f"`{option} {text}`: not a device name ({DEVICE_HINT})") from None
    if dev.type == "cpu":
        return text
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = (
                f"ROCm {torch.version.hip}"
                if getattr(torch.version, "hip", None)
                else f"CUDA {torch.version.cuda}"
                if torch.version.cuda
                else "built without CUDA"
            )
            raise UsageError(
                f"`{option} {text}`: no CUDA GPU is available to this PyTorch "
                f"({torch.__version__}, {build}); use --device cpu or leave --device out"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UsageError(
                f"`{option} {text}`: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            )
        return text
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise UsageError(f"`{option} {text}`: Apple MPS is not available here; use --device cpu")
        return text
    if dev.type == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise UsageError(f"`{option} {text}`: no Intel XPU is available here; use --device cpu")
        return text
    raise UsageError(f"`{option} {text}`: VRAM Guard does not run on {dev.type!r} devices ({DEVICE_HINT})")


def positive_finite(option: str):
    """An argparse ``type=`` for a float option that must be finite and > 0 (``inf``/``nan`` refused)."""
    import argparse

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if not math.isfinite(x) or x <= 0:
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
        return x

    parse.__name__ = option.lstrip("-")
    return parse
