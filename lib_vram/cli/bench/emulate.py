"""``python -m lib_vram bench emulate``: each stage, plain vs VRAM Guard, on emulated 4/6/8 GB cards.

FP32 at 1/4 of the channels stands for FP16 at full width, so a card of N GB is emulated as N/2
GiB beside an SD1.5 checkpoint's weights. Method: docs/benchmarks.md, "Emulated cards".
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
from pathlib import Path

import torch

from lib_vram.cli.common import MAX_CARD_BYTES, int_list
from lib_vram.cli.hostmodels import SD_VAE, build_ldm
from lib_vram.core.emulate import EmulatedCard, module_bytes
from lib_vram.planning import planner

from ..models.archs import save_and_load
from ..models.synthetic import image_like, rrdb_net
from ._harness import Bench, attempt, known, ok, psnr, runner, table, timed

MAX_CARD_GB = MAX_CARD_BYTES // 2**30

HELP = "Emulated 4/6/8 GB cards: each stage plain vs VRAM Guard (OK/OOM, plan, peak/cap, fidelity, CPU time)."

GB = 1024**3
SCALE = 0.5
"""Emulated bytes per real byte: FP32 (x2) at 1/4 channel width (x1/4)."""
RESIDENT_REAL = int(2.1 * GB)
"""An SD1.5 checkpoint in FP16 (UNet 1.72 GB + text encoder 0.25 GB + VAE 0.16 GB), on the card."""
VAE_NARROW = {**SD_VAE, "ch": 32}

FULL = {"vae_decode": (1024, 1536, 2048), "vae_encode": (1024, 2048), "upscale": (512, 768, 1024)}
QUICK = {"vae_decode": (512, 1024), "vae_encode": (1024,), "upscale": (768,)}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller images (a few minutes)")
    add_cards(parser)
    parser.add_argument("--stages", default=None, help="comma-separated: vae_decode,vae_encode,upscale")
    parser.add_argument("--overhead", action="store_true",
                        help="also measure the emulation's own CPU cost (full-size models)")  # fmt: skip


def bench(args: argparse.Namespace) -> Bench:
    sizes = QUICK if args.quick else FULL
    stages = known("--stages", args.stages, list(FULL))
    cases = [(stage, px) for stage in stages for px in sizes[stage]] + [("overhead", 0)] * args.overhead
    return Bench(cases, lambda c: overhead() if c[0] == "overhead" else run_stage(*c, args.cards), _table,
                 label=lambda c: c[0] if c[0] == "overhead" else f"{c[0]} {c[1]}²")  # fmt: skip


def add_cards(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cards", type=int_list("--cards", 1, MAX_CARD_GB, why="1 TiB", unit="GB"),
                        default="4,6,8",
                        help=f"card sizes in GB (default 4,6,8; each 1 to {MAX_CARD_GB})")  # fmt: skip


def latent(px: int):
    img = image_like(px // 8, px // 8, 4, seed=3) * 4 - 2  # image-like, in the range of scaled SD latents
    return img + 0.1 * torch.randn(img.shape, generator=torch.Generator().manual_seed(4))


def rrdb(filters: int = 16, blocks: int = 6):
    """A spandrel ESRGAN ``RRDBNet`` x4 (seed 0; full size: 64 filters, 23 blocks), loaded from a file."""
    torch.manual_seed(0)
    net = rrdb_net(filters, blocks)
    with tempfile.TemporaryDirectory() as tmp:
        return save_and_load(net, Path(tmp) / "rrdb.safetensors")


def fidelity(out, ref, data_range: float) -> dict:
    err = (out.float() - ref.float()).abs()
    db = psnr(float((err**2).mean()), data_range)
    to8 = 255.0 / data_range
    lsb = int(((out.float() * to8).round() - (ref.float() * to8).round()).abs().max())
    return {"psnr_db": round(db, 2) if math.isfinite(db) else None, "max_err": float(err.max()),
            "max_err_lsb": lsb, "finite": bool(torch.isfinite(out).all())}  # fmt: skip


def stage_fns(stage: str, px: int, device=None, dtype=None, full: bool | None = None):  # noqa: ANN001
    """(module on the card, plain(), guarded(report), its report class, data range) of ``stage``:
    full-size models if ``full`` (default: on CUDA), else the narrow ones."""
    from lib_vram.upscale import UpscaleConfig, UpscaleReport, upscale_tensor
    from lib_vram.vae import TiledVAEConfig, VAEReport, tiled_decode, tiled_encode

    device, dtype = torch.device(device or "cpu"), dtype or torch.float32
    full = device.type == "cuda" if full is None else full
    if stage in ("vae_decode", "vae_encode"):
        kind = "decoder" if stage == "vae_decode" else "encoder"
        mod = net = build_ldm(kind, SD_VAE if full else VAE_NARROW).to(device, dtype)
        x = (latent(px) if kind == "decoder" else image_like(px, px) * 2 - 1).to(device, dtype)
        fn = tiled_decode if kind == "decoder" else tiled_encode
        no_grad, report, data_range = torch.no_grad, VAEReport, 2.0

        def guarded(rep):
            return fn(mod, x, config=TiledVAEConfig(mode="auto"), report=rep, original_forward=mod.forward,
                      memory=planner.PlanMemory())  # fmt: skip
    else:
        net = (rrdb(64, 23) if full else rrdb()).to(device, dtype)
        mod, x = net.model, image_like(px, px).to(device, dtype)
        prec = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
        no_grad, report, data_range = torch.inference_mode, UpscaleReport, 1.0

        def guarded(rep):
            return upscale_tensor(net, x.float(), config=UpscaleConfig(precision=prec), report=rep,
                                  memory=planner.PlanMemory())  # fmt: skip

    def plain():
        with no_grad():
            return net(x)

    return mod, plain, guarded, report, data_range


def _plan_of(rep) -> str:
    """The report's plan and its out-of-memory retries (VAE: ``oom_retries``; upscale: ``events``)."""
    retries = getattr(rep, "oom_retries", None) or getattr(rep, "events", None)
    return f"{rep.plan} (after OOM: {retries})" if retries else rep.plan


