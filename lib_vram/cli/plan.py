"""``python -m lib_vram plan``: predicted peak, chosen plan and fit, per stage, before anything runs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

from lib_vram.core.device import capabilities, free_bytes, memory_info, resolve_device
from lib_vram.planning.presets import PRESET_NAMES, resolve_precision, resolve_preset
from lib_vram.planning.reference import ARCHS, UPSCALERS, vae_arch
from lib_vram.sampling import CONTROLS

from .common import MAX_IMAGES, MAX_SIDE, UsageError, bounded_float, bounded_int, card_size

SIDE_WHY = "the largest image side VRAM Guard plans; see docs/cli.md"
IMAGES_WHY = "the sampling stage plans a UNet batch of at most 2 x 32 (cond and uncond)"

NAME = "plan"
HELP = "Predict each stage's peak memory for a generation and choose tiles/batches that fit."

SCHEMA_VERSION = 1
MAX_CONTROLNETS = 8
"""The most ControlNet units a plan takes (sd-webui-controlnet's unit count setting goes to 8)."""


def configure(parser: argparse.ArgumentParser) -> None:
    from .stageplan import CONTROLNET_HIRES

    parser.add_argument("--arch", required=True, choices=sorted(ARCHS), help="model family")
    for name in ("width", "height"):
        parser.add_argument(
            f"--{name}",
            type=bounded_int(f"--{name}", 8, MAX_SIDE, why=SIDE_WHY, multiple_of=8, unit="px"),
            required=True,
            help=f"image {name} in px (a multiple of 8, at most {MAX_SIDE})",
        )
    parser.add_argument(
        "--batch",
        "--batch-size",
        dest="batch",
        type=bounded_int("--batch", 1, MAX_IMAGES, why=IMAGES_WHY),
        default=1,
        help=f"images per batch (default 1, at most {MAX_IMAGES}); the UNet's forward holds twice as many",
    )
    parser.add_argument(
        "--attention",
        default="Automatic",
        help="the WebUI's cross-attention optimization for the sampling stages: Automatic (what "
        "v1.10.1 picks with no flags: Doggettx on CUDA), sdp, sdp-no-mem, xformers, sub-quadratic, "
        "Doggettx, InvokeAI, V1, None",
    )
    parser.add_argument(
        "--hires",
        type=bounded_float("--hires", 1.0, 8.0, why="hires fix scale"),
        default=None,
        help=f"hires fix scale in (1, 8], e.g. 2; the hires image's sides at most {MAX_SIDE} px",
    )
    parser.add_argument("--upscaler", choices=UPSCALERS, default=None, help="4x upscaler (hires or final)")
    parser.add_argument(
        "--controlnet",
        action="append",
        default=[],
        choices=CONTROLS,
        help="a ControlNet unit of the sampling passes (its model's family: sd15, sdxl, or the smaller "
        "SDXL layouts sdxl-mid and sdxl-small); once per unit",
    )
    parser.add_argument(
        "--controlnet-hires",
        choices=CONTROLNET_HIRES,
        default="both",
        help="with --hires: which passes the units run in (both, lowres: the first pass only, highres: "
        "the hires pass only), ControlNet's Hires-fix option",
    )
    _add_forward_options(parser)
    parser.add_argument(
        "--vram",
        default=None,
        help="plan for a card of this size (e.g. 6GB; at most 1024GB) instead of this device; on CUDA "
        "also caps this process at that size (torch.cuda.set_per_process_memory_fraction)",
    )
    parser.add_argument("--preset", default="Auto", choices=PRESET_NAMES, help="preset (default Auto)")
    parser.add_argument(
        "--safety-margin",
        default=None,
        help="override the preset's safety margin (e.g. 512MB; at most 1024GB)",
    )
    parser.add_argument("--device", default=None, help="device whose capabilities apply (default: best)")
    parser.add_argument(
        "--medvram",
        action="store_true",
        help="the WebUI runs with --medvram/--lowvram (it keeps the UNet and text encoders off the "
        "card outside sampling); assumed anyway when they alone leave no room",
    )
    parser.add_argument(
        "--no-half",
        action="store_true",
        help="the WebUI runs with --no-half (cards without FP16): the whole checkpoint in FP32",
    )
    place = parser.add_mutually_exclusive_group()
    place.add_argument(
        "--place",
        dest="place",
        action="store_true",
        help="plan the checkpoint placed, as the WebUI with --vram-guard-place-checkpoint runs it (text "
        "encoders and VAE on the CPU until used, as much of the UNet on the card as fits, the rest "
        "streamed); the default where the checkpoint and a working margin do not fit the card",
    )
    place.add_argument(
        "--no-place", dest="place", action="store_false", help="the plain plan (the checkpoint not placed)"
    )
    parser.set_defaults(place=None)
    parser.add_argument("--json", action="store_true", help="print JSON: one record per stage")


FRAMES_WHY = "AnimateDiff's frames x cond/uncond make the UNet's batch, at most 64"


def _add_forward_options(parser: argparse.ArgumentParser) -> None:
    """What else shapes the sampling passes' forward (:class:`.stageplan.PassOptions`)."""
    from .stageplan import IP_ADAPTERS, TILE_BATCH, TILE_OVERLAP

    g = parser.add_argument_group(
        "the sampling forward", "the WebUI's own options and extensions that change the UNet's forward"
    )
    g.add_argument(
        "--hypertile",
        action="store_true",
        help="the WebUI's HyperTile on the UNet (Settings > Optimizations; its default max tile 256 px, "
        "depth 3, swap size 3): the estimate counts its self-attention tiles",
    )
    g.add_argument(
        "--hypertile-tile",
        type=bounded_int("--hypertile-tile", 0, 512, why="HyperTile's max tile size setting", unit="px"),
        default=None,
        metavar="PX",
        help="HyperTile's max tile size in px (0-512, the setting's range; implies --hypertile)",
    )
    g.add_argument(
        "--token-merging",
        type=bounded_float("--token-merging", 0.0, 0.9, why="the WebUI's token merging ratio setting"),
        default=0.0,
        metavar="RATIO",
        help="the WebUI's token merging ratio (tomesd; 0 < RATIO <= 0.9) for every sampling pass: the "
        "estimate counts the merged self-attention and tomesd's similarity matrix",
    )
    g.add_argument(
        "--tiled-diffusion",
        type=bounded_int(
            "--tiled-diffusion", 128, 2048, why="its latent tile 16-256", unit="px", multiple_of=128
        ),
        default=None,
        metavar="TILE",
        help="Tiled Diffusion (MultiDiffusion) with latent tiles of TILE image px (128-2048, e.g. 768 = its "
        f"default 96 latent px; overlap {TILE_OVERLAP} latent px): a sampling forward is one tile batch",
    )  # fmt: skip
    g.add_argument(
        "--tiled-diffusion-batch",
        type=bounded_int("--tiled-diffusion-batch", 1, 8, why="Tiled Diffusion's latent tile batch size"),
        default=TILE_BATCH,
        metavar="N",
        help=f"Tiled Diffusion's latent tile batch size (1-8, default {TILE_BATCH})",
    )
    g.add_argument(
        "--animatediff",
        type=bounded_int("--animatediff", 1, 32, why=FRAMES_WHY),
        default=None,
        metavar="FRAMES",
        help="AnimateDiff with FRAMES frames per forward (its context batch size, 16 by default; 1-32): the "
        "batch is FRAMES x cond/uncond in one forward, frames are never split (motion modules not counted)",
    )
    g.add_argument(
        "--ip-adapter",
        choices=sorted(IP_ADAPTERS),
        default=None,
        help="an IP-Adapter unit (ip-adapter or ip-adapter-plus for sd15/sdxl): its CLIP vision encoder's "
        "stage, its image tokens in every cross-attention, the batch kept whole",
    )


def pass_options(args: argparse.Namespace) -> object:
    """The :class:`.stageplan.PassOptions` of ``args`` (checked by :func:`check_options`)."""
    from .stageplan import PassOptions

    tile = args.hypertile_tile if args.hypertile_tile is not None else (256 if args.hypertile else None)
    return PassOptions(
        hypertile=tile, token_merging=args.token_merging, tiled=args.tiled_diffusion,
        tile_batch=args.tiled_diffusion_batch, frames=args.animatediff, ip_adapter=args.ip_adapter,
    )  # fmt: skip


def collect(args: argparse.Namespace) -> dict:
    from lib_vram.sampling import attention_of

    from .placed import place_checkpoint, plan_placed_job
    from .stageplan import SAMPLING_ARCHS, plan_job

    dev = resolve_device(args.device)
    caps = capabilities(dev)
    vram = None if args.vram is None else card_size(args.vram, "--vram")
    margin = None
    if args.safety_margin is not None:
        margin = card_size(args.safety_margin, "--safety-margin", allow_zero=True)
    emulated = vram is not None and dev.type == "cuda"
    if emulated:  # cap this process's allocations at the card's size
        import torch

        card = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, vram / card), dev)
    if vram is not None:
        total = free = vram
        # A generic card of that size: half precision, bf16 unknown -> assume fp16 only. With
        # --device cpu: the WebUI's emulated card on the CPU (--vram-guard-emulate-vram), CPU kernels.
        cpu = args.device is not None and dev.type == "cpu"
        caps = SimpleNamespace(backend="cpu" if cpu else "cuda", fp16=True, bf16=False)
    else:
        total = memory_info(dev).total
        free = free_bytes(dev)
    preset = resolve_preset(args.preset, total, caps)
    dtype = "fp32" if args.no_half else "fp16"
    if args.no_half:  # (the VAE too: VRAM Guard's Auto VAE precision is the host's)
        preset = dataclasses.replace(preset, precision_vae="fp32")
    safety = preset.safety_margin(total) if margin is None else margin
    arch = vae_arch(args.arch)
    models = sum(arch.model_bytes(4 if args.no_half else 2))
    swaps = "flag" if args.medvram else ("inferred" if models >= free - safety else "")
    t0 = time.perf_counter()
    job = dict(
        caps=caps,
        batch=args.batch,
        hires=args.hires,
        upscaler=args.upscaler,
        controlnets=tuple(args.controlnet),
        controlnet_hires=args.controlnet_hires,
        options=pass_options(args),
    )
    placed = note = None
    placing = args.place is not False and not args.medvram
    if placing and args.arch not in SAMPLING_ARCHS and (args.place or models >= total - safety):
        note = (
            f"{args.arch}: not placed: the checkpoint placement plans the ldm/sgm UNets (sd15, sdxl), "
            f"not {args.arch}'s; the plain plan follows"
        )
    elif placing and args.arch in SAMPLING_ARCHS:

        def margin_of(t: int) -> int:
            return margin if margin is not None else resolve_preset(args.preset, t, caps).safety_margin(t)

        backend = getattr(caps, "backend", "cuda")
        placed = place_checkpoint(
            args.arch,
            total,
            margin_of,
            vae_dtype=resolve_precision(preset.precision_vae, caps),
            attention=attention_of(args.attention or "Automatic", backend=backend),
            backend=backend,
            force=bool(args.place),
            dtype=dtype,
        )
    extra: dict = {}
    if placed is not None:
        swaps = ""
        plans = plan_placed_job(placed, args.width, args.height, preset, free, safety, **job)
        extra = {
            "placed": True,
            "placed_by": "flag" if args.place else "auto",
            "host_bytes": placed.plan.host_bytes,
            "placement": placed.to_dict(),
        }
    else:
        plans = plan_job(
            args.arch,
            args.width,
            args.height,
            preset,
            free,
            total,
            safety_margin_bytes=margin,
            host_swaps=bool(swaps),
            attention=args.attention,
            dtype=dtype,
            **job,
        )
        if note:
            extra = {"placed": False, "place_note": note}
    forward = job["options"].describe()
    if forward:  # (only where an option is given: the plain record is unchanged)
        extra = extra | {"forward": forward}
    return extra | {
        "schema": SCHEMA_VERSION,
        "arch": args.arch,
        "width": args.width,
        "height": args.height,
        "batch": args.batch,
        "hires": args.hires,
        "upscaler": args.upscaler,
        "controlnets": list(job["controlnets"]),
        "controlnet_hires": args.controlnet_hires,
        "preset": preset.name,
        "resolved_from": preset.resolved_from,
        "total_bytes": total,
        "free_bytes": free,
        "emulated": args.vram is not None,
        "memory_fraction_set": emulated,
        "host_swaps_models": swaps or None,
        "models_bytes": models,
        "stages": [p.to_dict() for p in plans],
        "planning_seconds": round(time.perf_counter() - t0, 3),
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_table(report: dict) -> str:
    head = (
        f"{report['arch']} {report['width']}x{report['height']}"
        + (f" batch {report['batch']}" if report["batch"] > 1 else "")
        + (f", hires x{report['hires']:g}" if report["hires"] else "")
        + (f", upscaler {report['upscaler']}" if report["upscaler"] else "")
        + (f", ControlNet {' + '.join(report['controlnets'])}" if report.get("controlnets") else "")
        + "".join(f", {f}" for f in report.get("forward", ()))
        + f"; preset {report['preset']}"
        + (f" ({report['resolved_from']})" if report["resolved_from"] else "")
        + f"; {_gib(report['free_bytes'])} free of {_gib(report['total_bytes'])}"
        + (" (emulated)" if report["emulated"] else "")
    )
    rows = [("stage", "plan", "dtype", "predicted peak", "activations", "budget", "fits")]
    rows += [
        (
            s["stage"],
            s["plan"] + (f" ({s['attention']})" if s.get("attention") else ""),
            s["dtype"],
            *(_gib(s[k]) for k in ("predicted_peak_bytes", "activation_bytes", "budget_bytes")),
            "yes" if s["fits"] else "NO",
        )
        for s in report["stages"]
    ]
    lines = [head]
    if report.get("placement"):
        lines += _placement_lines(report)
    elif report.get("place_note"):
        lines.append(report["place_note"])
    if report.get("host_swaps_models") == "inferred":
        lines.append(
            f"the UNet and text encoders ({_gib(report['models_bytes'])}) leave no room on this card: "
            "planned as the WebUI runs with --medvram/--lowvram (they stay off the card outside sampling)"
        )
    elif report.get("host_swaps_models") == "flag":
        lines.append("--medvram: the UNet and text encoders stay off the card outside sampling")
    lines.append("")
    lines += _columns(rows)
    if report.get("placement"):
        lines += [""] + _placed_rows(report)
    line = (report.get("placement") or {}).get("line")
    if line:  # even the placed plan does not fit: one line, for all its stages
        lines.append(f"does not fit: {line}")
    for s in report["stages"]:
        if line and line in (s.get("suggestion"), s["warning"]):
            continue
        if s.get("moved_off_card"):
            lines.append(
                f"{s['stage']}: moves the {', '.join(s['moved_off_card'])} off the card for this pass "
                "(its plan does not fit with them there)"
            )
        if s.get("suggestion"):
            lines.append(f"does not fit: {s['stage']}: {s['suggestion']}")
        elif s["warning"]:
            lines.append(f"warning: {s['stage']}: {s['warning']}")
    if any(f.startswith(("Tiled Diffusion", "AnimateDiff")) for f in report.get("forward", ())):
        lines.append(
            "Tiled Diffusion / AnimateDiff: the stock UNet's forward at that batch (AnimateDiff's motion "
            "modules not counted); in the WebUI VRAM Guard plans these passes from their measured first "
            "forward"
        )
    lines.append(
        "peak = stage model weights + resident weights still on the card + input + predicted activations; "
        "budget = free - safety margin"
        + (
            " (placed: sampling's weights = the UNet's resident part + the stream buffer; the "
            "text encoders' activations are not counted)"
            if report.get("placement")
            else ""
        )
    )
    return "\n".join(lines)


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _placement_lines(report: dict) -> list[str]:
    """The placed checkpoint in three lines: why, where its parts are, what it costs the host."""
    p = report["placement"]
    parked = " and ".join(f"{m['name']} ({m['mib']:.0f} MiB)" for m in p["parked"])
    d = p["default_pass"]
    if p["units_streamed"]:
        unet = (
            f"UNet {_mib(p['unet_resident_bytes'])} of {_mib(p['unet_bytes'])} on the card "
            f"({p['units_resident']} of {p['units_resident'] + p['units_streamed']} units), "
            f"{_mib(p['unet_streamed_bytes'])} streamed per forward"
        )
    else:
        unet = f"UNet on the card ({_mib(p['unet_bytes'])})"
    sizes = (
        f"the checkpoint ({_gib(p['checkpoint_bytes'])}) and a working margin "
        f"({_gib(p['working_margin_bytes'])})"
    )
    if report["placed_by"] == "flag" and not p["needed"]:
        why = f"--place (the WebUI would not place it: {sizes} fit the card)"
    else:
        why = ("--place; " if report["placed_by"] == "flag" else "") + f"{sizes} do not fit the card"
    return [
        f"checkpoint placed, as the WebUI runs it with --vram-guard-place-checkpoint: {why}; "
        "--no-place: the plain plan",
        f"  {unet}; {parked} on the CPU until used",
        f"  host memory it needs: {_gib(p['host_bytes'])} (the parked parts, the streamed units' copies); "
        f"placed for a {d['width']}x{d['height']} pass at batch {d['batch']}, {d['context_tokens']} tokens, "
        f"{d['attention']}, {d['dtype']}",
    ]


def _placed_rows(report: dict) -> list[str]:
    """Per stage: where each model of the checkpoint is, its MiB on the card and streamed, and the
    sampling stages' bytes moved per step against ``--lowvram``'s."""
    where = {"card": "card", "host": "CPU"}
    names = [m["name"] for m in report["stages"][0]["models"]]
    rows = [("stage", *names, "resident", "streamed", "moved per step", "--lowvram", "ratio")]
    for s in report["stages"]:
        cells = [
            f"streamed, {m['card_mib']:.0f} MiB on the card"
            if m["where"] == "streamed"
            else where[m["where"]]
            for m in s["models"]
        ]
        moved = s.get("bytes_moved_per_step")
        low = s.get("lowvram_bytes_per_step")
        rows.append(
            (
                s["stage"],
                *cells,
                f"{s['resident_mib']:.0f} MiB",
                f"{s['streamed_mib']:.0f} MiB",
                _mib(moved) if moved is not None else "",
                _mib(low) if moved is not None and low else "",
                f"{s['lowvram_ratio']:.2f}x" if s.get("lowvram_ratio") is not None else "",
            )
        )
    return _columns(rows)


def check_options(args: argparse.Namespace) -> None:
    """Refuse, before any work, what argparse's per-option checks cannot: one line naming the option.
    (The device was checked by ``main``; ``--vram``/``--safety-margin`` are read by :func:`collect`
    before it plans.)"""
    from lib_vram.sampling import attention_of

    from .stageplan import SAMPLING_ARCHS

    if args.hires is not None:
        side = max(args.width, args.height) * args.hires
        if side > MAX_SIDE:
            raise UsageError(
                f"`--hires {args.hires:g}` makes a {side:.0f} px side; the hires image's sides must be "
                f"<= {MAX_SIDE} px ({SIDE_WHY})"
            )
    try:
        attention_of(args.attention)
    except ValueError as exc:
        raise UsageError(f"`--attention {args.attention}`: {exc}") from None
    units = args.controlnet
    if len(units) > MAX_CONTROLNETS:
        raise UsageError(
            f"`--controlnet` at most {MAX_CONTROLNETS} times (ControlNet's units), got {len(units)}"
        )
    for unit in units:
        if args.arch not in SAMPLING_ARCHS:
            raise UsageError(
                f"`--controlnet {unit}`: the sampling plan knows the sd15 and sdxl UNets, not {args.arch}'s"
            )
        if unit.split("-")[0] != args.arch:
            raise UsageError(
                f"`--controlnet {unit}` is not a ControlNet for `--arch {args.arch}` ({args.arch})"
            )
    if args.tiled_diffusion is not None and args.animatediff is not None:
        raise UsageError("`--tiled-diffusion` and `--animatediff` exclude each other in a plan")
    if args.animatediff is not None and args.batch > 1:
        raise UsageError(
            f"`--animatediff {args.animatediff}` with `--batch {args.batch}`: AnimateDiff's frames are the "
            "batch; leave --batch at 1"
        )
    if args.tiled_diffusion is not None and 2 * args.batch * args.tiled_diffusion_batch > 64:
        raise UsageError(
            f"`--tiled-diffusion-batch {args.tiled_diffusion_batch}` with `--batch {args.batch}`: a tile "
            f"batch of {args.tiled_diffusion_batch} x 2 x {args.batch} samples is over the UNet batch the "
            "sampling plan takes (64)"
        )
    if (args.hypertile or args.hypertile_tile is not None or args.token_merging) and (
        args.arch not in SAMPLING_ARCHS
    ):
        raise UsageError(
            "`--hypertile`/`--token-merging`: the sampling plan knows the sd15 and sdxl UNets, "
            f"not {args.arch}'s"
        )
    if args.ip_adapter is not None and args.ip_adapter.split("-")[0] != args.arch:
        raise UsageError(f"`--ip-adapter {args.ip_adapter}` is not an IP-Adapter for `--arch {args.arch}`")
    if args.place and args.medvram:
        raise UsageError(
            "`--place` and `--medvram` exclude each other: the WebUI does not place a checkpoint with "
            "--medvram/--lowvram"
        )


PROGRESS_AFTER_S = 2.0
"""A plan that takes longer than this shows that it is working (large sizes take a while)."""


@contextlib.contextmanager
def _progress(label: str) -> Iterator[None]:
    """Elapsed-time progress on stderr while planning, from ``PROGRESS_AFTER_S`` on: a line that
    updates every second on a terminal; one line (no ``\\r``) into pipes and logs."""
    stop, wrote = threading.Event(), threading.Event()

    def show() -> None:
        t0 = time.perf_counter()
        if stop.wait(PROGRESS_AFTER_S):
            return
        if not getattr(sys.stderr, "isatty", lambda: False)():
            sys.stderr.write(f"planning {label} (large sizes take a while)...\n")
            sys.stderr.flush()
            return
        while not wrote.is_set() or not stop.wait(1.0):
            sys.stderr.write(f"\rplanning {label}: {time.perf_counter() - t0:.0f} s")
            sys.stderr.flush()
            wrote.set()

    thread = threading.Thread(target=show, name="vram-guard-plan-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if wrote.is_set():
            sys.stderr.write("\n")
            sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    check_options(args)
    with _progress(f"{args.arch} {args.width}x{args.height}"):
        report = collect(args)
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_table(report))
    return 0 if all(s["fits"] for s in report["stages"]) else 3
