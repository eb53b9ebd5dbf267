"""``python -m lib_vram bench planner``: predicted (a fake run) vs measured (peak RSS above the start)
peak memory per case, each in a fresh process. Method: docs/benchmarks.md, "Planner".
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from lib_vram.cli.common import MAX_SECONDS, bounded_float
from lib_vram.core.predict import new_fake_mode
from lib_vram.core.tracker import StageTracker
from lib_vram.planning import reference

from ._harness import Bench, known, mib, mib_of, runner
from ._harness import table as grid

HELP = "Predicted vs measured peak memory (CPU RSS) for VAE and upscaler stages, untiled and tiled."


@dataclass(frozen=True)
class Case:
    name: str
    engine: str
    """``"vae"``/``"upscale"`` (the untiled model) or ``"vae-engine"``/``"upscale-engine"``."""
    kind: str
    size: int
    """Output image side in px (decode/upscale) or input image side (encode)."""
    ch: int = 128
    tile: int | None = None
    batch: int = 1
    quick: bool = False
    mode: str = "exact"

    @property
    def plan(self) -> str:
        if self.tile is None:
            return "untiled"
        fast = " fast" if self.mode == "fast" else ""
        return f"tile {self.tile}" + (f" x{self.batch}" if self.batch > 1 else "") + fast


CASES: tuple[Case, ...] = (
    Case("dec-256", "vae", "decode", 256, 128),
    Case("enc-256-ch64", "vae", "encode", 256, 64),
    Case("dec-512-ch32", "vae", "decode", 512, 32, quick=True),
    Case("enc-512-ch32", "vae", "encode", 512, 32, quick=True),
    Case("eng-dec-1024-ch32-t32", "vae-engine", "decode", 1024, 32, tile=32),
    Case("eng-dec-256-t16", "vae-engine", "decode", 256, 128, tile=16),
    Case("eng-dec-256-t16-fast", "vae-engine", "decode", 256, 128, tile=16, mode="fast"),
    Case("eng-dec-512-t32", "vae-engine", "decode", 512, 128, tile=32),
    Case("eng-dec-512-t32-fast", "vae-engine", "decode", 512, 128, tile=32, mode="fast"),
    Case("eng-enc-512-t32", "vae-engine", "encode", 512, 128, tile=32),
    Case("rrdb-256", "upscale", "rrdb", 256, quick=True),
    Case("eng-rrdb-1024-t128x2", "upscale-engine", "rrdb", 1024, tile=128, batch=2),
    Case("compact-512", "upscale", "compact", 512, quick=True),
    Case("compact-2048", "upscale", "compact", 2048),
    Case("eng-compact-2048-t192x2", "upscale-engine", "compact", 2048, tile=192, batch=2),
)
"""CPU time decides the widths (narrower VAEs above 256²) and stops VAE sizes at 1024²."""
BY_NAME = {c.name: c for c in CASES}

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
"""glibc settings for the measured processes: every allocation above 64 KiB gets its own mapping,
returned to the OS when freed, so RSS follows the bytes actually allocated (as a GPU allocator's
``allocated`` counter does). With glibc's default, the mmap threshold grows after the first large
frees and later tensors come from the heap, whose freed chunks stay resident: RSS then depends on
the allocation history, not only on what the stage holds (``--glibc-default`` shows that)."""

RRDB_BLOCKS = 2
SCALE = 4


def _build(case: Case):
    """The model and the input shape of ``case``."""
    if case.engine in ("vae", "vae-engine"):
        from lib_vram.cli.hostmodels import SD_VAE, build_ldm

        lat = case.size // 8
        shape = (1, 4, lat, lat) if case.kind == "decode" else (1, 3, case.size, case.size)
        kind = "decoder" if case.kind == "decode" else "encoder"
        return build_ldm(kind, {**SD_VAE, "ch": case.ch}, seed=None), shape
    blocks = RRDB_BLOCKS if case.kind == "rrdb" else None
    side = case.size // SCALE
    return reference.build_upscaler(case.kind, SCALE, num_blocks=blocks).eval(), (1, 3, side, side)


def _loop(case: Case):
    """``loop(model, x)``: the engine as its prediction runs it (:mod:`lib_vram.cli.stageplan`), or
    the untiled model."""
    from lib_vram.cli.stageplan import upscale_loop, vae_loop

    if case.engine == "vae-engine":
        return vae_loop(case.kind, case.tile, case.mode, torch.float32)
    if case.engine == "upscale-engine":
        return upscale_loop(case.tile, case.batch, SCALE)
    return lambda m, x: m(x)


def measure(name: str) -> dict:
    """Run the case ``name`` (in a fresh process): its record (:func:`_record`)."""
    case = BY_NAME[name]
    torch.manual_seed(0)
    model, shape = _build(case)
    x = torch.randn(shape)
    loop = _loop(case)
    tracker = StageTracker("cpu", owns_peak_counters=True)
    with torch.no_grad():
        small = (1, shape[1], 8, 8) if case.kind == "decode" else (1, 3, 64, 64)
        with tracker.stage("warmup"):
            model(torch.randn(small))
        t0 = time.perf_counter()
        with tracker.stage(case.name) as rec:
            loop(model, x)  # the output is freed inside the stage
        seconds = time.perf_counter() - t0
    return _record(case, rec.delta_peak_bytes, rec.exact, seconds)


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--quick", action="store_true", help="only the 4 light cases (~1-2 min)")
    add("--case", action="append", default=None, help="run only these cases (repeatable)")
    add("--glibc-default", action="store_true", help="run the cases with glibc's default malloc thresholds "
        "(RSS then also holds freed heap chunks)")  # fmt: skip
    add("--timeout", type=bounded_float("--timeout", 0.0, MAX_SECONDS, why="one day", unit="s"),
        default=900.0, help="seconds per case (default 900, at most 86400)")  # fmt: skip


def bench(args: argparse.Namespace) -> Bench:
    if args.case:
        cases = [BY_NAME[n] for n in known("--case", ",".join(args.case), list(BY_NAME))]
    else:
        cases = [c for c in CASES if c.quick or not args.quick]

    def done(r: dict) -> str:
        return (f"{r['case']:<22} {r['plan']:<12} pred {mib(r['predicted_bytes']):>8} MiB  meas "
                f"{mib(r['measured_bytes']):>8} MiB  err {100 * (r['error'] or 0):+6.1f} %  "
                f"({r['run_seconds']:.0f} s)")  # fmt: skip

    return Bench([c.name for c in cases], None, _table, lines=False, done=done,
                 env={} if args.glibc_default else MALLOC_ENV, timeout=args.timeout)  # fmt: skip


def _record(case: Case, measured: int, exact: bool, seconds: float) -> dict:
    """The case's prediction (:func:`_loop` on fake tensors, after the measured run) beside what
    :func:`measure` measured."""
    from lib_vram.cli.stageplan import predict_loop

    with torch.device("meta"):
        model, shape = _build(case)
    t0 = time.perf_counter()
    with reference.dry_run():
        p = predict_loop(model, _loop(case), shape, torch.float32, "cpu", new_fake_mode())
    predict_seconds = time.perf_counter() - t0
    return {
        "case": case.name, "engine": case.engine, "kind": case.kind, "size": case.size,
        "ch": case.ch if case.engine.startswith("vae") else None, "plan": case.plan,
        "predicted_bytes": p.activation_bytes, "measured_bytes": measured,
        "error": p.activation_bytes / measured - 1 if measured else None,
        "weights_bytes": p.weights_bytes, "input_bytes": p.input_bytes, "predict_seconds": predict_seconds,
        "run_seconds": seconds, "exact": exact,
    }  # fmt: skip


def _table(records: list[dict]) -> str:
    lines = [grid(["case", "engine", "plan", ("predicted MiB", mib_of("predicted_bytes")),
                   ("measured MiB", mib_of("measured_bytes")),
                   ("error", lambda r: f"{100 * (r['error'] or 0):+.1f} %")], records)]  # fmt: skip
    errs = [abs(r["error"]) for r in records if r["error"] is not None]
    if errs:
        lines.append(f"\n{len(records)} cases; max |error| {100 * max(errs):.1f} %, "
                     f"mean {100 * sum(errs) / len(errs):.1f} %")  # fmt: skip
    return "\n".join(lines)


run = runner(bench, child=measure)