def reset_memory(device: torch.device) -> None:
    """Garbage collected; on CUDA also the cache emptied and the peak counter reset."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device, card: EmulatedCard | None = None) -> int | None:
    """The peak since :func:`reset_memory`: CUDA's own counter, else the emulated ``card``'s."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None if card is None else card.peak_bytes


def _on_card(fn, device: torch.device) -> tuple:  # noqa: ANN001
    """``fn()`` timed, its output moved to the host; on CUDA beside the checkpoint's weights, held on
    the card for real."""
    held = torch.empty(RESIDENT_REAL, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    out, secs, cpu_secs = timed(fn, device)
    del held
    return out.cpu(), secs, cpu_secs


def run_stage(stage: str, px: int, cards: list[int], device: torch.device | None = None) -> list[dict]:
    """``stage`` at ``px`` on each card: plain, then VRAM Guard's (the card installed). With a
    ``device``: ``bench gpu``'s matrix rows, their own fields (on CUDA: FP16 at full size, the card
    caps the device itself and the checkpoint's weights are held on it for real)."""
    gpu, device = device is not None, torch.device(device or "cpu")
    cuda = device.type == "cuda"
    dtype, scale = (torch.float16, 1.0) if cuda else (torch.float32, SCALE)
    module, plain, guarded, report, data_range = stage_fns(stage, px, device, dtype)
    ref, _, ref_cpu = timed(plain)
    ref, records = ref.float().cpu(), []
    resident = 0 if cuda else int(RESIDENT_REAL * scale) + (0 if gpu else module_bytes([module]))
    for gb in cards:
        cap, rep = int(gb * GB * scale), report()
        rec = {"stage": stage, "image_px": px, "card_gb": gb, "card_bytes": cap}
        rec.update({"device": str(device)} if gpu else {"resident_bytes": resident, "scale": scale})
        label = None if gpu else f"emulated {gb} GB card (x{scale} scale)"
        for which, fn in (("plain", plain), ("guarded", lambda rep=rep: guarded(rep))):
            reset_memory(device)
            card = EmulatedCard(cap, device=device.type, resident=resident, label=label)
            got = attempt(lambda fn=fn: _on_card(fn, device), card, install=True)
            out, secs, cpu_secs = got.out if got.ok else (None, 0.0, 0.0)
            if gpu:
                done = {f"{which}_seconds": round(secs, 3), f"{which}_ok": True}
                rec.update(done if got.ok else {f"{which}_ok": False, f"{which}_error": got.error[:160]})
            elif which == "plain":
                rec.update(plain_ok=got.ok, plain_error=None if got.ok else got.error.split(".")[0])
            else:
                rec.update(guarded_ok=got.ok, plan=_plan_of(rep))
                done = {"seconds": round(secs, 2), "cpu_ratio": round(cpu_secs / ref_cpu, 3)}
                rec.update(done if got.ok else {"error": got.error[:200]})
            if got.ok and which == "guarded":
                rec.update(fidelity(out, ref, data_range))
                if gpu:
                    rec["plan"] = rep.plan
            peak = peak_memory(device, card)
            rec[f"{which}_peak_bytes" if gpu or which == "plain" else "peak_bytes"] = peak
            del got, out
        rec["peak_over_cap"] = round(peak / cap, 3)
        if gpu:
            rec["ref_cpu_s"] = round(ref_cpu, 3)
        records.append(rec)
    reset_memory(device)
    torch.manual_seed(0)
    return records


def overhead() -> list[dict]:
    """The emulation's own CPU cost: the plain forward with and without a card that never refuses."""
    out = []
    for name, stage, px in (
        ("full SD VAE decode 512²", "vae_decode", 512),
        ("full RRDB x4 upscale 128²", "upscale", 128),
    ):
        fn = stage_fns(stage, px, full=True)[1]
        fn()  # warm-up (oneDNN primitives, page faults)
        _, t_plain, c_plain = timed(fn)
        with EmulatedCard("1024GB") as card:
            _, t_card, c_card = timed(fn)
        out.append({"stage": "overhead", "case": name, "cpu_s_plain": round(c_plain, 2),
                    "cpu_s_emulated": round(c_card, 2), "cpu_ratio": round(c_card / c_plain, 3),
                    "wall_ratio": round(t_card / t_plain, 3),
                    "counted_peak_bytes": card.peak_bytes})  # fmt: skip
    return out


def _table(records: list[dict]) -> str:
    def psnr_cell(r: dict) -> str:
        return "∞" if r.get("guarded_ok") and r.get("psnr_db") is None else str(r.get("psnr_db", "—"))

    cols = [
        "stage", ("image", lambda r: f"{r['image_px']}²"), ("card", lambda r: f"{r['card_gb']} GB"),
        ("plain", ok("plain_ok")), ("VRAM Guard", ok("guarded_ok")), ("plan", lambda r: r.get("plan") or "—"),
        ("peak/cap", lambda r: f"{r['peak_over_cap']:.2f}"), ("PSNR", psnr_cell),
        ("max LSB", lambda r: str(r.get("max_err_lsb", "—"))),
        ("CPU vs plain", lambda r: str(r.get("cpu_ratio", "—"))),
    ]  # fmt: skip
    text = table(cols, [r for r in records if r["stage"] != "overhead"])
    over = [r for r in records if r["stage"] == "overhead"]
    if over:
        cols = [("emulation overhead", lambda r: r["case"]), ("CPU s plain", lambda r: str(r["cpu_s_plain"])),
                ("CPU s on the card", lambda r: str(r["cpu_s_emulated"])),
                ("ratio", lambda r: str(r["cpu_ratio"]))]  # fmt: skip
        text += "\n\n" + table(cols, over)
    return text


run = runner(bench)
