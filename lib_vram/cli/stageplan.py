"""The ``plan`` command's model of a job: its stages (:func:`job_stages`), each planned by the
function its engine decides with at run time (:func:`lib_vram.vae.plan_vae`,
:func:`lib_vram.upscale.plan_upscale`, :func:`lib_vram.sampling.plan_sampling`) on the
:mod:`lib_vram.planning.reference` architectures built on the meta device: no weights, no ldm/sgm,
nothing run over the image. Peak = the weights on the card + the engine's predicted peak.

The engines' fake-tensor runs (:func:`predict_engine_vae`, :func:`predict_loop`) are
the validators of those estimates (tests, ``bench planner``), not a second planner.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
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

MiB = 1 << 20


_RECORD_FIELDS = (  # what a stage's record (StagePlan.to_dict) carries as it is
    "stage", "plan", "predicted_peak_bytes", "fits", "budget_bytes", "safety_margin_bytes", "resident_bytes",
    "input_bytes", "activation_bytes", "tile", "batch", "dtype", "warning",
)  # fmt: skip


@dataclass(frozen=True)
class StagePlan:
    """The chosen plan of one stage, with the numbers behind it."""

    stage: str
    plan: str  # the engine's label ("untiled", "exact t64", "tiled t192 o16 b2", "whole b1")
    predicted_peak_bytes: int
    fits: bool
    budget_bytes: int  # free memory minus the safety margin (what the whole peak must fit)
    safety_margin_bytes: int
    resident_bytes: int  # on the card during the stage, not its model's (and a batch's waiting images)
    weights_bytes: int  # the stage model's
    input_bytes: int
    activation_bytes: int  # the engine's predicted peak minus the input
    tile: int | None
    batch: int
    dtype: str
    key: tuple = ()  # the planner-memory key the engine learns under
    warning: str | None = None
    candidates: list[planner.Candidate] = field(default_factory=list, compare=False)
    moved_off: str = ""  # what leaves the card for this stage to fit ("UNet, text encoders")
    suggestion: str | None = None  # sampling that does not fit: the largest size and batch that would
    attention: str = ""  # sampling: the attention planned for
    models: tuple[dict, ...] = ()
    """The placed plan (:func:`plan_placed_job`): each model of the checkpoint during the stage
    (``name``, ``where``: ``card``/``host``/``streamed``, ``card_mib``, ``mib``); empty: not placed."""
    card_bytes: int = 0  # placed: the checkpoint's bytes on the card between forwards
    streamed_bytes: int = 0  # placed: the UNet's part in host memory, through the card per forward
    bytes_moved_per_step: int | None = None  # placed sampling: host->card bytes (streamed x forwards)
    lowvram_bytes_per_step: int | None = None  # what --lowvram moves per step for the same UNet
    controlnet_bytes: int = 0  # sampling: the ControlNets' weights on the card (in the peak)

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
        sampling = ("attention", "suggestion", "controlnet_bytes") if self.attention else ()
        return {
            **placed,
            **{k: getattr(self, k) for k in _RECORD_FIELDS + sampling},
            "model_weights_bytes": self.weights_bytes,
            "moved_off_card": self.moved_off.split(", ") if self.moved_off else [],
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
    total, budget = weights + resident + peak, free_bytes - margin
    warning = None
    if total > budget:
        chosen = planner.choose([planner.Candidate(label, total, tile, batch)], max(free_bytes, 0), margin)
        warning = chosen.warning
    cands = [dataclasses.replace(c, peak_bytes=c.peak_bytes + weights + resident) for c in raw_candidates]
    return StagePlan(
        stage=stage, plan=label, predicted_peak_bytes=total, fits=total <= budget, budget_bytes=budget,
        safety_margin_bytes=margin, resident_bytes=resident, weights_bytes=weights, input_bytes=input_bytes,
        activation_bytes=max(0, peak - input_bytes), tile=tile, batch=batch, dtype=dtype, key=key,
        warning=warning, candidates=cands,
    )  # fmt: skip


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
) -> StagePlan:
    """``stage`` as the VAE engine plans it (:func:`lib_vram.vae.plan_vae`) for the reference VAE
    of ``arch``, within what the preset leaves of ``free_bytes``."""
    from lib_vram.vae import estimate_peak_bytes, plan_vae

    a = reference.vae_arch(arch)
    module = reference_vae(arch, kind)
    dt = dtype_of(dtype)
    latent = (height // a.downscale, width // a.downscale)
    shape = (1, a.z_channels, *latent) if kind == "decode" else (1, 3, height, width)
    weights = weights_bytes(module, dt)
    input_bytes = math.prod(shape) * dt.itemsize
    budget = max(0, free_bytes - safety_margin_bytes - weights - resident_bytes)
    if preset.vae_mode == "off":  # the WebUI's own forward, untiled
        peak = estimate_peak_bytes(module, shape, dt, tile=None, mode="untiled", backend=backend)
        label, tile, cands, key = "untiled", None, [planner.Candidate("untiled", peak)], ()
    else:
        p = plan_vae(module, shape, dt, budget, mode=preset.vae_mode, backend=backend)
        label, tile, peak, cands, key = p.plan, p.tile, p.peak_bytes, list(p.candidates), p.key
    return _stage(
        stage, label, tile, 1, peak, cands, free_bytes=free_bytes, margin=safety_margin_bytes,
        weights=weights, resident=resident_bytes, input_bytes=input_bytes, dtype=dtype, key=key,
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
    resident_bytes: int = 0,
    backend: str = "cuda",
) -> StagePlan:
    """``stage`` as the upscale engine plans it (:func:`lib_vram.upscale.plan_upscale`) for the
    reference 4x upscaler ``kind`` (``"rrdb"``/``"compact"``), within what is left of ``free_bytes``."""
    from lib_vram.upscale import plan_upscale

    scale = 4
    module = reference_upscaler(kind, scale)
    dt = dtype_of(dtype)
    shape = (1, 3, height, width)
    weights = weights_bytes(module, dt)
    budget = max(1, free_bytes - safety_margin_bytes - weights - resident_bytes)
    p = plan_upscale(module, shape, dt, budget, scale=scale, host_apart=backend != "cpu")
    input_bytes = 0 if p.in_host else 3 * height * width * dt.itemsize
    tile = None if p.whole else p.tile
    cand = p.candidate(p.tile, p.batch, p.halo)
    return _stage(
        stage, p.plan, tile, p.batch, p.peak_bytes, [cand], free_bytes=free_bytes,
        margin=safety_margin_bytes, weights=weights, resident=resident_bytes, input_bytes=input_bytes,
        dtype=dtype, key=p.key,
    )  # fmt: skip


SAMPLING_ARCHS = ("sd15", "sdxl")
"""Archs whose UNet the sampling estimate knows (:func:`lib_vram.sampling.reference_spec`)."""


def sampling_stage(
    stage: str, p: object, budget: int, margin: int, shift: int = 0, **fields: object
) -> StagePlan:
    """The stage of sampling plan ``p``, its peaks moved by ``shift``; ``fields``: ``resident_bytes``,
    ``dtype``, ``attention`` and what else differs from ``p``."""
    n = p.control_bytes
    return StagePlan(**{
        "stage": stage, "plan": p.label + (f", ControlNet {n / MiB:.0f} MiB" if n else ""),
        "predicted_peak_bytes": p.predicted_peak_bytes + shift, "fits": p.fits, "budget_bytes": budget,
        "safety_margin_bytes": margin, "weights_bytes": p.weights_bytes,
        "input_bytes": p.input_bytes, "activation_bytes": p.activation_bytes, "tile": None,
        "batch": p.micro_batch, "key": p.key, "warning": None if p.fits else p.suggestion,
        "candidates": [dataclasses.replace(c, peak_bytes=c.peak_bytes + shift) for c in p.candidates],
        "suggestion": p.suggestion, "controlnet_bytes": n, **fields,
    })  # fmt: skip


TILE_BATCH = 4
"""Tiled Diffusion's default latent tile batch size (MultiDiffusion's "Latent tile batch size")."""
TILE_OVERLAP = 48
"""Tiled Diffusion's default latent tile overlap in txt2img (latent px)."""


