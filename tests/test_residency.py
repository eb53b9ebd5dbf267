"""The one owner of the card (lib_vram.residency): which model is where, every move, its faults.

Real modules (the ldm VAE decoder, a UNet, a text-encoder-sized embedding) moved by
:class:`ModuleMover` on the emulated card (an allocation beyond it raises the real out-of-memory
error; each weight a move brings to the card is one allocation, so :attr:`inject_oom_at` reaches
the first, a middle and the last of them), and the GPU path (``module.to``) with the CPU as device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from webui_fakes import tiny_decoder, tiny_unet

from lib_vram.core import emulate
from lib_vram.residency import CARD, HOST, STREAMED, Model, Owner
from lib_vram.residency._modules import ModuleMover, nbytes_of, tensors_of

MiB = 1 << 20


def _bytes(m: torch.nn.Module) -> int:
    return nbytes_of(tensors_of([m]))


class Parts:
    """A placed checkpoint's parts on an emulated card: the UNet's resident part (never moves),
    the text encoders and the VAE at home in host memory; the card holds the resident UNet and the
    larger of the two beside it, not both."""

    def __init__(self, *, slack: int = 64 << 10) -> None:
        self.unet = tiny_unet(seed=3)
        self.te = torch.nn.Embedding(512, 64)
        self.vae = tiny_decoder()
        self.resident = _bytes(self.unet) // 2
        largest = max(_bytes(self.te), _bytes(self.vae))
        self.card = emulate.EmulatedCard(self.resident + largest + slack)
        self.card.set_resident(self.resident)
        self.owner = Owner(lambda: self.card.free_bytes)
        self.models = {}
        for name, role, module, home in (
            ("UNet", "unet", self.unet, STREAMED),
            ("text encoders", "text_encoders", self.te, HOST),
            ("VAE", "vae", self.vae, HOST),
        ):
            mover = ModuleMover(module, torch.device("cpu"), self.card)
            m = Model(name, role, _bytes(module), mover, home=home, where=home, movable=home != STREAMED)
            if home == STREAMED:
                m.resident_bytes = self.resident
            mover.on_use = lambda m=m: self.owner.use(m, why="needed")
            if home == HOST:
                mover.hook()
            self.models[name] = self.owner.join(m)

    def where(self) -> dict[str, str]:
        return {n: m.where for n, m in self.models.items()}

    def card_bytes(self) -> int:
        return self.owner.card_bytes


def test_the_vae_a_decode_woke_no_longer_keeps_the_text_encoders_off_the_card():
    """Issue 29's failure in the real WebUI: the VAE went to the card for the decode and stayed;
    the next job's text encoders did not fit beside it and every later job failed. The owner sends
    the VAE home after its stage, and a wake makes room by sending parts away from home first."""
    w = Parts()
    with emulate.running_on(w.card):
        w.te(torch.zeros(1, 4, dtype=torch.long))  # conditioning: woken by its own forward
        assert w.where()["text encoders"] == CARD
        w.owner.begin("decode", busy=[w.models["VAE"]])
        w.owner.use(w.models["VAE"], "decode")  # the decode needs it: the text encoders make room
        assert w.where() == {"UNet": STREAMED, "text encoders": HOST, "VAE": CARD}
        w.owner.end("decode")
        assert w.where()["VAE"] == HOST and w.card.resident_bytes == w.resident
        # a VAE woken outside any stage (a job with the accordion off) still gives way
        w.vae.conv_in(torch.zeros(1, 4, 4, 4))
        w.te(torch.zeros(1, 4, dtype=torch.long))  # the next job's conditioning
        assert w.where() == {"UNet": STREAMED, "text encoders": CARD, "VAE": HOST}
        assert w.card.resident_bytes == w.resident + _bytes(w.te) == w.card_bytes()
    moves = [(m.name, m.to) for m in w.owner.moves]
    assert moves[-2:] == [("VAE", HOST), ("text encoders", CARD)]


def test_without_the_room_rule_the_second_wake_runs_out_of_memory():
    """The check can fail: with nothing allowed to leave (the old per-site wake), waking the text
    encoders beside the VAE raises the card's out-of-memory error and leaves them in host memory."""
    w = Parts()
    with emulate.running_on(w.card):
        w.vae.conv_in(torch.zeros(1, 4, 4, 4))
        w.owner.busy.add(id(w.models["VAE"]))  # nothing may leave: the VAE is in use
        with pytest.raises(torch.OutOfMemoryError):
            w.te(torch.zeros(1, 4, dtype=torch.long))
        assert w.where()["text encoders"] == HOST and w.card.resident_bytes == w.resident + _bytes(w.vae)


