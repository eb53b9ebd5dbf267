"""The ``plan`` command's model of a job with the checkpoint placed (``--place``; the WebUI's
``--vram-guard-place-checkpoint``): the reference checkpoint placed on the card
(:func:`place_checkpoint`: the UNet partly streamed, the text encoders and VAE parked in host
memory) and every stage of a job planned around that placement (:func:`plan_placed_job`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lib_vram.core.predict import dtype_of
from lib_vram.planning import reference
from lib_vram.planning.presets import Preset, resolve_precision

from .stageplan import (
    MiB,
    PassOptions,
    StagePlan,
    ip_encode_stage,
    job_stages,
    plan_upscale_stage,
    plan_vae_stage,
    sampling_pass,
    sampling_stage,
    vae_weights,
)

# The default pass the WebUI's placement plans for (lib_vram.webui.placement.native_latent_hw): the
# native size, one image (cond and uncond in one forward), 77 tokens, the UNet in the checkpoint's
# dtype (FP16; FP32 with the WebUI's --no-half).
NATIVE_SIDE = {"sd15": 512, "sdxl": 1024}
DEFAULT_BATCH = 2
CONTEXT_TOKENS = 77
LEFTOVER_BYTES = 13 * 1000 * 4
"""The checkpoint's own buffers: ldm's 13 noise schedules of 1000 steps in float32 (sgm's fewer)."""


@dataclass(frozen=True)
class PlacedCheckpoint:
    """The placed plan of a reference checkpoint on one card (:func:`place_checkpoint`)."""

    arch: str
    plan: object  # the lib_vram.residency.CheckpointPlan
    checkpoint_bytes: int
    working_margin_bytes: int  # the safety margin + the default pass's activations and inputs
    side: int  # the default pass's image side (px)
    attention: str
    input_bytes: int = 0  # the default pass's inputs (latent, timesteps, context)
    smallest_card_bytes: int | None = None  # not fitting: the smallest card it fits (256 MiB steps)
    dtype: str = "fp16"  # the UNet's and text encoders' ("fp32": the WebUI's --no-half)

    @property
    def needed(self) -> bool:
        """The checkpoint does not fit the card with the working margin: the WebUI places it."""
        return self.checkpoint_bytes + self.working_margin_bytes > self.plan.card_bytes

    @property
    def fits(self) -> bool:
        """The default pass fits with the UNet streamed, and a parked part that wakes beside it."""
        return _fits(self.plan)

    @property
    def line(self) -> str | None:
        """When even the placed plan does not fit: one line naming what would."""
        if self.fits:
            return None
        cp = self.plan
        st = cp.stream
        card = (
            f"a card of {self.smallest_card_bytes / 2**30:.2f} GB or more would"
            if self.smallest_card_bytes
            else "a larger card would"
        )
        has = f"the card has {cp.card_bytes / MiB:.0f} MiB"
        name, b = max(cp.parked, key=lambda p: p[1])
        lowvram = " (or the WebUI's --lowvram)"
        if cp.safety_bytes + cp.leftover_bytes + b > cp.card_bytes or st.fits:
            lowvram = ""  # (--lowvram brings them to the card as well)
            # (a parked part larger than the budget: plan_checkpoint's rounds keep less and less of
            # the UNet resident until the stream no longer fits either; the part is the reason)
            need = cp.safety_bytes + cp.leftover_bytes + (cp.unet_resident_bytes if st.fits else 0) + b
            why = (
                f"the {name} ({b / MiB:.0f} MiB) run on the card: they need {need / MiB:.0f} MiB with the "
                f"safety margin, {has}"
            )
        elif st.activation_bytes:
            need = cp.safety_bytes + cp.leftover_bytes + st.predicted_peak_bytes + self.input_bytes
            why = (
                f"a {self.side}x{self.side} px pass needs {need / MiB:.0f} MiB with the safety margin, {has}"
            )
        else:  # (the attention refuses at this budget)
            why = f"a {self.side}x{self.side} px pass does not fit: {'; '.join(st.notes)}; {has}"
        return (
            f"the checkpoint cannot be placed on this card: even with the text encoders and VAE on the "
            f"CPU until used and the UNet streamed, {why}: {card}{lowvram}"
        )

    def to_dict(self) -> dict:
        cp = self.plan
        st = cp.stream
        return {
            "needed": self.needed,
            "checkpoint_bytes": self.checkpoint_bytes,
            "working_margin_bytes": self.working_margin_bytes,
            "card_bytes": cp.card_bytes,
            "safety_margin_bytes": cp.safety_bytes,
            "leftover_bytes": cp.leftover_bytes,
            "host_bytes": cp.host_bytes,
            "unet_bytes": st.unet_bytes,
            "unet_resident_bytes": cp.unet_resident_bytes,
            "unet_streamed_bytes": st.unet_bytes - cp.unet_resident_bytes,
            "stream_buffer_bytes": st.buffer_bytes if st.streamed else 0,
            "units_resident": len(st.resident),
            "units_streamed": len(st.streamed),
            "bytes_moved_per_step": st.bytes_moved_per_step if st.streamed else 0,
            "lowvram_bytes_per_step": st.lowvram_bytes_per_step,
            "parked": [{"name": n, "mib": round(b / MiB, 1)} for n, b in cp.parked],
            "default_pass": {
                "width": self.side,
                "height": self.side,
                "batch": DEFAULT_BATCH,
                "context_tokens": CONTEXT_TOKENS,
                "attention": self.attention,
                "dtype": self.dtype,
            },
            "fits": self.fits,
            "smallest_card_bytes": self.smallest_card_bytes,
            "line": self.line,
        }


def _fits(cp: object) -> bool:
    """The checkpoint plan fits, and its largest parked part beside the UNet's resident part."""
    budget = cp.card_bytes - cp.safety_bytes - cp.leftover_bytes
    return cp.fits and cp.unet_resident_bytes + cp.largest_parked_bytes <= budget


def place_checkpoint(
    arch: str,
    total_bytes: int,
    margin_of: object,
    *,
    vae_dtype: str,
    attention: str,
    backend: str = "cuda",
    force: bool = True,
    dtype: str = "fp16",
) -> PlacedCheckpoint | None:
    """The placed plan of the reference checkpoint of ``arch`` on a card of ``total_bytes``: the
    WebUI's own :func:`lib_vram.residency.plan_checkpoint` on the reference UNet's units, the text
    encoders and VAE parked, for the default pass (native size, batch 2, 77 tokens, ``dtype``: the
    UNet's and text encoders', FP32 with the WebUI's ``--no-half``).
    ``margin_of(total)``: a card's safety margin. Not fitting: the smallest card that would is
    searched (256 MiB steps). ``force=False``: None where the WebUI would not place it."""
    from lib_vram.residency import plan_checkpoint
    from lib_vram.sampling import estimate_sampling, reference_spec
    from lib_vram.sampling._estimate import input_bytes

    from .refunet import reference_units

    spec = reference_spec(arch)
    a = reference.vae_arch(arch)
    dt = dtype_of(dtype)
    dec, enc = vae_weights(arch, vae_dtype)
    parked = (("text encoders", a.model_bytes(dt.itemsize)[1]), ("VAE", dec + enc))
    side = NATIVE_SIDE[arch]
    hw = (side // a.downscale, side // a.downscale)
    step = dict(
        batch=DEFAULT_BATCH, latent_hw=hw, context_tokens=CONTEXT_TOKENS, attention=attention, dtype=dt,
        backend=backend,
    )  # fmt: skip
    # the UNet's bytes in closed form (its units are built only to place it: the same sum, tested)
    ckpt = LEFTOVER_BYTES + spec.params * dt.itemsize + sum(b for _, b in parked)

    ib = input_bytes(spec, DEFAULT_BATCH, hw, CONTEXT_TOKENS, dt)
    # the working margin, as the WebUI's placement decides with (placement.Placement.need)
    est = estimate_sampling(spec, free_bytes=total_bytes, **step)
    margin = int(margin_of(total_bytes)) + est.activation_bytes + ib

    def at(total: int) -> object:
        return plan_checkpoint(
            units, spec, card_bytes=total, safety_bytes=int(margin_of(total)), leftover_bytes=LEFTOVER_BYTES,
            parked=parked, **step,
        )  # fmt: skip

    if not force and ckpt + margin <= total_bytes:
        return None
    units = reference_units(arch, dt.itemsize)
    cp = at(total_bytes)
    smallest = None
    if not _fits(cp):
        step_bytes = 256 * MiB
        lo = -(-total_bytes // step_bytes)  # (in steps) does not fit, or is the card itself
        hi = max(lo + 1, -(-(ckpt + margin) // step_bytes) + 1)
        while not _fits(at(hi * step_bytes)) and hi < 4 * lo + 64:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _fits(at(mid * step_bytes)) else (mid, hi)
        smallest = hi * step_bytes
    return PlacedCheckpoint(arch, cp, ckpt, margin, side, attention, ib, smallest, dtype)


PLACED_STAGES = {
    "ip_adapter_encode": "",
    "conditioning": "text encoders",
    "sample": "UNet",
    "sample_hires": "UNet",
    "vae_decode": "VAE",
    "vae_encode": "VAE",
    "vae_decode_hires": "VAE",
    "hires_upscale": "",
    "upscale": "",
}
"""Each stage of a placed job and the checkpoint's part it runs (the others stay home)."""


def plan_placed_job(
    placed: PlacedCheckpoint,
    width: int,
    height: int,
    preset: Preset,
    free_bytes: int,
    safety_margin_bytes: int,
    *,
    caps: object | None = None,
    batch: int = 1,
    hires: float | None = None,
    upscaler: str | None = None,
    controlnets: tuple[str, ...] = (),
    controlnet_hires: str = "both",
    options: PassOptions | None = None,
) -> list[StagePlan]:
    """Plans for every stage of a job with the checkpoint placed, as the WebUI runs it with
    ``--vram-guard-place-checkpoint`` (``options``: :class:`PassOptions`): each stage's part woken
    beside the UNet's resident part (the text encoders' activations not modelled); sampling as
    :mod:`lib_vram.webui.sampling` plans a placed pass, its bytes moved per step (streamed bytes x
    forwards) against ``--lowvram``'s. Budgets are ``free_bytes - safety_margin_bytes`` as in
    :func:`plan_job`."""
    from lib_vram.sampling import more_streamed_pass

    from .refunet import reference_units

    cp = placed.plan
    arch = placed.arch
    st = cp.stream
    dtype = placed.dtype  # the UNet's and text encoders'
    a = reference.vae_arch(arch)
    margin = safety_margin_bytes
    backend = getattr(caps, "backend", "cuda")
    vae_dtype = resolve_precision(preset.precision_vae, caps)
    up_dtype = resolve_precision(preset.precision_upscale, caps)
    dec_w, enc_w = vae_weights(arch, vae_dtype)
    unet_res = cp.unet_resident_bytes
    buffer = st.buffer_bytes if st.streamed else 0
    streamed = st.unet_bytes - unet_res
    base = cp.leftover_bytes + unet_res
    budget = free_bytes - margin
    itemsize = dtype_of(vae_dtype).itemsize
    rows = {r["stage"]: r["models"] for r in cp.stage_rows(tuple(PLACED_STAGES.items()))}

    te = dict(cp.parked)["text encoders"]
    warning = None
    if not placed.fits:
        warning = placed.line
    elif base + te > budget:
        warning = (
            f"the text encoders ({te / MiB:.0f} MiB) beside the UNet's resident part need "
            f"{(base + te) / MiB:.0f} MiB, the card offers {budget / MiB:.0f} MiB: a larger card would fit"
        )
    conditioning = StagePlan(
        stage="conditioning", plan="text encoders on the card", predicted_peak_bytes=base + te,
        fits=base + te <= budget and placed.fits, budget_bytes=budget, safety_margin_bytes=margin,
        resident_bytes=base, weights_bytes=te, input_bytes=0, activation_bytes=0, tile=None, batch=1,
        dtype=dtype, warning=warning,
    )  # fmt: skip

    def sample(stage: str, w: int, h: int) -> StagePlan:
        # the WebUI's plan of a placed checkpoint's pass (lib_vram.webui.sampling): the budget less
        # the checkpoint's buffers, raised by what the UNet does not keep on the card (the plans
        # count the whole UNet), the peak lowered by as much
        inflate = max(0, st.unet_bytes - unet_res - buffer)

        def at(budget_bytes: int) -> object:
            return sampling_pass(
                arch, stage, w, h, batch, controlnets, controlnet_hires, options, attention=placed.attention,
                budget_bytes=budget_bytes, backend=backend, dtype=dtype,
            )  # fmt: skip

        p = at(max(0, budget - cp.leftover_bytes) + inflate)
        freed = nmore = 0
        if not p.fits and placed.fits:  # more of the UNet streams for a short pass, as in the run
            got = more_streamed_pass(
                reference_units(arch, dtype_of(dtype).itemsize), st.resident, p, streamed
            )
            wider = at(p.budget_bytes + got[1] - got[2]) if got else None
            if wider is not None and wider.fits:
                nmore, freed = got[1], got[1] - got[2]
                more = f"{len(got[0])} more UNet blocks ({nmore / MiB:.0f} MiB) stream for the pass"
                p = dataclasses.replace(
                    wider,
                    predicted_peak_bytes=wider.predicted_peak_bytes - freed,
                    label=f"{wider.label}, {more}",
                )
        peak = p.predicted_peak_bytes - inflate + cp.leftover_bytes
        fits = p.fits and placed.fits
        forwards = -(-p.batch // p.micro_batch)
        if options is not None and options.tiled is not None:  # each tile batch's forwards
            down = a.downscale
            _, count, per = options.tiles((h // down, w // down))
            forwards *= -(-count // per)
        suggestion = None
        if not placed.fits:
            suggestion = placed.line
        elif not fits:
            rest = p.suggestion.split(": ", 1)[1] if p.suggestion and ": " in p.suggestion else ""
            suggestion = (
                f"sampling {w}x{h} px with the checkpoint placed needs {peak / MiB:.0f} MiB, the card "
                f"offers {budget / MiB:.0f} MiB: {rest or 'a smaller image or batch may fit'}"
            )
        return sampling_stage(
            stage, p, budget, margin, shift=cp.leftover_bytes - inflate, resident_bytes=cp.leftover_bytes,
            dtype=dtype, attention=placed.attention, fits=fits, weights_bytes=unet_res + buffer - freed,
            warning=suggestion, suggestion=suggestion, bytes_moved_per_step=(streamed + nmore) * forwards,
            lowvram_bytes_per_step=st.lowvram_bytes_per_step,
        )  # fmt: skip

    def vae(stage: str, kind: str, w: int, h: int) -> StagePlan:
        other = enc_w if kind == "decode" else dec_w  # the VAE wakes whole: its other half is there
        waiting = (batch - 1) * 3 * w * h * itemsize
        return plan_vae_stage(
            stage, kind, arch, w, h, preset, free_bytes, margin, dtype=vae_dtype,
            resident_bytes=base + other + waiting, backend=backend
        )  # fmt: skip

    def upscale(stage: str, w: int, h: int) -> StagePlan:
        return plan_upscale_stage(
            stage, upscaler, w, h, free_bytes, margin, dtype=up_dtype, resident_bytes=base, backend=backend
        )  # fmt: skip

    stages = job_stages(width, height, hires, upscaler, a.downscale, sample=sample, vae=vae, upscale=upscale)
    # each stage with where the checkpoint's models are during it
    encode = () if options is None or options.ip_adapter is None else (
        ip_encode_stage(options.ip_adapter, arch, free_bytes, margin, base),
    )  # fmt: skip
    return [
        dataclasses.replace(
            sp,
            models=tuple(rows[sp.stage]),
            card_bytes=base + sum(b for n, b in cp.parked if n == PLACED_STAGES[sp.stage]),
            streamed_bytes=streamed,
        )
        for sp in (*encode, conditioning, *stages)
    ]