@dataclass(frozen=True)
class PassOptions:
    """What else shapes the sampling passes' UNet forward (``plan``'s options):

    * ``hypertile``: the WebUI's HyperTile on the UNet with this max tile size in px (None: off;
      depth 3, swap size 3: the WebUI's defaults; its random tiles keep the batch whole), and
      ``token_merging``: its ratio (0: off), both
      modelled by the estimate (:class:`lib_vram.sampling.SelfAttention`);
    * ``tiled``: Tiled Diffusion (MultiDiffusion) with latent tiles of this side in image px,
      ``tile_batch`` tiles per forward at most (the extension evens the batches out) and its
      txt2img overlap: the pass's forward is one tile batch (x cond/uncond x images), whole;
    * ``frames``: AnimateDiff's frames of one forward (its context batch): the batch is the frames
      x cond/uncond, coupled (never split).

    In the WebUI VRAM Guard plans Tiled Diffusion's and AnimateDiff's passes from their measured
    first forward; ``plan`` can only predict their stock forward (motion modules not counted)."""

    hypertile: int | None = None
    token_merging: float = 0.0
    tiled: int | None = None
    tile_batch: int = TILE_BATCH
    frames: int | None = None
    ip_adapter: str | None = None
    """An IP-Adapter unit (:data:`IP_ADAPTERS`): its image tokens in every cross-attention
    (modelled), its encoder's output on the card, its encoder's own stage (:func:`ip_encode_stage`)."""

    def self_attention(self, arch: str) -> object:
        from lib_vram.sampling import HyperTile, SelfAttention, TokenMerging

        ht = (
            HyperTile(max_tile_px=self.hypertile, sdxl=arch == "sdxl") if self.hypertile is not None else None
        )
        tm = TokenMerging(self.token_merging) if self.token_merging else None
        ip = (ip_adapter_bytes(self.ip_adapter, arch)["tokens"],) if self.ip_adapter else ()
        return SelfAttention(ht, tm, ip) if ht is not None or tm is not None or ip else None

    def tiles(self, latent_hw: tuple[int, int]) -> tuple[tuple[int, int], int, int]:
        """Tiled Diffusion at a latent of ``latent_hw``: the tile (latent px, at most the latent),
        the tiles in all and the tiles per forward (MultiDiffusion's grid: columns and rows of
        ``ceil((side - overlap) / (tile - overlap))``, the batches evened out)."""
        t = self.tiled // 8
        th, tw = min(t, latent_hw[0]), min(t, latent_hw[1])
        overlap = max(0, min(TILE_OVERLAP, t - 4))

        def count(side: int, tile: int) -> int:
            return 1 if tile >= side else math.ceil((side - overlap) / (tile - overlap))

        n = count(latent_hw[0], th) * count(latent_hw[1], tw)
        return (th, tw), n, math.ceil(n / math.ceil(n / self.tile_batch))

    def describe(self) -> list[str]:
        out = []
        if self.hypertile is not None:
            out.append(f"HyperTile (max tile {self.hypertile} px)")
        if self.token_merging:
            out.append(f"token merging {self.token_merging:g}")
        if self.tiled is not None:
            out.append(f"Tiled Diffusion ({self.tiled} px tiles, up to {self.tile_batch} per forward)")
        if self.frames is not None:
            out.append(f"AnimateDiff ({self.frames} frames)")
        if self.ip_adapter is not None:
            out.append(f"IP-Adapter {self.ip_adapter} ({IP_ADAPTERS[self.ip_adapter]})")
        return out


