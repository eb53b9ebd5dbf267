"""``python -m lib_vram bench upscale``: untiled vs this engine vs a one-tile-at-a-time PIL loop.

Each case in a fresh process, on real spandrel architectures with random weights loaded from files
(:data:`ARCHS`, made to behave like trained models by :mod:`..models.synthetic`). Method and columns:
docs/benchmarks.md, "Tiled upscaling".
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from lib_vram.cli.common import bounded_int
from lib_vram.core.device import resolve_device
from lib_vram.core.livebytes import LiveBytesCounter
from lib_vram.core.predict import DTYPES
from lib_vram.core.tracker import _read_vm_hwm, _reset_vm_hwm

from ..models.archs import BUILDERS, build, save, save_and_load
from ..models.synthetic import compact_net, image_like, rrdb_net
from ._harness import Bench, cell, known, mib_of, ok, psnr, runner, table, timed

HELP = "Tiled upscaling: untiled vs this engine (tiles x batches) vs a one-tile-at-a-time PIL loop."

FIELDS = ("method", "arch", "image_px", "tile", "batch", "seconds", "cpu_seconds", "peak_bytes", "psnr_db",
          "max_err_lsb", "flop_ratio", "overlap", "rss_peak_bytes", "dtype")  # fmt: skip

ARCHS = {"compact": ("compact", 64, 16), "rrdb": ("rrdb", 64, 23), "compact-s": ("compact", 16, 4)}
"""(kind, features or filters, convolutions or blocks), x4."""
PIL_OVERLAP = 8
"""The WebUI's default ``ESRGAN_tile_overlap``."""
ARCH_IMAGE = (110, 150)
"""Height, width of the per-architecture table's image (neither a multiple of 8 nor of 16)."""
ARCH_TILES = (64, 96)
FALLBACK_PX = 512
FALLBACK_TILES = (128, 256)
"""Tile cores (input px) the fallback table measures: what a card that cannot hold the whole image
runs (the engine gives an inexact model the largest tile that fits)."""


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    # fmt: off
    add("--quick", action="store_true", help="small sizes (a smoke run of a few minutes)")
    add("--large", action="store_true", help="add Compact 1024², RRDBNet 256² (slow on CPU)")
    add("--device", default=None, help="device (default: the best available)")
    add("--precision", default="auto", choices=("auto", "fp16", "bf16", "fp32"), help="auto: fp16 on GPU")
    add("--workdir", type=Path, default=None, help="where model files and references go")
    add("--only", default=None, metavar="ARCH:PX",
        help="run only one architecture and size, e.g. rrdb:256 (with --large for the large ones)")
    add("--archs", nargs="?", const="all", default=None, metavar="A,B,...",
        help="instead: the per-architecture fidelity table (tiled vs untiled for every spandrel "
        "architecture of lib_vram.cli.models.archs, or the named ones)")
    add("--fallback", nargs="?", const="auto", default=None, metavar="A,B,...",
        help="instead: the tiled error of models flagged inexact at a real image size (--fallback-px), "
        "for the named architectures of lib_vram.cli.models.archs (default: all of them; exact ones show 0)")
    add("--fallback-px", type=bounded_int("--fallback-px", 64, 4096), default=FALLBACK_PX,
        help=f"input side for --fallback (default {FALLBACK_PX}; 64-4096)")
    # fmt: on


def plan(quick: bool, large: bool = False) -> list[dict]:
    """The cases, in order; each (arch, size) but the compact-s memory series starts with its reference."""
    cases: list[dict] = []

    def group(
        arch: str, px: int, engine: list[tuple[int, int]], pil: list[int], untiled: bool = True
    ) -> None:
        runs = [("untiled", 0, 1)] if untiled else []
        runs += [("engine", tile, batch) for tile, batch in engine] + [("pil_loop", tile, 1) for tile in pil]
        cases.extend({"method": m, "arch": arch, "image_px": px, "tile": t, "batch": b} for m, t, b in runs)

    if quick:
        group("compact", 128, [(64, 4), (32, 8)], [64])
        group("rrdb", 64, [(32, 4)], [32])
    else:
        group("compact", 256, [(192, 4), (128, 4), (64, 8)], [192, 64])
        group("compact", 512, [(192, 4), (192, 1), (128, 4)], [192])
        group("rrdb", 96, [(64, 4), (32, 8)], [64])
        if large:  # needs a GPU or a quiet many-core CPU
            group("compact", 1024, [(192, 4), (64, 8)], [192])
            group("rrdb", 256, [(192, 4), (96, 4)], [192])
    for px in (128, 256) if quick else (512, 1024, 2048):
        group("compact-s", px, [(64 if quick else 192, 4)], [], untiled=False)
    return cases


