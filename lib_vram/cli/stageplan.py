"""The ``plan`` command's model of a job: its stages, each planned by its own engine.

Stages of a txt2img job (with hires fix and an upscaler, as in the WebUI): ``vae_decode`` of the
first pass, ``hires_upscale`` (the upscaler on the first-pass image), ``vae_encode`` at the hires
size, ``vae_decode_hires``; or, without hires fix, a final ``upscale`` (Extras-style) of the image.

Every stage is planned by the function its engine decides with at run time
(:func:`lib_vram.vae.plan_vae`, :func:`lib_vram.upscale.plan_upscale`): the same candidates, the
same analytic estimates, the same learning keys. There is no model here, so the engines plan the
:mod:`lib_vram.planning.reference` architectures, built on the meta device (no weights, no
ldm/sgm). Nothing runs over the image: a plan takes milliseconds at any size.

The preset decides what the engines are given: the stage's budget is the free memory minus the
preset's safety margin, the stage model's weights, the UNet/text-encoder weights the preset keeps
on the device and the decoded images of a batch that wait there; and the precision.
Peak = those weights + the engine's predicted peak (input, activations, output).

The engines' fake-tensor runs (:func:`predict_engine_vae`, :func:`predict_engine_upscale`) are
the validators of those estimates (tests, ``bench planner``), not a second planner.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import torch

from lib_vram.core.predict import (
    PeakPrediction,
    dtype_of,
    fake_call,
    fake_state,
    new_fake_mode,
    predict_callable,
    weights_bytes,
)
from lib_vram.planning import planner, reference
from lib_vram.planning.presets import Preset, resolve_precision

logger = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class StagePlan:
    """The chosen plan of one stage, with the numbers behind it."""

    stage: str
    plan: str
    """The engine's label (``"untiled"``, ``"exact t64"``, ``"tiled t192 o16 b2"``, ``"whole b1"``)."""
    predicted_peak_bytes: int
    fits: bool
    budget_bytes: int
    """Free memory minus the safety margin (what the whole peak must fit)."""
    safety_margin_bytes: int
    resident_bytes: int
    """Weights that stay on the device during the stage but are not the stage's own model (and
    decoded images of a batch waiting there)."""
    weights_bytes: int
    """The stage model's weights."""
    input_bytes: int
    activation_bytes: int
    """The engine's predicted peak minus the input."""
    tile: int | None
    batch: int
    dtype: str
    key: tuple = ()
    """The planner-memory key the engine learns under for this stage."""
    warning: str | None = None
    candidates: list[planner.Candidate] = field(default_factory=list, compare=False)
    moved_off: str = ""
    """What leaves the card for this stage because its plan does not fit with it there (e.g.
    ``"UNet, text encoders"``); empty when nothing moves."""
    suggestion: str | None = None
    """Sampling stages that do not fit: the largest size and batch that would (one line)."""
    attention: str = ""
    """Sampling stages: the attention implementation planned for."""
    models: tuple[dict, ...] = ()
    """The placed plan (:func:`plan_placed_job`): each model of the checkpoint during the stage
    (``name``, ``where``: ``card``/``host``/``streamed``, ``card_mib``, ``mib``); empty: not placed."""
    card_bytes: int = 0
    """The placed plan: the checkpoint's bytes on the card during the stage (between forwards)."""
    streamed_bytes: int = 0
    """The placed plan: the UNet's streamed part (in host memory, through the card per forward)."""
    bytes_moved_per_step: int | None = None
    """The placed plan's sampling stages: host->card bytes per step (streamed bytes x forwards)."""
    lowvram_bytes_per_step: int | None = None
    """What ``--lowvram`` moves per step for the same UNet."""

    def to_dict(self) -> dict:
        placed = {}
        if self.models:
            lowvram = self.lowvram_bytes_per_step
            moved = self.bytes_moved_per_step
            placed = {
                "placed": True,
                "models": [
                    dict(m, card_mib=round(m["card_mib"], 1), mib=round(m["mib"], 1)) for m in self.models
                ],
                "resident_mib": round(self.card_bytes / MiB, 1),
                "streamed_mib": round(self.streamed_bytes / MiB, 1),
                "bytes_moved_per_step": moved,
                "lowvram_bytes_per_step": lowvram,
                "lowvram_ratio": round(moved / lowvram, 3) if moved is not None and lowvram else None,
            }
        return placed | {
            "stage": self.stage,
            "plan": self.plan,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "fits": self.fits,
            "budget_bytes": self.budget_bytes,
            "safety_margin_bytes": self.safety_margin_bytes,
            "resident_bytes": self.resident_bytes,
            "model_weights_bytes": self.weights_bytes,
            "input_bytes": self.input_bytes,
            "activation_bytes": self.activation_bytes,
            "tile": self.tile,
            "batch": self.batch,
            "dtype": self.dtype,
            "warning": self.warning,
            "moved_off_card": self.moved_off.split(", ") if self.moved_off else [],
            **({"attention": self.attention, "suggestion": self.suggestion} if self.attention else {}),
            "candidates": [
                {"plan": c.plan, "tile": c.tile, "batch": c.batch, "predicted_peak_bytes": c.peak_bytes}
                for c in self.candidates
            ],
        }


