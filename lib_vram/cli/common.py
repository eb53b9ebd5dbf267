"""Helpers shared by the sub-commands: up-front option checks that end in one clear line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
import warnings

logger = logging.getLogger(__name__)

DEVICE_HINT = "use cpu, cuda, cuda:N, mps or xpu"


class UsageError(ValueError):
    """A bad option or argument: ``main`` prints ``error: <message>`` and exits 2."""


def check_device(text: str | None, option: str = "--device") -> str | None:
    """``text`` (``None``: the best available) if this PyTorch can use it, before any work; else
    :class:`UsageError` naming the option, the value and the reason."""
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
    if dev.type in ("mps", "xpu"):
        backend = getattr(torch.backends, "mps", None) if dev.type == "mps" else getattr(torch, "xpu", None)
        if backend is None or not backend.is_available():
            missing = "Apple MPS is not" if dev.type == "mps" else "no Intel XPU is"
            raise UsageError(f"`{option} {text}`: {missing} available here; use --device cpu")
        return text
    raise UsageError(f"`{option} {text}`: VRAM Guard does not run on {dev.type!r} devices ({DEVICE_HINT})")


# -- bounds on every size/count option (docs/cli.md) ------------------------------------------------

GiB = 2**30

MAX_SIDE = 16384
"""Largest image side (px) a command plans, makes or profiles: 8x the WebUI's 2048 px sliders, 2x
its largest hires-fix output, the Extras tab's 8x of 2048 px. Beyond, a plan walks ever more tiles
while no card holds even the smallest tile's image."""

MAX_PIXELS = MAX_SIDE * MAX_SIDE
"""Largest image (px) an upscale writes, any pass included: 268 Mpx, a float32 accumulator of 3 GiB."""

MAX_CARD_BYTES = 1024 * GiB
"""Largest card (``--vram``, ``--emulate-vram``, ``--safety-margin``, ``--budget-mb``): 1 TiB, more
than 5x the largest accelerator sold (192 GB)."""

MAX_IMAGES = 32
"""Images per batch a plan takes: 4x the WebUI's batch-size slider (8); the sampling stage's UNet
holds twice as many (cond and uncond), :data:`lib_vram.sampling.MAX_BATCH`."""

MAX_TILE_BATCH = 256
"""Tiles per forward pass: 256 tiles of 64 px are a 1024² image in one pass."""

MAX_OVERLAP = 512
"""Context px beyond a tile core: 5x the calibration's largest (96 px)."""

MAX_UPSCALE = 16
"""``upscale --scale``: 16x (two passes of a 4x model); the output is bounded by MAX_PIXELS too."""

MAX_COUNT = 1000
"""Repetitions and list lengths (``--top``, ``--reps``)."""

MAX_THREADS = 1024
"""CPU threads (``--threads``)."""

MAX_SECONDS = 86400.0
"""Time limits (``--timeout``, ``--budget-s``): one day."""


def check_int(
    value: int, option: str, lo: int, hi: int, *, why: str = "", multiple_of: int = 1, unit: str = ""
) -> int:
    """``value`` within ``[lo, hi]`` (and a multiple of ``multiple_of``), else :class:`UsageError`
    naming ``option`` and the bound."""
    unit = f" {unit}" if unit else ""
    if value < lo:
        raise UsageError(f"`{option}` must be >= {lo}{unit}, got {value}")
    if value > hi:
        raise UsageError(f"`{option}` must be <= {hi}{unit}{f' ({why})' if why else ''}, got {value}")
    if multiple_of > 1 and value % multiple_of:
        raise UsageError(f"`{option}` must be a multiple of {multiple_of}, got {value}")
    return value


def _arg_int(n: int, option: str, lo: int, hi: int, **kw) -> int:
    """:func:`check_int` for argparse: its message without the option (argparse names it)."""
    try:
        return check_int(n, option, lo, hi, **kw)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(" ", 1)[1]) from None


def bounded_int(
    option: str, lo: int, hi: int, *, why: str = "", multiple_of: int = 1, unit: str = "", auto: bool = False
):
    """An argparse ``type=`` for an integer in ``[lo, hi]``: beyond it, one line naming the option and
    the bound (exit 2), before any work. ``auto``: ``"auto"`` is accepted as ``None``."""

    def parse(value: str) -> int | None:
        if auto and value == "auto":
            return None
        try:
            n = int(str(value).strip())
        except ValueError:
            expected = "'auto' or an integer" if auto else "an integer"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
        return _arg_int(n, option, lo, hi, why=why, multiple_of=multiple_of, unit=unit)

    parse.__name__ = option.lstrip("-")
    return parse