def bench(args: argparse.Namespace) -> Bench:
    def workdir(what: str) -> Path:
        path = args.workdir or Path(tempfile.mkdtemp(prefix=f"vram-guard-bench-{what}-"))
        path.mkdir(parents=True, exist_ok=True)
        return path

    if args.fallback:
        names, work = known("--fallback", args.fallback, list(BUILDERS), "auto"), workdir("fallback")
        return Bench(names, lambda n: fallback_rows([n], work, args.fallback_px, args.device), fallback_table,
                     lines=False)  # fmt: skip
    if args.archs:
        names, work = known("--archs", args.archs, list(BUILDERS), "all"), workdir("archs")
        return Bench(names, lambda n: arch_rows([n], work, args.device), arch_table, lines=False)
    cases = plan(args.quick, args.large)
    if args.only:
        arch, _, px = args.only.partition(":")
        cases = [c for c in cases if c["arch"] == arch and str(c["image_px"]) == px]
        if not cases:
            raise ValueError(f"`--only {args.only}` matches no case (try --large for the large sizes)")
    work = workdir("upscale")
    build_models(work, {c["arch"] for c in cases})
    full = [dict(c, workdir=str(work), device=args.device, precision=args.precision) for c in cases]
    return Bench(full, None, _table, lines=False, timeout=1800,
                 label=lambda c: f"{c['method']} {c['arch']} {c['image_px']}² t{c['tile']} b{c['batch']}",
                 done=lambda r: f"{r['seconds']:.2f}s (cpu {r['cpu_seconds']:.2f}s) psnr "
                 f"{cell(r['psnr_db'])} {r['plan']}")  # fmt: skip


def _model_path(workdir: Path, arch: str) -> Path:
    return workdir / f"{arch}.safetensors"


def build_models(workdir: Path, archs: set[str]) -> None:
    """Save each architecture's random-weight model (seed 0) once."""
    for arch in sorted(archs):
        if not (path := _model_path(workdir, arch)).exists():
            kind, width, depth = ARCHS[arch]
            torch.manual_seed(0)
            save((rrdb_net if kind == "rrdb" else compact_net)(width, depth), path)


def pil_loop(model, img, tile: int, overlap: int, device, dtype):  # noqa: ANN001
    """The WebUI's scheme, rewritten from its description: tiles of ``tile`` px spread evenly with
    at least ``overlap`` px overlap, one at a time, each through PIL -> float64 -> device -> PIL,
    pasted with a linear ramp over ``overlap`` output-scaled px at the new tile's left/top edge."""
    from PIL import Image

    s = model.scale
    w, h = img.size

    def starts(length: int) -> tuple[list[int], int]:
        if length <= tile:
            return [0], length
        n = math.ceil((length - overlap) / (tile - overlap))
        return [round(i * (length - tile) / (n - 1)) for i in range(n)], tile

    ys, th = starts(h)
    xs, tw = starts(w)
    out = Image.new("RGB", (w * s, h * s))
    ramp = overlap * s
    for y in ys:
        for x in xs:
            arr = np.asarray(img.crop((x, y, x + tw, y + th)), dtype=np.float64) / 255.0
            t = torch.from_numpy(arr).permute(2, 0, 1)[None].to(device=device, dtype=dtype)
            with torch.inference_mode():
                o = model(t)
            o8 = (o[0].permute(1, 2, 0).float().cpu().numpy() * 255.0).round().clip(0, 255).astype(np.uint8)
            mask = np.ones((th * s, tw * s), np.float64)
            if x > 0:
                mask[:, :ramp] *= np.linspace(0, 1, ramp)[None, :]
            if y > 0:
                mask[:ramp, :] *= np.linspace(0, 1, ramp)[:, None]
            alpha = Image.fromarray((mask * 255).round().astype(np.uint8))
            out.paste(Image.fromarray(o8), (x * s, y * s), alpha)
    return np.asarray(out), len(xs) * len(ys) * tw * th / float(w * h)


