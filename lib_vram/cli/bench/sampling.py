"""``python -m lib_vram bench sampling``: one UNet sampling step on emulated 4/6/8 GB cards, the
plain WebUI's way (the whole cond/uncond batch in one forward, the idle VAE and text encoders
resident) against VAE Guard's plan (the idle models off the card when the step does not fit beside
them; the largest micro-batch that fits), then the streamed cases of
:mod:`lib_vram.cli.bench.sampling_stream` (a UNet that does not fit beside one micro-batch: bytes
moved per step against ``--lowvram``'s; their records add ``unet_bytes``, ``resident_bytes``,
``bytes_moved_per_step``, ``lowvram_bytes_per_step``).

Models: the real ldm ``UNetModel`` at reduced width (``model_channels`` 32; SD1.5-shaped and
SDXL-shaped, :data:`lib_vram.cli.bench._unet.SHAPES`), float32 on the CPU under the emulated card
(:class:`lib_vram.core.emulate.EmulatedCard`: the real out-of-memory error). Scaling: a reduced
model does not shrink every term alike (weights by ~width², convolution activations by width,
attention scores not at all), so each case scales the card by its own factor
``f = reduced plain peak / full-size plain peak`` (both from :func:`lib_vram.sampling.estimate_sampling`:
the reduced model in float32 on the CPU backend, the full-size SD1.5/SDXL UNet in float16 on
CUDA), and the idle VAE + text encoders' bytes by the same ``f``: the plain step fits the scaled
card exactly when the full-size one fits the real card. The guarded step is planned by
:func:`lib_vram.sampling.plan_sampling` for the reduced model on the scaled card and run through
:func:`lib_vram.sampling.micro_batched`. Cases run in this process, one after another.
"""

from __future__ import annotations

import argparse
import json
import time

HELP = (
    "Sampling step: plain vs VRAM Guard's plan (idle models off, micro-batch, streamed UNet) on "
    "emulated cards."
)

GiB = 1 << 30
CARDS = (4, 6, 8)
# (shape, latent h, w, UNet batch, attention)
QUICK = (
    ("sd15", 48, 48, 8, "none"),
    ("sdxl", 96, 96, 8, "none"),
)
FULL = QUICK + (
    ("sd15", 48, 48, 8, "sdp"),
    ("sdxl", 96, 96, 8, "sdp"),
    ("sd15", 48, 48, 8, "doggettx"),
    ("sd15", 48, 48, 8, "sub-quadratic"),
    ("sd15", 32, 32, 4, "none"),
    ("sdxl", 96, 96, 8, "doggettx"),
    ("sdxl", 64, 64, 4, "none"),
)
TOKENS = 77
CTX = 96


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="two base cases (ldm's attention; SD1.5, SDXL shapes) on the three cards",
    )
    parser.add_argument("--json", action="store_true", help="print JSON records only")


def _idle_bytes(shape: str) -> int:
    """The full-size idle models during sampling (fp16): the VAE and the text encoders."""
    import torch

    from lib_vram.cli.stageplan import reference_vae
    from lib_vram.core.predict import weights_bytes
    from lib_vram.planning.reference import vae_arch

    vae = sum(weights_bytes(reference_vae(shape, k), torch.float16) for k in ("decode", "encode"))
    return vae + vae_arch(shape).text_encoder_bytes


