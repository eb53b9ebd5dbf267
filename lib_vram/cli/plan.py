"""``python -m lib_vram plan``: predicted peak, chosen plan and fit, per stage, before anything runs."""

from __future__ import annotations

import argparse
import json
import time

from lib_vram.core.device import capabilities, free_bytes, memory_info, resolve_device
from lib_vram.core.emulate import parse_size as emulate_parse_size
from lib_vram.planning.presets import PRESET_NAMES, resolve_preset
from lib_vram.planning.reference import ARCHS, UPSCALERS, vae_arch

MAX_IMAGES = 32
"""Images per batch ``plan`` takes (:data:`lib_vram.cli.stageplan.MAX_IMAGES`)."""

NAME = "plan"
HELP = "Predict each stage's peak memory for a generation and choose tiles/batches that fit."

SCHEMA_VERSION = 1


def parse_size(text: str, option: str = "--vram", *, allow_zero: bool = False) -> int:
    """``"6GB"``/``"6G"``/``"6GiB"`` -> 6 GiB, ``"4096MB"`` -> 4 GiB. Card sizes are binary: a "6 GB"
    card has 6 GiB, so GB and GiB mean the same here. Errors name ``option``."""
    return emulate_parse_size(text, option, allow_zero=allow_zero)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS), help="model family")
    parser.add_argument("--width", type=int, required=True, help="image width in px (multiple of 8)")
    parser.add_argument("--height", type=int, required=True, help="image height in px (multiple of 8)")
    parser.add_argument(
        "--batch",
        "--batch-size",
        dest="batch",
        type=int,
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
    parser.add_argument("--hires", type=float, default=None, help="hires fix scale, e.g. 2")
    parser.add_argument("--upscaler", choices=UPSCALERS, default=None, help="4x upscaler (hires or final)")
    parser.add_argument(
        "--vram",
        default=None,
        help="plan for a card of this size (e.g. 6GB) instead of this device; on CUDA also caps "
        "this process at that size (torch.cuda.set_per_process_memory_fraction)",
    )
    parser.add_argument("--preset", default="Auto", choices=PRESET_NAMES, help="preset (default Auto)")
    parser.add_argument(
        "--safety-margin", default=None, help="override the preset's safety margin (e.g. 512MB)"
    )
    parser.add_argument("--device", default=None, help="device whose capabilities apply (default: best)")
    parser.add_argument(
        "--medvram",
        action="store_true",
        help="the WebUI runs with --medvram/--lowvram (it keeps the UNet and text encoders off the "
        "card outside sampling); assumed anyway when they alone leave no room",
    )
    parser.add_argument("--json", action="store_true", help="print JSON: one record per stage")


def emulate_vram(total: int, device: object | None = None) -> bool:
    """On CUDA, cap this process's allocations at ``total`` bytes (an emulated smaller card).
    Returns False where the backend has no such cap."""
    import torch

    dev = resolve_device(device)
    if dev.type != "cuda":
        return False
    card = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, total / card), dev)
    return True


