"""The sampling stage inside the WebUI, and room made for every stage (lib_vram.webui.sampling,
lib_vram.webui.offload, the upscale route).

Real ldm UNet and VAE (the WebUI's classes), a real spandrel upscaler loaded from a file; host
state faked (webui_fakes). The card is the emulated one (``--vram-guard-emulate-vram``): the
checkpoint's weights count as resident, moving idle parts off the card is the card's resident
bytes going down by theirs, and an allocation beyond the card raises the real out-of-memory error.

A sampling pass is driven the way the WebUI drives it: ``process_before_every_sampling`` (the
script's ``before_sampling``), then the UNet called as the sampler calls it (the cond/uncond pair
and the images of the batch in one forward, ``opts.batch_cond_uncond``), one ``on_cfg_denoiser``
per step, then ``post_sample`` and the decode.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from conftest import image_like
from PIL import Image
from webui_fakes import FakeHost, FakeP, fake_sd_model, tiny_xattn_unet

from lib_vram.cli.models.archs import build, save_and_load
from lib_vram.core import emulate
from lib_vram.planning import planner
from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui.emulation import WebUICard
from lib_vram.webui.options import VRAMGuardOptions

BIG = 2**34


class TextEncoder(torch.nn.Module):
    """Stands for ``cond_stage_model`` (its weights are what matters here: idle during sampling
    once the conditioning is computed, and during an upscale)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(512, 64)