def run_case(case: dict) -> dict:
    from PIL import Image

    from lib_vram.upscale import UpscaleConfig, UpscaleReport, as_spec, context, load_model, upscale_tensor

    workdir, method, px = Path(case["workdir"]), case["method"], case["image_px"]
    device = resolve_device(case["device"])
    cuda = device.type == "cuda"
    precision = ("fp16" if cuda else "fp32") if case["precision"] == "auto" else case["precision"]
    dtype = DTYPES[precision]
    model = load_model(_model_path(workdir, case["arch"]), device=device, dtype=dtype)
    arr = (image_like(px, px, seed=1)[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    img = Image.fromarray(arr, "RGB")
    meter = {"peak": 0}
    if not cuda:  # the working set: the live bytes inside the model's forwards plus the batch fed to them
        forward = model.model.forward

        def metered(x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            with LiveBytesCounter() as counter:
                out = forward(x, *args, **kwargs)
            meter["peak"] = max(meter["peak"], counter.peak_bytes + x.numel() * x.element_size())
            return out

        model.model.forward = metered
    overlap, calib_s = PIL_OVERLAP if method == "pil_loop" else 0, 0.0
    if method == "engine":  # calibrate before timing (cached per process in real use)
        t0 = time.perf_counter()
        spec = as_spec(model)
        with spec.placed(device, dtype):
            overlap = context(spec, device, dtype)
        calib_s = time.perf_counter() - t0
        meter["peak"] = 0
    if cuda:  # (the allocator's peak above the weights)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    _reset_vm_hwm()
    rss0 = _read_vm_hwm() or 0
    rep = UpscaleReport()

    def upscale() -> tuple[np.ndarray, float]:
        if method == "pil_loop":
            return pil_loop(model, img, case["tile"], overlap, device, dtype)
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float().div_(255)
        if method == "untiled":
            with torch.inference_mode():
                y = model(x.to(device=device, dtype=dtype)).float()
        else:
            acc = "cpu" if case["arch"] == "compact-s" else "auto"
            cfg = UpscaleConfig(tile=case["tile"], batch=case["batch"], overlap=overlap, precision=precision,
                                device=device, accumulate_on=acc)  # fmt: skip
            y = upscale_tensor(model, x, config=cfg, report=rep)
        out8 = (y[0] * 255).round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        return out8, rep.flop_ratio

    (out8, flop), seconds, cpu_seconds = timed(upscale, device)
    peak = (torch.cuda.max_memory_allocated(device) - base) if cuda else meter["peak"]
    rss = max(0, (_read_vm_hwm() or 0) - rss0)
    ref_path = workdir / f"ref-{case['arch']}-{px}-{precision}.npy"
    if method == "untiled":
        np.save(ref_path, out8)
    db = max_err = None
    if ref_path.exists():
        diff = out8.astype(np.float64) - np.load(ref_path).astype(np.float64)
        db, max_err = round(psnr(float((diff**2).mean()), 255.0), 2), int(np.abs(diff).max())
    return {
        **{k: case[k] for k in ("method", "arch", "image_px", "tile", "batch")},
        "seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 3), "peak_bytes": int(peak),
        "psnr_db": db, "max_err_lsb": max_err, "flop_ratio": round(flop, 3), "overlap": overlap,
        "rss_peak_bytes": int(rss), "dtype": precision, "device": str(device),
        "calib_seconds": round(calib_s, 3), "plan": rep.plan,
    }  # fmt: skip


def _table(records: list[dict]) -> str:
    """The records, then each tiled case's time over the untiled time of the same arch and size."""
    cols = [(c, mib_of(c, 1, " MiB")) if c in ("peak_bytes", "rss_peak_bytes") else c for c in FIELDS]
    key = "cpu_seconds" if all(r.get("cpu_seconds") for r in records) else "seconds"
    base = {(r["arch"], r["image_px"]): r[key] for r in records if r["method"] == "untiled"}
    ratios = [
        f"{r['arch']} {r['image_px']}² {r['method']} tile {r['tile']} batch {r['batch']}: "
        f"{r[key] / base[(r['arch'], r['image_px'])]:.2f}x untiled {key}"
        for r in records
        if r["method"] != "untiled" and base.get((r["arch"], r["image_px"]))
    ]
    return table(cols, records) + "\n\n" + "\n".join(ratios)


def _tiled_rows(names, workdir: Path, prefix: str, device, image, tiles, columns) -> list[dict]:  # noqa: ANN001
    """Per architecture (saved to a file, loaded through spandrel), each tile against the untiled call
    on ``image(spec)`` in 8 bits: the row's ``columns`` and its seconds."""
    from lib_vram.upscale import UpscaleConfig, UpscaleReport, as_spec, upscale_tensor

    rows = []
    for name in names:
        t0 = time.perf_counter()
        model = save_and_load(build(name), workdir / f"{prefix}-{name}.safetensors")
        spec = as_spec(model)
        x = image(spec)
        with torch.inference_mode():
            ref = model(x.to(model.device)).float().cpu()
        for tile in tiles:
            rep = UpscaleReport()
            y = upscale_tensor(model, x, config=UpscaleConfig(tile=tile, device=device), report=rep)
            diff = ((y.float().cpu() * 255).round() - (ref.float().cpu() * 255).round()).abs()
            note = "; ".join(rep.notes)
            row = {"arch": name, "spandrel": spec.name, "kind": "windowed" if spec.grid > 1 else "local",
                   "grid": spec.grid, "image_px": x.shape[-1], "tile": "auto" if tile is None else tile,
                   "overlap": rep.overlap, "plan": rep.plan.split(" float")[0].split(" bfloat")[0],
                   "exact": rep.exact, "max_err_lsb": int(diff.max()),
                   "pct_over_1lsb": round(100.0 * float((diff > 1).float().mean()), 3),
                   "psnr_db": round(psnr(float((diff**2).mean()), 255.0), 1), "note": note,
                   "why": note.split("(", 1)[-1].split("); it did not fit")[0]}  # fmt: skip
            rows.append({**{c: row[c] for c in columns}, "seconds": round(time.perf_counter() - t0, 1)})
            t0 = time.perf_counter()
    return rows


ARCH_COLUMNS = ["arch", "spandrel", "kind", "grid", "tile", "plan", "max_err_lsb", "psnr_db", "exact", "note"]
FALLBACK_COLUMNS = ["arch", "spandrel", "image_px", "tile", "overlap", "exact", "max_err_lsb",
                    "pct_over_1lsb", "psnr_db", "why"]  # fmt: skip


def arch_rows(names: list[str], workdir: Path, device: object = None) -> list[dict]:
    """Per architecture: automatic plan, then each tile of ``ARCH_TILES`` with the calibrated
    overlap, against spandrel's untiled call."""
    x = image_like(*ARCH_IMAGE, seed=11)
    return _tiled_rows(names, workdir, "arch", device, lambda spec: x, (None, *ARCH_TILES), ARCH_COLUMNS)


def fallback_rows(names: list[str], workdir: Path, px: int, device: object = None) -> list[dict]:
    """Per architecture: the tiled error on a ``px``² image at each tile of ``FALLBACK_TILES``
    smaller than it, with the overlap the engine calibrates (``exact`` True: none)."""

    def image(spec):  # noqa: ANN001, ANN202
        return image_like(px, px, channels=spec.input_channels or 3, seed=21)

    tiles = [t for t in FALLBACK_TILES if t < px]
    return _tiled_rows(names, workdir, "fallback", device, image, tiles, FALLBACK_COLUMNS)


def _exact_table(columns: list[str], no: str) -> Callable[[list[dict]], str]:
    return lambda rows: table([(c, ok(c, "yes", no)) if c == "exact" else c for c in columns], rows)


arch_table, fallback_table = _exact_table(ARCH_COLUMNS, "**no**"), _exact_table(FALLBACK_COLUMNS, "no")


run = runner(bench, child=run_case)
