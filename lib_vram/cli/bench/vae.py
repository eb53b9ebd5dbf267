"""``python -m lib_vram bench vae``: tiled VAE (exact, fast) against untiled and diffusers, each
case in a fresh process; the untiled case of each size is the reference. Method and columns:
docs/benchmarks.md, "Tiled VAE"."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import time
from pathlib import Path

import numpy as np
import torch

from lib_vram.cli.common import MAX_SIDE, MAX_THREADS, bounded_int, int_list
from lib_vram.cli.hostmodels import build_ldm, diffusers_from_ldm, sdp_attn_forward
from lib_vram.core.predict import DTYPES, LiveBytesCounter, fake_state, new_fake_mode
from lib_vram.core.tracker import StageTracker

from ..models.synthetic import image_latent, picture
from ._harness import Bench, Column, fmt, known, mib_of, psnr, runner, timed
from ._harness import table as grid

SIDE_WHY = "the largest image side VRAM Guard makes; see docs/cli.md"
MAX_FAST_SAMPLE = 256
"""``--fast-sample``: subsampling per axis; 256 leaves a 16384 px image's 2048 px latent 8 px."""

HELP = "Tiled VAE: untiled vs exact vs fast vs diffusers tiled_decode (full-size SD VAE, random weights)."

FULL_CASES = [
    # (kind, mode, image_px, tile)
    ("decode", "untiled", 512, None), ("decode", "exact", 512, 32), ("decode", "fast", 512, 32),
    ("decode", "diffusers", 512, 32), ("encode", "untiled", 512, None), ("encode", "exact", 512, 32),
    ("decode", "untiled", 1024, None), ("decode", "exact", 1024, 64), ("decode", "exact", 1024, 32),
    ("decode", "fast", 1024, 64), ("decode", "diffusers", 1024, 64), ("encode", "untiled", 1024, None),
    ("encode", "exact", 1024, 64),
    # 2048²: the untiled decode needs ~17 GiB of RAM here (run with --sizes 2048 on a quiet machine)
    ("decode", "untiled", 2048, None), ("decode", "exact", 2048, 64), ("decode", "fast", 2048, 64),
]  # fmt: skip
QUICK_CASES = [(kind, mode, 256, tile and tile // 2) for kind, mode, px, tile in FULL_CASES if px == 512]
"""The 512² cases at 256², each with as many tiles."""


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    # fmt: off
    add("--quick", action="store_true", help="CI-sized run (256 px)")
    add("--device", default="cpu", help="cpu (default) or cuda")
    add("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    add("--sizes", type=int_list("--sizes", 8, MAX_SIDE, why=SIDE_WHY, unit="px", multiple_of=8),
        default=None,
        help=f"comma-separated image sizes to keep (e.g. 512,1024; each a multiple of 8, at most {MAX_SIDE})")
    add("--modes", default=None, help="comma-separated modes to keep (untiled,exact,fast,diffusers)")
    add("--workdir", default=".bench/vae", help="where references and images go")
    add("--diff-image", default=None, help="write the fast-mode |diff| image here (PNG)")
    add("--threads", type=bounded_int("--threads", 0, MAX_THREADS), default=0,
        help=f"torch threads per case (0 = default; at most {MAX_THREADS})")
    add("--state-offload", default="cpu", choices=("cpu", "device", "auto"),
        help="where exact-mode tiles park their state (default cpu: on a GPU pinned CPU memory; on the "
        "CPU nothing moves but the parked bytes are left out of the device peak)")
    add("--fast-sample", type=bounded_int("--fast-sample", 1, MAX_FAST_SAMPLE), default=None,
        help=f"fast mode's statistics subsampling per axis (1 to {MAX_FAST_SAMPLE})")
    add("--predict", default=None,
        type=int_list("--predict", 8, MAX_SIDE, why="fake-tensor decodes walk every tile", unit="px",
                      multiple_of=8),
        help="comma-separated image sizes: instead of running, count the device peak of untiled, exact and "
        "fast decodes on fake tensors (same code, no memory; for sizes this machine cannot run; each a "
        f"multiple of 8, at most {MAX_SIDE})")
    add("--tile", type=bounded_int("--tile", 1, MAX_SIDE // 8, why="the largest image's latent side",
                                   unit="latent px"),
        default=64, help=f"tile for --predict (latent px, at most {MAX_SIDE // 8})")
    # fmt: on


def select_cases(args: argparse.Namespace) -> list[tuple]:
    cases = QUICK_CASES if args.quick else FULL_CASES
    if args.sizes:
        cases = [c for c in cases if c[2] in args.sizes]
    else:
        cases = [c for c in cases if c[2] < 2048]  # 2048² only when asked for by --sizes
    if args.modes:
        modes = known("--modes", args.modes, ("untiled", "exact", "fast", "diffusers"))
        cases = [c for c in cases if c[1] in modes]
    return cases


def bench(args: argparse.Namespace) -> Bench:
    if args.predict:
        return Bench(args.predict, lambda px: predict_device_peaks(px, args.tile, args.fast_sample),
                     _predict_table, label=lambda px: f"decode {px}² on fake tensors")  # fmt: skip
    cases = select_cases(args)
    biggest_fast = max((c[2] for c in cases if c[1] == "fast"), default=None)
    options = ("device", "dtype", "workdir", "threads", "state_offload", "fast_sample")
    specs = [
        {"kind": kind, "mode": mode, "image_px": px, "tile": tile, **{o: getattr(args, o) for o in options},
         "diff_image": args.diff_image if (mode == "fast" and px == biggest_fast) else None}
        for kind, mode, px, tile in cases
    ]  # fmt: skip
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    return Bench(specs, None, table, label=lambda c: f"{c['kind']} {c['mode']} {c['image_px']} t{c['tile']}")


def _vs(records: list[dict], key: str, form) -> Column:  # noqa: ANN001
    """A cell: the record's ``key`` over that of the untiled case of its method and size, by ``form``."""
    base = {(r["method"], r["image_px"]): r for r in records if r.get("mode") == "untiled"}

    def cell(r: dict) -> str:
        b = base.get((r["method"], r["image_px"]), {})
        return form(r[key] / b[key]) if r.get(key) and b.get(key) else "-"

    return cell


def table(records: list[dict]) -> str:
    vs = functools.partial(_vs, records)

    def psnr_cell(r: dict) -> str:
        return "inf" if r["psnr_db"] is None and r["mode"] == "untiled" else fmt("psnr_db", ".1f")(r)

    return grid([
        "method", "mode", ("image", lambda r: f"{r['image_px']}²"), ("tile", lambda r: r["tile"] or "-"),
        ("seconds", fmt("seconds", ".1f")), ("CPU s", fmt("cpu_seconds", ".1f")),
        ("time vs untiled", vs("cpu_seconds", lambda x: f"{x:.2f}x")),
        ("RSS peak MiB", mib_of("peak_bytes", 0)),
        ("RSS vs untiled", vs("peak_bytes", lambda x: f"{100 * x:.0f} %")),
        ("device peak MiB", mib_of("device_peak_bytes", 0)),
        ("device vs untiled", vs("device_peak_bytes", lambda x: f"{100 * x:.1f} %")), ("PSNR dB", psnr_cell),
        ("max abs err", fmt("max_abs_err", ".2e")), ("seam ratio", fmt("seam_ratio", ".2f")),
    ], records)  # fmt: skip


def _worker(spec: dict) -> dict:
    from lib_vram.vae import TiledVAEConfig, VAEReport, tiled_decode, tiled_encode

    if spec["threads"]:
        torch.set_num_threads(int(spec["threads"]))
    dtype = DTYPES[spec["dtype"]]
    device = torch.device(spec["device"])
    kind, mode, px, tile = spec["kind"], spec["mode"], spec["image_px"], spec["tile"]
    dec = build_ldm("decoder")
    enc = build_ldm("encoder", seed=None)  # drawn after the decoder, as the references were made
    module = diffusers_from_ldm(dec, enc) if mode == "diffusers" else dec if kind == "decode" else enc
    del dec, enc
    if mode == "diffusers":  # (decode only)
        module.enable_tiling()
        module.tile_sample_min_size, module.tile_latent_min_size = tile * 8, tile
    elif mode == "untiled" and kind == "decode":
        module.mid.attn_1.forward = sdp_attn_forward(module.mid.attn_1)
    module.to(device=device, dtype=dtype)
    x = (image_latent(px) if kind == "decode" else picture(px)).to(device=device, dtype=dtype)
    tracker, report = StageTracker(device, owns_peak_counters=True), VAEReport()
    if mode in ("exact", "fast"):
        cfg = TiledVAEConfig(mode=mode, tile=tile, **{k: spec[k] for k in ("state_offload", "fast_sample")})
    gc.collect()
    counter = _device_counter() if device.type == "cpu" else None  # a GPU: the allocator's peak

    def run() -> torch.Tensor:
        if mode == "untiled":
            return module(x)
        if mode == "diffusers":
            return module.tiled_decode(x).sample
        return (tiled_decode if kind == "decode" else tiled_encode)(module, x, config=cfg, report=report)

    with torch.no_grad(), tracker.stage("case") as rec, counter or contextlib.nullcontext():
        out, seconds, cpu_seconds = timed(run, device)
    peak = rec.delta_peak_bytes
    device_peak, live_peak = (counter.device_peak_bytes, counter.peak_bytes) if counter else (peak, peak)
    out = out.float().cpu()
    ref_path = Path(spec["workdir"]) / f"ref_{kind}_{px}_{spec['dtype']}_{spec['device'].split(':')[0]}.pt"
    db = err = seam = None
    if mode == "untiled":
        torch.save(out, ref_path)
    elif ref_path.exists():
        ref = torch.load(ref_path)
        diff = (out - ref).abs()
        err, db = float(diff.max()), psnr(float((diff**2).mean()), float(ref.max() - ref.min()))
        if kind == "decode" and report.tiles > 1 and mode in ("exact", "fast"):
            seam = _seam_ratio(diff, px, report.tile * 8)
        if spec["diff_image"]:
            _save_diff(diff, Path(spec["diff_image"]))
    return {
        "method": kind, "mode": mode, "image_px": px, "tile": tile, "device": spec["device"],
        "dtype": spec["dtype"], "seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 3),
        "peak_bytes": int(peak), "peak_measure": rec.measure, "device_peak_bytes": int(device_peak),
        "live_peak_bytes": int(live_peak), "parked_peak_bytes": report.parked_peak_bytes or None,
        "state_offload": report.state_offload or None, "fast_sample": report.fast_sample,
        "peak_estimate_bytes": report.peak_estimate_bytes or None, "tiles": report.tiles or None,
        "psnr_db": None if db is None or math.isinf(db) else round(db, 2),
        "max_abs_err": err, "seam_ratio": seam, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "numpy": np.__version__,
    }  # fmt: skip


def _device_counter() -> LiveBytesCounter:
    """A live-tensor counter whose ``device_peak_bytes`` leaves out tile state parked "off the device"."""
    from lib_vram.vae import parked_bytes

    class DeviceBytes(LiveBytesCounter):
        device_peak_bytes = 0

        def track(self, tensor):
            super().track(tensor)
            self.device_peak_bytes = max(self.device_peak_bytes, self.live_bytes - parked_bytes())

    return DeviceBytes()


def predict_device_peaks(px: int, tile: int, fast_sample: int | None = None) -> list[dict]:
    """Device peak of the untiled, exact and fast decodes of a ``px``² image, counted as
    :func:`_worker` counts on fake tensors (the precision guard is off: it reads values)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lib_vram.cli.stageplan import Loop
    from lib_vram.vae import TiledVAEConfig, tiled_decode

    with torch.device("meta"):
        dec = build_ldm("decoder")
    dec.mid.attn_1.forward = sdp_attn_forward(dec.mid.attn_1)

    out = []
    for mode in ("untiled", "exact", "fast"):
        fmode = new_fake_mode()
        state = {f"inner.{k}": v for k, v in fake_state(dec, fmode, torch.float32).items()}
        call = Loop(dec, lambda m, x: m(x))
        if mode != "untiled":
            cfg = TiledVAEConfig(mode=mode, tile=tile, guard=False, state_offload="cpu", budget_bytes=2**50,
                                 fast_sample=fast_sample)  # fmt: skip
            call = Loop(dec, tiled_decode, config=cfg)
        counter, flops = _device_counter(), FlopCounterMode(display=False)
        t0 = time.perf_counter()
        with torch.no_grad(), fmode:
            x = torch.empty((1, 4, px // 8, px // 8))
            with counter, flops:
                torch.func.functional_call(call, state, (x,))  # the output is freed inside the counter
        by_op = flops.get_flop_counts().get("Global", {})
        out.append({
            "method": "decode", "mode": mode, "image_px": px, "tile": None if mode == "untiled" else tile,
            "predicted_device_peak_bytes": int(counter.device_peak_bytes),
            "predicted_live_peak_bytes": int(counter.peak_bytes), "flops": int(flops.get_total_flops()),
            "conv_flops": int(sum(n for op, n in by_op.items() if "convolution" in str(op))),
            "fast_sample": fast_sample if mode == "fast" else None,
            "predict_seconds": round(time.perf_counter() - t0, 2),
        })  # fmt: skip
    return out


def _predict_table(records: list[dict]) -> str:
    vs = functools.partial(_vs, records)
    return grid([
        "mode", ("image", lambda r: f"{r['image_px']}²"), ("tile", lambda r: r["tile"] or "-"),
        ("device peak MiB", mib_of("predicted_device_peak_bytes", 0)),
        ("vs untiled", vs("predicted_device_peak_bytes", lambda x: f"{100 * x:.1f} %")),
        ("conv FLOPs vs untiled", vs("conv_flops", lambda x: f"{x:.3f}x")),
        ("all FLOPs vs untiled", vs("flops", lambda x: f"{x:.3f}x")),
    ], records)  # fmt: skip


def _seam_ratio(diff, px: int, tile_px: int) -> float | None:
    """Mean |diff| within 2 px of a tile border over the mean elsewhere (1.0 = no seam)."""
    d = diff.mean(dim=(0, 1))
    mask = torch.zeros_like(d, dtype=torch.bool)
    for b in range(tile_px, px, tile_px):
        mask[max(0, b - 2) : b + 2, :] = True
        mask[:, max(0, b - 2) : b + 2] = True
    if not mask.any() or mask.all():
        return None
    rest = float(d[~mask].mean())
    return float(d[mask].mean()) / rest if rest > 0 else None


def _save_diff(diff, path: Path) -> None:
    from PIL import Image

    d = diff.mean(dim=1)[0].numpy()
    scale = float(np.percentile(d, 99.5)) or 1.0
    im = Image.fromarray((np.clip(d / scale, 0, 1) * 255).astype(np.uint8), mode="L")
    if im.width > 256:
        im = im.resize((256, 256), Image.BILINEAR)
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path, optimize=True)


run = runner(bench, child=_worker)
