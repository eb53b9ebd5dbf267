"""``python -m lib_vram profile vae|upscale ...``: what took the memory in one stage.

Runs a VAE decode/encode or an upscale once under ``torch.profiler`` (:mod:`lib_vram.core.profiling`)
and prints the operators that allocated the most, the stage's plan and its peak as the tracker
measured it next to the profiler's count; ``--out DIR`` writes the trace, summary and snapshot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lib_vram.cli import add_emulate_argument
from lib_vram.cli.common import (
    MAX_COUNT,
    MAX_SIDE,
    MAX_TILE_BATCH,
    UsageError,
    bounded_int,
    native_stderr_filtered,
)
from lib_vram.core.device import resolve_device

NAME = "profile"
HELP = "Profile one stage (VAE decode/encode, upscale): the operators that took the memory, and its peak."

SCHEMA = 1
LAYOUTS = ("sd", "small")
"""``sd``: the SD1.x/2.x VAE (ch 128); ``small``: the same layout at 1/4 of the channels (ch 32)."""


SIZE_WHY = "the largest image side VRAM Guard makes; see docs/cli.md"


def _common(p: argparse.ArgumentParser, size_help: str, default_size: int, multiple_of: int) -> None:
    add_emulate_argument(p)
    p.add_argument(
        "--size",
        type=bounded_int("--size", multiple_of, MAX_SIDE, why=SIZE_WHY, multiple_of=multiple_of, unit="px"),
        default=default_size,
        help=size_help,
    )
    p.add_argument("--device", default=None, help="device (default: the best available)")
    p.add_argument(
        "--top",
        type=bounded_int("--top", 1, MAX_COUNT),
        default=10,
        help=f"operators to list (default 10, at most {MAX_COUNT})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the Chrome trace, the summary (JSON) and, on CUDA, the memory snapshot here",
    )
    p.add_argument("--overwrite", action="store_true", help="replace files of an earlier run in --out")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", metavar="vae|upscale", required=True)
    v = sub.add_parser(
        "vae", help="a VAE decode (or --encode)", description="Profile a VAE decode or encode."
    )
    _common(v, f"image size in px, a multiple of 8 (default 256, at most {MAX_SIDE})", 256, 8)
    v.add_argument("--encode", action="store_true", help="profile the encoder (default: the decoder)")
    v.add_argument("--mode", choices=("exact", "fast", "untiled"), default="exact")
    v.add_argument(
        "--tile",
        type=bounded_int("--tile", 1, MAX_SIDE // 8, why="the largest image's latent side", unit="latent px"),
        default=None,
        help=f"tile in latent px (default: auto; at most {MAX_SIDE // 8})",
    )
    v.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    v.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=None,
        help="random-weight VAE: sd (SD1.x/2.x, ch 128) or small (ch 32); default small on the CPU, "
        "sd on a GPU",
    )
    v.add_argument(
        "--family", choices=("ldm", "diffusers"), default="ldm", help="module classes (default ldm)"
    )
    v.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        metavar="FILE",
        help="VAE weights in the ldm layout (a VAE file, or a full SD checkpoint) instead of random ones",
    )
    v.set_defaults(_profile=_run_vae)
    u = sub.add_parser("upscale", help="an upscale with a model file", description="Profile an upscale.")
    u.add_argument("model", type=Path, help="model file (.pth, .pt, .safetensors)")
    _common(u, f"input image size in px (default 128); the output's side at most {MAX_SIDE}", 128, 1)
    u.add_argument(
        "--tile",
        type=bounded_int("--tile", 8, MAX_SIDE, why=SIZE_WHY, unit="px"),
        default=None,
        help=f"tile core size (default: auto; 8 to {MAX_SIDE})",
    )
    u.add_argument(
        "--batch",
        type=bounded_int("--batch", 1, MAX_TILE_BATCH),
        default=None,
        help=f"tiles per forward (default: auto; at most {MAX_TILE_BATCH})",
    )
    u.add_argument("--precision", choices=("auto", "fp16", "bf16", "fp32"), default="fp32")
    u.set_defaults(_profile=_run_upscale)


def _check_out(args: argparse.Namespace, stem: str, history: bool) -> None:
    """``--out``: a folder this run can write, without files of an earlier run unless ``--overwrite``."""
    out: Path | None = args.out
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise UsageError(f"`--out` {out} is a file; give a folder")
    names = [f"{stem}.trace.json", f"{stem}.summary.json", *([f"{stem}.snapshot.pickle"] if history else [])]
    there = [out / n for n in names if (out / n).exists() or (out / n).is_symlink()]
    if there and not args.overwrite:
        raise UsageError(f"`--out`: {there[0]} exists; pass --overwrite to replace it")
    import tempfile

    try:  # a probe file, before the profiled run rather than after it
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".vram-guard-probe-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"`--out` {out}: cannot write there ({reason})") from None


_NEEDS = {"who": "profiling a VAE", "alternative": " or --family diffusers"}


def _random_vae(kind: str, layout: str, family: str):
    import torch

    from lib_vram.cli.hostmodels import SD_VAE, build_ldm, diffusers_vae

    cfg = dict(SD_VAE) if layout == "sd" else {**SD_VAE, "ch": 32}
    if family != "diffusers":
        return build_ldm(kind, cfg, seed=0, **_NEEDS)
    torch.manual_seed(0)
    try:
        vae = diffusers_vae(cfg)
    except ImportError as exc:
        raise UsageError(f"`--family diffusers` needs the diffusers package ({exc})") from None
    return vae.decoder if kind == "decode" else vae.encoder


_PREFIXES = ("first_stage_model.", "vae.", "")


def _checkpoint_vae(kind: str, path: Path):
    """An ldm ``Decoder``/``Encoder`` with the weights of ``path`` (its shape read from them)."""
    import torch

    from lib_vram.cli.hostmodels import SD_VAE, build_ldm

    if not path.is_file():
        raise UsageError(f"`--checkpoint` not found: {path}")
    part = "decoder." if kind == "decode" else "encoder."
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
            state = state.get("state_dict", state) if isinstance(state, dict) else state
    except Exception as exc:  # damaged/unknown file: one line naming it
        raise UsageError(f"`--checkpoint` {path}: cannot read it ({type(exc).__name__})") from None
    if not isinstance(state, dict):
        raise UsageError(f"`--checkpoint` {path}: not a state dict")
    for prefix in _PREFIXES:
        sub = {k[len(prefix + part) :]: v for k, v in state.items() if k.startswith(prefix + part)}
        if sub:
            break
    group = "up" if kind == "decode" else "down"
    if "conv_in.weight" not in sub or f"{group}.0.block.0.conv2.weight" not in sub:
        raise UsageError(f"`--checkpoint` {path}: no ldm-layout VAE {kind[:-1]}er weights ({part}conv_in...)")
    levels = sorted({int(k.split(".")[1]) for k in sub if k.startswith(("up.", "down."))})
    blocks = {int(k.split(".")[3]) for k in sub if k.startswith(f"{group}.0.block.")}
    widths = [int(sub[f"{group}.{i}.block.0.conv2.weight"].shape[0]) for i in levels]
    ch = widths[0]
    z = sub["conv_in.weight"].shape[1] if kind == "decode" else sub["conv_out.weight"].shape[0] // 2
    cfg = {
        **SD_VAE,
        "ch": ch,
        "ch_mult": tuple(w // ch for w in widths),
        "num_res_blocks": len(blocks) - (1 if kind == "decode" else 0),
        "z_channels": int(z),
    }
    module = build_ldm(kind, cfg, seed=None, **_NEEDS)
    try:
        module.load_state_dict(sub, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UsageError(
            f"`--checkpoint` {path}: the weights do not fit an SD VAE {kind[:-1]}er ({first})"
        ) from None
    return module


def _run_vae(args: argparse.Namespace) -> int:
    from lib_vram.core.predict import dtype_of

    if args.mode == "untiled" and args.tile is not None:
        raise UsageError("`--tile` is for --mode exact or fast, not untiled")
    if args.checkpoint is not None and (args.layout is not None or args.family != "ldm"):
        raise UsageError("`--checkpoint` sets the VAE; leave out --layout and --family")
    device = resolve_device(args.device)
    kind = "encode" if args.encode else "decode"
    layout = args.layout or ("small" if device.type == "cpu" else "sd")
    stage = f"vae_{kind}"
    stem = f"{stage}-{args.size}-{args.mode}"
    _check_out(args, stem, device.type == "cuda")
    dtype = dtype_of(args.dtype)
    if args.checkpoint is not None:
        module = _checkpoint_vae(kind, args.checkpoint)
        what = args.checkpoint.name
    else:
        module = _random_vae(kind, layout, args.family)
        what = f"{args.family} {layout} layout, random weights"
    side = args.size
    shape = (1, module.conv_in.in_channels, side // 8, side // 8) if kind == "decode" else (1, 3, side, side)
    _check_memory(module, shape, dtype, device, args)
    from lib_vram.cli.models.synthetic import image_like

    x = image_like(shape[2], shape[3], shape[1], 0)
    x = x * 4 - 2 if kind == "decode" else x * 2 - 1
    from lib_vram import vae as engine

    report = engine.VAEReport()
    if args.mode == "untiled":
        module = module.to(device=device, dtype=dtype)
        if kind == "decode" and args.family == "ldm":
            from lib_vram.cli.hostmodels import sdp_attn_forward

            module.mid.attn_1.forward = sdp_attn_forward(module.mid.attn_1)
        x = x.to(device=device, dtype=dtype)

        def call(tracker: Any):
            return module(x)
    else:
        module = module.to(device=device)
        x = x.to(device=device)
        config = engine.TiledVAEConfig(mode=args.mode, tile=args.tile, dtype=dtype)
        fn = engine.tiled_decode if kind == "decode" else engine.tiled_encode

        def call(tracker: Any):
            return fn(module, x, config=config, tracker=tracker, report=report)

    head = f"VAE {kind} {args.size}x{args.size} ({what}, {args.dtype}, {device})"
    return _profile(args, stage, device, call, head, stem, lambda: report.plan or args.mode)


def _check_memory(module, shape: tuple, dtype, device, args: argparse.Namespace) -> None:
    """Refuse, before the run, a pass whose predicted peak does not fit the device's free memory (the
    CPU's: available RAM): one line, not an allocator error or a process killed for memory."""
    from lib_vram.core.device import free_bytes
    from lib_vram.vae import estimate_peak_bytes, plan_vae

    free = free_bytes(device)
    if args.mode == "untiled":
        need = estimate_peak_bytes(module, shape, dtype, tile=None, mode="untiled", backend=device.type)
        fits = need <= free
    else:
        plan = plan_vae(module, shape, dtype, free, mode=args.mode, tile=args.tile, backend=device.type)
        need, fits = plan.peak_bytes, plan.fits
    if not fits:
        hint = "--mode exact (tiles) or " if args.mode == "untiled" else ""
        raise UsageError(
            f"`--size {args.size}`: the {args.mode} pass needs about {need / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB is free on {device.type}; use {hint}a smaller --size"
        )


