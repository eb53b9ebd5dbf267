"""Every job type, in any order, with the checkpoint placed on a card below it (issue 29 item 2).

The placed checkpoint of ``test_webui_placement`` (the WebUI's real ldm UNet with cross-attention,
its VAE decoder and encoder, a text encoder's weights) on emulated cards that keep about two
thirds, a half and a third of the UNet resident. Job types as the WebUI runs their stages:
txt2img; img2img (encode, conditioning, pass, decode); hires fix with a latent upscale (a second
conditioning and pass at twice the size) and with an image upscale (decode, encode between the
passes); batch size 2; a live preview decoded on another thread during the pass. Each kind runs
as the first job of a session and after every other kind (one sequence through every ordered
pair), each with its own prompt (the text encoders run in every job: no conditioning cache hides a
wake). The criterion, the one the real-WebUI runs use: every sampler output equal to the uncapped
plain run's bit for bit; every picture within the exact tiled VAE's bound (``VAE_EXACT``) of it.
And without the placement: a card that holds the checkpoint but not everything at once.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import test_webui_placement as placement_tests
import torch
from test_webui_placement import COND, SAFETY, SIGMAS, UNCOND, Checkpoint, checkpoint_bytes, unet_of
from tolerances import VAE_EXACT

from lib_vram import sampling
from lib_vram.residency import plan_checkpoint
from lib_vram.residency._modules import nbytes_of, tensors_of
from lib_vram.webui import ScriptJobs
from lib_vram.webui.options import VRAMGuardOptions

MiB = 1 << 20
KINDS = ("txt2img", "img2img", "hires_latent", "hires_image", "batch2", "preview")
_g = torch.Generator().manual_seed(29)
HW = (8, 8)
"""The jobs' latent (and the placement's default pass): small enough that a third of this UNet
resident leaves room for a pass with ldm's own (unsliced) attention."""
HIRES = (HW[0] * 5 // 4, HW[1] * 5 // 4)
"""The hires pass's latent (x1.25: the small cards here hold no larger pass with ldm's attention)."""
IMG = torch.rand(1, 3, 2 * HW[0], 2 * HW[1], generator=_g) * 2 - 1


def tokens(n: int) -> torch.Tensor:
    """A new prompt for each job."""
    return torch.randint(0, 512, (1, 77), generator=torch.Generator().manual_seed(1000 + n))


def sample(
    jobs: ScriptJobs, p: Any, model: Checkpoint, x: torch.Tensor, *, preview: bool = False
) -> torch.Tensor:
    n = x.shape[0]
    cond, uncond = COND.expand(n, -1, -1), UNCOND.expand(n, -1, -1)
    jobs.before_sampling(p, x=x.clone(), c=[COND[0]] * n, uc=[UNCOND[0]] * n)
    outs = []
    for sigma in SIGMAS:
        jobs.session.sampling_step()
        s = sigma[:1].expand(2 * n)
        outs.append(unet_of(model)(torch.cat([x, x]), s, context=torch.cat([cond, uncond])))
        if preview:  # the WebUI decodes a live preview in the progress request's thread
            state = jobs.session.host.state
            state.current_latent, state.preview_decoder = outs[-1][:n], model.first_stage_model.decoder
            t = threading.Thread(target=state.do_set_current_image)
            t.start()
            t.join()
    jobs.post_sample(p)
    return torch.stack(outs)


def body_of(kind: str, n: int) -> Any:
    def body(jobs: ScriptJobs, p: Any, model: Checkpoint) -> dict[str, torch.Tensor]:
        vae = model.first_stage_model
        out: dict[str, torch.Tensor] = {}
        x = torch.randn(1, 4, *HW, generator=torch.Generator().manual_seed(KINDS.index(kind)))
        if kind == "img2img":
            x = vae.encoder(IMG)[:, :4]
            out["encoded"] = x
        if kind == "batch2":
            x = torch.cat([x, x.flip(-1)])
        model.cond_stage_model.embedding(tokens(n))
        first = sample(jobs, p, model, x, preview=kind == "preview")
        out["first"] = first
        latent = first[-1][: x.shape[0]]
        if kind.startswith("hires"):
            if kind == "hires_latent":
                big = torch.nn.functional.interpolate(latent, size=HIRES, mode="nearest")
            else:
                image = vae.decoder(latent)
                out["first_image"] = image
                up = torch.nn.functional.interpolate(
                    image, size=(2 * HIRES[0], 2 * HIRES[1]), mode="bilinear"
                )
                big = vae.encoder(up)[:, :4]
            jobs.before_hr(p)
            p.is_hr_pass = True
            model.cond_stage_model.embedding(tokens(n + 500))  # the hires prompt's conditioning
            hires = sample(jobs, p, model, big)
            out["hires"] = hires
            latent = hires[-1][:1]
        out["image"] = vae.decoder(latent)
        return out

    return body


def run(w: Any, kind: str, n: int, *, enabled: bool = True) -> tuple[dict | None, BaseException | None]:
    o = VRAMGuardOptions(
        enabled=enabled, release_between_stages=False, vae_tiling="Auto", upscale_tiling=False
    )
    jobs = ScriptJobs(w.session, kind="img2img" if kind == "img2img" else "txt2img")
    w.host.state.begin()
    from webui_fakes import FakeP

    p = FakeP(enable_hr=kind.startswith("hires"))
    out = error = None
    try:
        jobs.setup(p, o)
        jobs.process(p, o)
        assert (jobs.job is not None) == enabled
        if jobs.job is not None:
            jobs.job.settings = dataclasses.replace(jobs.job.settings, sampling_margin_bytes=0)
        try:
            with torch.no_grad():
                out = body_of(kind, n)(jobs, p, w.host.model)
        except Exception as exc:
            error = exc
        if jobs.job is not None and out is not None:
            split = [pp.plan.micro_batch < pp.batch for pp in jobs.job.sampling_guard().passes]
            out["split"] = torch.tensor(split + [False] * (2 - len(split)))
        if error is None:
            jobs.postprocess(p)
    finally:
        p.close()
        jobs.close(failed=True)
        w.host.state.end()
    errors = list(w.host.state.preview_errors)
    w.host.state.preview_errors.clear()
    if error is None and errors:
        error = errors[0]
    return out, error


def pairs_sequence(kinds: tuple[str, ...]) -> list[str]:
    """A sequence in which every kind follows every kind (itself too) at least once: an Euler
    circuit of the complete directed graph with loops (Hierholzer)."""
    edges = {a: list(kinds) for a in kinds}
    stack, path = [kinds[0]], []
    while stack:
        v = stack[-1]
        if edges[v]:
            stack.append(edges[v].pop())
        else:
            path.append(stack.pop())
    return path[::-1]


MODEL = Checkpoint()


def world(capacity: int, *, on: bool = True) -> Any:
    w = placement_tests.world(capacity, on=on)
    w.session.placement.latent_hw = HW
    return w


_REF: dict[str, dict] = {}


def references() -> dict[str, dict]:
    """The uncapped plain run of each job type (no VRAM Guard, a card that holds everything),
    made before a test's own session: a new session clears what the planner learned."""
    if not _REF:
        w = world(1 << 40, on=False)
        try:
            w.host.sd_models.load_model(MODEL, w.session)
            for kind in KINDS:
                out, error = run(w, kind, 0, enabled=False)
                assert error is None, error
                _REF[kind] = out
        finally:
            w.close()
    return _REF


def same(got: dict, ref: dict, what: str) -> None:
    split = dict(zip(("first", "hires"), got.pop("split", torch.zeros(2, dtype=torch.bool)).tolist()))
    ref = {k: v for k, v in ref.items() if k != "split"}
    assert got.keys() == ref.keys(), what
    for k in got:
        if k in ("first", "hires") and not split[k]:
            assert torch.equal(got[k], ref[k]), (what, k)  # the sampler's outputs: bit for bit
        elif k in ("first", "hires"):
            # a micro-batched pass: each sample's result is computed alone; oneDNN may sum a
            # kernel's dot products in another order for another batch size (test_webui_sampling)
            err, scale = float((got[k] - ref[k]).abs().max()), float(ref[k].abs().max())
            assert err <= 1e-4 * scale, (what, k, err)
        else:
            err = float((got[k] - ref[k]).abs().max())
            assert err <= VAE_EXACT, (what, k, err)  # a picture: exact tiles' rounding at most


def card_for(fraction: float) -> int:
    """The card on which the placement keeps about ``fraction`` of the UNet resident."""
    dm = unet_of(MODEL)
    spec = sampling.unet_spec(dm)
    parts = [("text encoders", MODEL.cond_stage_model), ("VAE", MODEL.first_stage_model)]
    parked = [(n, nbytes_of(tensors_of([m]))) for n, m in parts]
    leftover = MODEL.alphas_cumprod.numel() * 4
    step = dict(
        batch=2, latent_hw=HW, context_tokens=77, attention="none", dtype=torch.float32, backend="cpu"
    )
    unet = nbytes_of(tensors_of([dm]))
    lo, hi = 0, checkpoint_bytes(MODEL) + 8 * MiB
    for _ in range(40):
        mid = (lo + hi) // 2
        cp = plan_checkpoint(
            dm, spec, card_bytes=mid, safety_bytes=SAFETY, leftover_bytes=leftover, parked=parked, **step
        )
        if cp.fits and cp.unet_resident_bytes >= fraction * unet:
            hi = mid
        else:
            lo = mid + 1
    return hi


@pytest.mark.parametrize("fraction", [2 / 3, 1 / 2, 1 / 3])
def test_every_job_type_after_every_other_gives_the_uncapped_plain_result(fraction):
    ref = references()
    cap = card_for(fraction)
    order = pairs_sequence(KINDS)
    w = world(cap)
    try:
        w.host.sd_models.load_model(MODEL, w.session)
        placed = w.session.placement.placed_for(MODEL)
        assert placed is not None and placed.streamer is not None
        share = placed.plan.resident_bytes / placed.plan.unet_bytes
        assert abs(share - fraction) < 0.12, share
        base = w.card.resident_bytes
        for n, kind in enumerate(order):
            got, error = run(w, kind, n)
            assert error is None, (n, kind, order[max(0, n - 1)], error)
            same(got, ref[kind], f"job {n} ({kind} after {order[max(0, n - 1)]})")
            # at rest after every job: the placed part of the checkpoint and nothing woken beyond
            # what may wait on the card (a VAE woken outside a stage gives way when needed)
            assert w.card.resident_bytes <= base + placed.parked_on_card_bytes
            assert w.card.peak_bytes <= cap
        models = {r["name"]: r for r in w.session.status()["models"]}
        assert models["UNet"]["where"] == "streamed" and models["text encoders"]["where"] == "host"
    finally:
        w.close()


@pytest.mark.parametrize("kind", KINDS)
def test_each_job_type_as_the_first_job_of_a_session(kind):
    ref = references()
    w = world(card_for(1 / 2))
    try:
        w.host.sd_models.load_model(MODEL, w.session)
        got, error = run(w, kind, 7)
        assert error is None, error
        same(got, ref[kind], kind)
    finally:
        w.close()


def test_without_the_placement_a_card_that_holds_the_checkpoint_but_not_all_at_once():
    """The checkpoint fits (nothing placed); a pass or a decode fits only with the idle models off:
    the owner moves them for the stage and back after it, in every job of the sequence."""
    ref = references()
    cap = checkpoint_bytes(MODEL) + 512 * 1024
    order = pairs_sequence(KINDS[:4])
    w = world(cap, on=False)
    try:
        w.host.sd_models.load_model(MODEL, w.session)
        plain, error = run(w, "hires_latent", 0, enabled=False)
        assert error is not None and "out of memory" in str(error).lower(), error  # the plain WebUI
        base = w.card.resident_bytes
        for n, kind in enumerate(order):
            got, error = run(w, kind, n)
            assert error is None, (n, kind, error)
            same(got, ref[kind], f"job {n} ({kind})")
            assert w.card.resident_bytes == base  # everything back home after each job
        assert any(m.to == "host" for m in w.session.card_models().owner.moves)
    finally:
        w.close()


@pytest.mark.parametrize("ends", ["end", "finish_task"])
@pytest.mark.parametrize("late", [False, True])
def test_a_live_preview_decoded_after_the_jobs_last_stage_leaves_no_vae_on_the_card(ends, late):
    """Found in the real WebUI (issue 29, Run 7: the VAE on the card after a previews job): v1.10.1
    decodes a live preview whenever a progress poll arrives while the task is current, also after
    the job's final decode, and a poll that began just before the task ended can decode after it.
    That VAE wake is outside any stage; it stayed on the card until the next job. The job's end
    (``state.end``: the API routes' last call; ``progress.finish_task``: the UI wrapper's) and such a
    late preview now send it home."""
    ref = references()
    w = world(card_for(1 / 2))
    try:
        w.host.sd_models.load_model(MODEL, w.session)
        vae = next(m for m in w.session.card_models().owner.models if m.name == "VAE")
        base = w.card.resident_bytes
        got, error = run(w, "preview", 0)
        assert error is None, error
        same(got, ref["preview"], "preview")
        assert vae.where == "host"
        state = w.host.state
        state.current_latent, state.preview_decoder = got["first"][-1][:1], MODEL.first_stage_model.decoder

        def preview() -> None:
            t = threading.Thread(target=state.do_set_current_image)
            t.start()
            t.join()

        end = state.end if ends == "end" else lambda: w.host.progress.finish_task("task(1)")
        state.begin()  # the job's last moments: its stages are over, the task still current
        if not late:
            preview()
            assert vae.where == "card"  # woken outside any stage: it may wait until the job ends
            end()
        else:
            end()
            preview()
        assert not state.preview_errors, state.preview_errors
        assert vae.where == "host", (ends, late)
        assert w.card.resident_bytes == base
        moves = [m.text for m in w.session.card_models().owner.moves]
        assert moves[-1] == f"VAE ({vae.nbytes / MiB:.0f} MiB) to the CPU: the job is done", moves[-3:]
    finally:
        w.close()