def collect(args: argparse.Namespace) -> dict:
    from .stageplan import plan_job

    dev = resolve_device(args.device)
    caps = capabilities(dev)
    if args.vram is not None:
        total = free = parse_size(args.vram)
        emulated = emulate_vram(total, dev)
        # A generic card of that size: half precision, bf16 unknown -> assume fp16 only.
        from types import SimpleNamespace

        caps_used = SimpleNamespace(backend="cuda", fp16=True, bf16=False)
    else:
        total = memory_info(dev).total
        free = free_bytes(dev)
        emulated = False
        caps_used = caps
    preset = resolve_preset(args.preset, total, caps_used)
    margin = (
        None
        if args.safety_margin is None
        else parse_size(args.safety_margin, "--safety-margin", allow_zero=True)
    )
    arch = vae_arch(args.arch)
    models = arch.unet_bytes + arch.text_encoder_bytes
    room = free - (preset.safety_margin(total) if margin is None else margin)
    swaps = "flag" if args.medvram else ("inferred" if models >= room else "")
    t0 = time.perf_counter()
    plans = plan_job(
        args.arch,
        args.width,
        args.height,
        preset,
        free,
        total,
        caps=caps_used,
        batch=args.batch,
        hires=args.hires,
        upscaler=args.upscaler,
        safety_margin_bytes=margin,
        host_swaps=bool(swaps),
        attention=args.attention,
    )
    return {
        "schema": SCHEMA_VERSION,
        "arch": args.arch,
        "width": args.width,
        "height": args.height,
        "batch": args.batch,
        "hires": args.hires,
        "upscaler": args.upscaler,
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
        + f"; preset {report['preset']}"
        + (f" ({report['resolved_from']})" if report["resolved_from"] else "")
        + f"; {_gib(report['free_bytes'])} free of {_gib(report['total_bytes'])}"
        + (" (emulated)" if report["emulated"] else "")
    )
    rows = [("stage", "plan", "dtype", "predicted peak", "activations", "budget", "fits")]
    for s in report["stages"]:
        rows.append(
            (
                s["stage"],
                s["plan"] + (f" ({s['attention']})" if s.get("attention") else ""),
                s["dtype"],
                _gib(s["predicted_peak_bytes"]),
                _gib(s["activation_bytes"]),
                _gib(s["budget_bytes"]),
                "yes" if s["fits"] else "NO",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head]
    if report.get("host_swaps_models") == "inferred":
        lines.append(
            f"the UNet and text encoders ({_gib(report['models_bytes'])}) leave no room on this card: "
            "planned as the WebUI runs with --medvram/--lowvram (they stay off the card outside sampling)"
        )
    elif report.get("host_swaps_models") == "flag":
        lines.append("--medvram: the UNet and text encoders stay off the card outside sampling")
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for s in report["stages"]:
        if s.get("moved_off_card"):
            lines.append(
                f"{s['stage']}: moves the {', '.join(s['moved_off_card'])} off the card for this pass "
                "(its plan does not fit with them there)"
            )
        if s.get("suggestion"):
            lines.append(f"does not fit: {s['stage']}: {s['suggestion']}")
        elif s["warning"]:
            lines.append(f"warning: {s['stage']}: {s['warning']}")
    lines.append(
        "peak = stage model weights + resident weights still on the card + input + predicted activations; "
        "budget = free - safety margin"
    )
    return "\n".join(lines)


def check_options(args: argparse.Namespace) -> None:
    """Refuse bad options before any work, one line naming the option."""
    import math

    from .common import UsageError, check_device

    check_device(args.device)
    for name in ("width", "height"):
        v = getattr(args, name)
        if v < 8 or v % 8:
            raise UsageError(f"`--{name}` must be a multiple of 8 and >= 8, got {v}")
    if not 1 <= args.batch <= MAX_IMAGES:
        raise UsageError(f"`--batch`/`--batch-size` must be in 1..{MAX_IMAGES} images, got {args.batch}")
    from lib_vram.sampling import attention_of

    try:
        attention_of(args.attention)
    except ValueError as exc:
        raise UsageError(f"`--attention {args.attention}`: {exc}") from None
    if args.hires is not None and (not math.isfinite(args.hires) or not 1 < args.hires <= 8):
        raise UsageError(f"`--hires` must be a scale in (1, 8], got {args.hires}")
    if args.vram is not None:
        parse_size(args.vram, "--vram")
    if args.safety_margin is not None:
        parse_size(args.safety_margin, "--safety-margin", allow_zero=True)


PROGRESS_AFTER_S = 2.0
"""A plan that takes longer than this shows that it is working (large sizes take a while)."""


class _Progress:
    """Elapsed-time progress on stderr while planning, from ``PROGRESS_AFTER_S`` on: a line that
    updates every second on a terminal; one line (no ``\\r``) into pipes and logs."""

    def __init__(self, label: str) -> None:
        import threading

        self.label = label
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="vram-guard-plan-progress", daemon=True)
        self.wrote = False

    def _run(self) -> None:
        import sys
        import time

        t0 = time.perf_counter()
        if self.stop.wait(PROGRESS_AFTER_S):
            return
        tty = getattr(sys.stderr, "isatty", lambda: False)()
        if not tty:
            sys.stderr.write(f"planning {self.label} (large sizes take a while)...\n")
            sys.stderr.flush()
            return
        while True:
            sys.stderr.write(f"\rplanning {self.label}: {time.perf_counter() - t0:.0f} s")
            sys.stderr.flush()
            self.wrote = True
            if self.stop.wait(1.0):
                return

    def __enter__(self) -> _Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import sys

        self.stop.set()
        self.thread.join()
        if self.wrote:
            sys.stderr.write("\n")
            sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    check_options(args)
    with _Progress(f"{args.arch} {args.width}x{args.height}"):
        report = collect(args)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(format_table(report))
    return 0 if all(s["fits"] for s in report["stages"]) else 3
