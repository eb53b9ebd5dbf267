"""A ControlNet in cldm's layout over a real ldm UNet's encoder, the forward ControlNet's hook runs,
and ``bench sampling``'s ControlNet cases.

cldm's ``ControlNet`` (what sd-webui-controlnet loads for SD1.5/SDXL control models) is the UNet's
down path and middle block with its own weights, a zero convolution after each input block and
after the middle, and a hint block that takes the control image down 8x (:data:`HINT_BLOCK`).
:class:`ControlNet` builds that layout from a copy of a real ldm ``UNetModel``'s modules (this
project's own code; the extension is not a package). Its zero convolutions get random weights (a
zero convolution would make the control a no-op and hide a wrong residual).

:func:`controlled` is the UNet forward with ControlNet's residuals as the extension's hook computes
them (each unit on the whole batch, scaled and summed, added to the skips and the middle).

The bench cases: one sampling step with one ControlNet unit on emulated 4/6/8 GB cards, the plain
WebUI's way (ControlNet's model on the card beside everything: its default, and with its Low VRAM
the same peak during the forward) against VRAM Guard's plan (the control counted; the idle VAE and
text encoders off when it does not fit with them). Scaled like the sampling cases
(:mod:`.sampling`): the card and the idle models by ``f = reduced plain peak / full-size plain
peak``, both from the estimate with the control counted.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lib_vram.sampling._spec import HINT_BLOCK

GiB = 1 << 30
STEPS = 20
"""The sampling steps a job runs (the bytes VRAM Guard moves per pass, per step)."""
# (shape, latent h, w, UNet batch, attention): 448 px, 2 images, no attention optimization; at full
# size the plain step with ControlNet and the idle VAE and text encoders needs 5.2 GiB (the estimate):
# out of memory on a 4 GB card, not on 6 GB
CASES = (("sd15", 56, 56, 4, "none"),)


class ControlNet(nn.Module):
    """cldm's layout over a copy of ``unet``'s encoder (see the module docstring)."""

    def __init__(self, unet: nn.Module, hint_channels: int = 3, seed: int = 7) -> None:
        from ldm.modules.diffusionmodules.openaimodel import TimestepEmbedSequential

        super().__init__()
        torch.manual_seed(seed)
        self.in_channels, self.model_channels = unet.in_channels, unet.model_channels
        self.channel_mult, self.num_res_blocks = unet.channel_mult, unet.num_res_blocks
        self.time_embed = copy.deepcopy(unet.time_embed)
        self.input_blocks = copy.deepcopy(unet.input_blocks)
        self.middle_block = copy.deepcopy(unet.middle_block)
        convs = [_out_channels(b) for b in self.input_blocks]
        self.zero_convs = nn.ModuleList(TimestepEmbedSequential(nn.Conv2d(c, c, 1)) for c in convs)
        mid = _out_channels(self.middle_block)
        self.middle_block_out = TimestepEmbedSequential(nn.Conv2d(mid, mid, 1))
        layers: list[nn.Module] = []
        cin = hint_channels
        for cout, stride in HINT_BLOCK:
            layers += [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.SiLU()]
            cin = cout
        self.input_hint_block = TimestepEmbedSequential(
            *layers, nn.Conv2d(cin, self.model_channels, 3, padding=1)
        )
        for p in (*self.zero_convs.parameters(), *self.middle_block_out.parameters()):
            nn.init.normal_(p, std=0.05)
        self.eval()

    def forward(self, x, hint, timesteps, context, y=None, **kwargs):  # noqa: ANN001, ANN201
        from ldm.modules.diffusionmodules.util import timestep_embedding

        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels, repeat_only=False))
        guided = self.input_hint_block(hint, emb, context)
        outs, h = [], x
        for module, zero_conv in zip(self.input_blocks, self.zero_convs):
            h = module(h, emb, context)
            if guided is not None:
                h += guided
                guided = None
            outs.append(zero_conv(h, emb, context))
        h = self.middle_block(h, emb, context)
        outs.append(self.middle_block_out(h, emb, context))
        return outs


def _out_channels(block: nn.Module) -> int:
    return [m.out_channels for m in block.modules() if isinstance(m, nn.Conv2d)][-1]


def controlled(unet, controls, hints, x, timesteps, context, weights=None):  # noqa: ANN001, ANN201
    """The UNet's forward with the residuals of ``controls`` (run on ``hints``), as
    sd-webui-controlnet's hook computes them; ``controls`` empty: the UNet's own forward."""
    from ldm.modules.diffusionmodules.util import timestep_embedding

    total = None
    for i, (control, hint) in enumerate(zip(controls, hints)):
        w = 1.0 if weights is None else weights[i]
        outs = [c * w for c in control(x=x, hint=hint, timesteps=timesteps, context=context)]
        total = outs if total is None else [c + t for c, t in zip(outs, total)]
    forward = unet.__dict__.get("_original_forward", unet.forward)
    if total is None:
        return forward(x, timesteps=timesteps, context=context)
    emb = unet.time_embed(timestep_embedding(timesteps, unet.model_channels, repeat_only=False))
    hs, h = [], x
    for module in unet.input_blocks:
        h = module(h, emb, context)
        hs.append(h)
    h = unet.middle_block(h, emb, context) + total.pop()
    for module in unet.output_blocks:
        h = module(torch.cat([h, hs.pop() + total.pop()], dim=1), emb, context)
    return unet.out(h)


def records(case: tuple, models: dict, idle_full: int) -> list[dict]:
    """One ControlNet case on each card (``models``: the UNets built so far, by shape)."""
    from lib_vram.core.emulate import EmulatedCard
    from lib_vram.core.predict import weights_bytes
    from lib_vram.sampling import (
        estimate_sampling,
        micro_batched,
        plan_sampling,
        reference_control,
        reference_spec,
        unet_spec,
    )
    from lib_vram.sampling._estimate import Step

    from ._harness import attempt
    from ._unet import attention_applied, build_unet, context_arg, host_forward

    shape, h, w, batch, attention = case
    key = ("controlnet", shape)
    if key not in models:
        unet = build_unet(shape, 32, context_dim=96)
        models[key] = (unet, ControlNet(unet))
    unet, control = models[key]
    spec, cspec = unet_spec(unet), unet_spec(control)
    kw = dict(batch=batch, latent_hw=(h, w), context_tokens=77, attention=attention)

    def plain_peak(s, c, dtype, backend):  # noqa: ANN001, ANN202
        step = Step(s, batch, (h, w), 77, attention, dtype, backend, (c,))
        return step.weights_bytes + step.control_bytes + step.input_bytes + step.activation(batch, None)[0]

    full_c = reference_control(shape)
    f = plain_peak(spec, cspec, torch.float32, "cpu") / plain_peak(
        reference_spec(shape), full_c, torch.float16, "cuda"
    )
    idle, w_bytes, c_bytes = int(idle_full * f), weights_bytes(unet), weights_bytes(control)
    c_full = full_c.params * 2
    gen = torch.Generator().manual_seed(0)
    x0, c0 = torch.randn(batch, 4, h, w, generator=gen), torch.randn(batch, 77, 96, generator=gen)
    hint0, t0 = torch.rand(1, 3, 8 * h, 8 * w, generator=gen), torch.linspace(10, 900, batch)

    def forward(card, m=None):  # noqa: ANN001, ANN202
        probe = (lambda: float(card.free_bytes)) if card is not None else (lambda: float(1 << 50))

        def step():  # noqa: ANN202
            with attention_applied(unet, host_forward(attention, probe, "cpu")), torch.no_grad():
                x, t, c, hint = x0.clone(), t0.clone(), c0.clone(), hint0.clone()
                with attention_applied(control, host_forward(attention, probe, "cpu")):
                    run = lambda x, t, c: controlled(unet, [control], [hint], x, t, c)  # noqa: E731
                    if m is not None:  # VRAM Guard: the plan's micro-batches through the hook (each
                        run = micro_batched(run, m)  # its rows' control, the one image broadcast)
                    return run(x, t, context_arg(shape, c))

        return attempt(step, card)

    ref = forward(None)
    out = []
    for gb in (4, 6, 8):
        cap = int(gb * GiB * f)
        plain = forward(EmulatedCard(cap, resident=w_bytes + c_bytes + idle))
        plan = plan_sampling(spec, dtype=torch.float32, budget_bytes=cap, resident_bytes=idle, backend="cpu",
                             controls=(cspec,), **kw)  # fmt: skip
        moved = not plan.fits
        if moved:
            plan = plan_sampling(spec, dtype=torch.float32, budget_bytes=cap, resident_bytes=0, backend="cpu",
                                 controls=(cspec,), **kw)  # fmt: skip
        card = EmulatedCard(cap, resident=w_bytes + c_bytes + (0 if moved else idle))
        got = forward(card, plan.micro_batch)
        est = estimate_sampling(spec, dtype=torch.float32, backend="cpu", **kw)
        out.append({
            "stage": "controlnet", "shape": shape, "latent": [h, w], "batch": batch, "attention": attention,
            "card_gib": gb, "scale": f, "card_bytes": cap, "plain_ok": plain.ok, "guarded_ok": got.ok,
            "plan": f"{plan.label}, 1 ControlNet unit on the card" + ("; VAE, text encoders off" * moved),
            "controlnet_bytes": c_full, "controlnet_resident_bytes": c_full,
            "bytes_moved_per_step": (2 * c_full + (2 * idle_full if moved else 0)) // STEPS,
            "controlnet_lowvram_bytes_per_step": 2 * c_full, "steps": STEPS,
            "predicted_bytes": plan.predicted_peak_bytes, "peak_bytes": card.peak_bytes,
            "unet_activation_bytes": est.activation_bytes,
            "max_abs_diff": float((got.out - ref.out).abs().max()) if got.ok else None,
        })  # fmt: skip
    return out


def table_columns() -> list:
    return [
        "shape", ("latent", lambda r: f"{r['latent'][0]}x{r['latent'][1]}"), "batch", "attention",
        ("card", lambda r: f"{r['card_gib']} GB ({r['card_bytes'] / 2**20:.0f} MiB)"),
        ("plain", lambda r: "OK" if r["plain_ok"] else "OOM"), ("VRAM Guard's plan", lambda r: r["plan"]),
        ("guarded", lambda r: "OK" if r["guarded_ok"] else "OOM"),
        ("predicted MiB", lambda r: f"{r['predicted_bytes'] / 2**20:.1f}"),
        ("measured MiB", lambda r: f"{r['peak_bytes'] / 2**20:.1f}"),
        ("moved/step (full size)", lambda r: f"{r['bytes_moved_per_step'] / 2**20:.0f} MiB"),
        ("Low VRAM moves/step", lambda r: f"{r['controlnet_lowvram_bytes_per_step'] / 2**20:.0f} MiB"),
    ]  # fmt: skip
