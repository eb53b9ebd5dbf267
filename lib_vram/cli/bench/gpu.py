"""``python -m lib_vram bench gpu``: everything a GPU should measure, in one prepared call (one JSON
file): the capped 4/6/8 GB ``matrix``, ``decode_2048``, ``upscale_batch``, ``cudnn_workspace`` and
``stream_unet``. Without CUDA the CPU-sized parts run and the rest is listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lib_vram.cli.common import MAX_SECONDS, bounded_float
from lib_vram.cli.hostmodels import SD_VAE, build_ldm
from lib_vram.core.device import capabilities, memory_info, resolve_device
from lib_vram.core.files import write_atomic

from ..models.synthetic import image_like
from ._harness import Bench, runner, timed
from .emulate import add_cards, fidelity, latent, peak_memory, reset_memory, rrdb, run_stage
from .sampling_stream import gpu_stream

JSON = False
HELP = "One prepared GPU run (< 8 min): capped 4/6/8 GB matrix, fp16 2048² decode, upscale batching, cuDNN."


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--out", type=Path, default=Path("vram_guard_gpu.json"), help="the JSON file to write")
    add("--budget-s", type=bounded_float("--budget-s", 0.0, MAX_SECONDS, why="one day", unit="s"),
        default=420.0,
        help="stop starting new parts after this many seconds (default 420, at most 86400)")  # fmt: skip
    add_cards(parser)


class _Clock:
    def __init__(self, budget: float) -> None:
        self.end = time.perf_counter() + budget

    def late(self, skipped: list[str], what: str, need: float) -> bool:
        """Fewer than ``need`` seconds left for ``what``: noted in ``skipped``."""
        late = self.end - time.perf_counter() < need
        if late:
            skipped.append(f"{what}: out of time")
        return late


def bench(args: argparse.Namespace) -> Bench:
    cuda = torch.cuda.is_available()
    device = resolve_device("cuda" if cuda else "cpu")
    clock = _Clock(args.budget_s)
    skipped = [] if cuda else ["no CUDA device: the matrix ran on the emulated CPU card at small sizes (x0.5 "
                               "scale)"]  # fmt: skip
    env = {"capabilities": capabilities(device).__dict__, "memory": memory_info(device).to_dict(),
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version() if cuda else None}  # fmt: skip
    result: dict = {"schema": 1, "device": str(device), "env": env}
    parts = {"matrix": lambda *a: matrix(device, args.cards, clock, skipped), "decode_2048": decode_2048,
             "upscale_batch": upscale_batch, "cudnn_workspace": cudnn_workspace,
             "stream_unet": gpu_stream}  # fmt: skip

    def part(name: str) -> dict:
        t0 = time.perf_counter()
        result[name] = parts[name](device, clock, skipped)
        result.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 2)
        text = json.dumps({**result, "skipped": skipped}, indent=1, default=str)
        write_atomic(args.out, lambda tmp: tmp.write_text(text), overwrite=True)  # survives a later failure
        return {"part": name, "seconds": result["seconds"][name]}

    def finish(records: list[dict]) -> str:
        lines = [f"wrote {args.out} ({sum(result['seconds'].values()):.0f} s)"]
        return "\n".join(lines + [f"skipped: {line}" for line in skipped])

    return Bench(list(parts), part, finish)


def matrix(device, cards: list[int], clock: _Clock, skipped: list[str]) -> list[dict]:  # noqa: ANN001
    cuda = device.type == "cuda"
    sizes = {"vae_decode": (1024, 2048), "vae_encode": (2048,), "upscale": (512,)} if cuda else {
        "vae_decode": (512,), "vae_encode": (512,), "upscale": (128,)}  # fmt: skip
    out = []
    for stage, pxs in sizes.items():
        for px in pxs:
            if not clock.late(skipped, f"matrix {stage} {px}²", 60):
                reset_memory(device)
                out += run_stage(stage, px, cards, device)
    return out


def decode_2048(device, clock: _Clock, skipped: list[str]) -> list[dict]:  # noqa: ANN001
    from lib_vram.vae import TiledVAEConfig, VAEReport, tiled_decode

    if device.type != "cuda":
        skipped.append("decode_2048: needs CUDA (FP16 at 2048² with a full-size VAE)")
        return []
    dec = build_ldm("decoder", SD_VAE).to(device)
    z = latent(2048).to(device)
    reset_memory(device)
    with torch.no_grad():
        ref = dec(z).float().cpu()
    dec.half()
    out = []
    fp16 = {f"{m} t64": TiledVAEConfig(mode=m, tile=64, dtype=torch.float16) for m in ("exact", "fast")}
    for name, cfg in {"untiled": None, **fp16}.items():
        if clock.late(skipped, f"decode_2048 {name}", 30):
            continue
        reset_memory(device)
        rep = VAEReport()
        with torch.no_grad():
            y, secs, _ = timed(lambda cfg=cfg, rep=rep: dec(z.half()) if cfg is None else
                               tiled_decode(dec, z.half(), config=cfg, report=rep), device)  # fmt: skip
        out.append({"case": name, "seconds": round(secs, 3), "max_memory_allocated": peak_memory(device),
                    "recomputed": len(rep.recomputed), **fidelity(y.float().cpu(), ref, 2.0)})  # fmt: skip
        del y
    return out


def upscale_batch(device, clock: _Clock, skipped: list[str]) -> list[dict]:  # noqa: ANN001
    from lib_vram.upscale import UpscaleConfig, UpscaleReport, upscale_tensor

    cuda = device.type == "cuda"
    desc = (rrdb(64, 23) if cuda else rrdb()).to(device)
    x = (image_like(512, 512) if cuda else image_like(96, 96)).to(device)
    out = []
    for name, batch in (("batched (auto)", None), ("one tile at a time", 1)):
        if clock.late(skipped, f"upscale_batch {name}", 20):
            continue
        reset_memory(device)
        rep = UpscaleReport()
        cfg = UpscaleConfig(tile=128 if cuda else 32, batch=batch, precision="fp16" if cuda else "fp32")
        _, secs, _ = timed(lambda cfg=cfg, rep=rep: upscale_tensor(desc, x, config=cfg, report=rep), device)
        peak = peak_memory(device)
        out.append({"case": name, "plan": rep.plan, "seconds": round(secs, 3), "max_memory_allocated": peak})
    return out


def cudnn_workspace(device, clock: _Clock, skipped: list[str]) -> dict:  # noqa: ANN001
    if device.type != "cuda":
        skipped.append("cudnn_workspace: needs CUDA")
        return {}
    shapes = [(512, 512, 64), (512, 512, 128), (256, 256, 256), (128, 128, 512), (128, 3, 512), (64, 64, 256),
              (3, 64, 256), (64, 64, 512)]  # (in_ch, out_ch, px)  # fmt: skip
    rows = []
    for dt in (torch.float16, torch.float32):
        for cin, cout, px in shapes:
            if clock.late(skipped, "cudnn_workspace", 10):
                break
            conv = torch.nn.Conv2d(cin, cout, 3, padding=1).to(device, dt)
            x = torch.randn(1, cin, px, px, device=device, dtype=dt)
            with torch.no_grad():
                conv(x)  # warm-up: cuDNN picks its algorithm
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                y = conv(x)
                torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
            out_b, in_b = y.numel() * y.element_size(), x.numel() * x.element_size()
            rows.append({"dtype": str(dt), "in_ch": cin, "out_ch": cout, "px": px, "input_bytes": in_b,
                         "output_bytes": out_b, "workspace_bytes": max(0, peak - out_b)})  # fmt: skip
            del conv, x, y
    pairs = [(max(r["input_bytes"], r["output_bytes"]), r["workspace_bytes"]) for r in rows]
    den = sum(a * a for a, _ in pairs)
    fit = sum(a * w for a, w in pairs) / den if den else None
    return {"rows": rows, "fit_bytes_per_max_in_out": fit,
            "benchmark_flag": bool(torch.backends.cudnn.benchmark)}  # fmt: skip


run = runner(bench)