class FirstStage(torch.nn.Module):
    """``first_stage_model`` as the WebUI has it: one module holding the VAE's decoder and encoder
    (the unit the VAE moves as)."""

    def __init__(self, decoder: torch.nn.Module, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.decoder, self.encoder = decoder, encoder


MODEL = fake_sd_model(unet=tiny_xattn_unet())
MODEL.cond_stage_model = TextEncoder()
MODEL.first_stage_model = FirstStage(MODEL.first_stage_model.decoder, MODEL.first_stage_model.encoder)
UNET = MODEL.model.diffusion_model
UNET_BYTES = emulate.module_bytes([UNET])
TE_BYTES = emulate.module_bytes([MODEL.cond_stage_model])
VAE_BYTES = emulate.module_bytes([MODEL.first_stage_model.decoder, MODEL.first_stage_model.encoder])


class UpscalerESRGAN:
    """Host-state fake of the WebUI's ESRGAN upscaler object (``do_upscale(img, path)``)."""

    def __init__(self) -> None:
        self.calls = 0

    def do_upscale(self, img: Any, selected_model: Any) -> Any:
        self.calls += 1
        return img


@dataclass
class Run:
    out: Any
    error: BaseException | None
    notes: list[str]
    status: dict
    resident_before: int
    resident_after: int
    peak: int
    p: Any
    final: dict | None = None
    """The readout after the job closed (a failed job's stage is recorded then)."""


def run_job(
    capacity: int,
    body: Any,
    *,
    kind: str = "txt2img",
    settings: dict | None = None,
    host: FakeHost | None = None,
    p: Any = None,
    inject_oom_at: int | None = None,
    **options: Any,
) -> Run:
    """One job on a card of ``capacity`` bytes with the checkpoint resident; ``body(jobs, p)``
    is what the host does inside it."""
    planner.MEMORY.clear()
    o = VRAMGuardOptions(**{"enabled": True, "release_between_stages": False, "vae_tiling": "Off", **options})
    host = host if host is not None else FakeHost(MODEL)
    session = Session(host=host)
    wc = WebUICard(capacity, host=host)
    wc.install()
    session.emulation = wc
    before = wc.card.resident_bytes
    jobs = ScriptJobs(session, kind=kind)
    host.state.begin()
    p = p if p is not None else FakeP()
    out = error = None
    try:
        jobs.setup(p, o)
        jobs.process(p, o)
        if settings and jobs.job is not None:
            jobs.job.settings = dataclasses.replace(jobs.job.settings, **settings)
        wc.card.inject_oom_at = None if inject_oom_at is None else wc.card.allocations + inject_oom_at
        try:
            with torch.no_grad():
                out = body(jobs, p)
        except Exception as exc:
            error = exc
        peak = wc.card.peak_bytes
        status = session.status()
        notes = list(status["notes"])
        if error is None:
            jobs.postprocess(p)
    finally:
        p.close()
        jobs.close(failed=True)
        host.state.end()
        after = wc.card.resident_bytes
        wc.close()
    return Run(out, error, notes, status, before, after, peak, p, session.status())


def assert_clean(r: Run) -> None:
    """Nothing left moved or patched, the card gone."""
    assert r.resident_after == r.resident_before
    assert "forward" not in UNET.__dict__, UNET.__dict__.get("forward")
    for m in (UNET, MODEL.cond_stage_model, MODEL.first_stage_model.decoder, MODEL.first_stage_model.encoder):
        assert all(not mod._forward_pre_hooks for mod in m.modules())
    assert emulate.installed() is None and torch._C._len_torch_dispatch_stack() == 0


# -- the upscale stage: the UNet and text encoders off the card when the upscaler needs the room ---


@pytest.fixture(scope="module")
def rrdb(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "rrdb-x2.safetensors"
    model = save_and_load(build("rrdb-x2"), path)
    return path, model


def _picture(h: int = 40, w: int = 48) -> Image.Image:
    x = image_like(h, w, seed=4)
    return Image.fromarray((x[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8), "RGB")


PICTURE = _picture()
"""The first pass's picture (host memory: made before the job)."""


def _upscale_body(path: Any, scaler: UpscalerESRGAN) -> Any:
    def body(jobs: ScriptJobs, p: Any) -> Any:
        return scaler.do_upscale(PICTURE, str(path))

    return body


def _upscale_run(capacity: int, path: Any, **kw: Any) -> Run:
    host = FakeHost(MODEL)
    scaler = UpscalerESRGAN()
    host.scalers = [scaler]
    return run_job(capacity, _upscale_body(path, scaler), host=host, **kw)


def _tight_upscale_cap(path: Any) -> tuple[Run, int]:
    """The reference upscale (whole image) on a big card, and a card with 64 KiB free beside the
    checkpoint: not even the smallest tile fits there, while the UNet and text encoders (2.8 MiB)
    make room for a tiled upscale."""
    _upscale_run(BIG, path)  # calibrates the model once (cached for the process), as a first job does
    ref = _upscale_run(BIG, path)
    assert ref.error is None
    cap = ref.resident_before + 64 * 1024
    assert ref.peak > cap, "the upscale fits beside the checkpoint: nothing to show here"
    return ref, cap


def _same_picture(got: Any, ref: Any) -> None:
    """The tiled upscale against the whole-image one: the engine's tiles carry the model's whole
    receptive field as overlap, so every output pixel comes from the same inputs and weights; only
    the convolutions' summation order differs (other spatial blocking), a float rounding that can
    flip one 8-bit level."""
    diff = np.abs(np.asarray(got).astype(int) - np.asarray(ref).astype(int))
    assert diff.max() <= 1, diff.max()


def test_an_upscale_that_fits_only_without_the_unet_moves_it_off_and_back(rrdb):
    path, _ = rrdb
    ref, cap = _tight_upscale_cap(path)
    off = _upscale_run(cap, path, settings={"offload_unet": False, "offload_text_encoders": False})
    # Without the move VRAM Guard's engine runs out of memory even at its smallest tile: the job
    # fails, or (since the route falls back to the host's own upscaler after a failed tiled run,
    # which on a real card runs out of memory too) says so in one note.
    gave_up = [n for n in off.notes if "out of memory even with one" in n and "upscaler runs it instead" in n]
    assert (off.error is not None and "out of memory" in str(off.error).lower()) or gave_up, off
    r = _upscale_run(cap, path)
    assert r.error is None, r.error
    _same_picture(r.out, ref.out)
    moved = [n for n in r.notes if "off the card" in n]
    assert len(moved) == 1 and "UNet, text encoders" in moved[0] and "smallest plan" in moved[0], r.notes
    plans = [st["plan"] for st in r.status["stages"] if st["stage"] == "hires_upscale"]
    assert plans and plans[-1].endswith("UNet, text encoders off the card"), plans
    assert r.peak <= cap
    assert_clean(r)
    assert_clean(off)


def test_an_upscale_that_runs_out_of_memory_where_no_tile_helps_is_retried_with_them_off(rrdb, monkeypatch):
    """The smallest plan said it fits (here: forced), the upscale ran out of memory even at the
    smallest tile: the same upscale runs again with the idle models off the card."""
    from lib_vram.webui import upscalers

    path, _ = rrdb
    ref, cap = _tight_upscale_cap(path)
    monkeypatch.setattr(upscalers, "smallest_plan_fits", lambda *a, **k: True)
    r = _upscale_run(cap, path)
    assert r.error is None, r.error
    _same_picture(r.out, ref.out)
    assert any("ran out of memory with them there" in n for n in r.notes), r.notes
    assert_clean(r)


def test_an_upscale_that_fits_beside_them_moves_nothing(rrdb):
    path, _ = rrdb
    r = _upscale_run(BIG, path)
    assert r.error is None
    assert not any("off the card" in n for n in r.notes)
    assert_clean(r)


# -- sampling -------------------------------------------------------------------------------------

IMAGES = 2
HW = (24, 24)
CTX = 48
_g = torch.Generator().manual_seed(31)
X = torch.randn(IMAGES, 4, *HW, generator=_g)
COND = torch.randn(IMAGES, 77, CTX, generator=_g)
UNCOND = torch.randn(IMAGES, 77, CTX, generator=_g)
SIGMAS = (torch.full((2 * IMAGES,), 700.0), torch.full((2 * IMAGES,), 300.0))
NO_MARGIN = {"sampling_margin_bytes": 0, "stream_unet": False}
"""The tests' cards are a few MiB: the presets' safety margin (256 MiB and up) is left out. The
UNet does not stream here (the rung after these: tests/test_webui_stream.py)."""


class Step:
    """Counts the card's allocations of the UNet forwards of a pass (what the fault matrix
    injects into) and can inject an out-of-memory error at the n-th of them."""

    def __init__(self, inject_at: int | None = None) -> None:
        self.inject_at = inject_at
        self.counts: list[int] = []

    def __call__(self, x_in: Any, t: Any, ctx: Any) -> Any:
        card = emulate.installed()
        first = not self.counts
        if first and self.inject_at is not None:
            card.inject_oom_at = card.allocations + self.inject_at
        start = card.allocations
        out = UNET(x_in, t, context=ctx)
        self.counts.append(card.allocations - start)
        return out


def sample_pass(jobs: ScriptJobs, p: Any, *, step: Step | None = None, hr: bool = False, wake: bool = False):
    """One pass as the WebUI runs it: ``process_before_every_sampling``, then per step one
    ``on_cfg_denoiser`` and one UNet forward of the cond/uncond batch, then ``post_sample`` and
    the final decode. ``wake``: the text encoder runs mid-pass (the hires conditioning)."""
    step = step if step is not None else Step()
    p.is_hr_pass = hr
    x = X.clone()
    jobs.before_sampling(p, x=x, c=[COND[0]], uc=[UNCOND[0]])
    outs = []
    for i, sigma in enumerate(SIGMAS):
        jobs.session.sampling_step()
        x_in = torch.cat([x, x])
        ctx = torch.cat([COND, UNCOND])
        outs.append(step(x_in, sigma, ctx))
        if wake and i == 0:
            MODEL.cond_stage_model.embedding(torch.zeros(1, 77, dtype=torch.long))
    jobs.post_sample(p)
    decoded = MODEL.first_stage_model.decoder(outs[-1][:1])
    return torch.stack(outs), decoded


def _sampling(
    capacity: int, *, step: Step | None = None, settings: dict | None = None, wake: bool = False, **kw: Any
) -> Run:
    return run_job(
        capacity,
        lambda jobs, p: sample_pass(jobs, p, step=step, wake=wake),
        settings={**NO_MARGIN, **(settings or {})},
        **kw,
    )


def same_samples(got: Any, ref: Any) -> None:
    """Each sample's UNet output, micro-batched against the whole batch. Same layers, same inputs:
    only the batch size of each kernel call differs, and oneDNN may block a convolution or a GEMM
    differently for another batch size (another order of the sums of a dot product). Float32 sums
    of length k differ then by at most ~k * eps * sum|w x| per layer; over this UNet's ~30 layers
    with k <= 9 * 128 that stays far below 1e-4 of the output's scale. Bit-identity is not
    promised (the library's docstring), so not asserted."""
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) <= 1e-4 * scale, float((got - ref).abs().max())


@functools.lru_cache(maxsize=1)
def _reference() -> Run:
    r = _sampling(BIG)
    assert r.error is None, r.error
    return r


def _need(r: Run) -> int:
    return r.peak - r.resident_before


def test_a_pass_whose_activations_do_not_fit_runs_in_micro_batches_with_the_plain_result():
    ref = _reference()
    assert not any("off the card" in n for n in ref.notes)
    plans = [st["plan"] for st in ref.status["stages"] if st["stage"] == "sampling"]
    assert len(plans) == 1 and plans[0].startswith("batch 4 (predicted "), plans
    cap = ref.resident_before + int(_need(ref) * 0.6)
    off = _sampling(cap, guard_sampling=False)
    assert off.error is not None and "out of memory" in str(off.error).lower(), off.error
    r = _sampling(cap)
    assert r.error is None, r.error
    same_samples(r.out[0], ref.out[0])
    stages = [st for st in r.status["stages"] if st["stage"] == "sampling"]
    assert stages and stages[0]["plan"].startswith("micro-batch "), stages
    assert r.peak <= cap and r.status["card"]["ooms"] == 0
    assert "sampling micro-batch" in r.p.extra_generation_params["VRAM Guard plan"]()
    predicted = [n for n in r.notes if "predicted peak" in n]
    assert predicted and "micro-batch" in predicted[0], r.notes
    assert not any("off the card" in n for n in r.notes)
    assert_clean(r)
    assert_clean(off)


@functools.lru_cache(maxsize=1)
def _one_sample_need() -> int:
    """What one UNet forward of a single sample needs above the resident checkpoint."""

    def body(jobs: ScriptJobs, p: Any) -> Any:
        return UNET(X[:1].clone(), SIGMAS[0][:1], context=COND[:1].clone())

    one = run_job(BIG, body, guard_sampling=False)
    assert one.error is None, one.error
    return _need(one)


def _cap_for_moves(ref: Run) -> tuple[int, int]:
    """A card on which micro-batch 1 fits only with the VAE and text encoders off it: a single
    sample's forward plus 512 KiB (the step's inputs and the outputs held), with the idle parts'
    bytes less."""
    idle = VAE_BYTES + TE_BYTES
    assert idle > 2 * 512 * 1024, "the idle parts are too small to matter here"
    return ref.resident_before - idle + _one_sample_need() + 512 * 1024, idle


def _host(**opts: Any) -> FakeHost:
    host = FakeHost(MODEL)
    host.opts.update(opts)
    return host


def test_a_pass_that_fits_only_without_the_vae_and_text_encoders_moves_them_off_for_the_pass():
    ref = _reference()
    cap, idle = _cap_for_moves(ref)
    off = _sampling(cap, settings={"offload_unet": False, "offload_text_encoders": False})
    assert off.error is not None and "out of memory" in str(off.error).lower(), off.error
    r = _sampling(cap)
    assert r.error is None, r.error
    same_samples(r.out[0], ref.out[0])
    moved = [n for n in r.notes if "off the card for this pass" in n]
    # the owner of the card sends the fewest bytes that let the plan fit: the VAE is enough here
    assert len(moved) == 1 and "moved the VAE (" in moved[0], r.notes
    stages = [st for st in r.status["stages"] if st["stage"] == "sampling"]
    assert "VAE off the card (predicted" in stages[0]["plan"], stages
    assert r.peak <= cap
    assert_clean(r)


def test_with_full_live_previews_the_vae_stays_and_a_part_needed_mid_pass_comes_back():
    ref = _reference()
    cap, _ = _cap_for_moves(ref)
    r = _sampling(cap, host=_host(show_progress_type="Full"), wake=True)
    moved = [n for n in r.notes if "off the card for this pass" in n]
    # the VAE stays for the previews; the text encoders alone are not room enough here
    assert not any("VAE" in n for n in moved), r.notes
    assert isinstance(r.error, Exception) and "out of memory" in str(r.error).lower()
    assert_clean(r)


def test_a_part_run_mid_pass_comes_back_and_goes_home_after_the_pass():
    """A path VRAM Guard does not plan (a preview decode, an inpainting model's image
    conditioning) runs the VAE after the pass moved it off: its wake hook puts it back first; the
    text encoders the owner left on the card stay; after the pass all is where it was."""
    ref = _reference()
    cap, _ = _cap_for_moves(ref)
    seen: list[int] = []

    def body(jobs: ScriptJobs, p: Any) -> Any:
        card = emulate.installed()
        jobs.before_sampling(p, x=X.clone(), c=[COND[0]], uc=[UNCOND[0]])
        seen.append(card.resident_bytes)
        MODEL.cond_stage_model.embedding(torch.zeros(1, 77, dtype=torch.long))  # it was not moved
        seen.append(card.resident_bytes)
        MODEL.first_stage_model.decoder.conv_in(torch.zeros(1, 4, 4, 4))
        seen.append(card.resident_bytes)
        jobs.post_sample(p)

    r = run_job(cap, body, settings=NO_MARGIN)
    assert r.error is None, r.error
    off = r.resident_before - VAE_BYTES
    assert seen == [off, off, r.resident_before], seen
    assert r.resident_after == r.resident_before
    assert_clean(r)


def test_a_card_too_small_for_any_plan_gets_the_named_error_before_the_unet_runs():
    from lib_vram.webui.sampling import SamplingOutOfMemory

    class Watched(Step):
        """Counts the card's allocations of each UNet call, also of one that raised (a hook on the
        UNet would be an extension's change to its forward: VRAM Guard would not predict it)."""

        def __init__(self) -> None:
            super().__init__()
            self.allocated: list[int] = []

        def __call__(self, *args: Any) -> Any:
            card = emulate.installed()
            start = card.allocations
            try:
                return super().__call__(*args)
            finally:
                self.allocated.append(card.allocations - start)

    ref = _reference()
    step = Watched()
    r = _sampling(
        ref.resident_before + 512 * 1024, step=step
    )  # the sampler's own inputs fit, no forward does
    assert isinstance(r.error, SamplingOutOfMemory), r.error
    text = str(r.error)
    assert "\n" not in text and "out of memory" in text and "px" in text and "fits" in text, text
    assert step.allocated == [0]  # stopped before the UNet computed anything
    assert not any("off the card for this pass" in n for n in r.notes)
    failed = [st for st in r.final["stages"] if st["stage"] == "sampling"]
    assert failed and failed[0]["ok"] is False and "VRAM Guard stopped" in (failed[0]["error"] or ""), failed
    assert_clean(r)


def test_the_named_error_says_what_fits_with_the_idle_parts_off_the_card():
    """A card where the UNet's weights and the VAE/text encoders together exceed the budget, and
    the pass does not fit even with those off: the line must name what would fit on the card VRAM
    Guard gives the pass (the idle parts off), not "the UNet's weights alone do not fit" (found in
    the real WebUI: a 768x768 hires pass with ldm's unsliced attention on a 4255 MiB card)."""
    from lib_vram.webui.sampling import SamplingOutOfMemory

    ref = _reference()
    idle = VAE_BYTES + TE_BYTES
    # the sampler's inputs fit on the card; the safety margin puts the pass's budget below the
    # UNet's weights with the idle parts (as the 4GB preset's 256 MiB did in the real WebUI)
    cap, margin = ref.resident_before + 512 * 1024, 1024 * 1024
    assert _one_sample_need() > idle  # micro-batch 1 of 24x24 does not fit, even with them off
    r = _sampling(cap, settings={"sampling_margin_bytes": margin})
    assert isinstance(r.error, SamplingOutOfMemory), r.error
    text = str(r.error)
    assert "\n" not in text and "VAE off the card" in text, text
    assert "weights alone" not in text and "px fits at batch 1" in text, text
    # the readout says it once, with the line's own numbers (both were off in the real WebUI:
    # "VRAM Guard: VRAM Guard stopped ...", and the stage's plan counted the idle parts on the card)
    assert [n for n in r.notes if "stopped" in n] == [text], r.notes
    said = [n for n in r.notes if "predicted peak" in n]
    assert len(said) == 1 and said[0].endswith("does not fit"), r.notes
    mib = said[0].split("predicted peak ")[1].split()[0]
    assert f"needs {mib} MiB" in text, (said, text)
    assert_clean(r)


def test_guard_off_plans_nothing_and_patches_nothing():
    seen: list[bool] = []

    def step(x_in: Any, t: Any, ctx: Any) -> Any:
        seen.append("forward" in UNET.__dict__)
        return UNET(x_in, t, context=ctx)

    r = _sampling(BIG, step=step, guard_sampling=False)
    assert r.error is None and seen == [False, False]
    assert not any("predicted peak" in n for n in r.notes)
    assert_clean(r)


def test_with_the_hosts_own_swapping_nothing_moves_and_nothing_is_patched():
    """--medvram/--lowvram (``sd_model.lowvram``): the host moves the UNet itself."""
    ref = _reference()
    cap = ref.resident_before + int(_need(ref) * 0.6)
    seen: list[bool] = []

    def step(x_in: Any, t: Any, ctx: Any) -> Any:
        seen.append("forward" in UNET.__dict__)
        return UNET(x_in, t, context=ctx)

    MODEL.lowvram = True
    try:
        r = _sampling(cap, step=step)
    finally:
        del MODEL.lowvram
    assert r.error is not None and "out of memory" in str(r.error).lower()
    assert seen == [False] and not any("off the card" in n for n in r.notes)
    assert_clean(r)


def test_forge_and_a_preview_thread_are_left_alone():
    import threading
    from types import SimpleNamespace

    from lib_vram.webui.sampling import SamplingGuard

    job = SimpleNamespace(settings=SimpleNamespace(guard_sampling=True), host=FakeHost(MODEL))
    forge = SimpleNamespace(forge_objects=object(), model=MODEL.model)
    assert SamplingGuard(job)._skip_reason(forge) == "Forge"
    host = FakeHost(MODEL)
    jobs = ScriptJobs(Session(host=host), kind="txt2img")
    p = FakeP()
    jobs.process(p, VRAMGuardOptions(enabled=True, vae_tiling="Off"))
    got: list[Any] = []
    with emulate.running_on(emulate.EmulatedCard(BIG)):
        guard = jobs.job.sampling_guard()
        t = threading.Thread(target=lambda: got.append(guard._movable(p, "sampling", MODEL)))
        t.start()
        t.join()
        here = guard._movable(p, "sampling", MODEL)
    jobs.postprocess(p)
    assert got == [None] and here is not None and here.names == "text encoders, VAE"


def test_an_out_of_memory_error_the_plan_did_not_foresee_moves_them_off_in_the_first_step(monkeypatch):
    """The plan said the whole batch fits with everything there (here: forced); the first step ran
    out of memory even at micro-batch 1: the VAE and text encoders leave, the step runs again."""
    import lib_vram.sampling as sampling

    ref = _reference()
    cap, _ = _cap_for_moves(ref)
    real = sampling.plan_sampling

    def optimistic(spec: Any, **kw: Any) -> Any:
        plan = real(spec, **kw)
        return dataclasses.replace(plan, fits=True, micro_batch=kw["batch"], suggestion=None)

    monkeypatch.setattr(sampling, "plan_sampling", optimistic)
    r = _sampling(cap)
    assert r.error is None, r.error
    same_samples(r.out[0], ref.out[0])
    assert any("first step ran out of memory with them there" in n for n in r.notes), r.notes
    assert_clean(r)


@functools.lru_cache(maxsize=1)
def _micro_cap() -> tuple[Run, int, list[int]]:
    ref = _reference()
    cap = ref.resident_before + int(_need(ref) * 0.6)
    step = Step()
    dry = _sampling(cap, step=step)
    assert dry.error is None and step.counts[0] > 10, step.counts
    return ref, cap, step.counts


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_an_out_of_memory_error_anywhere_in_a_micro_batched_step_is_absorbed(where):
    """The card refuses the first, a middle or the last allocation of the first micro-batched
    step once (another process took the memory for a moment): the micro-batch halves and the step
    runs again from the chunk that failed; every sample's result is the plain one."""
    ref, cap, counts = _micro_cap()
    n = {"first": 1, "middle": counts[0] // 2, "last": counts[0]}[where]
    r = _sampling(cap, step=Step(inject_at=n))
    assert r.error is None, r.error
    assert r.status["card"]["ooms"] == 1
    same_samples(r.out[0], ref.out[0])
    assert_clean(r)


def test_a_failed_move_off_leaves_everything_in_place_and_the_pass_fails_plainly(monkeypatch):
    from lib_vram.residency._modules import ModuleMover

    ref = _reference()
    cap, _ = _cap_for_moves(ref)

    def refuse(self: Any) -> None:
        raise torch.OutOfMemoryError("out of memory copying to the host")

    monkeypatch.setattr(ModuleMover, "to_host", refuse)
    r = _sampling(cap)
    assert r.error is not None and "out of memory" in str(r.error).lower()
    assert any("they stay" in n for n in r.notes), r.notes
    assert_clean(r)


def test_a_wrapper_another_extension_puts_over_ours_is_kept_and_ours_steps_aside():
    """ControlNet wraps the UNet's forward as an instance attribute; if it does so after us, ours
    cannot be taken out from under it: it becomes a pass-through, and a warning says so once."""

    def body(jobs: ScriptJobs, p: Any) -> Any:
        jobs.before_sampling(p, x=X.clone(), c=[COND[0]], uc=[UNCOND[0]])
        ours = UNET.__dict__["forward"]
        UNET.forward = lambda *a, **k: ours(*a, **k)  # the other extension's wrapper
        out = UNET(torch.cat([X, X]), SIGMAS[0], context=torch.cat([COND, UNCOND]))
        jobs.post_sample(p)
        return ours, out

    try:
        r = run_job(BIG, body, settings=NO_MARGIN)
        theirs = UNET.__dict__["forward"]
        ours = r.out[0]
    finally:
        UNET.__dict__.pop("forward", None)
    assert r.error is None and ours.active is False and theirs is not ours
    assert sum("wrapped the UNet's forward after VRAM Guard" in n for n in r.notes) == 1, r.notes


def test_the_hires_pass_is_planned_as_its_own_stage_and_named_in_the_infotext():
    ref = _reference()
    cap = ref.resident_before + int(_need(ref) * 0.6)

    def body(jobs: ScriptJobs, p: Any) -> Any:
        first = sample_pass(jobs, p)
        jobs.before_hr(p)
        return first, sample_pass(jobs, p, hr=True)

    r = run_job(cap, body, settings=NO_MARGIN, p=FakeP(enable_hr=True))
    assert r.error is None, r.error
    names = [st["stage"] for st in r.status["stages"] if "sampling" in st["stage"]]
    assert names == ["sampling", "hires_sampling"], names
    plan = r.p.extra_generation_params["VRAM Guard plan"]()
    assert "sampling micro-batch" in plan and "hires sampling micro-batch" in plan, plan
    same_samples(r.out[1][0], ref.out[0])
    assert_clean(r)


def test_an_error_mid_pass_and_a_script_unload_undo_the_patch_and_the_moves():
    ref = _reference()
    cap, idle = _cap_for_moves(ref)
    seen: list[Any] = []

    def body(jobs: ScriptJobs, p: Any) -> Any:
        card = emulate.installed()
        jobs.before_sampling(p, x=X.clone(), c=[COND[0]], uc=[UNCOND[0]])
        seen.append(("forward" in UNET.__dict__, card.resident_bytes))
        raise RuntimeError("the sampler failed")  # e.g. an interrupted job, another extension

    r = run_job(cap, body, settings=NO_MARGIN)
    assert isinstance(r.error, RuntimeError) and "the sampler failed" in str(r.error)
    assert seen == [(True, r.resident_before - VAE_BYTES)]
    assert_clean(r)

    # script unload while a pass is open (Reload UI mid-job)
    host = FakeHost(MODEL)
    session = Session(host=host)
    wc = WebUICard(cap, host=host)
    wc.install()
    session.emulation = wc
    jobs = ScriptJobs(session, kind="txt2img")
    host.state.begin()
    p = FakeP()
    o = VRAMGuardOptions(enabled=True, release_between_stages=False, vae_tiling="Off")
    jobs.process(p, o)
    jobs.job.settings = dataclasses.replace(jobs.job.settings, **NO_MARGIN)
    with torch.no_grad():
        jobs.before_sampling(p, x=X.clone(), c=[COND[0]], uc=[UNCOND[0]])
    patched, during = "forward" in UNET.__dict__, wc.card.resident_bytes
    assert session.close_all() == 1
    after = wc.card.resident_bytes
    host.state.end()
    wc.close()
    assert patched and during < after and "forward" not in UNET.__dict__
    assert all(not mod._forward_pre_hooks for mod in MODEL.first_stage_model.modules())


# -- a forward VRAM Guard does not predict (an extension's change to the UNet) -----------------


@pytest.fixture(scope="module")
def ext_code(tmp_path_factory):
    from extension_code import extension_module

    root = tmp_path_factory.mktemp("webui")
    return {
        "frames": extension_module(root, "sd-webui-animatediff"),
        "tiles": extension_module(root, "multidiffusion-upscaler-for-automatic1111"),
    }


@dataclass
class Frames:
    """A motion module in the UNet's second input block for the test's pass: the batch of one
    forward is cond and uncond of IMAGES frames (2 videos of IMAGES frames), coupled."""

    module: Any

    def __enter__(self) -> Frames:
        UNET.input_blocks[1].append(self.module)
        return self

    def __exit__(self, *exc: Any) -> None:
        del UNET.input_blocks[1][-1]


@dataclass
class Counted:
    """A pre-hook of a known per-sample extension (Tiled Diffusion's folder) on a UNet block: the
    estimate does not model it; it records each call's batch."""

    ext: Any
    batches: list[int] = dataclasses.field(default_factory=list)

    def __enter__(self) -> Counted:
        self.handle = UNET.middle_block.register_forward_pre_hook(self.ext.count_batches(self.batches))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()


def _stage(r: Run, name: str) -> list[dict]:
    return [st for st in (r.final or r.status)["stages"] if st["stage"] == name]


def test_a_forward_the_estimate_does_not_know_runs_whole_and_is_planned_from_its_measured_first_step(
    ext_code,
):
    with Counted(ext_code["tiles"]) as counted:
        off = _sampling(BIG, guard_sampling=False)
        r = _sampling(BIG)
    assert off.error is None and r.error is None, (off.error, r.error)
    assert torch.equal(r.out[0], off.out[0])  # the WebUI's own forward, whole batch: the same bits
    assert counted.batches == [4] * 4, counted.batches  # (2 steps without VRAM Guard, 2 with)
    measured = [n for n in r.notes if "planned from its measured first step" in n]
    assert len(measured) == 1 and "Tiled Diffusion (a hook on middle_block)" in measured[0], r.notes
    plan = _stage(r, "sampling")[0]["plan"]
    assert "measured, not predicted" in plan and "micro-batch" not in plan, plan
    events = [e["text"] for e in r.status["timeline"]["events"] if e["kind"] == "plan"]
    assert len(events) == 1 and events[0].startswith("sampling: first step measured at "), events
    assert_clean(r)


def test_a_coupled_batch_is_never_split_it_fits_with_the_idle_parts_off(ext_code):
    with Frames(ext_code["frames"].TemporalMix(IMAGES)) as frames:
        big = _sampling(BIG, guard_sampling=False)
        assert big.error is None, big.error
        cap = big.resident_before - VAE_BYTES - TE_BYTES + _need(big) + 512 * 1024
        off = _sampling(cap, guard_sampling=False)
        frames.module.batches.clear()
        r = _sampling(cap)
    assert off.error is not None and "out of memory" in str(off.error).lower(), off.error
    assert r.error is None, r.error
    assert torch.equal(r.out[0], big.out[0])  # every step whole: the same videos
    assert set(frames.module.batches) == {4}, frames.module.batches  # never a part of the batch
    assert any("off the card for this pass" in n and "ran out of memory" in n for n in r.notes), r.notes
    assert "micro-batch" not in _stage(r, "sampling")[0]["plan"]
    assert_clean(r)


def test_a_coupled_batch_that_does_not_fit_whole_stops_with_the_line_naming_the_extension(ext_code):
    from lib_vram.webui.sampling import SamplingOutOfMemory

    with Frames(ext_code["frames"].TemporalMix(IMAGES)) as frames:
        r = _sampling(_reference().resident_before + int(_need(_reference()) * 0.6))
    assert isinstance(r.error, SamplingOutOfMemory), r.error
    text = str(r.error)
    assert "\n" not in text and "AnimateDiff" in text and "never splits" in text, text
    assert set(frames.module.batches) <= {4}, frames.module.batches  # (the first blocks ran out)
    failed = _stage(r, "sampling")
    assert failed and failed[0]["ok"] is False, failed
    assert_clean(r)


def test_a_per_sample_forward_the_estimate_does_not_know_is_split_only_after_its_whole_batch_ran_out(
    ext_code,
):
    ref = _reference()
    settings = {"offload_unet": False, "offload_text_encoders": False}  # nothing may move: the split alone
    cap = ref.resident_before + int(_need(ref) * 0.6)
    with Counted(ext_code["tiles"]) as counted:
        r = _sampling(cap, settings=settings)
    assert r.error is None, r.error
    same_samples(r.out[0], ref.out[0])
    assert set(counted.batches) <= {1, 2}, counted.batches  # (the whole batch ran out before this block)
    assert any("out of memory with its whole batch: it runs in micro-batches of 2" in n for n in r.notes), (
        r.notes
    )
    assert r.peak <= cap
    assert_clean(r)


def test_a_change_made_mid_pass_makes_the_rest_of_the_pass_a_measured_whole_one(ext_code):
    """Kohya's Deep Shrink swaps blocks at a step: the forward is checked at every call."""
    ref = _reference()
    frames = ext_code["frames"].TemporalMix(IMAGES)

    def body(jobs: ScriptJobs, p: Any) -> Any:
        x = X.clone()
        jobs.before_sampling(p, x=x, c=[COND[0]], uc=[UNCOND[0]])
        outs = []
        for i, sigma in enumerate(SIGMAS):
            jobs.session.sampling_step()
            if i == 1:
                UNET.input_blocks[1].append(frames)
            try:
                outs.append(UNET(torch.cat([x, x]), sigma, context=torch.cat([COND, UNCOND])))
            finally:
                if i == 1:
                    del UNET.input_blocks[1][-1]
        jobs.post_sample(p)
        return outs

    r = run_job(ref.resident_before + int(_need(ref) * 0.6), body, settings=NO_MARGIN)
    # the first step micro-batched as predicted; the second is coupled: whole, and out of memory
    assert r.error is not None and "AnimateDiff" in str(r.error), r.error
    assert set(frames.batches) <= {4}, frames.batches
    assert any("from this step on" in n and "AnimateDiff" in n for n in r.notes), r.notes
    assert_clean(r)


def test_a_pass_another_extension_runs_inside_the_job_is_planned_as_a_pass_of_the_job():
    """ADetailer's inpaint: its own img2img ``p``, its scripts filtered (VRAM Guard's
    ``process_before_every_sampling`` does not run): planned at its first ``on_cfg_denoiser``."""
    from types import SimpleNamespace

    def body(jobs: ScriptJobs, p: Any) -> Any:
        sample_pass(jobs, p)
        jobs.postprocess_batch(p)
        inner, x = FakeP(), X.clone()
        inner._ad_inner = True
        jobs.postprocess(inner)  # ADetailer calls every script's postprocess with a copy of p first
        x_in = torch.cat([x, x])  # CFGDenoiserParams.x: the cond rows, then the uncond rows
        params = SimpleNamespace(
            denoiser=SimpleNamespace(p=inner), x=x_in, text_cond=COND, text_uncond=UNCOND
        )
        for sigma in SIGMAS:
            jobs.session.sampling_step(params)
            UNET(x_in, sigma, context=torch.cat([COND, UNCOND]))
        return None

    r = run_job(BIG, body, settings=NO_MARGIN)
    assert r.error is None, r.error
    ext = _stage(r, "ext_sampling")
    assert len(ext) == 1 and ext[0]["plan"].startswith("batch 4 (predicted "), ext
    assert any("ADetailer's inpainting runs inside this job" in n for n in r.notes), r.notes
    assert len(_stage(r, "sampling")) == 1
    assert_clean(r)