@functools.lru_cache(maxsize=8)
def reference_vae(arch: str, kind: str, attn: str = "sdpa") -> torch.nn.Module:
    """The reference decoder/encoder of ``arch`` on the meta device (no memory, no init work)."""
    a = reference.vae_arch(arch)
    with torch.device("meta"):
        return reference.Decoder(a, attn=attn) if kind == "decode" else reference.Encoder(a, attn=attn)


@functools.lru_cache(maxsize=8)
def reference_upscaler(kind: str, scale: int) -> torch.nn.Module:
    with torch.device("meta"):
        return reference.build_upscaler(kind, scale).eval()


def _stage(
    stage: str,
    label: str,
    tile: int | None,
    batch: int,
    peak: int,
    raw_candidates: list[planner.Candidate],
    *,
    free_bytes: int,
    margin: int,
    weights: int,
    resident: int,
    input_bytes: int,
    dtype: str,
    key: tuple,
) -> StagePlan:
    total = weights + resident + peak
    budget = free_bytes - margin
    fits = total <= budget
    warning = None
    if not fits:
        warning = planner.choose(
            [planner.Candidate(label, total, tile, batch)], max(free_bytes, 0), margin
        ).warning
    cands = [dataclasses.replace(c, peak_bytes=c.peak_bytes + weights + resident) for c in raw_candidates]
    return StagePlan(
        stage=stage,
        plan=label,
        predicted_peak_bytes=total,
        fits=fits,
        budget_bytes=budget,
        safety_margin_bytes=margin,
        resident_bytes=resident,
        weights_bytes=weights,
        input_bytes=input_bytes,
        activation_bytes=max(0, peak - input_bytes),
        tile=tile,
        batch=batch,
        dtype=dtype,
        key=key,
        warning=warning,
        candidates=cands,
    )


