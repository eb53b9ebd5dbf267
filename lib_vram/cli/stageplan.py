"""Per-stage plans for a generation: predict every candidate plan's peak, then let the planner choose.

Stages of a txt2img job (with hires fix and an upscaler, as in the WebUI): ``vae_decode`` of the
first pass, ``hires_upscale`` (the upscaler on the first-pass image), ``vae_encode`` at the hires
size, ``vae_decode_hires``; or, without hires fix, a final ``upscale`` (Extras-style) of the image.

Each stage's candidates are: untiled, then the preset's tile ladder (VAE tiles in latent px,
upscaler tiles in image px, batches up to the preset's maximum). Every candidate's peak is
predicted by a fake run (:mod:`lib_vram.core.predict`) of the tiled loop in this module
(:func:`tiled_decode`, :func:`tiled_encode`, :func:`tiled_upscale`): the same layer sequence the
tiled engines run, on tile-sized inputs, with a full-size output accumulator. The loops are also
runnable on real tensors, which is how ``bench planner`` measures them.

Peak = weights of the stage's model + resident weights that are not offloaded (UNet, text
encoders; see the preset) + the stage's input + the predicted activations.
"""

from __future__ import annotations

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

DECODER_HALO = 12
"""Latent px of context around a decoder tile's core (the receptive field after the mid block is
~12.25 latent px; the fast/streaming plans use the rounded value)."""
ENCODER_HALO = 32
"""Image px of context around an encoder tile's core (multiple of 8)."""
UPSCALE_OVERLAP = 16
"""Input px two neighbouring upscaler tiles share (blended)."""


# -- the tiled loops (run on fake tensors for predictions, real ones for measurements) -----------


