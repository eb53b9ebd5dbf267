"""``python -m lib_vram bench timeline``: what the memory timeline costs a job (each job run
``none``/``tracker``/``timeline``, interleaved). Method: docs/benchmarks.md, "Memory timeline overhead".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lib_vram.cli.common import MAX_COUNT, MAX_THREADS, bounded_int
from lib_vram.core.timeline import Timeline
from lib_vram.core.tracker import StageTracker
from lib_vram.planning import planner

from ..models.synthetic import image_like
from ._harness import Bench, fmt, runner, timed
from ._harness import table as grid
from .emulate import VAE_NARROW, rrdb

HELP = "Memory timeline overhead: a job with and without sampling, side by side (VAE decode, upscale)."
VARIANTS = ("none", "tracker", "timeline")


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--reps", type=bounded_int("--reps", 1, MAX_COUNT), default=5,
        help=f"runs per variant (default 5, at most {MAX_COUNT})")  # fmt: skip
    add("--quick", action="store_true", help="smaller jobs (under a minute)")
    add("--device", default="cpu", help="device (default cpu)")
    add("--threads", type=bounded_int("--threads", 1, MAX_THREADS), default=None,
        help=f"torch CPU threads (default: torch's; 1 = least noise; at most {MAX_THREADS})")  # fmt: skip


def bench(args: argparse.Namespace) -> Bench:
    if args.threads is not None:  # (both bounded by their parsers)
        torch.set_num_threads(args.threads)
    costs: dict[str, float] = {}

    def run_case(job: tuple) -> dict:
        rec = _measure(*job, args.reps, args.device)
        if not costs:  # one sample measured alone, once
            costs.update({k: _sample_cost(args.device, k == "timeline") for k in ("tracker", "timeline")})
        rec.update({f"sample_us_{k}": round(cost * 1e6, 2) for k, cost in costs.items()})
        n, tracker, timeline = rec["samples"], costs["tracker"], costs["timeline"]
        rec["implied_timeline_pct"] = round(100 * n * (timeline - tracker) / rec["tracker_s"], 4)
        rec["implied_all_sampling_pct"] = round(100 * n * timeline / rec["none_s"], 4)
        return rec

    return Bench(_jobs(args.quick, args.device), run_case, lambda rows: _table(rows, args.device),
                 label=lambda job: job[0])  # fmt: skip


def _jobs(quick: bool, device: str) -> list[tuple[str, object]]:
    """(name, run(tracker)) for each job."""
    from lib_vram.cli.hostmodels import build_ldm
    from lib_vram.upscale import UpscaleConfig, upscale_tensor
    from lib_vram.vae import TiledVAEConfig, tiled_decode

    px, upx = (256, 64) if quick else (512, 128)
    dec = build_ldm("decoder", VAE_NARROW).to(device)
    z = (image_like(px // 8, px // 8, 4, seed=3) * 4 - 2).to(device)

    def vae(tracker):  # noqa: ANN001, ANN202
        with torch.no_grad():
            return tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=16), tracker=tracker,
                                memory=planner.PlanMemory())  # fmt: skip

    desc = rrdb(16, 3)
    x = image_like(upx, upx, 3, seed=5).to(device)

    def upscale(tracker):  # noqa: ANN001, ANN202
        cfg = UpscaleConfig(tile=32, batch=1, device=device)
        return upscale_tensor(desc, x, config=cfg, tracker=tracker, memory=planner.PlanMemory())

    return [
        (f"vae decode {px}² exact t16 (ch 32)", vae),
        (f"upscale {upx}²→{4 * upx}² t32 b1 (RRDB 16f)", upscale),
    ]


def _measure(name: str, job, reps: int, device: str) -> dict:  # noqa: ANN001
    """``job`` ``reps`` times each way, interleaved, after a warm-up; CPU time on the CPU (other
    processes disturb it far less than wall time), wall time after a synchronize on CUDA."""
    cuda = device.startswith("cuda")
    job(StageTracker(device))  # warm-up (the upscale engine measures a model once)
    times, wall = {k: [] for k in VARIANTS}, {k: [] for k in VARIANTS}
    samples = points = 0
    for _ in range(reps):
        for variant in VARIANTS:
            timeline = Timeline() if variant == "timeline" else None
            tracker = None if variant == "none" else StageTracker(device, timeline=timeline)
            _, seconds, cpu_seconds = timed(lambda: job(tracker), device)  # noqa: B023 (called here)
            wall[variant].append(seconds)
            times[variant].append(seconds if cuda else cpu_seconds)
            if timeline is not None:
                d = timeline.to_dict()
                samples, points = sum(d["samples"].values()), len(d["points"]["t"])
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    return {
        "job": name, "reps": reps, "clock": "wall" if cuda else "cpu",
        "wall_s": {k: round(statistics.median(v), 3) for k, v in wall.items()},
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        "timeline_vs_tracker_pct": round(100 * (med["timeline"] / med["tracker"] - 1), 2),
        "timeline_vs_none_pct": round(100 * (med["timeline"] / med["none"] - 1), 2),
        "min_s": {k: round(v, 4) for k, v in low.items()},
        "min_timeline_vs_tracker_pct": round(100 * (low["timeline"] / low["tracker"] - 1), 2),
        "samples": samples, "points": points,
    }  # fmt: skip


def _sample_cost(device: str, with_timeline: bool, n: int = 2_000, rounds: int = 10) -> float:
    """Seconds per ``tracker.sample()`` in an open stage: the fastest of ``rounds`` rounds of ``n``."""
    tracker = StageTracker(device, timeline=Timeline() if with_timeline else None)
    best = float("inf")
    with tracker.stage("bench"):
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                tracker.sample()
            best = min(best, (time.perf_counter() - t0) / n)
    return best


def _table(rows: list[dict], device: str) -> str:
    if not rows:
        return ""
    r0 = rows[0]
    what = "process CPU time" if r0["clock"] == "cpu" else "wall time"
    lines = [f"device {device} ({torch.get_num_threads()} threads); {what}, medians of {r0['reps']} "
             "interleaved runs per variant", "", grid([
        "job", *[(f"{k} s", fmt(f"{k}_s", ".3f")) for k in VARIANTS],
        ("timeline vs tracker", fmt("timeline_vs_tracker_pct", "+.2f", " %")),
        ("timeline vs none", fmt("timeline_vs_none_pct", "+.2f", " %")), "samples", "points",
        ("µs/sample (tracker / +timeline)",
         lambda r: f"{r['sample_us_tracker']:.1f} / {r['sample_us_timeline']:.1f}"),
        ("implied by µs/sample", lambda r: f"{r['implied_timeline_pct']:.3f} % (all sampling "
         f"{r['implied_all_sampling_pct']:.3f} %)"),
    ], rows)]  # fmt: skip
    lines.append("\nfastest run per variant (s): " + "; ".join(
        f"{r['job']}: none {r['min_s']['none']:.3f}, tracker {r['min_s']['tracker']:.3f}, timeline "
        f"{r['min_s']['timeline']:.3f} ({r['min_timeline_vs_tracker_pct']:+.2f} %)" for r in rows
    ))  # fmt: skip
    return "\n".join(lines)


run = runner(bench)