IP_ADAPTERS = {"sd15": "ViT-H", "sd15-plus": "ViT-H", "sdxl": "ViT-bigG", "sdxl-plus": "ViT-H"}
"""IP-Adapter models ``plan`` knows (ip-adapter_sd15, ip-adapter-plus_sd15, ip-adapter_sdxl,
ip-adapter-plus_sdxl_vit-h) and the CLIP vision encoder of each."""
_VISION = {"ViT-H": (1280, 5120, 32, 1024), "ViT-bigG": (1664, 8192, 48, 1280)}
"""sd-webui-controlnet's CLIP vision configs (``annotator/clipvision``): hidden width, MLP width,
layers, projection; 224 px images in 14 px patches (257 tokens), 16 heads, float32."""


def ip_adapter_bytes(kind: str, arch: str) -> dict[str, int]:
    """IP-Adapter ``kind`` (:data:`IP_ADAPTERS`) on ``arch``'s UNet, float32 as sd-webui-controlnet
    v1.1.455 runs it: ``tokens``; ``encoder``: the CLIP vision model's weights (closed form of
    transformers' ``CLIPVisionModelWithProjection``); ``encode``: its run's activations (the
    image, every layer's hidden states, which it returns, and the larger of a layer's attention
    scores or MLP); ``output``: what it returns, kept on the card as the unit's input for the job;
    ``adapter``: the image projection (a linear map, or plus's 4-layer resampler) and a key and a
    value projection of the image tokens per cross-attention, kept in host memory."""
    from lib_vram.sampling import reference_spec

    d, mlp, layers, proj = _VISION[IP_ADAPTERS[kind]]
    n, spec = 257, reference_spec(arch)
    encoder = d * (3 * 14 * 14 + n + 5) + layers * (4 * d * d + 9 * d + 2 * d * mlp + mlp) + d * proj
    kept = (layers + 1) * n * d + d + proj
    encode = 4 * (3 * 224 * 224 + kept + max(2 * n * mlp, 4 * n * d + 2 * 16 * n * n))
    ctx, plus = spec.context_dim, kind.endswith("plus")
    if plus:  # Resampler: 16 latents, proj_in/out, 4 x (2 norms, q, kv, out; norm, 4x feed-forward)
        dim, inner = (1280, 1280) if arch == "sdxl" else (ctx, 768)
        block = 6 * dim + 4 * dim * inner + 8 * dim * dim
        adapter = 16 * dim + d * dim + dim + dim * ctx + 3 * ctx + 4 * block
    else:  # ImageProjModel: 4 tokens from the projected embedding, a norm
        adapter = proj * 4 * ctx + 4 * ctx + 2 * ctx
    adapter += 2 * ctx * spec.cross_width
    return dict(
        tokens=16 if plus else 4, encoder=4 * encoder, encode=encode, output=4 * kept, adapter=4 * adapter
    )


