"""``python -m lib_vram bench sampling``: one UNet sampling step on emulated 4/6/8 GB cards, the
plain WebUI's way (the whole cond/uncond batch in one forward, the idle VAE and text encoders
resident) against VRAM Guard's plan (the idle models off when the step does not fit beside them;
the largest micro-batch that fits), then the streamed cases of :mod:`.sampling_stream` and the
ControlNet cases of :mod:`._controlnet`.

Models: the real ldm ``UNetModel`` at ``model_channels`` 32 (:data:`._unet.SHAPES`), float32 on
the CPU under :class:`~lib_vram.core.emulate.EmulatedCard`. Each case scales the card and the idle
models by ``f = reduced plain peak / full-size plain peak`` (both from
:func:`lib_vram.sampling.estimate_sampling`), so the plain step fits the scaled card exactly when
the full-size one fits the real card. Method: docs/benchmarks.md, "Sampling step".
"""

from __future__ import annotations

import argparse

import torch

from lib_vram.core.emulate import EmulatedCard
from lib_vram.core.predict import weights_bytes
from lib_vram.planning import planner
from lib_vram.planning.reference import vae_arch
from lib_vram.sampling import estimate_sampling, micro_batched, plan_sampling, reference_spec, unet_spec

from . import _controlnet, sampling_stream
from ._harness import Bench, attempt, runner, table

HELP = (
    "Sampling step: plain vs VRAM Guard's plan (idle models off, micro-batch, streamed UNet) on "
    "emulated cards."
)

GiB = 1 << 30
CARDS = (4, 6, 8)
# (shape, latent h, w, UNet batch, attention)
QUICK = (("sd15", 48, 48, 8, "none"), ("sdxl", 96, 96, 8, "none"))
FULL = QUICK + (
    ("sd15", 48, 48, 8, "sdp"), ("sdxl", 96, 96, 8, "sdp"), ("sd15", 48, 48, 8, "doggettx"),
    ("sd15", 48, 48, 8, "sub-quadratic"), ("sd15", 32, 32, 4, "none"), ("sdxl", 96, 96, 8, "doggettx"),
    ("sdxl", 64, 64, 4, "none"),
)  # fmt: skip
TOKENS = 77
CTX = 96


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two base cases (ldm's attention; SD1.5, "
                        "SDXL shapes) on the three cards")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON records only")


def bench(args: argparse.Namespace) -> Bench:
    step, models = QUICK if args.quick else FULL, {}
    streamed = sampling_stream.cases(args.quick)

    controls = [("controlnet", *c) for c in _controlnet.CASES]

    def run_case(case: tuple) -> list[dict]:
        if case in controls:
            return _controlnet.records(case[1:], models, _idle_bytes(case[1]))
        return _case_records(*case, models) if case in step else [sampling_stream.run_one(case)]

    def label(case: tuple) -> str:
        return "streamed: " + sampling_stream.label(case) if case in streamed else " ".join(map(str, case))

    return Bench([*step, *streamed, *controls], run_case, _table, lines=False, label=label)


def records(quick: bool) -> list[dict]:
    """The sampling-step records (without the streamed ones), in this process."""
    models: dict = {}
    return [r for case in (QUICK if quick else FULL) for r in _case_records(*case, models)]


def _idle_bytes(shape: str) -> int:
    """The full-size idle models during sampling (fp16): the VAE and the text encoders."""
    from lib_vram.cli.stageplan import reference_vae

    vae = sum(weights_bytes(reference_vae(shape, k), torch.float16) for k in ("decode", "encode"))
    return vae + vae_arch(shape).text_encoder_bytes


