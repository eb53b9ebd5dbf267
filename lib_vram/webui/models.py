"""The WebUI's models, reported to the one owner of the card (:class:`lib_vram.residency.Owner`).

The host adapter does not decide where a model lives: it reports the loaded checkpoint's parts
(:func:`checkpoint_parts`) with their movers and asks the owner for room before a stage
(docs/streaming.md, "One owner of the card"). Nothing is reported (so nothing moves) where the
host or Forge moves models itself or the WebUI computes on the CPU without an emulated card
(:meth:`CardModels.skip_reason`), or for a model whose weights are not on the compute device. A
checkpoint placed by VRAM Guard (:mod:`.placement`) is reported with its placed homes: the UNet
streamed (its resident part never moves), the text encoders and the VAE in host memory until used.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.device import free_bytes, release
from lib_vram.residency import CARD, HOST, STREAMED, Model, Owner, Room
from lib_vram.residency._modules import ModuleMover, nbytes_of, tensors_of

logger = logging.getLogger(__name__)

ROLES = {"UNet": "unet", "text encoders": "text_encoders", "VAE": "vae"}


def checkpoint_parts(
    sd_model: Any, *, unet: bool = True, vae: bool = True
) -> list[tuple[str, torch.nn.Module]]:
    """The checkpoint's parts: ``("UNet", sd_model.model)``, ``("text encoders",
    sd_model.cond_stage_model or sd_model.conditioner)`` (ldm / sgm), ``("VAE", first_stage_model)``."""
    out: list[tuple[str, torch.nn.Module]] = []
    if sd_model is None:
        return out
    if unet:
        wrapper = getattr(sd_model, "model", None)
        if isinstance(wrapper, torch.nn.Module):
            out.append(("UNet", wrapper))
        elif isinstance(getattr(wrapper, "diffusion_model", None), torch.nn.Module):
            out.append(("UNet", wrapper.diffusion_model))
    for attr in ("cond_stage_model", "conditioner"):
        m = getattr(sd_model, attr, None)
        if isinstance(m, torch.nn.Module):
            out.append(("text encoders", m))
            break
    if vae:
        m = getattr(sd_model, "first_stage_model", None)
        if isinstance(m, torch.nn.Module):
            out.append(("VAE", m))
    return out


def model_skip_reason(sd_model: Any) -> str | None:
    """Why VRAM Guard leaves ``sd_model``'s memory to the WebUI (None: it may manage it)."""
    if sd_model is None:
        return "no model"
    if getattr(sd_model, "forge_objects", None) is not None:
        return "Forge"
    if getattr(sd_model, "lowvram", False):
        return "--medvram/--lowvram"
    return None


def _dtype_of(module: torch.nn.Module) -> str:
    first = next(module.parameters(), None)
    return str(first.dtype).replace("torch.", "") if first is not None else ""


