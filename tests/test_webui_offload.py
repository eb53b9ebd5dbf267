"""Idle models off the card for a VAE pass that does not fit with them there (lib_vram.webui.offload).

Real ldm decoder, encoder and UNet (the WebUI's classes); host state faked (webui_fakes). The card
is the emulated one (``--vram-guard-emulate-vram``): the checkpoint's weights count as resident, so
moving the idle UNet and text encoders off the card for a pass is the card's resident bytes going
down by theirs, and a pass that needs that room raises the real out-of-memory error without it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from tolerances import VAE_EXACT
from webui_fakes import FakeHost, FakeP, fake_sd_model, tiny_unet

import lib_vram.vae as engine
from lib_vram.core import emulate
from lib_vram.core.hooks import ATTR
from lib_vram.planning import planner
from lib_vram.vae import TiledVAEConfig, VAEOutOfMemory, VAEReport
from lib_vram.webui import ScriptJobs, Session
from lib_vram.webui.emulation import WebUICard
from lib_vram.webui.models import CardModels, checkpoint_parts
from lib_vram.webui.options import VRAMGuardOptions

BIG = 2**34
Z = torch.randn(1, 4, 24, 24, generator=torch.Generator().manual_seed(21))
X = torch.rand(1, 3, 48, 48, generator=torch.Generator().manual_seed(22)) * 2 - 1


class TextEncoder(torch.nn.Module):
    """Stands for ``cond_stage_model`` (its weights are what matters here: idle during the VAE)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(512, 64)


MODEL = fake_sd_model(unet=tiny_unet())
MODEL.cond_stage_model = TextEncoder()
DEC, ENC = MODEL.first_stage_model.decoder, MODEL.first_stage_model.encoder
IDLE_BYTES = emulate.module_bytes([MODEL.model.diffusion_model, MODEL.cond_stage_model])


@dataclass
class Result:
    out: Any
    error: BaseException | None
    notes: list[str]
    status: dict
    resident_during: list[int]
    """The card's resident bytes each time they were set during the pass."""
    resident_after: int
    resident_before: int
    peak: int


def job(capacity: int, body: Any = None, *, kind: str = "decode", **options: Any) -> Result:
    """One txt2img job whose final decode (or an img2img-style encode) runs on a card of
    ``capacity`` bytes with the checkpoint resident."""
    planner.MEMORY.clear()
    o = VRAMGuardOptions(
        **{"enabled": True, "release_between_stages": False, "upscale_tiling": False, "vae_tiling": "Always",
           "vae_tile": 16, **options}
    )  # fmt: skip
    host = FakeHost(MODEL)
    session = Session(host=host)
    wc = WebUICard(capacity, host=host)
    wc.install()
    session.emulation = wc
    before = wc.card.resident_bytes
    jobs = ScriptJobs(session, kind="txt2img")
    host.state.begin()
    p = FakeP()
    during: list[int] = []
    out = error = None
    try:
        jobs.setup(p, o)
        jobs.process(p, o)
        set_resident = wc.card.set_resident

        def record(value: Any) -> None:  # what the card's resident bytes are set to, in order
            set_resident(value)
            during.append(wc.card.resident_bytes)

        wc.card.set_resident = record
        try:
            with torch.no_grad():
                out = body() if body is not None else (DEC(Z) if kind == "decode" else ENC(X))
        except Exception as exc:
            error = exc
        finally:
            del wc.card.set_resident
        peak = wc.card.peak_bytes
        status = session.status()
        notes = list(status["notes"])
        jobs.postprocess(p)
    finally:
        p.close()
        jobs.close(failed=True)
        host.state.end()
        after = wc.card.resident_bytes
        wc.close()
    return Result(out, error, notes, status, during, after, before, peak)


def reference(kind: str = "decode") -> Result:
    r = job(BIG, kind=kind)
    assert r.error is None
    return r


def tight_cap(kind: str = "decode", slack: int = 64 * 1024) -> int:
    """A card on which the pass fits only with the idle models off it."""
    ref = reference(kind)
    need = ref.peak - ref.resident_before
    cap = ref.resident_before - IDLE_BYTES + need + slack
    assert cap < ref.resident_before + need - slack, "the idle models are too small to matter here"
    return cap


