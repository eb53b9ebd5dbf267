"""ControlNet's preprocessor models in the one owner (lib_vram.residency.preprocessors).

The models are real: transformers' ``CLIPVisionModelWithProjection`` (IP-Adapter's image encoder,
a small config with random weights) and a small convolutional depth network. What holds them is
shaped as sd-webui-controlnet v1.1.455 holds its annotators (a registry of preprocessor objects
whose ``cached_call`` runs them; a dict of CLIP encoders in a module, each a detector with a
``model``; a module global ``model`` for depth; ``unload`` moving them to ``meta`` or the CPU).
The card is the emulated one: a "checkpoint" is resident, a preprocessor model counts on it where a
GPU would hold it, and an allocation beyond it raises the real out-of-memory error.

Criterion: a preprocessor's output with VRAM Guard is bit-identical to the plain call's (same
weights, same kernels; parking copies the weights back and forth unchanged).
"""

from __future__ import annotations

import logging
import sys
import types
from contextlib import ExitStack
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from lib_vram.core import emulate
from lib_vram.residency import HOST, Owner
from lib_vram.residency.preprocessors import PreprocessorOutOfMemory, Preprocessors, models_in

transformers = pytest.importorskip("transformers")

MiB = 1 << 20
RESIDENT = 8 * MiB
"""The "checkpoint" on the card."""


def clip_model() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(
        hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        image_size=64, patch_size=8, projection_dim=64,
    )  # fmt: skip
    return transformers.CLIPVisionModelWithProjection(config).eval()


def depth_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 1, 3, padding=1),
    ).eval()  # fmt: skip


# -- ControlNet's holders (the shapes of its registry and annotator modules) ------------------------
LOADS = {"clip": 0, "depth": 0}
processor = types.ModuleType("processor")  # (its legacy processor module: a dict of CLIP encoders)
processor.clip_encoder = {"clip_h": None}
midas = types.ModuleType("midas")  # (an annotator module: a global model)
midas.model = None


class ClipDetector:
    def __init__(self) -> None:
        LOADS["clip"] += 1
        self.model = clip_model()

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(pixel_values=image).image_embeds

    def unload_model(self) -> None:
        self.model.to("meta")


class Preprocessor:
    all_processors: ClassVar[dict[str, Preprocessor]] = {}

    def __init__(self, name: str) -> None:
        self.name = name
        Preprocessor.all_processors[name] = self

    def cached_call(self, image: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self(image)


class ClipPreprocessor(Preprocessor):
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if processor.clip_encoder["clip_h"] is None:
            processor.clip_encoder["clip_h"] = ClipDetector()
        return processor.clip_encoder["clip_h"](image)

    def unload(self) -> bool:
        if processor.clip_encoder["clip_h"] is not None:
            processor.clip_encoder["clip_h"].unload_model()
            processor.clip_encoder["clip_h"] = None
            return True
        return False


class DepthPreprocessor(Preprocessor):
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if midas.model is None:
            LOADS["depth"] += 1
            midas.model = depth_model()
        midas.model.to("cpu")  # (ControlNet's annotators move theirs to their device at each call)
        with torch.no_grad():
            return midas.model(image)

    def unload(self) -> bool:
        if midas.model is not None:
            midas.model = midas.model.cpu()
            return True
        return False


CLIP = ClipPreprocessor("ip-adapter_clip_h")
DEPTH = DepthPreprocessor("depth_midas")
IMAGE = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))


class Cards:
    def __init__(self, card: emulate.EmulatedCard) -> None:
        self._card = card
        self.owner = Owner(lambda: card.free_bytes)

    def device(self) -> torch.device:
        return torch.device("cpu")

    def card(self) -> emulate.EmulatedCard:
        return self._card


@pytest.fixture
def world():
    """Fresh holders, an emulated card with the checkpoint resident, the patches installed."""
    processor.clip_encoder["clip_h"] = None
    midas.model = None
    LOADS.update(clip=0, depth=0)
    card = emulate.EmulatedCard(256 * MiB, resident=RESIDENT)
    cards = Cards(card)
    state = {"owned": True, "stops": []}
    pre = Preprocessors(
        cards, lambda: [processor, midas, Preprocessor.all_processors], lambda: state["owned"],
        state["stops"].append,
    )  # fmt: skip
    with ExitStack() as stack:
        assert pre.install(Preprocessor, stack)
        yield types.SimpleNamespace(card=card, cards=cards, pre=pre, state=state)
    assert "cached_call" in Preprocessor.__dict__ and not hasattr(Preprocessor.cached_call, "_vram_guard")
    assert not hasattr(ClipPreprocessor.unload, "_vram_guard") and not pre.entries


def run(w: Any, pre: Preprocessor, image: torch.Tensor = IMAGE) -> torch.Tensor:
    with w.card:  # (the job's thread runs on the card)
        return pre.cached_call(image)


def plain_outputs() -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return clip_model()(pixel_values=IMAGE).image_embeds, depth_model()(IMAGE)


def clip_bytes() -> int:
    return emulate.module_bytes([clip_model()])


def test_the_models_are_found_where_controlnet_holds_them():
    holder = types.SimpleNamespace(detector=types.SimpleNamespace(model=clip_model()), n=1, f=print)
    found = models_in([{"a": holder}, [depth_model()]])
    assert sorted(type(m).__name__ for m in found) == ["CLIPVisionModelWithProjection", "Sequential"]