def plan_vae_stage(
    stage: str,
    kind: str,
    arch: str,
    width: int,
    height: int,
    preset: Preset,
    free_bytes: int,
    safety_margin_bytes: int,
    *,
    dtype: str,
    resident_bytes: int = 0,
    backend: str = "cuda",
    memory: planner.PlanMemory | None = None,
) -> StagePlan:
    """``stage`` as the VAE engine plans it (:func:`lib_vram.vae.plan_vae`) for the reference VAE
    of ``arch``, within what the preset leaves of ``free_bytes``."""
    from lib_vram.vae import estimate_peak_bytes, plan_vae

    if kind not in ("decode", "encode"):
        raise ValueError(f"`kind` must be 'decode' or 'encode', got {kind!r}")
    a = reference.vae_arch(arch)
    if width <= 0 or height <= 0 or width % a.downscale or height % a.downscale:
        raise ValueError(
            f"`width`/`height` must be positive multiples of {a.downscale}, got {width}x{height}"
        )
    module = reference_vae(arch, kind)
    dt = dtype_of(dtype)
    shape = (
        (1, a.z_channels, height // a.downscale, width // a.downscale)
        if kind == "decode"
        else (1, 3, height, width)
    )
    weights = weights_bytes(module, dt)
    input_bytes = shape[0] * shape[1] * shape[2] * shape[3] * dt.itemsize
    budget = max(0, free_bytes - safety_margin_bytes - weights - resident_bytes)
    if preset.vae_mode == "off":
        # the WebUI's own forward, untiled
        peak = estimate_peak_bytes(module, shape, dt, tile=None, mode="untiled", backend=backend)
        cand = planner.Candidate("untiled", peak)
        return _stage(
            stage, "untiled", None, 1, peak, [cand], free_bytes=free_bytes, margin=safety_margin_bytes,
            weights=weights, resident=resident_bytes, input_bytes=input_bytes, dtype=dtype, key=(),
        )  # fmt: skip
    p = plan_vae(module, shape, dt, budget, mode=preset.vae_mode, backend=backend, memory=memory)
    return _stage(
        stage, p.plan, p.tile, 1, p.peak_bytes, list(p.candidates), free_bytes=free_bytes,
        margin=safety_margin_bytes, weights=weights, resident=resident_bytes, input_bytes=input_bytes,
        dtype=dtype, key=p.key,
    )  # fmt: skip


def plan_upscale_stage(
    stage: str,
    kind: str,
    width: int,
    height: int,
    free_bytes: int,
    safety_margin_bytes: int,
    *,
    dtype: str,
    scale: int = 4,
    resident_bytes: int = 0,
    backend: str = "cuda",
    memory: planner.PlanMemory | None = None,
) -> StagePlan:
    """``stage`` as the upscale engine plans it (:func:`lib_vram.upscale.plan_upscale`) for the
    reference upscaler ``kind`` (``"rrdb"``/``"compact"``), within what is left of ``free_bytes``."""
    from lib_vram.upscale import plan_upscale

    if width <= 0 or height <= 0:
        raise ValueError(f"`width`/`height` must be positive, got {width}x{height}")
    module = reference_upscaler(kind, scale)
    dt = dtype_of(dtype)
    shape = (1, 3, height, width)
    weights = weights_bytes(module, dt)
    budget = max(1, free_bytes - safety_margin_bytes - weights - resident_bytes)
    p = plan_upscale(module, shape, dt, budget, scale=scale, host_apart=backend != "cpu", memory=memory)
    input_bytes = 0 if p.in_host else 3 * height * width * dt.itemsize
    tile = None if p.whole else p.tile
    cand = p.candidate(p.tile, p.batch, p.halo)
    return _stage(
        stage, p.plan, tile, p.batch, p.peak_bytes, [cand], free_bytes=free_bytes,
        margin=safety_margin_bytes, weights=weights, resident=resident_bytes, input_bytes=input_bytes,
        dtype=dtype, key=p.key,
    )  # fmt: skip


SAMPLING_ARCHS = {"sd15": "sd15", "sdxl": "sdxl"}
"""Archs whose UNet the sampling estimate knows (:func:`lib_vram.sampling.reference_spec`)."""
MAX_IMAGES = 32
"""The largest images per batch ``plan`` takes (the UNet's forward then holds 64 samples)."""


def plan_sampling_stage(
    stage: str,
    arch: str,
    width: int,
    height: int,
    free_bytes: int,
    safety_margin_bytes: int,
    *,
    images: int = 1,
    attention: str = "doggettx",
    dtype: str = "fp16",
    resident_bytes: int = 0,
    context_tokens: int = 77,
    backend: str = "cuda",
    memory: planner.PlanMemory | None = None,
) -> StagePlan:
    """``stage`` (a sampling pass) as :func:`lib_vram.sampling.plan_sampling` plans it: the
    reference UNet of ``arch``, one forward of ``2 x images`` samples (the WebUI batches cond and
    uncond), the latent of ``width`` x ``height``."""
    from lib_vram.sampling import plan_sampling, reference_spec

    spec = reference_spec(SAMPLING_ARCHS[arch])
    a = reference.vae_arch(arch)
    dt = dtype_of(dtype)
    budget = max(0, free_bytes - safety_margin_bytes)
    batch = 2 * images
    p = plan_sampling(
        spec,
        batch=batch,
        latent_hw=(height // a.downscale, width // a.downscale),
        context_tokens=context_tokens,
        attention=attention,
        dtype=dt,
        budget_bytes=budget,
        resident_bytes=resident_bytes,
        backend=backend,
        memory=memory,
    )
    cands = [dataclasses.replace(c, peak_bytes=c.peak_bytes) for c in p.candidates]
    warning = None
    if not p.fits:
        warning = p.suggestion
    return StagePlan(
        stage=stage,
        plan=p.label,
        predicted_peak_bytes=p.predicted_peak_bytes,
        fits=p.fits,
        budget_bytes=budget,
        safety_margin_bytes=safety_margin_bytes,
        resident_bytes=resident_bytes,
        weights_bytes=p.weights_bytes,
        input_bytes=p.input_bytes,
        activation_bytes=p.activation_bytes,
        tile=None,
        batch=p.micro_batch,
        dtype=dtype,
        key=p.key,
        warning=warning,
        candidates=cands,
        suggestion=p.suggestion,
        attention=attention,
    )


def plan_job(
    arch: str,
    width: int,
    height: int,
    preset: Preset,
    free_bytes: int,
    total_bytes: int,
    *,
    caps: object | None = None,
    batch: int = 1,
    hires: float | None = None,
    upscaler: str | None = None,
    upscale_scale: int = 4,
    safety_margin_bytes: int | None = None,
    memory: planner.PlanMemory | None = None,
    host_swaps: bool = False,
    attention: str | None = None,
) -> list[StagePlan]:
    """Plans for every memory-heavy stage of a job (see the module docstring).

    ``free_bytes`` is what the job may use with the model loaded *off* the device (the resident
    UNet/text encoder bytes are added per stage from the arch table unless the preset offloads
    them). The WebUI decodes a batch one image at a time, so ``batch`` adds only the decoded images
    that wait on the device.

    Sampling stages (``sample``, ``sample_hires``; archs with a UNet the sampling estimate knows)
    plan one UNet forward of the whole batch (cond and uncond) with ``attention`` (default: what
    the WebUI v1.10.1 picks with no flags, :func:`lib_vram.sampling.attention_of`). During
    sampling the VAE is idle and the text encoders are done once the conditioning is computed:
    when the step does not fit beside them, they leave the card for it (``moved_off``), not when
    the host swaps models itself (``host_swaps``).
    """
    if batch < 1:
        raise ValueError(f"`batch` must be >= 1, got {batch}")
    if hires is not None and not (1.0 < hires <= 8.0):
        raise ValueError(f"`hires` must be in (1, 8], got {hires}")
    a = reference.vae_arch(arch)
    margin = preset.safety_margin(total_bytes) if safety_margin_bytes is None else safety_margin_bytes
    backend = getattr(caps, "backend", "cuda")
    vae_dtype = resolve_precision(preset.precision_vae, caps)
    up_dtype = resolve_precision(preset.precision_upscale, caps)
    # The UNet and text encoders stay on the card; a VAE pass whose plan does not fit with them
    # there moves the ones the preset allows off for that pass (lib_vram.residency does it).
    # With ``host_swaps`` (the WebUI's --medvram/--lowvram) the host keeps them off the card
    # outside sampling itself.
    resident = 0 if host_swaps else a.unet_bytes + a.text_encoder_bytes
    movable = [
        (name, n)
        for name, n, ok in (
            ("UNet", a.unet_bytes, preset.offload_unet_during_vae),
            ("text encoders", a.text_encoder_bytes, preset.offload_text_encoder_during_vae),
        )
        if ok and n and not host_swaps
    ]
    itemsize = dtype_of(vae_dtype).itemsize

    def waiting(w: int, h: int) -> int:
        return (batch - 1) * 3 * w * h * itemsize

    def vae(stage: str, kind: str, w: int, h: int) -> StagePlan:
        def at(on_card: int) -> StagePlan:
            return plan_vae_stage(
                stage, kind, arch, w, h, preset, free_bytes, margin, dtype=vae_dtype,
                resident_bytes=on_card + waiting(w, h), backend=backend, memory=memory,
            )  # fmt: skip

        sp = at(resident)
        if sp.fits or not movable:
            return sp
        off = at(resident - sum(n for _, n in movable))
        return dataclasses.replace(off, moved_off=", ".join(name for name, _ in movable))

    sampling = arch in SAMPLING_ARCHS
    if sampling:
        from lib_vram.sampling import attention_of

        att = attention_of(attention or "Automatic", backend=backend)
        vae_weights = weights_bytes(reference_vae(arch, "decode"), dtype_of(vae_dtype)) + weights_bytes(
            reference_vae(arch, "encode"), dtype_of(vae_dtype)
        )
        idle = [] if host_swaps else [("VAE", vae_weights), ("text encoders", a.text_encoder_bytes)]

    def sample(stage: str, w: int, h: int) -> StagePlan:
        def at(on_card: int) -> StagePlan:
            return plan_sampling_stage(
                stage, arch, w, h, free_bytes, margin, images=batch, attention=att,
                resident_bytes=on_card, backend=backend, memory=memory,
            )  # fmt: skip

        on_card = sum(n for _, n in idle)
        sp = at(on_card)
        if sp.fits or not idle:
            return sp
        off = at(0)
        return dataclasses.replace(off, moved_off=", ".join(name for name, _ in idle))

    plans = [sample("sample", width, height)] if sampling else []
    plans.append(vae("vae_decode", "decode", width, height))
    final_w, final_h = width, height
    if hires is not None:
        hw, hh = _hires_size(width, height, hires, a.downscale)
        if upscaler is not None:
            plans.append(
                plan_upscale_stage(
                    "hires_upscale",
                    upscaler,
                    width,
                    height,
                    free_bytes,
                    margin,
                    dtype=up_dtype,
                    scale=upscale_scale,
                    resident_bytes=resident,
                    backend=backend,
                    memory=memory,
                )  # fmt: skip
            )
        plans.append(vae("vae_encode", "encode", hw, hh))
        if sampling:
            plans.append(sample("sample_hires", hw, hh))
        plans.append(vae("vae_decode_hires", "decode", hw, hh))
        final_w, final_h = hw, hh
    elif upscaler is not None:
        plans.append(
            plan_upscale_stage(
                "upscale",
                upscaler,
                final_w,
                final_h,
                free_bytes,
                margin,
                dtype=up_dtype,
                scale=upscale_scale,
                resident_bytes=0,
                backend=backend,
                memory=memory,
            )  # fmt: skip
        )
    return plans


# -- the checkpoint placement (--vram-guard-place-checkpoint) --------------------------------------

NATIVE_SIDE = {"sd15": 512, "sdxl": 1024}
"""The model's native size: the default pass the WebUI's placement plans for
(:func:`lib_vram.webui.placement.native_latent_hw`)."""
DEFAULT_BATCH = 2
"""The default pass: one image, cond and uncond in one forward (the WebUI's placement's)."""
CONTEXT_TOKENS = 77
LEFTOVER_BYTES = 13 * 1000 * 4
"""The checkpoint's own buffers (not of the UNet, the text encoders or the VAE): ldm's 13 noise
schedules of 1000 steps in float32, 0.05 MiB (sgm's SDXL holds fewer)."""
UNET_DTYPE = "fp16"
"""The UNet's precision the sampling stages are planned at (the WebUI's default)."""


@dataclass(frozen=True)
class PlacedCheckpoint:
    """The placed plan of a reference checkpoint on one card (:func:`place_checkpoint`)."""

    arch: str
    plan: object
    """The :class:`lib_vram.residency.CheckpointPlan`."""
    checkpoint_bytes: int
    working_margin_bytes: int
    """The safety margin plus the default pass's activations and inputs."""
    side: int
    """The default pass's image side (px)."""
    attention: str
    input_bytes: int = 0
    """The default pass's inputs (latent, timesteps, context)."""
    smallest_card_bytes: int | None = None
    """When the placed plan does not fit: the smallest card (in 256 MiB steps) it fits."""

    @property
    def needed(self) -> bool:
        """The checkpoint does not fit the card with the working margin: the WebUI places it."""
        return self.checkpoint_bytes + self.working_margin_bytes > self.plan.card_bytes

    @property
    def fits(self) -> bool:
        """The default pass fits with the UNet streamed, and the largest parked part beside the
        UNet's resident part (a part that wakes)."""
        return self.plan.fits and _parked_fits(self.plan)

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
                "dtype": UNET_DTYPE,
            },
            "fits": self.fits,
            "smallest_card_bytes": self.smallest_card_bytes,
            "line": self.line,
        }