def _run_upscale(args: argparse.Namespace) -> int:
    from lib_vram.upscale import UpscaleConfig, UpscaleError, UpscaleReport, load_model, upscale_tensor

    device = resolve_device(args.device)
    if not args.model.exists():
        raise UsageError(f"`model` not found: {args.model}")
    stem = f"upscale-{args.size}"
    _check_out(args, stem, device.type == "cuda")
    # (a ValueError here is a usage error, exit 2, as UsageError is)
    config = UpscaleConfig(tile=args.tile, batch=args.batch, precision=args.precision, device=str(device))
    try:
        model = load_model(args.model, device=device)
    except UpscaleError as exc:
        raise UsageError(f"`model` {exc}") from None
    scale = int(getattr(model, "scale", 1) or 1)
    if args.size * scale > MAX_SIDE:
        raise UsageError(
            f"`--size {args.size}`: the x{scale} output would be {args.size * scale} px; its side must be "
            f"<= {MAX_SIDE} px ({SIZE_WHY})"
        )
    from lib_vram.cli.models.synthetic import image_like

    x = image_like(args.size, args.size, 3, 0)
    report = UpscaleReport()

    def call(tracker: Any):
        return upscale_tensor(model, x, config=config, tracker=tracker, report=report)

    head = f"upscale {args.size}x{args.size} ({args.model.name}, x{scale}, {args.precision}, {device})"
    return _profile(args, "upscale", device, call, head, stem, lambda: report.plan)


