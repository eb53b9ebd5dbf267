"""``python -m lib_vram bench sampling``: one UNet sampling step on emulated 4/6/8 GB cards, plain vs
VRAM Guard's plan, then the cases of :mod:`.sampling_stream` and those with one ControlNet unit.
Method: docs/benchmarks.md, "Sampling step".
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from lib_vram.core.emulate import EmulatedCard
from lib_vram.core.predict import weights_bytes
from lib_vram.planning import planner
from lib_vram.planning.reference import vae_arch
from lib_vram.sampling import micro_batched, plan_sampling, reference_control, reference_spec, unet_spec
from lib_vram.sampling._estimate import Step

from ..models.controlnet import ControlNet, controlled
from ..models.unet import attention_applied, build_unet, context_arg, host_forward
from . import sampling_stream
from ._harness import Bench, attempt, mib_of, ok, runner, table

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
# no attention optimization; at full size the plain step with ControlNet and the idle VAE and text
# encoders needs 5.2 GiB (SD1.5 448 px, 2 images: out of memory on 4 GB, not on 6 GB) and 9.1 GiB
# (SDXL 512 px, 1 image, its 2386 MiB ControlNet: out of memory on every card)
CONTROL_CASES = (("sd15", 56, 56, 4, "none"), ("sdxl", 64, 64, 2, "none"))
STEPS = 20
"""The sampling steps a job runs (the bytes VRAM Guard moves per pass, per step)."""
TOKENS = 77
CTX = 96


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two base cases (ldm's attention; SD1.5, "
                        "SDXL shapes) on the three cards")  # fmt: skip


def bench(args: argparse.Namespace) -> Bench:
    step, models = QUICK if args.quick else FULL, {}
    streamed = sampling_stream.cases(args.quick)
    controls = [("controlnet", *c) for c in CONTROL_CASES]

    def run_case(case: tuple) -> list[dict]:
        if case in streamed:
            return [sampling_stream.run_one(case)]
        control = case in controls
        return case_records(case[1:] if control else case, models, control)

    def label(case: tuple) -> str:
        return "streamed: " + sampling_stream.label(case) if case in streamed else " ".join(map(str, case))

    return Bench([*step, *streamed, *controls], run_case, _table, lines=False, label=label)


def case_records(case: tuple, models: dict, control: bool = False) -> list[dict]:
    """The step plain, then as planned, on each card scaled by f (``models``: those built so far;
    ``control``: with one ControlNet unit; plain: its model on the card beside everything)."""
    from lib_vram.cli.stageplan import vae_weights

    shape, h, w, batch, attention = case
    idle_full = sum(vae_weights(shape, "fp16")) + vae_arch(shape).text_encoder_bytes  # VAE, text encoders
    unet = models[shape] = models.get(shape) or build_unet(shape, 32, context_dim=CTX)
    if control:
        models["controlnet", shape] = models.get(("controlnet", shape)) or ControlNet(unet)
    nets = [unet, models["controlnet", shape]] if control else [unet]
    spec, controls = unet_spec(unet), tuple(unet_spec(n) for n in nets[1:])
    full_controls = (reference_control(shape),) if control else ()

    def plain(spec, controls, dtype, backend):  # noqa: ANN001, ANN202
        """The plain step's peak (everything on the card, one forward) and the UNet's estimate."""
        s = Step(spec, batch, (h, w), TOKENS, attention, dtype, backend, controls)
        act, est = s.activation(batch, None)
        return s.weights_bytes + s.control_bytes + s.input_bytes + act, est

    peak, est = plain(spec, controls, torch.float32, "cpu")
    f = peak / plain(reference_spec(shape), full_controls, torch.float16, "cuda")[0]
    idle = int(idle_full * f)
    kw = dict(batch=batch, latent_hw=(h, w), context_tokens=TOKENS, attention=attention, dtype=torch.float32,
              backend="cpu", controls=controls)  # fmt: skip
    resident = sum(weights_bytes(n) for n in nets)
    gen = torch.Generator().manual_seed(0)
    x0, c0 = torch.randn(batch, 4, h, w, generator=gen), torch.randn(batch, TOKENS, CTX, generator=gen)
    hint0 = torch.rand(1, 3, 8 * h, 8 * w, generator=gen) if control else None
    t0 = torch.linspace(10, 900, batch)

    def forward(card, plan=None, memory=None, wrapped=None):  # noqa: ANN001, ANN202
        probe = (lambda: float(card.free_bytes)) if card is not None else (lambda: float(1 << 50))

        def step():  # noqa: ANN202
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for net in nets:
                    stack.enter_context(attention_applied(net, host_forward(attention, probe, "cpu")))
                x, t, c = x0.clone(), t0.clone(), c0.clone()  # the sampler's inputs, on the card
                run = unet
                if control:
                    hint = hint0.clone()
                    run = lambda x, t, context: controlled(unet, nets[1:], [hint], x, t, context)  # noqa: E731
                if plan is not None:  # the plan's micro-batches (through the hook: each its rows' control)
                    run = wrapped["w"] = micro_batched(run, plan.micro_batch, key=plan.key, memory=memory)
                return run(x, t, context=context_arg(shape, c))

        return attempt(step, card)

    ref, out = forward(None), []
    for gb in CARDS:
        cap, memory = int(gb * GiB * f), planner.PlanMemory()
        plain_ok = forward(EmulatedCard(cap, resident=resident + idle)).ok
        plan = plan_sampling(spec, budget_bytes=cap, resident_bytes=idle, memory=memory, **kw)
        moved = not plan.fits
        if moved:
            plan = plan_sampling(spec, budget_bytes=cap, resident_bytes=0, memory=memory, **kw)
        card, wrapped = EmulatedCard(cap, resident=resident + (0 if moved else idle)), {}
        got = forward(card, plan, memory, wrapped)
        off = "VAE, text encoders" if moved else ""
        label = plan.label + (", 1 ControlNet unit on the card" if control else "") + (f"; {off} off" * moved)
        rec = {
            "stage": "controlnet" if control else "sample", "shape": shape, "latent": [h, w], "batch": batch,
            "attention": attention, "card_gib": gb, "scale": f, "card_bytes": cap, "plain_ok": plain_ok,
            "guarded_ok": got.ok, "predicted_bytes": plan.predicted_peak_bytes, "peak_bytes": card.peak_bytes,
            "max_abs_diff": float((got.out - ref.out).abs().max()) if got.ok else None, "plan": label,
        }  # fmt: skip
        if control:
            c_full = full_controls[0].params * 2
            out.append({
                **rec, "controlnet_bytes": c_full, "controlnet_resident_bytes": c_full,
                "bytes_moved_per_step": (2 * c_full + (2 * idle_full if moved else 0)) // STEPS,
                "controlnet_lowvram_bytes_per_step": 2 * c_full, "steps": STEPS,
                "unet_activation_bytes": est.activation_bytes,
            })  # fmt: skip
        else:
            micro = wrapped["w"].micro_batch if "w" in wrapped else plan.micro_batch
            out.append({
                **rec, "moved_off": off, "micro_batch": micro, "fits_predicted": plan.fits,
                "cpu_ratio": got.cpu_seconds / ref.cpu_seconds if ref.cpu_seconds > 0 else None,
            })  # fmt: skip
    return out


def _table(records: list[dict]) -> str:
    head = [
        "shape", ("latent", lambda r: f"{r['latent'][0]}x{r['latent'][1]}"), "batch", "attention",
        ("card", lambda r: f"{r['card_gib']} GB ({r['card_bytes'] / 2**20:.0f} MiB)"),
    ]  # fmt: skip
    plan = [("VRAM Guard's plan", lambda r: r["plan"]), ("guarded", ok("guarded_ok")),
            ("predicted MiB", mib_of("predicted_bytes")), ("measured MiB", mib_of("peak_bytes"))]  # fmt: skip
    ratio = ("CPU guarded/plain", lambda r: "" if r["cpu_ratio"] is None else f"{r['cpu_ratio']:.2f}")
    step = [*head, ("f", lambda r: f"{r['scale']:.4f}"), ("plain", ok("plain_ok")), *plan, ratio]
    control = [*head, ("plain", ok("plain_ok")), *plan,
               ("moved/step (full size)", mib_of("bytes_moved_per_step", 0, " MiB")),
               ("Low VRAM moves/step", mib_of("controlnet_lowvram_bytes_per_step", 0, " MiB"))]  # fmt: skip
    by = {k: [r for r in records if r["stage"] == k] for k in ("sample", "controlnet")}
    streamed = [r for r in records if r["stage"] not in by]
    return (
        "Sampling step, real ldm UNetModel at model_channels 32 (float32, CPU) on emulated cards; each "
        "case's card and idle models scaled by f = reduced plain peak / full-size (fp16) plain peak\n"
        + table(step, by["sample"])
        + "\n\nStreamed UNet (the plan's last rung when even micro-batch 1 does not fit beside the whole "
        "UNet):\n"
        + sampling_stream.table(streamed)
        + "\n\nWith one ControlNet unit (cldm layout over the UNet's encoder; plain: ControlNet's model "
        "on the card beside everything, as it keeps it; its Low VRAM has the same peak in the forward):\n"
        + table(control, by["controlnet"])
    )


run = runner(bench)