def _case_records(shape: str, h: int, w: int, batch: int, attention: str, unet, spec) -> list[dict]:
    import torch

    from lib_vram.core.emulate import EmulatedCard
    from lib_vram.core.predict import weights_bytes
    from lib_vram.planning import planner
    from lib_vram.sampling import estimate_sampling, micro_batched, plan_sampling, reference_spec

    from ._unet import attention_applied, context_arg, host_forward

    kw = dict(batch=batch, latent_hw=(h, w), context_tokens=TOKENS, attention=attention)
    red = estimate_sampling(spec, dtype=torch.float32, backend="cpu", **kw)
    full = estimate_sampling(reference_spec(shape), dtype=torch.float16, backend="cuda", **kw)
    f = red.peak_bytes / full.peak_bytes
    idle = int(_idle_bytes(shape) * f)
    w_bytes = weights_bytes(unet)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(batch, 4, h, w, generator=gen)
    c0 = torch.randn(batch, TOKENS, CTX, generator=gen)
    t0 = torch.linspace(10, 900, batch)

    def forward(card, fn_micro=None):
        """One step on ``card``: (output or None on out-of-memory, CPU seconds, peak)."""
        probe = (lambda: float(card.free_bytes)) if card is not None else (lambda: float(1 << 50))
        fwd = host_forward(attention, probe, "cpu")
        ctx = card if card is not None else _Null()
        start = time.process_time()
        try:
            with attention_applied(unet, fwd), ctx, torch.no_grad():
                x, t, c = x0.clone(), t0.clone(), c0.clone()  # the sampler's inputs, on the card
                run = fn_micro(unet) if fn_micro is not None else unet
                out = run(x, t, context=context_arg(shape, c))
                del x, t, c
        except torch.OutOfMemoryError:
            return None, time.process_time() - start
        return out, time.process_time() - start

    ref, plain_s = forward(None)
    out = []
    for gb in CARDS:
        cap = int(gb * GiB * f)
        plain_card = EmulatedCard(cap, resident=w_bytes + idle)
        got, _ = forward(plain_card)
        plain_ok = got is not None
        del got
        memory = planner.PlanMemory()
        plan = plan_sampling(spec, dtype=torch.float32, budget_bytes=cap, resident_bytes=idle, backend="cpu",
                             memory=memory, **kw)  # fmt: skip
        moved = ""
        if not plan.fits:
            off = plan_sampling(spec, dtype=torch.float32, budget_bytes=cap, resident_bytes=0, backend="cpu",
                                memory=memory, **kw)  # fmt: skip
            plan, moved = off, "VAE, text encoders"
        card = EmulatedCard(cap, resident=w_bytes + (0 if moved else idle))
        wrapped = {}

        def micro(u, plan=plan, wrapped=wrapped, memory=memory):
            wrapped["w"] = micro_batched(u, plan.micro_batch, key=plan.key, memory=memory)
            return wrapped["w"]

        got, guarded_s = forward(card, micro)
        rec = {
            "stage": "sample",
            "shape": shape,
            "latent": [h, w],
            "batch": batch,
            "attention": attention,
            "card_gib": gb,
            "scale": f,
            "card_bytes": cap,
            "plain_ok": plain_ok,
            "guarded_ok": got is not None,
            "plan": plan.label + (f"; {moved} off" if moved else ""),
            "moved_off": moved,
            "micro_batch": wrapped["w"].micro_batch if "w" in wrapped else plan.micro_batch,
            "fits_predicted": plan.fits,
            "predicted_bytes": plan.predicted_peak_bytes,
            "peak_bytes": card.peak_bytes,
            "cpu_ratio": guarded_s / plain_s if plain_s > 0 else None,
            "max_abs_diff": float((got - ref).abs().max()) if got is not None else None,
        }
        out.append(rec)
        del got
    return out


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def records(quick: bool) -> list[dict]:
    from lib_vram.sampling import unet_spec

    from ._unet import build_unet

    models = {}
    out = []
    for shape, h, w, batch, attention in QUICK if quick else FULL:
        if shape not in models:
            unet = build_unet(shape, 32, context_dim=CTX)
            models[shape] = (unet, unet_spec(unet))
        unet, spec = models[shape]
        out += _case_records(shape, h, w, batch, attention, unet, spec)
    return out


def run(args: argparse.Namespace) -> int:
    from .sampling_stream import stream_cases, table

    recs = records(args.quick)
    streamed = stream_cases(args.quick)
    if args.json:
        print(json.dumps(recs + streamed, indent=2))
        return 0
    print(format_table(recs))
    print()
    print("Streamed UNet (the plan's last rung when even micro-batch 1 does not fit beside the whole UNet):")
    print(table(streamed))
    return 0


def format_table(recs: list[dict]) -> str:
    mib = 1 << 20
    lines = []
    lines.append(
        "Sampling step, real ldm UNetModel at model_channels 32 (float32, CPU) on emulated cards; each "
        "case's card and idle models scaled by f = reduced plain peak / full-size (fp16) plain peak"
    )
    lines.append(
        "| shape | latent | batch | attention | card | f | plain | VRAM Guard's plan | guarded | "
        "predicted MiB | measured MiB | CPU guarded/plain |"
    )
    lines.append("|---|---|---:|---|---:|---:|---|---|---|---:|---:|---:|")
    for r in recs:
        ratio = "" if r["cpu_ratio"] is None else f"{r['cpu_ratio']:.2f}"
        lines.append(
            f"| {r['shape']} | {r['latent'][0]}x{r['latent'][1]} | {r['batch']} | {r['attention']} | "
            f"{r['card_gib']} GB ({r['card_bytes'] / mib:.0f} MiB) | {r['scale']:.4f} | "
            f"{'OK' if r['plain_ok'] else 'OOM'} | {r['plan']} | {'OK' if r['guarded_ok'] else 'OOM'} | "
            f"{r['predicted_bytes'] / mib:.1f} | {r['peak_bytes'] / mib:.1f} | {ratio} |"
        )
    return "\n".join(lines)