class CardModels:
    """The session's owner and the loaded checkpoint's models in it."""

    def __init__(self, host: Any, emulated: Callable[[], Any] | None = None) -> None:
        self.host = host
        self.emulated = emulated
        self.owner = Owner(self._free, release=lambda: release(self.device()))
        self.group: Any = None
        """The checkpoint whose models are reported."""
        self._unet_hook: Any = None

    # -- the card ------------------------------------------------------------------------------
    def device(self) -> torch.device:
        return self.host.device()

    def card(self) -> emulate.EmulatedCard | None:
        """The emulated card the weights count on (CPU emulation), else None."""
        if self.device().type != "cpu":
            return None
        card = self.emulated() if self.emulated is not None else None
        return card if card is not None else emulate.current("cpu")

    def has_card(self) -> bool:
        return self.device().type != "cpu" or self.card() is not None

    def _free(self) -> int:
        card = self.card()
        return card.free_bytes if card is not None else free_bytes(self.device())

    # -- reporting -----------------------------------------------------------------------------
    def skip_reason(self, sd_model: Any) -> str | None:
        why = model_skip_reason(sd_model)
        if why is None and not self.has_card():
            return "the WebUI runs on the CPU"
        return why

    def report(self, sd_model: Any, *, placed: Any = None) -> list[Model]:
        """Report ``sd_model``'s parts (the models of the previous checkpoint leave the owner).
        ``placed``: its :class:`~lib_vram.webui.placed.Placed` (the placed homes)."""
        owner = self.owner
        if self.group is not None and self.group is not sd_model:
            self.forget()
        if self.group is sd_model and owner.of(sd_model) and placed is None:
            return owner.of(sd_model)
        self.forget()
        if self.skip_reason(sd_model) is not None:
            return []
        device, card = self.device(), self.card()
        out = []
        for name, module in checkpoint_parts(sd_model):
            where = next((t.device for t in (*module.parameters(), *module.buffers())), None)
            if where is None or where.type == "meta":
                continue
            on_card = where.type == device.type and (where.index == device.index or device.index is None)
            if placed is None and not on_card:
                continue
            mover = ModuleMover(module, device, card)
            n = nbytes_of(tensors_of([module]))
            model = Model(name, ROLES[name], n, mover, dtype=_dtype_of(module), group=sd_model)
            verb = "are" if name.endswith("s") else "is"  # (wakes it while it is in host memory)
            mover.on_use = functools.partial(owner.use, model, why=f"the {name} {verb} needed now")
            if placed is not None and name == "UNet":
                model.home = model.where = STREAMED if placed.streamer is not None else CARD
                model.resident_bytes = placed.unet_resident_bytes
                model.movable = False
            elif placed is not None:
                model.home = model.where = HOST
                mover.hook()
            out.append(owner.join(model))
        self.group = sd_model
        if placed is not None:
            self._hook_unet(placed.unet)
        return out

    def _hook_unet(self, unet: torch.nn.Module) -> None:
        """At each forward of a placed UNet the text encoders woken outside a stage go home (the
        conditioning is computed before sampling: they only hold room the pass may need); this
        holds in every job, also one with the accordion off. A woken VAE stays (a live preview may
        decode with it on another thread); it is the first to go when a part needs its room."""
        owner = self.owner

        def unet_starts(module: torch.nn.Module, args: Any) -> None:
            owner.settle(roles=("text_encoders",))

        self._unet_hook = unet.register_forward_pre_hook(unet_starts)

    def forget(self) -> None:
        """The reported checkpoint leaves the owner (a switch, an unload, the placement undone)."""
        hook, self._unet_hook = self._unet_hook, None
        if hook is not None:
            hook.remove()
        if self.group is not None:
            for m in self.owner.leave_group(self.group):
                unhook = getattr(m.mover, "unhook", None)
                if callable(unhook):
                    unhook()
        self.group = None

    # -- asking ------------------------------------------------------------------------------
    def models(self, sd_model: Any, names: Iterable[str] | None = None) -> list[Model]:
        """The reported models of ``sd_model`` (those named), reporting it first if it is new."""
        if sd_model is not self.group:
            self.report(sd_model)
        found = self.owner.of(sd_model)
        return found if names is None else [m for m in found if m.name in set(names)]

    def room(self, stage: str, sd_model: Any, *, movable: Iterable[str], why: str = "") -> Room:
        """The models named in ``movable`` that are not in use leave the card for ``stage`` (the owner's
        moves, undone at its end)."""
        allowed = set(movable)
        self.models(sd_model)
        return self.owner.room(stage, why=why, may_move=lambda m: m.name in allowed)


def loaded_bytes(sd_model: Any, *, half: bool) -> int | None:
    """The checkpoint's bytes once loaded, from its (meta) parameters: FP16 except the VAE when the
    WebUI loads in half precision (v1.10.1's ``weight_dtype_conversion``), else as they are."""
    if not isinstance(sd_model, torch.nn.Module):
        return None
    vae = getattr(sd_model, "first_stage_model", None)
    vae_ids = {id(t) for t in tensors_of([vae])} if isinstance(vae, torch.nn.Module) else set()
    total = 0
    for t in tensors_of([sd_model]):
        size = t.element_size()
        if half and t.is_floating_point() and id(t) not in vae_ids:
            size = min(size, 2)
        total += t.numel() * size
    return total