def assert_clean(r: Result) -> None:
    assert r.resident_after == r.resident_before  # the models are back on the card
    for module in (DEC, ENC):
        assert "forward" not in module.__dict__ and ATTR not in module.__dict__
    assert emulate.installed() is None and torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_a_pass_that_fits_only_without_the_idle_models_moves_them_off_and_back(kind):
    ref = reference(kind)
    cap = tight_cap(kind)
    plain = job(cap, kind=kind, enabled=False)  # the plain WebUI on the same card
    assert plain.error is not None and "out of memory" in str(plain.error).lower()
    r = job(cap, kind=kind)
    assert r.error is None, r.error
    assert np.abs((r.out - ref.out).numpy()).max() <= VAE_EXACT  # tiled on the small card, or not
    moved = [n for n in r.notes if "off the card for this pass" in n]
    assert len(moved) == 1 and "UNet, text encoders" in moved[0] and "plan does not fit" in moved[0]
    # each model moves on its own (the owner logs each move): off one by one, back one by one
    d = r.resident_during
    assert len(d) == 4 and d[1] == min(d) == r.resident_before - IDLE_BYTES and d[-1] == r.resident_before, d
    events = r.status["timeline"]["events"]
    assert any(e["kind"] == "offload" for e in events), events
    plans = [st["plan"] for st in r.status["stages"] if st["stage"] in ("decode", "encode")]
    assert plans and plans[-1].endswith(", UNet, text encoders off the card"), plans
    assert_clean(r)


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_the_cards_peak_with_the_models_moved_off_is_a_use_the_card_had(kind):
    """A card that holds the checkpoint and half the pass: the pass's live bytes sat on the smaller
    resident, so the card's peak (status route, each stage) stays within its capacity. The real
    WebUI run found it reported as the restored resident plus the pass's peak: 4296 MiB on a
    4246 MiB card."""
    ref = reference(kind)
    need = ref.peak - ref.resident_before
    cap = ref.resident_before + need // 2
    assert ref.resident_before - IDLE_BYTES + need < cap, "the idle models are too small to matter here"
    r = job(cap, kind=kind)
    assert r.error is None, r.error
    assert any("off the card for this pass" in n for n in r.notes), r.notes
    assert r.peak <= cap and r.status["card"]["peak_bytes"] <= cap, (r.peak, cap)
    assert all((s.get("peak_bytes") or 0) <= cap for s in r.status["stages"]), r.status["stages"]
    assert r.status["card"]["ooms"] == 0
    assert_clean(r)


def test_a_pass_that_fits_with_them_moves_nothing():
    r = job(BIG)
    assert r.error is None
    assert not any("off the card" in n for n in r.notes)
    assert r.resident_during == []


def test_an_out_of_memory_error_the_plan_did_not_foresee_is_retried_with_them_off(monkeypatch):
    """The plan said it fits (here: forced), the pass ran out of memory where no tile helps
    (VAEOutOfMemory): the same pass runs again with the idle models off the card."""
    ref = reference()
    cap = tight_cap()
    monkeypatch.setattr(engine, "plan_pass", lambda *a, **k: SimpleNamespace(fits=True))
    r = job(cap)
    assert r.error is None, r.error
    assert np.abs((r.out - ref.out).numpy()).max() <= VAE_EXACT  # tiled on the small card, or not
    assert any("ran out of memory with them there" in n for n in r.notes), r.notes
    assert_clean(r)


def test_a_pass_too_big_even_without_them_fails_with_the_named_error_and_they_come_back():
    ref = reference()
    need = ref.peak - ref.resident_before
    r = job(ref.resident_before - IDLE_BYTES + need // 3)
    assert isinstance(r.error, VAEOutOfMemory), r.error
    assert any("off the card for this pass" in n for n in r.notes)
    assert_clean(r)


def test_with_the_hosts_own_swapping_nothing_moves():
    """--medvram/--lowvram (``sd_model.lowvram``): the host moves models itself."""
    cap = tight_cap()
    MODEL.lowvram = True
    try:
        r = job(cap)
    finally:
        del MODEL.lowvram
    assert isinstance(r.error, VAEOutOfMemory), r.error
    assert not any("off the card for this pass" in n for n in r.notes)
    assert_clean(r)


def test_a_live_preview_never_moves_the_unet_the_sampler_may_be_using():
    cap = tight_cap()
    seen: list[BaseException] = []

    def preview() -> Any:
        def decode() -> None:
            try:
                with emulate.running_on(emulate.installed()), torch.no_grad():
                    DEC(Z)
            except Exception as exc:
                seen.append(exc)

        t = threading.Thread(target=decode)
        t.start()
        t.join()
        return None

    r = job(cap, body=preview)
    assert r.error is None
    assert seen and "out of memory" in str(seen[0]).lower()
    assert not any("off the card" in n for n in r.notes)
    assert_clean(r)


CONFIGS = (
    TiledVAEConfig(budget_bytes=2**30),
    TiledVAEConfig(budget_bytes=3 * 2**20),
    TiledVAEConfig(mode="exact", tile=8),
    TiledVAEConfig(mode="fast", budget_bytes=4 * 2**20),
)


def test_plan_pass_is_the_plan_the_engine_runs():
    for config in CONFIGS:
        for module, x, run in ((DEC, Z, engine.tiled_decode), (ENC, X, engine.tiled_encode)):
            planner.MEMORY.clear()
            plan = engine.plan_pass(module, x, config=config)
            rep = VAEReport()
            with torch.no_grad():
                run(module, x, config=config, report=rep)
            assert rep.plan.split(" x")[0] == plan.plan, (config, type(module).__name__)


def test_the_owner_is_told_the_checkpoints_unet_text_encoders_and_vae():
    names = [n for n, _ in checkpoint_parts(MODEL, vae=False)]
    assert names == ["UNet", "text encoders"]
    assert [n for n, _ in checkpoint_parts(MODEL, unet=False, vae=False)] == ["text encoders"]
    # on a plain CPU (no emulated card) nothing is "on the card": nothing is reported, nothing moves
    assert CardModels(FakeHost(MODEL)).report(MODEL) == []
    forge = SimpleNamespace(**vars(MODEL), forge_objects=object())
    card = emulate.EmulatedCard(BIG)
    with emulate.running_on(card):
        cards = CardModels(FakeHost(MODEL))
        found = cards.report(MODEL)
        assert [m.name for m in found if m.name != "VAE"] == ["UNet", "text encoders"]
        assert sum(m.nbytes for m in found if m.name != "VAE") == IDLE_BYTES
        assert all(m.where == "card" and m.home == "card" for m in found)
        assert CardModels(FakeHost(MODEL)).report(forge) == []