def test_room_chooses_the_fewest_bytes_and_busy_or_unmovable_models_stay():
    w = Parts(slack=4 * MiB)
    with emulate.running_on(w.card):
        for name in ("text encoders", "VAE"):
            w.models[name].home = CARD  # an unplaced checkpoint: all at home on the card
            w.owner._move(w.models[name], CARD, "", "test", record=False)
        te, vae = _bytes(w.te), _bytes(w.vae)
        room = w.owner.room("sampling", [w.models["UNet"]], lambda freed: freed >= min(te, vae))
        assert room.fits and [m.name for m in room.moved] == ["text encoders" if te < vae else "VAE"]
        w.owner.end("sampling")
        assert w.where() == {"UNet": STREAMED, "text encoders": CARD, "VAE": CARD}
        room = w.owner.room("sampling", [], lambda freed: freed >= te + vae + 1)
        assert not room.fits and room.moved == []  # nothing is enough: nothing moves
        w.owner.busy.add(id(w.models["VAE"]))
        room = w.owner.room("decode", [], None)  # ran out of memory: every candidate leaves
        assert [m.name for m in room.moved] == ["text encoders"]  # not the busy VAE, not the UNet
        w.owner.end("decode")
        assert w.where()["text encoders"] == CARD


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_out_of_memory_in_a_wake_leaves_every_model_where_it_was_and_the_next_wake_works(where):
    """The card refuses the first, a middle or the last weight of the VAE's move to it: the VAE
    stays in host memory, the card's count is what it was, the error reaches the module that needed
    it; the next wake of it works."""
    w = Parts()
    n = len(tensors_of([w.vae]))
    k = {"first": 1, "middle": n // 2, "last": n}[where]
    with emulate.running_on(w.card):
        w.card.inject_oom_at = w.card.allocations + k
        with pytest.raises(torch.OutOfMemoryError):
            w.vae.conv_in(torch.zeros(1, 4, 4, 4))
        w.card.inject_oom_at = None
        assert w.where()["VAE"] == HOST and w.card.resident_bytes == w.resident
        w.vae.conv_in(torch.zeros(1, 4, 4, 4))
        assert w.where()["VAE"] == CARD and w.card.resident_bytes == w.resident + _bytes(w.vae)


def test_a_move_back_that_runs_out_of_memory_releases_and_tries_once_more(monkeypatch):
    """The GPU path (``module.to``) with the CPU as the device: the copy back after a stage runs out
    of memory once (what the stage left in the allocator's cache): the owner releases and retries;
    twice: the model stays in host memory until used (its wake hook stays), nothing raises."""
    unet = tiny_unet(seed=5)
    released: list[int] = []
    owner = Owner(lambda: 1 << 40, release=lambda: released.append(1))
    mover = ModuleMover(unet, torch.device("cpu"))
    model = owner.join(Model("UNet", "unet", _bytes(unet), mover))
    mover.on_use = lambda: owner.use(model)
    fails = {"n": 1}
    real_to = unet.to

    def to(device: Any) -> Any:
        if str(device) == "cpu" and fails["n"] and model.where == HOST:
            fails["n"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real_to(device)

    monkeypatch.setattr(unet, "to", to)
    owner.room("decode", [], None)
    assert model.where == HOST and unet.input_blocks[0]._forward_pre_hooks
    owner.end("decode")
    assert model.where == CARD and released == [1] and not unet.input_blocks[0]._forward_pre_hooks
    fails["n"] = 3  # the copy back, the clean-up of its half copy, the retry
    owner.room("decode", [], None)
    owner.end("decode")
    assert model.where == HOST and released == [1, 1] and unet.input_blocks[0]._forward_pre_hooks
    with torch.no_grad():
        unet.time_embed(torch.zeros(1, unet.model_channels))  # used: it comes back
    assert model.where == CARD and not unet.input_blocks[0]._forward_pre_hooks


def test_an_error_that_is_not_out_of_memory_is_not_hidden(monkeypatch):
    dec = tiny_decoder()
    owner = Owner(lambda: 1 << 40)
    model = owner.join(Model("VAE", "vae", _bytes(dec), ModuleMover(dec, torch.device("cpu"))))
    monkeypatch.setattr(dec, "to", lambda device: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        owner.room("sampling", [], None)
    assert model.where == CARD


def test_an_extensions_model_joins_with_the_same_entry_point_and_is_placed_like_the_others():
    """A model an extension adds (a control model) joins by name, role, bytes and a mover; a stage
    that needs the room sends it home, and it comes back after the stage; the snapshot and the
    summary say where each model is."""
    w = Parts()
    extra = torch.nn.Conv2d(64, 64, 3)
    with emulate.running_on(w.card):
        mover = ModuleMover(extra, torch.device("cpu"), w.card)
        control = w.owner.join(Model("ControlNet canny", "control", _bytes(extra), mover))
        mover.on_use = lambda: w.owner.use(control)
        w.card.set_resident(w.card.resident_bytes + _bytes(extra))
        w.owner.begin("decode", busy=[w.models["VAE"]])
        w.owner.use(w.models["VAE"], "decode")
        assert control.where == HOST  # it made the room the VAE needed
        w.owner.end("decode")
        assert control.where == CARD and w.models["VAE"].where == HOST
    rows = {r["name"]: r for r in w.owner.snapshot()}
    assert rows["ControlNet canny"]["where"] == CARD and rows["UNet"]["where"] == STREAMED
    assert rows["UNet"]["card_mib"] == round(w.resident / MiB, 1)
    assert "UNet streamed" in w.owner.summary() and "VAE on the CPU" in w.owner.summary()
    assert w.owner.host_bytes == _bytes(w.unet) - w.resident + _bytes(w.te) + _bytes(w.vae)


def test_bad_input_gets_one_clear_line():
    with pytest.raises(ValueError, match="`home` must be one of"):
        Model("x", "other", 1, ModuleMover(torch.nn.Linear(1, 1), torch.device("cpu")), home="gpu")
    with pytest.raises(ValueError, match="`nbytes` must be a non-negative integer"):
        Model("x", "other", -1, ModuleMover(torch.nn.Linear(1, 1), torch.device("cpu")))


def test_a_wake_outside_any_stage_is_undone_by_the_next_settle_and_leaves_no_record_behind():
    w = Parts(slack=4 * MiB)
    with emulate.running_on(w.card):
        te = w.models["text encoders"]
        te.home = CARD
        w.owner._move(te, CARD, "", "test", record=False)
        w.card.set_resident(w.card.resident_bytes)  # (its bytes were admitted by the move)
        w.owner.room("", [], None)  # e.g. a wake's room with no stage open: the text encoders leave
        assert te.where == HOST and w.owner._stages == {}
        w.vae.conv_in(torch.zeros(1, 4, 4, 4))  # a loose wake of the VAE
        assert w.owner._stages == {} and len(w.owner._loose) == 2
        w.owner.settle()
        assert te.where == CARD and w.models["VAE"].where == HOST and w.owner._loose == []


def test_a_stages_own_model_woken_just_before_it_began_goes_home_at_its_end():
    """The WebUI's decoder module fires its wake hook before VRAM Guard's decode stage opens: the
    stage's end still sends the VAE home (seen in the real WebUI: the VAE stayed on the card)."""
    w = Parts()
    with emulate.running_on(w.card):
        w.vae.conv_in(torch.zeros(1, 4, 4, 4))  # woken outside any stage
        w.owner.begin("decode", busy=[w.models["VAE"]])
        w.owner.use(w.models["VAE"], "decode")  # already there
        w.owner.end("decode")
        assert w.where()["VAE"] == HOST and w.owner._loose == [] and w.card.resident_bytes == w.resident
