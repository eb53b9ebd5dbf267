"""``python -m lib_vram bench timeline``: what the memory timeline costs a job.

The same job three ways, interleaved run by run in one process (so that both see the same machine
state): ``none`` (no tracker: nothing sampled), ``tracker`` (the per-stage tracker VRAM Guard always
runs, sampled after every tile step) and ``timeline`` (the tracker plus a
:class:`~lib_vram.core.timeline.Timeline`: every sample also stored). The overhead of the timeline is
``timeline`` over ``tracker`` (medians); of all sampling, ``timeline`` over ``none``.

Jobs (real modules, random weights): an exact tiled decode of the ldm ``Decoder`` (the SD layout at
``ch`` 32, so that the CPU affords many tiles: small tiles make the most samples per second, the
hardest case for sampling) and a tiled upscale of a spandrel ESRGAN ``RRDBNet`` loaded from a file.

On the CPU the times are the process's CPU time (all threads; a shared machine disturbs it far
less than wall time), on CUDA wall time after a synchronize. Both are noisy; the table also gives
the cost of one sample measured alone (``tracker.sample()`` with and without a timeline: the fastest
of 10 rounds of 2000 calls) and the overhead it implies: samples x extra cost per sample / job time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time

from lib_vram.cli.common import MAX_COUNT, MAX_THREADS, bounded_int

HELP = "Memory timeline overhead: a job with and without sampling, side by side (VAE decode, upscale)."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reps",
        type=bounded_int("--reps", 1, MAX_COUNT),
        default=5,
        help=f"runs per variant (default 5, at most {MAX_COUNT})",
    )
    parser.add_argument("--quick", action="store_true", help="smaller jobs (under a minute)")
    parser.add_argument("--json", action="store_true", help="print one JSON record per job")
    parser.add_argument("--device", default="cpu", help="device (default cpu)")
    parser.add_argument(
        "--threads",
        type=bounded_int("--threads", 1, MAX_THREADS),
        default=None,
        help=f"torch CPU threads (default: torch's; 1 = least noise; at most {MAX_THREADS})",
    )


def _decoder(ch: int):
    import torch

    from .vae import SD_VAE

    with contextlib.redirect_stdout(io.StringIO()):
        from ldm.modules.diffusionmodules.model import Decoder

        torch.manual_seed(0)
        return Decoder(**{**SD_VAE, "ch": ch}).eval()


def _jobs(quick: bool, device: str, tmp: str) -> list[tuple[str, object]]:
    """(name, run(tracker)) for each job."""
    import spandrel
    import torch
    from safetensors.torch import save_file

    from lib_vram.cli.bench._synthetic import image_like, make_imagelike_rrdb, rrdb_class
    from lib_vram.planning import planner
    from lib_vram.upscale import UpscaleConfig, upscale_tensor
    from lib_vram.vae import TiledVAEConfig, tiled_decode

    px = 256 if quick else 512
    dec = _decoder(32).to(device)
    z = (image_like(px // 8, px // 8, 4, seed=3) * 4 - 2).to(device)

    def vae(tracker):
        with torch.no_grad():
            return tiled_decode(dec, z, config=TiledVAEConfig(mode="exact", tile=16), tracker=tracker,
                                memory=planner.PlanMemory())  # fmt: skip

    torch.manual_seed(0)
    net = make_imagelike_rrdb(rrdb_class()(in_nc=3, out_nc=3, num_filters=16, num_blocks=3, scale=4))
    path = f"{tmp}/rrdb.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, path)
    desc = spandrel.ModelLoader().load_from_file(path)
    upx = 64 if quick else 128
    x = image_like(upx, upx, 3, seed=5).to(device)

    def upscale(tracker):
        cfg = UpscaleConfig(tile=32, batch=1, device=device)
        return upscale_tensor(desc, x, config=cfg, tracker=tracker, memory=planner.PlanMemory())

    return [
        (f"vae decode {px}² exact t16 (ch 32)", vae),
        (f"upscale {upx}²→{4 * upx}² t32 b1 (RRDB 16f)", upscale),
    ]


def _sample_cost(device: str, with_timeline: bool, n: int = 2_000, rounds: int = 10) -> float:
    """Seconds per ``tracker.sample()`` inside an open stage: the fastest of ``rounds`` rounds of
    ``n`` calls (the least disturbed by other processes)."""
    from lib_vram.core.timeline import Timeline
    from lib_vram.core.tracker import StageTracker

    tracker = StageTracker(device, timeline=Timeline() if with_timeline else None)
    best = float("inf")
    with tracker.stage("bench"):
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                tracker.sample()
            best = min(best, (time.perf_counter() - t0) / n)
    return best


def run(args: argparse.Namespace) -> int:
    import torch

    from lib_vram.cli.common import UsageError
    from lib_vram.core.timeline import Timeline
    from lib_vram.core.tracker import StageTracker

    if args.reps < 1:
        raise UsageError(f"`--reps` must be >= 1, got {args.reps}")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"`--threads` must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device
    # CPU: the process's CPU time (all threads), which other processes on a shared machine disturb
    # far less than wall time; CUDA: wall time after a synchronize
    clock = "wall" if device.startswith("cuda") else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, job in _jobs(args.quick, device, tmp):
            job(StageTracker(device))  # warm-up (the upscale engine measures a model once)
            times: dict[str, list[float]] = {"none": [], "tracker": [], "timeline": []}
            wall: dict[str, list[float]] = {k: [] for k in times}
            samples = points = 0
            for _ in range(args.reps):
                for variant in times:
                    timeline = Timeline() if variant == "timeline" else None
                    tracker = None if variant == "none" else StageTracker(device, timeline=timeline)
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    t0, c0 = time.perf_counter(), time.process_time()
                    job(tracker)
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    wall[variant].append(time.perf_counter() - t0)
                    times[variant].append(time.process_time() - c0 if clock == "cpu" else wall[variant][-1])
                    if timeline is not None:
                        d = timeline.to_dict()
                        samples = sum(d["samples"].values())
                        points = len(d["points"]["t"])
            med = {k: statistics.median(v) for k, v in times.items()}
            low = {k: min(v) for k, v in times.items()}
            rows.append(
                {
                    "job": name,
                    "reps": args.reps,
                    "clock": clock,
                    "wall_s": {k: round(statistics.median(v), 3) for k, v in wall.items()},
                    "none_s": round(med["none"], 4),
                    "tracker_s": round(med["tracker"], 4),
                    "timeline_s": round(med["timeline"], 4),
                    "timeline_vs_tracker_pct": round(100 * (med["timeline"] / med["tracker"] - 1), 2),
                    "timeline_vs_none_pct": round(100 * (med["timeline"] / med["none"] - 1), 2),
                    "min_s": {k: round(v, 4) for k, v in low.items()},
                    "min_timeline_vs_tracker_pct": round(100 * (low["timeline"] / low["tracker"] - 1), 2),
                    "samples": samples,
                    "points": points,
                }
            )
    cost_tracker = _sample_cost(device, False)
    cost_timeline = _sample_cost(device, True)
    for r in rows:
        r["sample_us_tracker"] = round(cost_tracker * 1e6, 2)
        r["sample_us_timeline"] = round(cost_timeline * 1e6, 2)
        r["implied_timeline_pct"] = round(
            100 * r["samples"] * (cost_timeline - cost_tracker) / r["tracker_s"], 4
        )
        r["implied_all_sampling_pct"] = round(100 * r["samples"] * cost_timeline / r["none_s"], 4)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    what = "process CPU time" if clock == "cpu" else "wall time"
    threads = torch.get_num_threads()
    print(f"device {device} ({threads} threads); {what}, medians of {args.reps} interleaved runs per variant")
    print()
    print("| job | none s | tracker s | timeline s | timeline vs tracker | timeline vs none | samples "
          "| points | µs/sample (tracker / +timeline) | implied by µs/sample |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['job']} | {r['none_s']:.3f} | {r['tracker_s']:.3f} | {r['timeline_s']:.3f} | "
            f"{r['timeline_vs_tracker_pct']:+.2f} % | {r['timeline_vs_none_pct']:+.2f} % | {r['samples']} | "
            f"{r['points']} | {r['sample_us_tracker']:.1f} / {r['sample_us_timeline']:.1f} | "
            f"{r['implied_timeline_pct']:.3f} % (all sampling {r['implied_all_sampling_pct']:.3f} %) |"
        )
    print()
    print("fastest run per variant (s): " + "; ".join(
        f"{r['job']}: none {r['min_s']['none']:.3f}, tracker {r['min_s']['tracker']:.3f}, timeline "
        f"{r['min_s']['timeline']:.3f} ({r['min_timeline_vs_tracker_pct']:+.2f} %)" for r in rows
    ))  # fmt: skip
    return 0