def _case_records(shape: str, h: int, w: int, batch: int, attention: str, models: dict) -> list[dict]:
    """One case on each card (``models``: the UNets built so far, by shape)."""

    from ._unet import attention_applied, build_unet, context_arg, host_forward

    if shape not in models:
        unet = build_unet(shape, 32, context_dim=CTX)
        models[shape] = (unet, unet_spec(unet))
    unet, spec = models[shape]
    kw = dict(batch=batch, latent_hw=(h, w), context_tokens=TOKENS, attention=attention)
    red = estimate_sampling(spec, dtype=torch.float32, backend="cpu", **kw)
    full = estimate_sampling(reference_spec(shape), dtype=torch.float16, backend="cuda", **kw)
    f = red.peak_bytes / full.peak_bytes
    idle, w_bytes = int(_idle_bytes(shape) * f), weights_bytes(unet)
    gen = torch.Generator().manual_seed(0)
    x0, c0 = torch.randn(batch, 4, h, w, generator=gen), torch.randn(batch, TOKENS, CTX, generator=gen)
    t0 = torch.linspace(10, 900, batch)

    def forward(card, fn_micro=None):  # noqa: ANN001, ANN202
        """One step on ``card``: the :class:`Attempt` (its output None on out-of-memory)."""
        probe = (lambda: float(card.free_bytes)) if card is not None else (lambda: float(1 << 50))

        def step():  # noqa: ANN202
            with attention_applied(unet, host_forward(attention, probe, "cpu")), torch.no_grad():
                x, t, c = x0.clone(), t0.clone(), c0.clone()  # the sampler's inputs, on the card
                run = fn_micro(unet) if fn_micro is not None else unet
                return run(x, t, context=context_arg(shape, c))

        return attempt(step, card)

    plain = forward(None)
    ref = plain.out
    out = []
    for gb in CARDS:
        cap = int(gb * GiB * f)
        plain_ok = forward(EmulatedCard(cap, resident=w_bytes + idle)).ok
        memory = planner.PlanMemory()
        plan = plan_sampling(spec, dtype=torch.float32, budget_bytes=cap, resident_bytes=idle, backend="cpu",
                             memory=memory, **kw)  # fmt: skip
        moved = ""
        if not plan.fits:
            plan = plan_sampling(spec, dtype=torch.float32, budget_bytes=cap, resident_bytes=0, backend="cpu",
                                 memory=memory, **kw)  # fmt: skip
            moved = "VAE, text encoders"
        card, wrapped = EmulatedCard(cap, resident=w_bytes + (0 if moved else idle)), {}

        def micro(u, plan=plan, wrapped=wrapped, memory=memory):  # noqa: ANN001, ANN202
            wrapped["w"] = micro_batched(u, plan.micro_batch, key=plan.key, memory=memory)
            return wrapped["w"]

        got = forward(card, micro)
        out.append({
            "stage": "sample", "shape": shape, "latent": [h, w], "batch": batch, "attention": attention,
            "card_gib": gb, "scale": f, "card_bytes": cap, "plain_ok": plain_ok, "guarded_ok": got.ok,
            "plan": plan.label + (f"; {moved} off" if moved else ""), "moved_off": moved,
            "micro_batch": wrapped["w"].micro_batch if "w" in wrapped else plan.micro_batch,
            "fits_predicted": plan.fits, "predicted_bytes": plan.predicted_peak_bytes,
            "peak_bytes": card.peak_bytes,
            "cpu_ratio": got.cpu_seconds / plain.cpu_seconds if plain.cpu_seconds > 0 else None,
            "max_abs_diff": float((got.out - ref).abs().max()) if got.ok else None,
        })  # fmt: skip
    return out


def _table(records: list[dict]) -> str:
    sample = [r for r in records if r["stage"] == "sample"]
    controls = [r for r in records if r["stage"] == "controlnet"]
    streamed = [r for r in records if r["stage"] not in ("sample", "controlnet")]
    cols = [
        "shape", ("latent", lambda r: f"{r['latent'][0]}x{r['latent'][1]}"), "batch", "attention",
        ("card", lambda r: f"{r['card_gib']} GB ({r['card_bytes'] / 2**20:.0f} MiB)"),
        ("f", lambda r: f"{r['scale']:.4f}"), ("plain", lambda r: "OK" if r["plain_ok"] else "OOM"),
        ("VRAM Guard's plan", lambda r: r["plan"]), ("guarded", lambda r: "OK" if r["guarded_ok"] else "OOM"),
        ("predicted MiB", lambda r: f"{r['predicted_bytes'] / 2**20:.1f}"),
        ("measured MiB", lambda r: f"{r['peak_bytes'] / 2**20:.1f}"),
        ("CPU guarded/plain", lambda r: "" if r["cpu_ratio"] is None else f"{r['cpu_ratio']:.2f}"),
    ]  # fmt: skip
    return (
        "Sampling step, real ldm UNetModel at model_channels 32 (float32, CPU) on emulated cards; each "
        "case's card and idle models scaled by f = reduced plain peak / full-size (fp16) plain peak\n"
        + table(cols, sample)
        + "\n\nStreamed UNet (the plan's last rung when even micro-batch 1 does not fit beside the whole "
        "UNet):\n"
        + sampling_stream.table(streamed)
        + "\n\nWith one ControlNet unit (cldm layout over the UNet's encoder; plain: ControlNet's model "
        "on the card beside everything, as it keeps it; its Low VRAM has the same peak in the forward):\n"
        + table(_controlnet.table_columns(), controls)
    )


run = runner(bench)
