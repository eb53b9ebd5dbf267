"""``python -m lib_vram bench emulate``: each stage, plain vs VRAM Guard, on emulated 4/6/8 GB cards.

The card is :class:`lib_vram.core.emulate.EmulatedCard`: device memory counted in software, CUDA's
out-of-memory error at its capacity. The stages are the real modules (ldm ``Decoder``/``Encoder``
of the SD1.x layout, a spandrel ESRGAN ``RRDBNet`` loaded from a file) with random weights.

**Scaling, so that this CPU can run it.** A GPU runs these stages in FP16 at full channel width;
here they run in FP32 at 1/4 of the channels (VAE ``ch`` 32 instead of 128, RRDB 16 features
instead of 64 and 6 blocks instead of 23). Activation bytes scale with the channel count times the
element size: 1/4 x 2 = 1/2. So a card of N GB is emulated as N/2 GiB, and the weights a WebUI
keeps on the card during these stages (an SD1.5 checkpoint in FP16: 2.1 GB) are resident as half
that. Image sizes are the real ones. The plain stage is the module's own forward on the whole
input (what the WebUI does without VRAM Guard); the guarded one is VRAM Guard's engine in auto mode
(exact VAE tiling, automatic upscale tiles), planning from the card's free memory.

Each record: ``stage, image_px, card_gb, card_bytes, resident_bytes, plain_ok, plain_error,
guarded_ok, plan, peak_bytes, peak_over_cap, psnr_db, max_err, max_err_lsb, cpu_ratio,
seconds`` (``cpu_ratio``: the guarded run's process CPU time over the uncapped plain run's;
fidelity against the uncapped plain output). ``--overhead`` adds the emulation's own cost on a
full-size SD VAE decode and a full-size RRDB upscale (the same plain forward with and without a
card big enough never to refuse).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import time

from lib_vram.cli.common import MAX_CARD_BYTES, int_list

from .vae import SD_VAE

MAX_CARD_GB = MAX_CARD_BYTES // 2**30

HELP = "Emulated 4/6/8 GB cards: each stage plain vs VRAM Guard (OK/OOM, plan, peak/cap, fidelity, CPU time)."

GB = 1024**3
SCALE = 0.5
"""Emulated bytes per real byte: FP32 (x2) at 1/4 channel width (x1/4)."""
RESIDENT_REAL = int(2.1 * GB)
"""An SD1.5 checkpoint in FP16 (UNet 1.72 GB + text encoder 0.25 GB + VAE 0.16 GB), on the card."""
CARDS = (4, 6, 8)
VAE_FULL = SD_VAE
VAE_NARROW = {**SD_VAE, "ch": 32}

FULL = {"vae_decode": (1024, 1536, 2048), "vae_encode": (1024, 2048), "upscale": (512, 768, 1024)}
QUICK = {"vae_decode": (512, 1024), "vae_encode": (1024,), "upscale": (768,)}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller images (a few minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON record per case")
    parser.add_argument(
        "--cards",
        type=int_list("--cards", 1, MAX_CARD_GB, why="1 TiB", unit="GB"),
        default="4,6,8",
        help=f"card sizes in GB (default 4,6,8; each 1 to {MAX_CARD_GB})",
    )
    parser.add_argument("--stages", default=None, help="comma-separated: vae_decode,vae_encode,upscale")
    parser.add_argument(
        "--overhead", action="store_true", help="also measure the emulation's own CPU cost (full-size models)"
    )


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())


def _ldm(kind: str, cfg: dict):
    import torch

    with _quiet():
        from ldm.modules.diffusionmodules.model import Decoder, Encoder

        torch.manual_seed(0)
        cls = Decoder if kind == "decoder" else Encoder
        extra = {"double_z": True} if kind == "encoder" else {}
        return cls(**cfg, **extra).eval()


def _image(px: int, channels: int = 3, seed: int = 0):
    from ._synthetic import image_like

    return image_like(px, px, channels, seed)


def _latent(px: int):
    import torch

    img = _image(px // 8, 4, seed=3) * 4 - 2  # image-like, in the range of scaled SD latents
    return img + 0.1 * torch.randn(img.shape, generator=torch.Generator().manual_seed(4))


def _rrdb(tmp: str, full: bool = False):
    import spandrel
    import torch
    from safetensors.torch import save_file

    from ._synthetic import make_imagelike_rrdb, rrdb_class

    torch.manual_seed(0)
    nf, nb = (64, 23) if full else (16, 6)
    net = make_imagelike_rrdb(rrdb_class()(in_nc=3, out_nc=3, num_filters=nf, num_blocks=nb, scale=4))
    path = f"{tmp}/rrdb_{nf}_{nb}.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, path)
    return spandrel.ModelLoader().load_from_file(path)


def _fidelity(out, ref, data_range: float) -> dict:
    import torch

    err = (out.float() - ref.float()).abs()
    mse = float((err**2).mean())
    psnr = math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse)
    to8 = 255.0 / data_range
    lsb = int(((out.float() * to8).round() - (ref.float() * to8).round()).abs().max())
    return {"psnr_db": round(psnr, 2) if math.isfinite(psnr) else None, "max_err": float(err.max()),
            "max_err_lsb": lsb, "finite": bool(torch.isfinite(out).all())}  # fmt: skip


def _timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def _stage_fns(stage: str, px: int, tmp: str):
    """(module whose weights are on the card, plain(), guarded(report_list), data range)."""
    import torch

    from lib_vram.planning import planner
    from lib_vram.upscale import UpscaleReport, upscale_tensor
    from lib_vram.vae import TiledVAEConfig, VAEReport, tiled_decode, tiled_encode

    if stage in ("vae_decode", "vae_encode"):
        kind = "decoder" if stage == "vae_decode" else "encoder"
        mod = _ldm(kind, VAE_NARROW)
        x = _latent(px) if kind == "decoder" else _image(px) * 2 - 1
        fn = tiled_decode if kind == "decoder" else tiled_encode

        def plain():
            with torch.no_grad():
                return mod(x)

        def guarded(reports):
            rep = VAEReport()
            reports.append(rep)
            out = fn(mod, x, config=TiledVAEConfig(mode="auto"), report=rep, original_forward=mod.forward,
                     memory=planner.PlanMemory())  # fmt: skip
            return out

        return mod, plain, guarded, 2.0
    desc = _rrdb(tmp)
    x = _image(px)

    def plain_up():
        with torch.inference_mode():
            return desc(x)

    def guarded_up(reports):
        rep = UpscaleReport()
        reports.append(rep)
        return upscale_tensor(desc, x, report=rep, memory=planner.PlanMemory())

    return desc.model, plain_up, guarded_up, 1.0


def _plan_of(rep) -> str:
    plan = getattr(rep, "plan", "") or ""
    retries = getattr(rep, "oom_retries", None) or getattr(rep, "events", None)
    return f"{plan} (after OOM: {retries})" if retries else plan


def run_stage(stage: str, px: int, cards: list[int], tmp: str) -> list[dict]:
    import torch

    from lib_vram.core.device import is_oom_error, release
    from lib_vram.core.emulate import EmulatedCard, install

    module, plain, guarded, data_range = _stage_fns(stage, px, tmp)
    ref, _, ref_cpu = _timed(plain)
    records = []
    for gb in cards:
        cap = int(gb * GB * SCALE)
        resident = int(RESIDENT_REAL * SCALE) + EmulatedCard(1, resident=[module]).resident_bytes
        rec = {"stage": stage, "image_px": px, "card_gb": gb, "card_bytes": cap, "resident_bytes": resident,
               "scale": SCALE}  # fmt: skip
        card = EmulatedCard(cap, resident=resident, label=f"emulated {gb} GB card (x{SCALE} scale)")
        try:
            with card:
                out = plain()
            rec["plain_ok"], rec["plain_error"] = True, None
            del out
        except Exception as exc:  # the card's OOM, or anything else (recorded, not hidden)
            if not is_oom_error(exc):
                raise
            rec["plain_ok"], rec["plain_error"] = False, str(exc).split(".")[0]
        rec["plain_peak_bytes"] = card.peak_bytes
        release()
        card = EmulatedCard(cap, resident=resident, label=f"emulated {gb} GB card (x{SCALE} scale)")
        previous = install(card)
        reports: list = []
        try:
            with card:
                out, secs, cpu = _timed(lambda reports=reports: guarded(reports))
            rec.update(guarded_ok=True, plan=_plan_of(reports[-1]), seconds=round(secs, 2),
                       cpu_ratio=round(cpu / ref_cpu, 3))  # fmt: skip
            rec.update(_fidelity(out, ref, data_range))
            del out
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            rec.update(
                guarded_ok=False, plan=_plan_of(reports[-1]) if reports else None, error=str(exc)[:200]
            )
        finally:
            install(previous)
        rec["peak_bytes"] = card.peak_bytes
        rec["peak_over_cap"] = round(card.peak_bytes / cap, 3)
        records.append(rec)
        release()
    del ref
    torch.manual_seed(0)
    return records


def overhead(tmp: str) -> list[dict]:
    """The emulation's own CPU cost: the same plain forward with and without a card that never refuses."""
    import torch

    from lib_vram.core.emulate import EmulatedCard

    dec = _ldm("decoder", VAE_FULL)
    z = _latent(512)
    desc = _rrdb(tmp, full=True)
    img = _image(128)

    def vae():
        with torch.no_grad():
            return dec(z)

    def up():
        with torch.inference_mode():
            return desc(img)

    out = []
    for name, fn in (("full SD VAE decode 512²", vae), ("full RRDB x4 upscale 128²", up)):
        fn()  # warm-up (oneDNN primitives, page faults)
        _, t_plain, c_plain = _timed(fn)
        with EmulatedCard("1024GB") as card:
            _, t_card, c_card = _timed(fn)
        out.append({"stage": "overhead", "case": name, "cpu_s_plain": round(c_plain, 2),
                    "cpu_s_emulated": round(c_card, 2), "cpu_ratio": round(c_card / c_plain, 3),
                    "wall_ratio": round(t_card / t_plain, 3),
                    "counted_peak_bytes": card.peak_bytes})  # fmt: skip
    return out