def bounded_float(option: str, lo: float, hi: float, *, why: str = "", unit: str = ""):
    """An argparse ``type=`` for a finite number ``lo < x <= hi`` (``inf``/``nan`` refused)."""
    unit = f" {unit}" if unit else ""

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if not math.isfinite(x) or x <= lo:
            raise argparse.ArgumentTypeError(f"must be a finite number > {lo:g}{unit}, got {value!r}")
        if x > hi:
            raise argparse.ArgumentTypeError(
                f"must be <= {hi:g}{unit}{f' ({why})' if why else ''}, got {value!r}"
            )
        return x

    parse.__name__ = option.lstrip("-")
    return parse


def int_list(option: str, lo: int, hi: int, *, why: str = "", unit: str = "", multiple_of: int = 1):
    """An argparse ``type=`` for a comma-separated list of integers (at most :data:`MAX_COUNT`), each
    in ``[lo, hi]``: the list."""

    def parse(value: str) -> list[int]:
        parts = [p.strip() for p in str(value).split(",")]
        if not value.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}")
        if len(parts) > MAX_COUNT:
            raise argparse.ArgumentTypeError(f"at most {MAX_COUNT} values, got {len(parts)}")
        out = []
        for p in parts:
            try:
                n = int(p)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {p!r}") from None
            out.append(_arg_int(n, option, lo, hi, why=why, unit=unit, multiple_of=multiple_of))
        return out

    parse.__name__ = option.lstrip("-")
    return parse


def card_size(text: str, option: str, *, allow_zero: bool = False) -> int:
    """A card/memory size (``6GB``, ``4096MB``) up to :data:`MAX_CARD_BYTES`; :class:`UsageError`
    naming ``option`` otherwise (an empty value included)."""
    from lib_vram.core.emulate import parse_size

    if not str(text).strip():
        raise UsageError(f"`{option}` is empty; give a size such as 6GB or 4096MB")
    try:
        n = parse_size(text, option, allow_zero=allow_zero)
    except (ValueError, OverflowError) as exc:
        raise UsageError(str(exc) if isinstance(exc, ValueError) else f"`{option}` is too large") from None
    if n > MAX_CARD_BYTES:
        raise UsageError(f"`{option}` must be <= 1024GB (1 TiB), got {text!r}")
    return n


# -- torch's own noise on a CPU run ------------------------------------------------------------------

WARNING_NOISE: tuple[tuple[type[Warning], re.Pattern[str]], ...] = (
    # spandrel's loader tries TorchScript on .pt/.pth files; torch 2.14 deprecates torch.jit.load
    (FutureWarning, re.compile(r"`torch\.jit\.load` is deprecated")),
)
"""Python warnings torch (or spandrel through it) raises on a normal run that are no problem of the
user's: logged at debug instead of printed."""

NATIVE_NOISE = re.compile(
    r"^[A-Z]+:\d{4}-\d\d-\d\d [\d:.]+ \d+:\d+ \w+\.cpp:\d+\] "
    r"(?:profiler_start|profiler_stop|gpuGetDeviceCount failed with code \d+|Completed Stage: .*)$"
)
"""Lines torch's profiler (Kineto) writes to the process's stderr on a CPU run: its start/stop
markers and the CUDA device count it cannot read without a GPU (printed as ``ERROR:``)."""


@contextlib.contextmanager
def warnings_filtered():
    """Route :data:`WARNING_NOISE` to the debug log; every other warning is shown as before."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if any(issubclass(category, c) and p.search(str(message)) for c, p in WARNING_NOISE):
            logger.debug("%s (%s:%s): %s", category.__name__, filename, lineno, message)
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = shown


@contextlib.contextmanager
def native_stderr_filtered():
    """Capture what native code writes to the process's stderr (file descriptor 2) while the block
    runs, then pass it on without the :data:`NATIVE_NOISE` lines (those go to the debug log). Where
    stderr has no file descriptor (a test's captured stream), nothing is captured."""
    import tempfile

    try:
        sys.stderr.flush()
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines():
                if NATIVE_NOISE.match(line):
                    logger.debug("torch (native): %s", line)
                else:
                    print(line, file=sys.stderr)


def _finite(obj: object) -> object:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def strict_json(obj: object, **kw) -> str:
    """``json.dumps`` that writes strict JSON: a non-finite float (an identical picture's infinite
    PSNR) becomes ``null`` instead of Python's ``Infinity``, which JSON parsers other than Python's
    reject."""
    return json.dumps(_finite(obj), allow_nan=False, **kw)