def _parked_fits(cp: object) -> bool:
    budget = cp.card_bytes - cp.safety_bytes - cp.leftover_bytes
    return cp.unet_resident_bytes + cp.largest_parked_bytes <= budget


def _vae_weights(arch: str, dtype: str) -> tuple[int, int]:
    """(decoder, encoder) weights of the reference VAE of ``arch`` at ``dtype``."""
    dt = dtype_of(dtype)
    return weights_bytes(reference_vae(arch, "decode"), dt), weights_bytes(reference_vae(arch, "encode"), dt)


def place_checkpoint(
    arch: str,
    total_bytes: int,
    margin_of: object,
    *,
    vae_dtype: str,
    attention: str,
    backend: str = "cuda",
    force: bool = True,
) -> PlacedCheckpoint | None:
    """The placed plan of the reference checkpoint of ``arch`` (SD1.5, SDXL) on a card of
    ``total_bytes``: :func:`lib_vram.residency.plan_checkpoint` (the WebUI's placement's own
    function) on the reference UNet's units (:func:`lib_vram.cli.refunet.reference_units`), the
    text encoders (:data:`lib_vram.planning.reference.ARCHS`) and the VAE (the reference VAE) parked,
    the checkpoint's buffers, and the default pass (the native size at batch 2, 77 tokens,
    ``attention``, FP16). ``margin_of(total)``: the safety margin of a card of ``total`` bytes
    (the preset's, or ``--safety-margin``). When it does not fit, the smallest card it fits is
    searched (256 MiB steps). ``force=False``: None when the checkpoint and the working margin fit
    the card (the WebUI does not place it)."""
    from lib_vram.residency import plan_checkpoint
    from lib_vram.sampling import estimate_sampling, reference_spec
    from lib_vram.sampling._estimate import input_bytes

    from .refunet import reference_units

    if arch not in SAMPLING_ARCHS:
        raise ValueError(f"`arch` must be one of {sorted(SAMPLING_ARCHS)} to be placed, got {arch!r}")
    spec = reference_spec(SAMPLING_ARCHS[arch])
    a = reference.vae_arch(arch)
    dt = dtype_of(UNET_DTYPE)
    dec, enc = _vae_weights(arch, vae_dtype)
    parked = (("text encoders", a.text_encoder_bytes), ("VAE", dec + enc))
    side = NATIVE_SIDE[arch]
    hw = (side // a.downscale, side // a.downscale)
    step = dict(
        batch=DEFAULT_BATCH, latent_hw=hw, context_tokens=CONTEXT_TOKENS, attention=attention, dtype=dt,
        backend=backend,
    )  # fmt: skip
    # the UNet's bytes in closed form (its units are built only to place it: the same sum, tested)
    ckpt = LEFTOVER_BYTES + spec.params * dt.itemsize + sum(b for _, b in parked)

    ib = input_bytes(spec, DEFAULT_BATCH, hw, CONTEXT_TOKENS, dt)

    def working_margin(total: int) -> int:
        # as the WebUI's placement decides with (placement.Placement.need)
        est = estimate_sampling(spec, free_bytes=total, **step)
        return int(margin_of(total)) + est.activation_bytes + ib

    def at(total: int) -> object:
        return plan_checkpoint(
            units, spec, card_bytes=total, safety_bytes=int(margin_of(total)), leftover_bytes=LEFTOVER_BYTES,
            parked=parked, **step,
        )  # fmt: skip

    def fits(total: int) -> bool:
        cp = at(total)
        return cp.fits and _parked_fits(cp)

    margin = working_margin(total_bytes)
    if not force and ckpt + margin <= total_bytes:
        return None
    units = reference_units(arch, dt.itemsize)
    cp = at(total_bytes)
    smallest = None
    if not (cp.fits and _parked_fits(cp)):
        step_bytes = 256 * MiB
        lo = -(-total_bytes // step_bytes)  # (in steps) does not fit, or is the card itself
        hi = max(lo + 1, -(-(ckpt + margin) // step_bytes) + 1)
        while not fits(hi * step_bytes) and hi < 4 * lo + 64:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid * step_bytes):
                hi = mid
            else:
                lo = mid
        smallest = hi * step_bytes
    return PlacedCheckpoint(arch, cp, ckpt, margin, side, attention, ib, smallest)


PLACED_STAGES = {
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
    upscale_scale: int = 4,
    memory: planner.PlanMemory | None = None,
) -> list[StagePlan]:
    """Plans for every stage of a job with the checkpoint placed (``placed``), as the WebUI runs
    it with ``--vram-guard-place-checkpoint``:

    * ``conditioning``: the text encoders woken on the card beside the UNet's resident part (their
      activations, 77 tokens, are not modelled);
    * ``sample``/``sample_hires``: the UNet's resident part, the stream buffer, the step's
      activations at the micro-batch :func:`lib_vram.sampling.plan_sampling` chooses with the
      placement's budget (as :mod:`lib_vram.webui.sampling` plans a placed checkpoint's pass) and
      the inputs; bytes moved per step = streamed bytes x forwards, against ``--lowvram``'s;
    * VAE stages: the VAE woken (both halves) beside the UNet's resident part, the VAE's own tiled
      plan (:func:`plan_vae_stage`); upscales: the upscaler beside the UNet's resident part.

    Budgets are ``free_bytes - safety_margin_bytes`` as in :func:`plan_job`."""
    from lib_vram.sampling import plan_sampling, reference_spec

    cp = placed.plan
    arch = placed.arch
    st = cp.stream
    a = reference.vae_arch(arch)
    margin = safety_margin_bytes
    backend = getattr(caps, "backend", "cuda")
    vae_dtype = resolve_precision(preset.precision_vae, caps)
    up_dtype = resolve_precision(preset.precision_upscale, caps)
    dec_w, enc_w = _vae_weights(arch, vae_dtype)
    spec = reference_spec(SAMPLING_ARCHS[arch])
    unet_res = cp.unet_resident_bytes
    buffer = st.buffer_bytes if st.streamed else 0
    streamed = st.unet_bytes - unet_res
    base = cp.leftover_bytes + unet_res
    budget = free_bytes - margin
    itemsize = dtype_of(vae_dtype).itemsize
    rows = {r["stage"]: r["models"] for r in cp.stage_rows(tuple(PLACED_STAGES.items()))}

    def with_models(sp: StagePlan, **kw: object) -> StagePlan:
        models = tuple(rows[sp.stage])
        on_card = base + sum(b for n, b in cp.parked if n == PLACED_STAGES[sp.stage])
        return dataclasses.replace(sp, models=models, card_bytes=on_card, streamed_bytes=streamed, **kw)

    def conditioning() -> StagePlan:
        te = a.text_encoder_bytes
        peak = base + te
        fits = peak <= budget and placed.fits
        warning = None
        if not placed.fits:
            warning = placed.line
        elif not fits:
            warning = (
                f"the text encoders ({te / MiB:.0f} MiB) beside the UNet's resident part need "
                f"{peak / MiB:.0f} MiB, the card offers {budget / MiB:.0f} MiB: a larger card would fit"
            )
        sp = StagePlan(
            stage="conditioning", plan="text encoders on the card", predicted_peak_bytes=peak, fits=fits,
            budget_bytes=budget, safety_margin_bytes=margin, resident_bytes=base, weights_bytes=te,
            input_bytes=0, activation_bytes=0, tile=None, batch=1, dtype=UNET_DTYPE, warning=warning,
        )  # fmt: skip
        return with_models(sp)

    def sample(stage: str, w: int, h: int) -> StagePlan:
        # the WebUI's plan of a placed checkpoint's pass (lib_vram.webui.sampling): the budget less
        # the checkpoint's buffers, raised by what the UNet does not keep on the card (the plans
        # count the whole UNet), the peak lowered by as much
        inflate = max(0, st.unet_bytes - unet_res - buffer)
        p = plan_sampling(
            spec, batch=2 * batch, latent_hw=(h // a.downscale, w // a.downscale),
            context_tokens=CONTEXT_TOKENS, attention=placed.attention, dtype=dtype_of(UNET_DTYPE),
            budget_bytes=max(0, budget - cp.leftover_bytes) + inflate, backend=backend, memory=memory,
        )  # fmt: skip
        peak = p.predicted_peak_bytes - inflate + cp.leftover_bytes
        fits = p.fits and placed.fits
        forwards = -(-(2 * batch) // p.micro_batch)
        suggestion = None
        if not placed.fits:
            suggestion = placed.line
        elif not fits:
            rest = p.suggestion.split(": ", 1)[1] if p.suggestion and ": " in p.suggestion else ""
            suggestion = (
                f"sampling {w}x{h} px with the checkpoint placed needs {peak / MiB:.0f} MiB, the card "
                f"offers {budget / MiB:.0f} MiB: {rest or 'a smaller image or batch may fit'}"
            )
        sp = StagePlan(
            stage=stage, plan=p.label, predicted_peak_bytes=peak, fits=fits, budget_bytes=budget,
            safety_margin_bytes=margin, resident_bytes=cp.leftover_bytes, weights_bytes=unet_res + buffer,
            input_bytes=p.input_bytes, activation_bytes=p.activation_bytes, tile=None, batch=p.micro_batch,
            dtype=UNET_DTYPE, key=p.key, warning=suggestion,
            candidates=[dataclasses.replace(c, peak_bytes=c.peak_bytes - inflate + cp.leftover_bytes)
                        for c in p.candidates],
            suggestion=suggestion, attention=placed.attention,
        )  # fmt: skip
        return with_models(
            sp,
            bytes_moved_per_step=streamed * forwards,
            lowvram_bytes_per_step=st.lowvram_bytes_per_step,
        )

    def vae(stage: str, kind: str, w: int, h: int) -> StagePlan:
        other = enc_w if kind == "decode" else dec_w  # the VAE wakes whole: its other half is there
        waiting = (batch - 1) * 3 * w * h * itemsize
        sp = plan_vae_stage(
            stage, kind, arch, w, h, preset, free_bytes, margin, dtype=vae_dtype,
            resident_bytes=base + other + waiting, backend=backend, memory=memory,
        )  # fmt: skip
        return with_models(sp)

    def upscale(stage: str, w: int, h: int) -> StagePlan:
        sp = plan_upscale_stage(
            stage, upscaler, w, h, free_bytes, margin, dtype=up_dtype, scale=upscale_scale,
            resident_bytes=base, backend=backend, memory=memory,
        )  # fmt: skip
        return with_models(sp)

    plans = [conditioning(), sample("sample", width, height), vae("vae_decode", "decode", width, height)]
    if hires is not None:
        hw, hh = _hires_size(width, height, hires, a.downscale)
        if upscaler is not None:
            plans.append(upscale("hires_upscale", width, height))
        plans.append(vae("vae_encode", "encode", hw, hh))
        plans.append(sample("sample_hires", hw, hh))
        plans.append(vae("vae_decode_hires", "decode", hw, hh))
    elif upscaler is not None:
        plans.append(upscale("upscale", width, height))
    return plans


def _hires_size(width: int, height: int, hires: float, downscale: int) -> tuple[int, int]:
    return (
        int(round(width * hires / downscale)) * downscale,
        int(round(height * hires / downscale)) * downscale,
    )


class _Loop(torch.nn.Module):
    """Wraps a tiled loop so that ``functional_call`` can swap the inner model's weights."""

    def __init__(self, inner: torch.nn.Module, loop, **kwargs: object) -> None:
        super().__init__()
        self.inner = inner
        self.loop = loop
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loop(self.inner, x, **self.kwargs)


# -- the engines' own code on fake tensors ---------------------------------------------------------


def predict_engine_vae(
    module: torch.nn.Module,
    kind: str,
    input_shape: tuple[int, ...],
    dtype: torch.dtype | str = torch.float32,
    tile: int | None = None,
    mode: str = "exact",
    backend: str = "cpu",
    state_offload: str = "device",
) -> PeakPrediction:
    """Peak of :func:`lib_vram.vae.tiled_decode`/``tiled_encode`` on ``module`` (any layout the
    engine supports: the WebUI's own VAE, ldm, diffusers, :mod:`lib_vram.planning.reference`), predicted by
    running the engine itself on fake tensors (its finite-check guard off, its state kept on the
    device). ``tile=None`` predicts the untiled pass the engine runs when everything fits."""
    from lib_vram.vae import TiledVAEConfig, tiled_decode, tiled_encode

    if kind not in ("decode", "encode"):
        raise ValueError(f"`kind` must be 'decode' or 'encode', got {kind!r}")
    dt = dtype_of(dtype)
    fmode = new_fake_mode()
    cfg = TiledVAEConfig(
        mode="auto" if tile is None else mode,
        tile=tile,
        budget_bytes=2**50,
        dtype=dt,
        guard=False,
        state_offload=state_offload,
    )
    run = tiled_decode if kind == "decode" else tiled_encode
    state = fake_state(module, fmode, dt)

    def call(x: torch.Tensor) -> torch.Tensor:
        return run(module, x, config=cfg)

    wrapper = _Loop(module, lambda m, x: call(x))
    fn = fake_call(wrapper, {f"inner.{k}": v for k, v in state.items()})
    return predict_callable(
        fn,
        (tuple(input_shape),),
        dtype=dt,
        weights=weights_bytes(module, dt),
        backend=backend,
        fake_mode=fmode,
    )


_PRECISION = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def predict_engine_upscale(
    model: object,
    input_shape: tuple[int, ...],
    dtype: str = "fp32",
    tile: int | None = None,
    batch: int = 1,
    scale: int = 4,
    backend: str = "cpu",
    overlap: int | None = None,
) -> PeakPrediction:
    """Peak of :func:`lib_vram.upscale.upscale_tensor` with ``model`` (a ``torch.nn.Module``),
    predicted by running the engine on fake tensors (finite check off, accumulator on the device;
    ``overlap`` None: the engine's default for an uncalibrated model)."""
    from lib_vram.upscale import UpscaleConfig, upscale_tensor

    net = getattr(model, "model", model)
    dt = dtype_of(dtype)
    fmode = new_fake_mode()
    side = max(input_shape[-2:])
    cfg = UpscaleConfig(
        tile=side if tile is None else tile,
        batch=batch,
        overlap=overlap,
        precision=dtype
        if isinstance(dtype, str)
        else str(dtype).replace("torch.float", "fp").replace("torch.bfloat16", "bf16"),
        device="cpu",
        budget_bytes=2**50,
        accumulate_on="device",
        check_finite=False,
        calibrate=False,
    )
    state = fake_state(net, fmode, dt)

    def loop(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        # A plain callable: the engine then leaves the module's device/dtype alone (the fake
        # weights are already of ``dtype``).
        return upscale_tensor(lambda t: m(t), x, config=cfg, scale=scale)

    fn = fake_call(_Loop(net, loop), {f"inner.{k}": v for k, v in state.items()})
    return predict_callable(
        fn, (tuple(input_shape),), dtype=dt, weights=weights_bytes(net, dt), backend=backend, fake_mode=fmode
    )
