"""``python -m lib_vram upscale INPUT OUTPUT --model FILE``: tiled upscaling of your own images.

File handling (docs/command-line.md, "`upscale`: your own images"): an input is never
overwritten; an existing output is skipped (a folder run) or refused (one file) unless
``--overwrite``; outputs are renamed into place from a temporary file, so no partial file is left;
every problem is one line naming the file, and a folder run goes on with the next file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lib_vram.core.files import write_atomic

from .common import (
    MAX_CARD_BYTES,
    MAX_OVERLAP,
    MAX_PIXELS,
    MAX_SIDE,
    MAX_TILE_BATCH,
    MAX_UPSCALE,
    UsageError,
    bounded_float,
    bounded_int,
)

logger = logging.getLogger(__name__)

NAME = "upscale"
HELP = "Upscale an image (or every image in a folder) with an ESRGAN-family model file, tiled to fit memory."

RUNS_MODELS = True
"""Gets the ``--emulate-vram`` switch (lib_vram.cli)."""

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")
OUTPUT_FORMATS = {
    ".png": "PNG",
    ".jpg": "JPEG",
    ".jpeg": "JPEG",
    ".webp": "WEBP",
    ".bmp": "BMP",
    ".tif": "TIFF",
    ".tiff": "TIFF",
}
"""Output name ending -> format. A folder run always writes PNG."""
MAX_PASSES = 3


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="an image file, or a folder of images")
    parser.add_argument(
        "output",
        type=Path,
        help="the output file (its ending picks the format: .png .jpg .webp .bmp .tif), or a folder; "
        "for a folder input, a folder (PNG files named after the inputs)",
    )
    parser.add_argument("--model", type=Path, required=True, help="model file (.pth, .pt, .safetensors)")
    parser.add_argument(
        "--tile",
        type=bounded_int("--tile", 8, MAX_SIDE, why="the largest image side", unit="px", auto=True),
        default=None,
        metavar="auto|N",
        help=f"tile core size (input px, 8 to {MAX_SIDE})",
    )
    parser.add_argument(
        "--batch",
        type=bounded_int("--batch", 1, MAX_TILE_BATCH, auto=True),
        default=None,
        metavar="auto|N",
        help=f"tiles per forward pass (at most {MAX_TILE_BATCH})",
    )
    parser.add_argument(
        "--overlap",
        type=bounded_int(
            "--overlap", 0, MAX_OVERLAP, why="5x the calibration's largest", unit="px", auto=True
        ),
        default=None,
        metavar="auto|N",
        help=f"context px beyond each tile core (0 to {MAX_OVERLAP})",
    )
    parser.add_argument("--precision", choices=("auto", "fp16", "bf16", "fp32"), default="auto")
    parser.add_argument(
        "--scale",
        type=bounded_float("--scale", 0.0, MAX_UPSCALE),
        default=None,
        help=f"output scale (default: the model's; at most {MAX_UPSCALE}); reached by repeated "
        f"passes (at most {MAX_PASSES}) and a final Lanczos resize; no pass may make an image above "
        f"{MAX_PIXELS // 2**20} Mpx ({MAX_SIDE}²)",
    )
    parser.add_argument("--device", default=None, help="device (default: the best available)")
    parser.add_argument("--alpha", choices=("model", "resize"), default="model", help="how to upscale alpha")
    parser.add_argument(
        "--budget-mb",
        type=bounded_int("--budget-mb", 1, MAX_CARD_BYTES // 2**20, why="1 TiB", unit="MiB"),
        default=None,
        help="memory budget for the upscale, MiB (at most 1048576: 1 TiB)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing output files (default: a folder run skips them, a single file is an "
        "error); an input is never replaced",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


class _Bar:
    """A one-line progress bar on stderr, drawn only on a terminal (never into pipes or logs)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        try:
            self.enabled = bool(enabled) and sys.stderr.isatty()
        except (AttributeError, OSError, ValueError):
            self.enabled = False
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        width = 30
        fill = int(width * done / max(1, total))
        secs = time.perf_counter() - self.t0
        sys.stderr.write(
            f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tiles {secs:.1f}s"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


@dataclass
class _Job:
    src: Path
    dst: Path
    skip: str | None = None  # why this file is not processed (a note)
    error: str | None = None  # why this file cannot be processed (counts as failed)


@dataclass
class _Tally:
    done: int = 0
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def line(self) -> str:
        text = f"{self.done} done, {len(self.skipped)} skipped, {len(self.failed)} failed"
        if self.failed:
            text += ": " + ", ".join(self.failed)
        return text


def _ident(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _output_format(dst: Path) -> str:
    fmt = OUTPUT_FORMATS.get(dst.suffix.lower())
    if fmt is None:
        known = " ".join(sorted(set(OUTPUT_FORMATS)))
        shown = dst.suffix or "no ending"
        raise UsageError(f"`output` {dst}: unknown image type ({shown}); end the name in one of {known}")
    return fmt


def _folder_jobs(src: Path, dst: Path, notes: list[str]) -> list[_Job]:
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"`output` must be a folder when `input` is a folder: {dst} is a file")
    if dst.exists() and os.path.samefile(src, dst) or os.path.realpath(src) == os.path.realpath(dst):
        raise UsageError(
            f"`output` folder {dst} is the `input` folder: outputs would replace or mix with the "
            "inputs (and a second run would upscale them again); choose another folder"
        )
    entries = sorted(src.iterdir())
    files = [p for p in entries if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
    ignored = [p.name for p in entries if p.is_file() and p not in files]
    if not files:
        raise UsageError(f"`input` folder {src} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    if ignored:
        shown = ", ".join(ignored[:5]) + (", ..." if len(ignored) > 5 else "")
        notes.append(f"{len(ignored)} file(s) in {src} ignored, not images by their ending: {shown}")
    stems = Counter(p.stem.casefold() for p in files)
    jobs = []
    for p in files:
        twin = stems[p.stem.casefold()] > 1  # another type of the same name: the type joins it
        jobs.append(_Job(p, dst / (f"{p.stem}_{p.suffix[1:].lower()}.png" if twin else f"{p.stem}.png")))
    renamed = [j for j in jobs if j.dst.stem != j.src.stem]
    if renamed:
        notes.append(
            "same name, different type: " + ", ".join(f"{j.src.name} -> {j.dst.name}" for j in renamed)
        )
    seen: dict[str, _Job] = {}
    for j in jobs:
        key = j.dst.name.casefold()
        if key in seen:
            j.error = f"its output name {j.dst.name} is already taken by {seen[key].src.name}"
        else:
            seen[key] = j
    return jobs


def _plan(args: argparse.Namespace, notes: list[str]) -> tuple[list[_Job], bool]:
    """The jobs, and whether this is a folder run. Raises :class:`UsageError` before any work."""
    src, dst = args.input, args.output
    if src.is_dir():
        jobs, folder = _folder_jobs(src, dst, notes), True
    else:
        if not src.exists():
            raise UsageError(f"`input` not found: {src}")
        if not src.is_file():
            raise UsageError(f"`input` {src} is neither an image file nor a folder")
        if dst.is_dir():
            dst = dst / (src.stem + ".png")
        _output_format(dst)
        jobs, folder = [_Job(src, dst)], False
    inputs = {i for i in (_ident(j.src) for j in jobs) if i is not None}
    for j in jobs:
        if j.error:
            continue
        # the same file (also through a link) or the same path
        if _ident(j.dst) in inputs or os.path.realpath(j.dst) == os.path.realpath(j.src):
            j.error = f"output {j.dst} is an input file; it is never overwritten (choose another output)"
        elif os.path.lexists(j.dst) and not args.overwrite:
            j.skip = f"{j.dst} exists (--overwrite replaces it)"
    if not folder:
        job = jobs[0]
        if job.error:
            raise UsageError(f"`output`: {job.error}")
        if job.skip:
            raise UsageError(f"`output` {job.dst} exists; pass --overwrite to replace it")
    return jobs, folder


def _passes(target: float, model_scale: float) -> int:
    """Model passes to reach ``target``: at least one, at most :data:`MAX_PASSES`."""
    passes = 1
    while model_scale**passes < target and passes < MAX_PASSES:
        passes += 1
    return passes


def largest_pass(w: int, h: int, target: float, model_scale: int) -> tuple[int, int]:
    """The largest image (w, h) an upscale of a ``w`` x ``h`` image to ``target`` makes: the last
    model pass or the final resize."""
    k = max(model_scale ** _passes(target, model_scale), target)
    return max(1, round(w * k)), max(1, round(h * k))


def _check_sizes(jobs: list[_Job], folder: bool, args: argparse.Namespace, model_scale: int) -> None:
    """Every image's largest pass within MAX_PIXELS, from the file headers, before any upscale: a
    single file is a usage error; in a folder that file fails with one line."""
    from PIL import Image

    target = args.scale if args.scale is not None else float(model_scale)
    for job in jobs:
        if job.error or job.skip:
            continue
        try:
            with _image_file(job.src) as im:
                w, h = im.size
        except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning):
            continue  # not readable: the upscale itself says why, in one line
        pw, ph = largest_pass(w, h, target, model_scale)
        if pw * ph <= MAX_PIXELS:
            continue
        what = f"--scale {target:g}" if args.scale is not None else f"the model's x{model_scale}"
        why = (
            f"{w}x{h} with {what} makes a {pw}x{ph} image ({pw * ph / 1e6:.0f} Mpx); an upscale may "
            f"make at most {MAX_PIXELS / 1e6:.0f} Mpx ({MAX_SIDE}²): use a smaller --scale or input"
        )
        if not folder:
            raise UsageError(f"`input` {job.src}: {why}")
        job.error = why


@contextmanager
def _image_file(src: Path) -> Iterator:
    """``Image.open(src)``, Pillow's decompression-bomb *warning* raised as an error: the user gets
    the one-line refusal (:func:`_reason`), not Pillow's two-line warning before it."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(src) as im:
            yield im


def _open(src: Path, notes: list[str]):
    """Read ``src`` as one upright still image; notes say what was done to it."""
    from PIL import ImageOps

    with _image_file(src) as im:
        frames = getattr(im, "n_frames", 1)
        if frames > 1:
            notes.append(f"animated ({frames} frames): only the first frame is upscaled")
            im.seek(0)
        wide = any(";16" in str(t[3]) for t in (im.tile or ()))
        if wide and im.mode in ("RGB", "RGBA"):
            notes.append("16-bit colour is read as 8 bits per channel (Pillow holds RGB at 8 bits)")
        orientation = im.getexif().get(0x0112, 1)
        upright = ImageOps.exif_transpose(im)
        if orientation not in (1, None):
            notes.append(f"EXIF orientation {orientation} applied (the output is stored upright)")
        img = upright if upright is not im else im.copy()
        img.load()
    return img


def _for_format(img, fmt: str, notes: list[str]):
    """Convert modes the output format cannot store (JPEG: no alpha, 8 bits)."""
    if fmt == "JPEG" and img.mode not in ("RGB", "L"):
        if "A" in img.mode:
            notes.append("alpha dropped (JPEG has none)")
        if img.mode in ("I;16", "I", "F"):
            notes.append("16-bit/float grey stored as 8 bits (JPEG)")
            import numpy as np
            from PIL import Image

            scale = 1 / 257 if img.mode != "F" else 255
            arr = np.clip(np.asarray(img, dtype=np.float64) * scale, 0, 255).round().astype(np.uint8)
            return Image.fromarray(arr, "L")
        return img.convert("L" if img.mode == "LA" else "RGB")  # (L, I;16, I, F: handled above)
    return img


def _reason(exc: BaseException) -> str:
    from PIL import Image, UnidentifiedImageError

    from lib_vram.upscale import UpscaleError

    if isinstance(exc, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"too large to open safely ({exc})"
    if isinstance(exc, UnidentifiedImageError):
        return "cannot read image (not an image file, or damaged)"
    if isinstance(exc, UpscaleError):
        return str(exc)
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        if exc.strerror:
            return f"{exc.strerror}{where}"
        return f"cannot read or write image ({exc})"
    if isinstance(exc, MemoryError):
        return "out of memory (try a smaller --tile or --budget-mb)"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _upscale_one(model, job: _Job, args, config, fmt: str, notes: list[str]) -> str:
    from PIL import Image

    from lib_vram.upscale import UpscaleReport, upscale_image

    img = _open(job.src, notes)
    icc = img.info.get("icc_profile")  # the colour profile travels with the pixels
    w0, h0 = img.size
    target = args.scale if args.scale is not None else float(model.scale)
    t0 = time.perf_counter()
    for n in range(1, _passes(target, model.scale) + 1):
        rep = UpscaleReport()
        bar = _Bar(f"{job.src.name} pass {n}", not args.quiet)
        img = upscale_image(model, img, config=config, alpha=args.alpha, progress=bar, report=rep)
    size = (max(1, round(w0 * target)), max(1, round(h0 * target)))
    if img.size != size:
        img = img.resize(size, Image.LANCZOS)
    img = _for_format(img, fmt, notes)
    job.dst.parent.mkdir(parents=True, exist_ok=True)
    params = {"icc_profile": icc} if icc and fmt in ("PNG", "JPEG", "WEBP", "TIFF") else {}

    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            img.save(f, format=fmt, **params)

    try:  # atomic; without --overwrite an output that appeared meanwhile is not replaced
        write_atomic(job.dst, fill, overwrite=args.overwrite)
    except FileExistsError:
        raise FileExistsError(f"{job.dst} appeared while upscaling; left as it is") from None
    secs = time.perf_counter() - t0
    return f"{job.src.name} -> {job.dst} ({w0}x{h0} -> {size[0]}x{size[1]}, {rep.plan}, {secs:.1f}s)"


def run(args: argparse.Namespace) -> int:
    from lib_vram.upscale import UpscaleConfig, UpscaleError, load_model

    try:
        config = UpscaleConfig(
            tile=args.tile,
            batch=args.batch,
            overlap=args.overlap,
            precision=args.precision,
            device=args.device,
            budget_bytes=None if args.budget_mb is None else args.budget_mb * 2**20,
        )
    except ValueError as exc:
        raise UsageError(f"{exc}".replace("`", "`--", 1)) from None
    notes: list[str] = []
    jobs, folder = _plan(args, notes)
    if folder:
        try:
            args.output.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"`output` folder {args.output}: cannot create it ({_reason(exc)})") from None
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    try:
        model = load_model(args.model, device=args.device)
    except UpscaleError as exc:
        raise UsageError(f"`--model` {exc}") from None
    _check_sizes(jobs, folder, args, int(model.scale))
    tally = _Tally()
    debug = getattr(args, "debug", False)
    try:
        for job in jobs:
            if job.skip and not job.error:
                print(f"skipped {job.src.name}: {job.skip}", file=sys.stderr)
                tally.skipped.append(job.src.name)
                continue
            file_notes: list[str] = []
            error = job.error
            if not error:
                fmt = "PNG" if folder else _output_format(job.dst)
                try:
                    line = _upscale_one(model, job, args, config, fmt, file_notes)
                except Exception as exc:  # one line per file; the run goes on with the next file
                    logger.debug("%s failed", job.src, exc_info=True)
                    if debug:
                        import traceback

                        traceback.print_exc()
                    error = _reason(exc)
            for note in file_notes:
                print(f"note: {job.src.name}: {note}", file=sys.stderr)
            if error:
                print(f"error: {job.src.name}: {error}", file=sys.stderr)
                tally.failed.append(job.src.name)
            else:
                print(line)
                tally.done += 1
    except KeyboardInterrupt:
        if not folder:
            raise
        print(f"interrupted: {tally.line()}; no partial file was left", file=sys.stderr)
        return 130
    if folder:
        print(tally.line())
    return 1 if tally.failed else 0