def _spans(size: int, tile: int) -> list[tuple[int, int]]:
    n = max(1, -(-size // tile))
    edges = [round(i * size / n) for i in range(n + 1)]
    return [(edges[i], edges[i + 1]) for i in range(n)]


def _repeat(seen: set, key: tuple, dedupe: bool) -> bool:
    """With ``dedupe``, True for a tile shape already run: every tile frees what it allocated and
    writes its result in place, so a tile of a shape already seen cannot raise the peak and a fake
    run may skip it (this makes predictions of many-tile plans cheap)."""
    if not dedupe:
        return False
    if key in seen:
        return True
    seen.add(key)
    return False


def tiled_decode(
    decoder: torch.nn.Module, z: torch.Tensor, tile: int, halo: int = DECODER_HALO, dedupe: bool = False
) -> torch.Tensor:
    """Decode ``z`` with a reference :class:`~lib_vram.planning.reference.Decoder`: ``conv_in`` + mid block
    on the whole latent, the rest per tile (core ``<= tile`` latent px plus ``halo``)."""
    f = 2 ** (len(decoder.up) - 1)
    h = decoder.mid(decoder.conv_in(z))
    b, _, hh, ww = h.shape
    out = torch.empty((b, 3, hh * f, ww * f), dtype=z.dtype, device=z.device)
    seen: set = set()
    for y0, y1 in _spans(hh, tile):
        for x0, x1 in _spans(ww, tile):
            ys, ye, xs, xe = max(0, y0 - halo), min(hh, y1 + halo), max(0, x0 - halo), min(ww, x1 + halo)
            if _repeat(seen, (ye - ys, xe - xs), dedupe):
                continue
            t = decoder.forward_tail(h[:, :, ys:ye, xs:xe])
            out[:, :, y0 * f : y1 * f, x0 * f : x1 * f] = t[
                :, :, (y0 - ys) * f : (y1 - ys) * f, (x0 - xs) * f : (x1 - xs) * f
            ]
            del t
    return out


def tiled_encode(
    encoder: torch.nn.Module, x: torch.Tensor, tile: int, halo: int = ENCODER_HALO, dedupe: bool = False
) -> torch.Tensor:
    """Encode ``x`` with a reference :class:`~lib_vram.planning.reference.Encoder`: the down path per tile
    (core ``<= tile`` latent px = ``8 * tile`` image px, plus ``halo`` image px), the mid block and
    output convolution on the whole latent."""
    f = 2 ** (len(encoder.down) - 1)
    b, _, hh, ww = x.shape
    lh, lw = hh // f, ww // f
    feats = None
    seen: set = set()
    for y0, y1 in _spans(lh, tile):
        for x0, x1 in _spans(lw, tile):
            ys, ye = max(0, y0 * f - halo), min(hh, y1 * f + halo)
            xs, xe = max(0, x0 * f - halo), min(ww, x1 * f + halo)
            if feats is not None and _repeat(seen, (ye - ys, xe - xs), dedupe):
                continue
            seen.add((ye - ys, xe - xs))
            t = encoder.forward_head(x[:, :, ys:ye, xs:xe])
            if feats is None:
                feats = torch.empty((b, t.shape[1], lh, lw), dtype=t.dtype, device=t.device)
            oy, ox = y0 - ys // f, x0 - xs // f
            feats[:, :, y0:y1, x0:x1] = t[:, :, oy : oy + (y1 - y0), ox : ox + (x1 - x0)]
            del t
    h = encoder.mid(feats)
    del feats
    h = encoder.norm_out(h)
    h = reference._act(h, encoder.act)
    return encoder.conv_out(h)


def tiled_upscale(
    model: torch.nn.Module,
    x: torch.Tensor,
    tile: int,
    batch: int,
    scale: int,
    overlap: int = UPSCALE_OVERLAP,
    dedupe: bool = False,
) -> torch.Tensor:
    """Upscale ``x`` by ``scale`` in tiles of ``tile`` px (``batch`` tiles per forward), averaging
    the overlaps into full-size output and weight accumulators."""
    b, c, hh, ww = x.shape
    th, tw = min(tile, hh), min(tile, ww)
    step_h, step_w = max(1, th - overlap), max(1, tw - overlap)
    ys = sorted({min(y, hh - th) for y in range(0, max(1, hh - overlap), step_h)})
    xs = sorted({min(v, ww - tw) for v in range(0, max(1, ww - overlap), step_w)})
    coords = [(y, v) for y in ys for v in xs]
    out = torch.zeros((b, c, hh * scale, ww * scale), dtype=x.dtype, device=x.device)
    weight = torch.zeros((1, 1, hh * scale, ww * scale), dtype=x.dtype, device=x.device)
    seen: set = set()
    for i in range(0, len(coords), batch):
        chunk = coords[i : i + batch]
        if _repeat(seen, (len(chunk),), dedupe):
            continue
        inp = torch.cat([x[:, :, y : y + th, v : v + tw] for y, v in chunk])
        res = model(inp)
        del inp
        for j, (y, v) in enumerate(chunk):
            sl = (
                slice(None),
                slice(None),
                slice(y * scale, (y + th) * scale),
                slice(v * scale, (v + tw) * scale),
            )
            out[sl] += res[j * b : (j + 1) * b]
            weight[sl] += 1
        del res
    out /= weight
    return out


# -- predictions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """The chosen plan of one stage, with the numbers behind it."""

    stage: str
    plan: str
    predicted_peak_bytes: int
    fits: bool
    budget_bytes: int
    safety_margin_bytes: int
    resident_bytes: int
    """Weights that stay on the device during the stage but are not the stage's own model."""
    prediction: PeakPrediction
    tile: int | None
    batch: int
    dtype: str
    warning: str | None = None
    candidates: list[planner.Candidate] = field(default_factory=list, compare=False)

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "plan": self.plan,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "fits": self.fits,
            "budget_bytes": self.budget_bytes,
            "safety_margin_bytes": self.safety_margin_bytes,
            "resident_bytes": self.resident_bytes,
            "model_weights_bytes": self.prediction.weights_bytes,
            "input_bytes": self.prediction.input_bytes,
            "activation_bytes": self.prediction.activation_bytes,
            "tile": self.tile,
            "batch": self.batch,
            "dtype": self.dtype,
            "warning": self.warning,
            "candidates": [
                {"plan": c.plan, "tile": c.tile, "batch": c.batch, "predicted_peak_bytes": c.peak_bytes}
                for c in self.candidates
            ],
        }


@functools.lru_cache(maxsize=8)
def _reference_vae(arch: str, dtype: str, attn: str):
    # Built on the meta device (no memory, no init work); the fake state stands in for the weights.
    mode = new_fake_mode()
    with torch.device("meta"):
        dec = reference.Decoder(reference.vae_arch(arch), attn=attn)
        enc = reference.Encoder(reference.vae_arch(arch), attn=attn)
    dt = dtype_of(dtype)
    return mode, (dec, fake_state(dec, mode, dt)), (enc, fake_state(enc, mode, dt))


@functools.lru_cache(maxsize=8)
def _reference_upscaler(kind: str, scale: int, dtype: str):
    mode = new_fake_mode()
    with torch.device("meta"):
        model = reference.build_upscaler(kind, scale)
    return mode, model, fake_state(model, mode, dtype_of(dtype))


class _Loop(torch.nn.Module):
    """Wraps a tiled loop so that ``functional_call`` can swap the inner model's weights."""

    def __init__(self, inner: torch.nn.Module, loop, **kwargs: object) -> None:
        super().__init__()
        self.inner = inner
        self.loop = loop
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loop(self.inner, x, **self.kwargs)


def _loop_call(module: torch.nn.Module, state: dict, loop, **kwargs: object):
    wrapper = _Loop(module, loop, **kwargs)
    return fake_call(wrapper, {f"inner.{k}": v for k, v in state.items()})


@functools.lru_cache(maxsize=512)
def predict_vae(
    kind: str,
    arch: str,
    width: int,
    height: int,
    dtype: str = "fp32",
    tile: int | None = None,
    backend: str = "cpu",
    attn: str = "sdpa",
) -> PeakPrediction:
    """Peak of a VAE decode (``kind="decode"``) or encode (``"encode"``) of a ``width`` x ``height``
    image with the reference ``arch``, untiled (``tile=None``) or tiled (``tile`` latent px)."""
    if kind not in ("decode", "encode"):
        raise ValueError(f"`kind` must be 'decode' or 'encode', got {kind!r}")
    a = reference.vae_arch(arch)
    if width <= 0 or height <= 0 or width % a.downscale or height % a.downscale:
        raise ValueError(
            f"`width`/`height` must be positive multiples of {a.downscale}, got {width}x{height}"
        )
    mode, (dec, dec_state), (enc, enc_state) = _reference_vae(arch, dtype, attn)
    lh, lw = height // a.downscale, width // a.downscale
    if kind == "decode":
        module, state, shape, loop = dec, dec_state, (1, a.z_channels, lh, lw), tiled_decode
    else:
        module, state, shape, loop = enc, enc_state, (1, 3, height, width), tiled_encode
    fn = fake_call(module, state) if tile is None else _loop_call(module, state, loop, tile=tile, dedupe=True)
    w = weights_bytes(module, dtype_of(dtype))
    with reference.dry_run():
        return predict_callable(fn, (shape,), dtype=dtype, weights=w, backend=backend, fake_mode=mode)


@functools.lru_cache(maxsize=512)
def predict_upscale(
    kind: str,
    width: int,
    height: int,
    dtype: str = "fp32",
    tile: int | None = None,
    batch: int = 1,
    scale: int = 4,
    backend: str = "cpu",
) -> PeakPrediction:
    """Peak of upscaling a ``width`` x ``height`` image with the reference upscaler ``kind``
    (``"rrdb"``/``"compact"``), untiled (``tile=None``) or in ``tile``-px tiles, ``batch`` per pass."""
    if width <= 0 or height <= 0:
        raise ValueError(f"`width`/`height` must be positive, got {width}x{height}")
    mode, model, state = _reference_upscaler(kind, scale, dtype)
    if tile is None:
        fn = fake_call(model, state)
    else:
        fn = _loop_call(model, state, tiled_upscale, tile=tile, batch=batch, scale=scale, dedupe=True)
    w = weights_bytes(model, dtype_of(dtype))
    return predict_callable(
        fn, ((1, 3, height, width),), dtype=dtype, weights=w, backend=backend, fake_mode=mode
    )


# -- choosing ------------------------------------------------------------------------------------


def _choice_to_plan(
    stage: str,
    choice: planner.Choice,
    predictions: dict,
    resident: int,
    dtype: str,
    candidates: list[planner.Candidate],
) -> StagePlan:
    c = choice.candidate
    return StagePlan(
        stage=stage,
        plan=c.plan,
        predicted_peak_bytes=c.peak_bytes,
        fits=choice.fits,
        budget_bytes=choice.budget_bytes,
        safety_margin_bytes=choice.safety_margin_bytes,
        resident_bytes=resident,
        prediction=predictions[(c.tile, c.batch)],
        tile=c.tile,
        batch=c.batch,
        dtype=dtype,
        warning=choice.warning,
        candidates=planner.order(candidates),
    )


def _label(tile: int | None, batch: int) -> str:
    return "untiled" if tile is None else f"tile {tile}" + (f" x{batch}" if batch > 1 else "")


def _choose_lazily(stage, key, options, predict, free_bytes, safety_margin_bytes, resident, dtype, memory):
    """Predict the options in preference order and stop at the first that fits (the planner's
    answer would be the same with all of them predicted; only the listed candidates differ)."""
    mem = planner.MEMORY if memory is None else memory
    ordered = sorted(options, key=lambda o: planner.Candidate("", 0, o[0], o[1]).preference)
    predictions: dict = {}
    candidates: list[planner.Candidate] = []
    for t, b in ordered:
        pred = predict(t, b)
        predictions[(t, b)] = pred
        candidates.append(planner.Candidate(_label(t, b), pred.total_bytes + resident, t, b))
        adjusted = mem.adjust(key, candidates[-1:])[0]
        if adjusted.peak_bytes <= free_bytes - safety_margin_bytes:
            break
    choice = planner.choose(mem.adjust(key, candidates), free_bytes, safety_margin_bytes)
    return _choice_to_plan(stage, choice, predictions, resident, dtype, candidates)


def plan_vae(
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
    backend: str = "cpu",
    memory: planner.PlanMemory | None = None,
) -> StagePlan:
    """Choose untiled or the largest tile of ``preset``'s VAE ladder that fits."""
    a = reference.vae_arch(arch)
    lat = max(height, width) // a.downscale
    tiles: list[int | None] = []
    if preset.vae_mode in ("auto", "off"):
        tiles.append(None)
    if preset.vae_mode != "off":
        tiles += [t for t in planner.tile_ladder(preset.vae_tile_min, preset.vae_tile_max) if t < lat]
        if not tiles:
            tiles.append(min(preset.vae_tile_min, lat))
    key = (stage, kind, arch, width, height, dtype)

    def predict(t: int | None, _b: int) -> PeakPrediction:
        return predict_vae(kind, arch, width, height, dtype, t, backend)

    options = [(t, 1) for t in tiles]
    return _choose_lazily(
        stage, key, options, predict, free_bytes, safety_margin_bytes, resident_bytes, dtype, memory
    )


def plan_upscale(
    stage: str,
    kind: str,
    width: int,
    height: int,
    preset: Preset,
    free_bytes: int,
    safety_margin_bytes: int,
    *,
    dtype: str,
    scale: int = 4,
    resident_bytes: int = 0,
    backend: str = "cpu",
    memory: planner.PlanMemory | None = None,
) -> StagePlan:
    """Choose untiled or the largest tile (then batch) of ``preset``'s upscaler bounds that fits."""
    options: list[tuple[int | None, int]] = [(None, 1)]
    side = max(width, height)
    for t in planner.tile_ladder(preset.upscale_tile_min, preset.upscale_tile_max):
        if t >= side:
            continue
        b = preset.upscale_batch_max
        while b >= 1:
            options.append((t, b))
            b //= 2
    key = (stage, kind, width, height, dtype, scale)

    def predict(t: int | None, b: int) -> PeakPrediction:
        return predict_upscale(kind, width, height, dtype, t, b, scale, backend)

    return _choose_lazily(
        stage, key, options, predict, free_bytes, safety_margin_bytes, resident_bytes, dtype, memory
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
) -> list[StagePlan]:
    """Plans for every memory-heavy stage of a job (see the module docstring).

    ``free_bytes`` is what the job may use with the model loaded *off* the device (the resident
    UNet/text encoder bytes are added per stage from the arch table unless the preset offloads
    them). The WebUI decodes a batch one image at a time, so ``batch`` adds only the decoded images
    that wait on the device.
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
    resident = 0
    if not preset.offload_unet_during_vae:
        resident += a.unet_bytes
    if not preset.offload_text_encoder_during_vae:
        resident += a.text_encoder_bytes
    itemsize = dtype_of(vae_dtype).itemsize

    def waiting(w: int, h: int) -> int:
        return (batch - 1) * 3 * w * h * itemsize

    def vae(stage: str, kind: str, w: int, h: int) -> StagePlan:
        return plan_vae(
            stage, kind, arch, w, h, preset, free_bytes, margin, dtype=vae_dtype,
            resident_bytes=resident + waiting(w, h), backend=backend, memory=memory,
        )  # fmt: skip

    plans = [vae("vae_decode", "decode", width, height)]
    final_w, final_h = width, height
    if hires is not None:
        hw = int(round(width * hires / a.downscale)) * a.downscale
        hh = int(round(height * hires / a.downscale)) * a.downscale
        if upscaler is not None:
            plans.append(
                plan_upscale(
                    "hires_upscale",
                    upscaler,
                    width,
                    height,
                    preset,
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
        plans.append(vae("vae_decode_hires", "decode", hw, hh))
        final_w, final_h = hw, hh
    elif upscaler is not None:
        plans.append(
            plan_upscale(
                "upscale",
                upscaler,
                final_w,
                final_h,
                preset,
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
        state_offload="device",
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


def predict_engine_upscale(
    model: object,
    input_shape: tuple[int, ...],
    dtype: str = "fp32",
    tile: int | None = None,
    batch: int = 1,
    scale: int = 4,
    backend: str = "cpu",
) -> PeakPrediction:
    """Peak of :func:`lib_vram.upscale.upscale_tensor` with ``model`` (a ``torch.nn.Module``),
    predicted by running the engine on fake tensors (finite check off, accumulator on the device)."""
    from lib_vram.upscale import UpscaleConfig, upscale_tensor

    net = getattr(model, "model", model)
    dt = dtype_of(dtype)
    fmode = new_fake_mode()
    side = max(input_shape[-2:])
    cfg = UpscaleConfig(
        tile=side if tile is None else tile,
        batch=batch,
        precision=dtype,
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
