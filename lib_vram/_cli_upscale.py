"""``python -m lib_vram upscale INPUT OUTPUT --model FILE``: tiled upscaling of your own images."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

NAME = "upscale"
HELP = "Upscale an image (or every image in a folder) with an ESRGAN-family model file, tiled to fit memory."

RUNS_MODELS = True
"""Gets the ``--emulate-vram`` switch (lib_vram.cli)."""

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
MAX_PASSES = 3


def _auto_int(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {value!r}") from exc
    return n


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="an image file, or a folder of images")
    parser.add_argument("output", type=Path, help="the output file (or folder, for a folder input)")
    parser.add_argument("--model", type=Path, required=True, help="model file (.pth, .pt, .safetensors)")
    parser.add_argument(
        "--tile", type=_auto_int, default=None, metavar="auto|N", help="tile core size (input px)"
    )
    parser.add_argument(
        "--batch", type=_auto_int, default=None, metavar="auto|N", help="tiles per forward pass"
    )
    parser.add_argument(
        "--overlap", type=_auto_int, default=None, metavar="auto|N", help="context px beyond each tile core"
    )
    parser.add_argument("--precision", choices=("auto", "fp16", "bf16", "fp32"), default="auto")
    parser.add_argument(
        "--scale",
        type=float,
        default=None,
        help="output scale (default: the model's); reached by repeated "
        f"passes (at most {MAX_PASSES}) and a final Lanczos resize",
    )
    parser.add_argument("--device", default=None, help="device (default: the best available)")
    parser.add_argument("--alpha", choices=("model", "resize"), default="model", help="how to upscale alpha")
    parser.add_argument("--budget-mb", type=int, default=None, help="memory budget for the upscale, MiB")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


class _Bar:
    """A one-line progress bar on stderr."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled, self.t0 = (
            label,
            enabled and sys.stderr.isatty() or enabled,
            time.perf_counter(),
        )

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


def _jobs(src: Path, dst: Path) -> list[tuple[Path, Path]]:
    if src.is_dir():
        files = sorted(p for p in src.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"`input` folder {src} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        if dst.exists() and not dst.is_dir():
            raise ValueError(f"`output` must be a folder when `input` is a folder: {dst}")
        return [(p, dst / (p.stem + ".png")) for p in files]
    if not src.is_file():
        raise FileNotFoundError(f"`input` not found: {src}")
    return [(src, dst)]


def run(args: argparse.Namespace) -> int:
    from PIL import Image, UnidentifiedImageError

    from .upscale import UpscaleConfig, UpscaleError, UpscaleReport, load_model, upscale_image

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
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.scale is not None and args.scale <= 0:
        print(f"error: `--scale` must be > 0, got {args.scale}", file=sys.stderr)
        return 2
    try:
        model = load_model(args.model, device=args.device)
    except UpscaleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    jobs = _jobs(args.input, args.output)
    if len(jobs) > 1:
        args.output.mkdir(parents=True, exist_ok=True)
    failed = 0
    for src, dst in jobs:
        try:
            with Image.open(src) as opened:
                img = opened.copy()
        except (UnidentifiedImageError, OSError) as exc:
            print(f"error: {src.name}: cannot read image ({exc})", file=sys.stderr)
            failed += 1
            continue
        w0, h0 = img.size
        target = args.scale if args.scale is not None else float(model.scale)
        passes, reached = 0, 1.0
        t0 = time.perf_counter()
        try:
            while passes == 0 or (reached < target and passes < MAX_PASSES):
                rep = UpscaleReport()
                bar = _Bar(f"{src.name} pass {passes + 1}", not args.quiet)
                img = upscale_image(model, img, config=config, alpha=args.alpha, progress=bar, report=rep)
                passes += 1
                reached *= model.scale
        except UpscaleError as exc:
            print(f"error: {src.name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        size = (max(1, round(w0 * target)), max(1, round(h0 * target)))
        if img.size != size:
            img = img.resize(size, Image.LANCZOS)
        dst.parent.mkdir(parents=True, exist_ok=True)
        img.save(dst)
        secs = time.perf_counter() - t0
        print(f"{src.name} -> {dst} ({w0}x{h0} -> {size[0]}x{size[1]}, {rep.plan}, {secs:.1f}s)")
    return 1 if failed else 0
