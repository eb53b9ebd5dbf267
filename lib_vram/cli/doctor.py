"""``python -m lib_vram doctor``: what this machine offers VRAM Guard."""

from __future__ import annotations

import argparse
import json

from lib_vram import __version__
from lib_vram.core.device import capabilities, memory_info, resolve_device
from lib_vram.planning.presets import tier_preset_name
from lib_vram.planning.tiers import tier_for_total, tier_label

NAME = "doctor"
HELP = "Show the compute device, its memory, precision and attention support, and its memory tier."

SCHEMA_VERSION = 1

CPU_ONLY_NOTE = (
    "No GPU found: PyTorch runs on the CPU here. Memory figures are system RAM and this process's "
    "resident memory; tiling still bounds RAM use, but expect generation to be slow."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object (stable keys)")
    parser.add_argument("--device", default=None, help="device to probe (default: the best available)")


def collect(device: str | None = None) -> dict:
    """The doctor report as a plain dict; the keys are documented in docs/command-line.md."""
    dev = resolve_device(device)
    mem = memory_info(dev)
    caps = capabilities(dev)
    cpu_only = caps.backend == "cpu"
    tier = tier_for_total(mem.total)
    notes = []
    if cpu_only:
        notes.append(CPU_ONLY_NOTE)
    if caps.backend == "mps":
        notes.append("Apple MPS shares system memory; totals are the recommended working-set size.")
    return {
        "schema": SCHEMA_VERSION,
        "vram_guard_version": __version__,
        "device": caps.device,
        "backend": caps.backend,
        "name": caps.name,
        "cpu_only": cpu_only,
        "memory": {
            "basis": "system RAM" if cpu_only else "device memory",
            "total_bytes": mem.total,
            "free_bytes": mem.free,
            "allocated_bytes": mem.allocated,
            "reserved_bytes": mem.reserved,
            "peak_allocated_bytes": mem.peak_allocated,
            "peak_reserved_bytes": mem.peak_reserved,
            "process_rss_bytes": mem.process_rss,
            "system_total_bytes": mem.system_total,
            "system_available_bytes": mem.system_available,
        },
        "torch": {
            "version": caps.torch_version,
            "cuda": caps.cuda_version,
            "hip": caps.hip_version,
            "sdpa": caps.sdpa,
            "xformers": caps.xformers,
        },
        "precision": {"fp16": caps.fp16, "bf16": caps.bf16},
        "tier": {"gb": tier, "label": tier_label(tier)},
        "recommended_preset": tier_preset_name(mem.total),
        "notes": notes,
    }


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def format_table(report: dict) -> str:
    m = report["memory"]
    t = report["torch"]

    def pair(a: str, b: str) -> str:
        return f"{_gib(m[a])} / {_gib(m[b])}"

    rows = [
        ("VRAM Guard", report["vram_guard_version"]),
        ("device", f"{report['device']} ({report['name']})"),
        ("backend", report["backend"]),
        (f"total ({m['basis']})", _gib(m["total_bytes"])),
        ("free", _gib(m["free_bytes"])),
        ("allocated / reserved", pair("allocated_bytes", "reserved_bytes")),
        ("peak allocated / reserved", pair("peak_allocated_bytes", "peak_reserved_bytes")),
        ("process RSS", _gib(m["process_rss_bytes"])),
        ("system RAM (available/total)", pair("system_available_bytes", "system_total_bytes")),
        ("torch", t["version"]),
        ("CUDA / HIP", f"{t['cuda'] or '-'} / {t['hip'] or '-'}"),
        ("SDPA attention", _yes(t["sdpa"])),
        ("xformers", _yes(t["xformers"])),
        ("fp16 / bf16", f"{_yes(report['precision']['fp16'])} / {_yes(report['precision']['bf16'])}"),
        ("memory tier", report["tier"]["label"]),
        ("recommended preset", str(report["recommended_preset"])),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = collect(args.device)
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_table(report))
    return 0