CONTROLNET_HIRES = ("both", "lowres", "highres")
"""Which passes of a hires job the ControlNet units run in (ControlNet's "Hires-fix option")."""


def sampling_pass(
    arch: str, stage: str, w: int, h: int, batch: int, controlnets: tuple[str, ...], hires_option: str,
    options: PassOptions | None = None, dtype: str = "fp16", **kw,
) -> object:  # fmt: skip
    """:func:`lib_vram.sampling.plan_sampling` of one forward of the reference UNet of ``arch`` in
    ``dtype`` over ``2 x batch`` samples (the WebUI batches cond and uncond), 77 tokens; one
    reference spec per ControlNet unit, none in the hires pass with ``lowres`` or in the first pass
    with ``highres``. ``options``: what else shapes the forward (:class:`PassOptions`). ``kw``:
    ``attention``, ``budget_bytes``, ``backend``, ``resident_bytes``."""
    from lib_vram.sampling import plan_sampling, reference_control, reference_spec

    opt = options or PassOptions()
    skipped = {"lowres": "sample_hires", "highres": "sample"}.get(hires_option)
    controls = () if stage == skipped else tuple(reference_control(c) for c in controlnets)
    down = reference.vae_arch(arch).downscale
    hw = (h // down, w // down)
    dt = dtype_of(dtype)
    # HyperTile's swap size 3 draws its tiles per forward: the guard never splits such a pass
    n, label, whole = 2 * batch, None, opt.hypertile is not None
    if opt.tiled is not None:
        # one tile batch per forward; the whole latent, the extension's sum of the tiles' outputs
        # (its size) and its float32 weights stay on the card beside it
        tile, count, per = opt.tiles(hw)
        n, whole = 2 * batch * per, True
        latent = 2 * batch * 4 * hw[0] * hw[1] * dt.itemsize  # (cond/uncond x images) x 4 channels
        kw["resident_bytes"] = kw.get("resident_bytes", 0) + 2 * latent + hw[0] * hw[1] * 4
        forwards = math.ceil(count / per)
        label = (
            f"Tiled Diffusion: {count} tile{'s' * (count > 1)} of {tile[1] * down}x{tile[0] * down} px, "
            f"{per} per forward ({forwards} forward{'s' * (forwards > 1)} of {n} per step)"
        )
    elif opt.frames is not None:
        n, whole = 2 * opt.frames, True
        label = f"AnimateDiff: {opt.frames} frames x cond/uncond in one forward (frames are never split)"
    if opt.ip_adapter is not None:  # its encoder's output stays on the card; its cache: whole
        kw["resident_bytes"] = kw.get("resident_bytes", 0) + ip_adapter_bytes(opt.ip_adapter, arch)["output"]
        whole = True
    shape = dict(
        latent_hw=tile if opt.tiled is not None else hw, context_tokens=77, dtype=dt,
        controls=controls, whole=whole, self_attention=opt.self_attention(arch), **kw,
    )  # fmt: skip
    p = plan_sampling(reference_spec(arch), batch=n, **shape)
    if label is None:
        return p
    suggestion = p.suggestion
    if not p.fits:
        # what would fit is a smaller tile batch or fewer frames, not a smaller image
        unit = 2 * batch if opt.tiled is not None else 2
        what = "a tile batch of {} fits" if opt.tiled is not None else "{} frames fit"
        smaller = range(n // unit - 1, 0, -1)
        spec = reference_spec(arch)
        k = next((k for k in smaller if plan_sampling(spec, batch=k * unit, **shape).fits), None)
        need = p.predicted_peak_bytes / MiB
        head = f"{label.split(':')[0]} needs {need:.0f} MiB, the card offers {p.budget_bytes / MiB:.0f} MiB"
        none = "a smaller tile may fit" if opt.tiled is not None else "no fewer frames fit either"
        suggestion = f"{head}: {what.format(k) if k else none}"
    return dataclasses.replace(p, label=label, suggestion=suggestion)


def ip_encode_stage(kind: str, arch: str, free_bytes: int, margin: int, resident: int) -> StagePlan:
    """IP-Adapter's encoder run (its preprocessor) beside ``resident`` bytes: the CLIP vision model
    on the card for it (VRAM Guard sends it to host memory after), its activations; the plan says
    where the adapter's weights are (host memory: sd-webui-controlnet runs them there)."""
    b = ip_adapter_bytes(kind, arch)
    label = f"{IP_ADAPTERS[kind]} encoder on the card, adapter {b['adapter'] / MiB:.0f} MiB in host memory"
    return _stage(
        "ip_adapter_encode", label, None, 1, b["encode"], [], free_bytes=free_bytes, margin=margin,
        weights=b["encoder"], resident=resident, input_bytes=4 * 3 * 224 * 224, dtype="fp32", key=(),
    )  # fmt: skip


def vae_weights(arch: str, dtype: str) -> tuple[int, int]:
    """(decoder, encoder) weights of the reference VAE of ``arch`` at ``dtype``."""
    dt = dtype_of(dtype)
    return weights_bytes(reference_vae(arch, "decode"), dt), weights_bytes(reference_vae(arch, "encode"), dt)


def _moving_off(at: Callable[[int], StagePlan], on_card: int, movable: list[tuple[str, int]]) -> StagePlan:
    """``at(on_card)``; where that does not fit, ``at`` with the ``movable`` (name, bytes) off the card."""
    sp = at(on_card)
    if sp.fits or not movable:
        return sp
    off = at(on_card - sum(n for _, n in movable))
    return dataclasses.replace(off, moved_off=", ".join(name for name, _ in movable))


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
    safety_margin_bytes: int | None = None,
    host_swaps: bool = False,
    attention: str | None = None,
    controlnets: tuple[str, ...] = (),
    controlnet_hires: str = "both",
    options: PassOptions | None = None,
    dtype: str = "fp16",
) -> list[StagePlan]:
    """Plans for every memory-heavy stage of a job (``options``: :class:`PassOptions`; ``dtype``:
    the UNet's and text encoders', FP32 with the WebUI's ``--no-half``).

    ``free_bytes``: what the job may use with the models *off* the device (the UNet/text encoders
    are added per stage). The WebUI decodes a batch one image at a time: ``batch`` adds only the
    decoded images waiting on the device. Sampling plans one UNet forward of the whole batch (cond
    and uncond); the idle VAE and text encoders leave the card for a step that does not fit beside
    them (``moved_off``), unless the host swaps models itself (``host_swaps``).
    """
    a = reference.vae_arch(arch)
    margin = preset.safety_margin(total_bytes) if safety_margin_bytes is None else safety_margin_bytes
    backend = getattr(caps, "backend", "cuda")
    vae_dtype = resolve_precision(preset.precision_vae, caps)
    up_dtype = resolve_precision(preset.precision_upscale, caps)
    # a VAE pass that does not fit beside the UNet and text encoders moves the ones the preset
    # allows off the card for that pass (lib_vram.residency does it)
    unet, te = a.model_bytes(dtype_of(dtype).itemsize)
    resident = 0 if host_swaps else unet + te
    movable = [
        (name, n)
        for name, n, ok in (
            ("UNet", unet, preset.offload_unet_during_vae),
            ("text encoders", te, preset.offload_text_encoder_during_vae),
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
                resident_bytes=on_card + waiting(w, h), backend=backend,
            )  # fmt: skip

        return _moving_off(at, resident, movable)

    sampling = arch in SAMPLING_ARCHS
    if sampling:
        from lib_vram.sampling import attention_of

        att = attention_of(attention or "Automatic", backend=backend)
        vae_bytes = sum(vae_weights(arch, vae_dtype))
        idle = [] if host_swaps else [("VAE", vae_bytes), ("text encoders", te)]
        budget = max(0, free_bytes - margin)

    def sample(stage: str, w: int, h: int) -> StagePlan:
        def at(on_card: int) -> StagePlan:
            p = sampling_pass(
                arch, stage, w, h, batch, controlnets, controlnet_hires, options, attention=att,
                budget_bytes=budget, resident_bytes=on_card, backend=backend, dtype=dtype,
            )  # fmt: skip
            return sampling_stage(
                stage, p, budget, margin, resident_bytes=on_card, dtype=dtype, attention=att
            )

        return _moving_off(at, sum(n for _, n in idle), idle)

    stages = job_stages(
        width, height, hires, upscaler, a.downscale, sample=sample if sampling else None, vae=vae,
        upscale=lambda stage, w, h: plan_upscale_stage(
            stage, upscaler, w, h, free_bytes, margin, dtype=up_dtype,
            resident_bytes=resident if stage == "hires_upscale" else 0, backend=backend),
    )  # fmt: skip
    if sampling and options is not None and options.ip_adapter is not None:  # (its preprocessor first)
        kind = options.ip_adapter
        encode = _moving_off(lambda n: ip_encode_stage(kind, arch, free_bytes, margin, n), resident, movable)
        stages.insert(0, encode)
    return stages


def job_stages(
    width: int,
    height: int,
    hires: float | None,
    upscaler: str | None,
    downscale: int,
    *,
    sample: Callable[[str, int, int], StagePlan] | None,
    vae: Callable[[str, str, int, int], StagePlan],
    upscale: Callable[[str, int, int], StagePlan],
) -> list[StagePlan]:
    """A job's stages in the WebUI's order, each planned by its function (``sample``: the sampling
    passes, None for none; ``vae(stage, kind, w, h)``; ``upscale(stage, w, h)``)."""
    plans = [sample("sample", width, height)] if sample else []
    plans.append(vae("vae_decode", "decode", width, height))
    if hires is not None:
        hw, hh = (int(round(side * hires / downscale)) * downscale for side in (width, height))
        if upscaler is not None:
            plans.append(upscale("hires_upscale", width, height))
        plans.append(vae("vae_encode", "encode", hw, hh))
        if sample:
            plans.append(sample("sample_hires", hw, hh))
        plans.append(vae("vae_decode_hires", "decode", hw, hh))
    elif upscaler is not None:
        plans.append(upscale("upscale", width, height))
    return plans


class Loop(torch.nn.Module):
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
) -> PeakPrediction:
    """Peak of :func:`lib_vram.vae.tiled_decode`/``tiled_encode`` on ``module`` (any layout the
    engine supports), predicted by running the engine itself on fake tensors. ``tile=None``: the
    untiled pass the engine runs when everything fits."""
    if kind not in ("decode", "encode"):
        raise ValueError(f"`kind` must be 'decode' or 'encode', got {kind!r}")
    dt = dtype_of(dtype)
    loop = vae_loop(kind, tile, mode, dt)
    return predict_loop(module, loop, input_shape, dt, backend, new_fake_mode())


def vae_loop(kind: str, tile: int | None, mode: str, dt: torch.dtype):  # noqa: ANN201
    """``loop(module, x)``: the tiled VAE engine as the predictions run it (unbounded budget, the
    finite-check guard off; ``tile=None``: auto, the untiled pass when everything fits)."""
    from lib_vram.vae import TiledVAEConfig, tiled_decode, tiled_encode

    cfg = TiledVAEConfig(mode="auto" if tile is None else mode, tile=tile, budget_bytes=2**50, dtype=dt,
                         guard=False, state_offload="device")  # fmt: skip
    run = tiled_decode if kind == "decode" else tiled_encode
    return lambda m, x: run(m, x, config=cfg)


def predict_loop(net, loop, input_shape, dt, backend, fmode) -> PeakPrediction:  # noqa: ANN001
    """``loop(net, x)`` on fake tensors (``net``'s weights fake, of ``dt``): its predicted peak."""
    state = {f"inner.{k}": v for k, v in fake_state(net, fmode, dt).items()}
    fn, weights = fake_call(Loop(net, loop), state), weights_bytes(net, dt)
    shapes = (tuple(input_shape),)
    return predict_callable(fn, shapes, dtype=dt, weights=weights, backend=backend, fake_mode=fmode)


def upscale_loop(tile: int, batch: int, scale: int, precision: str = "fp32", overlap: int | None = None):  # noqa: ANN201
    """``loop(module, x)``: the upscale engine as the predictions run it (on the CPU device, unbounded
    budget, accumulator on the device, no finite check, no calibration)."""
    from lib_vram.upscale import UpscaleConfig, upscale_tensor

    cfg = UpscaleConfig(tile=tile, batch=batch, overlap=overlap, device="cpu", budget_bytes=2**50,
                        precision=precision.replace("torch.bfloat16", "bf16"), accumulate_on="device",
                        check_finite=False, calibrate=False)  # fmt: skip
    # a plain callable: the engine then leaves the module's device/dtype alone
    return lambda m, x: upscale_tensor(lambda t: m(t), x, config=cfg, scale=scale)