def _profile(args, stage: str, device, call, head: str, stem: str, plan) -> int:
    import torch

    from lib_vram.core.profiling import VIEW_HINTS, StageProfiler, mib
    from lib_vram.core.tracker import StageTracker

    tracker = StageTracker(device, owns_peak_counters=True)
    prof = StageProfiler(stage, device)
    with native_stderr_filtered():  # the profiler's own start/stop lines and, on a CPU, its device count
        with torch.no_grad(), prof, tracker.stage(f"profile:{stage}") as rec:
            call(tracker)  # (its output freed within the stage)
        summary = prof.summary
        written = (
            prof.save(args.out, stem, overwrite=args.overwrite, top=max(args.top, 20)) if args.out else {}
        )
    record = {
        "schema": SCHEMA,
        "stage": stage,
        "description": head,
        "plan": plan(),
        "tracker": {
            "measure": rec.measure,
            "exact": rec.exact,
            "peak_above_start_bytes": rec.delta_peak_bytes,
            "seconds": round(rec.seconds, 3),
        },
        "profile": summary.to_dict(top=args.top),
        "files": {k: str(v) for k, v in written.items()},
    }
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"{head}: {record['plan']}, {rec.seconds:.2f} s under the profiler")
    print(
        f"top operators by memory allocated on {device.type} (allocated: every allocation while it "
        "ran, temporaries included; held: still allocated when it returned)"
    )
    print(summary.table(args.top))
    exact = "" if rec.exact else ", sampled: a lower bound"
    print(
        f"peak: {mib(rec.delta_peak_bytes)} above the stage's start (tracker, {rec.measure}{exact}); "
        f"profiler: {mib(summary.peak_bytes)} of tensors allocated at once, {mib(summary.alloc_bytes)} in all"
    )
    for key, path in written.items():
        print(f"wrote {path} ({VIEW_HINTS[key]})")
    for note in summary.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    return int(args._profile(args) or 0)