def test_a_preprocessor_model_joins_the_owner_runs_on_the_card_and_is_parked_after(world, caplog):
    clip_ref, depth_ref = plain_outputs()
    caplog.set_level(logging.INFO, logger="lib_vram")
    out = run(world, CLIP)
    assert torch.equal(out, clip_ref)
    (model,) = world.cards.owner.models
    assert (model.role, model.where, model.nbytes) == ("preprocessor", HOST, clip_bytes())
    assert world.card.resident_bytes == RESIDENT  # nothing but the checkpoint on the card after it
    assert world.card.peak_bytes >= RESIDENT + clip_bytes()  # it was on the card while it ran
    again = run(world, CLIP)
    assert torch.equal(again, clip_ref) and LOADS["clip"] == 1  # parked in host memory, no new load
    assert "from host memory (no disk load)" in caplog.text
    assert world.card.resident_bytes == RESIDENT
    assert torch.equal(run(world, DEPTH), depth_ref)
    rows = {r["name"]: r for r in world.cards.owner.snapshot()}
    assert set(rows) == {"ip-adapter_clip_h preprocessor model", "depth_midas preprocessor model"}
    assert all(r["where"] == "host" and r["role"] == "preprocessor" for r in rows.values())
    assert world.card.resident_bytes == RESIDENT


def test_the_plain_webui_keeps_it_on_the_card_and_runs_out_of_memory_where_vram_guard_does_not(world):
    """Outside VRAM Guard's job the model stays where ControlNet put it (counted on the card, as on
    a GPU); the next stage's allocation that fits beside the checkpoint does not fit beside it."""
    world.card.capacity = RESIDENT + clip_bytes() + 4 * MiB
    stage = (clip_bytes() + 2 * MiB) // 4  # float32 elements of the next stage (the sampling)
    world.state["owned"] = False
    run(world, CLIP)
    assert world.card.resident_bytes == RESIDENT + clip_bytes()
    with pytest.raises(torch.OutOfMemoryError), world.card:
        torch.empty(stage)
    world.state["owned"] = True
    run(world, CLIP)  # VRAM Guard's job: it joins, runs, is parked
    assert world.card.resident_bytes == RESIDENT
    with world.card:
        torch.empty(stage)


def test_controlnets_unload_paths_keep_working(world):
    run(world, CLIP)
    run(world, DEPTH)
    CLIP.unload()  # ControlNet's: to("meta"), dropped
    assert [m.name for m in world.cards.owner.models] == ["depth_midas preprocessor model"]
    DEPTH.unload()  # ControlNet's: cpu(), kept (where the owner parks it anyway)
    assert [m.name for m in world.cards.owner.models] == ["depth_midas preprocessor model"]
    assert world.card.resident_bytes == RESIDENT
    world.state["owned"] = False  # the plain WebUI: on the card until ControlNet moves it off
    run(world, CLIP)
    assert world.card.resident_bytes == RESIDENT + clip_bytes()
    CLIP.unload()
    assert world.card.resident_bytes == RESIDENT
    midas.model = None  # dropped: it leaves
    run(world, CLIP)
    assert [m.name for m in world.cards.owner.models] == []
    assert world.card.resident_bytes == RESIDENT + clip_bytes()
    CLIP.unload()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_wake_that_runs_out_of_memory_makes_room_and_tries_once_more(world, where):
    """The wake of the parked encoder fails once at its first, a middle or its last allocation:
    nothing is left half-moved, every idle model leaves the card and the second try runs; the
    output is the plain one."""
    clip_ref, _ = plain_outputs()
    run(world, CLIP)
    n = len(list(CLIP_MODEL(world).parameters())) + len(list(CLIP_MODEL(world).buffers()))
    world.card.inject_oom_at = world.card.allocations + {"first": 1, "middle": n // 2, "last": n}[where]
    assert torch.equal(run(world, CLIP), clip_ref)
    assert world.card.injected and world.card.ooms == 1
    assert world.card.resident_bytes == RESIDENT and not world.state["stops"]


def test_a_model_that_cannot_fit_stops_with_one_line_and_nothing_half_moved(world):
    run(world, CLIP)
    world.card.capacity = RESIDENT + clip_bytes() // 2
    image = IMAGE.clone()
    with pytest.raises(PreprocessorOutOfMemory) as err:
        run(world, CLIP, image)
    text = str(err.value)
    assert "\n" not in text and "out of memory" in text and "ip-adapter_clip_h" in text, text
    assert world.state["stops"] == [text]
    (model,) = world.cards.owner.models
    assert model.where == HOST and world.card.resident_bytes == RESIDENT
    assert torch.equal(image, IMAGE)  # the input image is kept


def CLIP_MODEL(w: Any) -> nn.Module:  # noqa: N802
    return processor.clip_encoder["clip_h"].model


def test_the_webui_adapter_finds_controlnets_registry_and_holders(monkeypatch):
    from lib_vram.webui import host

    assert host.controlnet_preprocessors() is None or "supported_preprocessor" in str(sys.modules)
    mod = types.ModuleType("scripts.supported_preprocessor")
    mod.Preprocessor = Preprocessor
    monkeypatch.setitem(sys.modules, "scripts.supported_preprocessor", mod)
    monkeypatch.setitem(sys.modules, "annotator.midas", midas)
    cls, roots = host.controlnet_preprocessors()
    assert cls is Preprocessor and roots()[0] is Preprocessor.all_processors and midas in roots()