def _table(records: list[dict]) -> str:
    head = "| stage | image | card | plain | VRAM Guard | plan | peak/cap | PSNR | max LSB | CPU vs plain |"
    lines = [head, "|" + "---|" * 10]
    for r in records:
        if r["stage"] == "overhead":
            continue
        psnr = "∞" if r.get("guarded_ok") and r.get("psnr_db") is None else r.get("psnr_db", "—")
        lines.append(
            f"| {r['stage']} | {r['image_px']}² | {r['card_gb']} GB | {'OK' if r['plain_ok'] else 'OOM'} | "
            f"{'OK' if r['guarded_ok'] else 'OOM'} | {r.get('plan') or '—'} | {r['peak_over_cap']:.2f} | "
            f"{psnr} | {r.get('max_err_lsb', '—')} | {r.get('cpu_ratio', '—')} |"
        )
    over = [r for r in records if r["stage"] == "overhead"]
    if over:
        lines += ["", "| emulation overhead | CPU s plain | CPU s on the card | ratio |", "|---|---|---|---|"]
        lines += [
            f"| {r['case']} | {r['cpu_s_plain']} | {r['cpu_s_emulated']} | {r['cpu_ratio']} |" for r in over
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import tempfile

    sizes = QUICK if args.quick else FULL
    stages = args.stages.split(",") if args.stages else list(sizes)
    unknown = set(stages) - set(FULL)
    if unknown:
        raise ValueError(f"`--stages`: unknown {sorted(unknown)}; choose from {sorted(FULL)}")
    cards = [int(c) for c in args.cards.split(",")]
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages:
            for px in sizes[stage]:
                for rec in run_stage(stage, px, cards, tmp):
                    records.append(rec)
                    if args.json:
                        print(json.dumps(rec), flush=True)
        if args.overhead:
            for rec in overhead(tmp):
                records.append(rec)
                if args.json:
                    print(json.dumps(rec), flush=True)
    if not args.json:  # --json: the records only, one per line
        print(_table(records))
    return 0
