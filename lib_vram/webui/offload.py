"""Idle models off the card for a stage that would not fit with them on it.

While the VAE decodes or encodes, the checkpoint's UNet and text encoders sit idle on the device
(SDXL: 5 GB + 1.6 GB in FP16). When the engine's own plan for a pass does not fit the free memory
(:func:`lib_vram.vae.plan_pass`), or the pass ran out of memory where no tile helps (the
whole-latent stage), the job moves them to the CPU for that pass and back right after it, on
success and on error. Nothing moves when the host already swaps models itself (``--lowvram``,
``--medvram``, ``--medvram-sdxl``: ``sd_model.lowvram``), on Forge (its memory manager owns
placement), for a live preview (decoded on another thread while the sampler may run) or when the
parts are not on the compute device.

The same move serves the other stages (:mod:`lib_vram.webui.job`):

* an upscale (hires upscale, Extras, SD upscale): the UNet and text encoders leave the card when
  the upscaler's model plus its smallest plan does not fit beside them, or when the upscale ran
  out of memory where no tile helps;
* a sampling pass: the VAE and the text encoders (the conditioning is computed before the pass)
  leave the card when the sampling plan does not fit with them there. They stay off for the whole
  pass (:meth:`IdleModels.off` / :meth:`IdleModels.back`) and come back at the pass's end, on an
  error, or as soon as anything runs one of their modules (:meth:`IdleModels.off` with
  ``wake_on_use``: a forward pre-hook on each of their modules), so a path VRAM Guard does not
  know about (the hires pass's conditioning, an inpainting model's image conditioning) finds
  them on the card.

On an emulated card (``--vram-guard-emulate-vram``, CPU) the weights already live in host memory:
moving them off is the card's resident bytes going down by theirs for the pass, which is what a
GPU's free memory would do.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.device import is_oom_error, release

logger = logging.getLogger(__name__)


def _device_of(module: torch.nn.Module) -> torch.device | None:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


def idle_parts(
    sd_model: Any, *, unet: bool, text_encoders: bool, vae: bool = False
) -> list[tuple[str, torch.nn.Module]]:
    """The checkpoint's parts that may be idle during a stage: ``("UNet", sd_model.model)``,
    ``("text encoders", sd_model.cond_stage_model or sd_model.conditioner)`` (ldm / sgm) and
    ``("VAE", sd_model.first_stage_model)``."""
    out: list[tuple[str, torch.nn.Module]] = []
    if sd_model is None:
        return out
    if unet:
        wrapper = getattr(sd_model, "model", None)
        if isinstance(wrapper, torch.nn.Module):
            out.append(("UNet", wrapper))
        elif isinstance(getattr(wrapper, "diffusion_model", None), torch.nn.Module):
            out.append(("UNet", wrapper.diffusion_model))
    if text_encoders:
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


@dataclass
class IdleModels:
    """Parts of the checkpoint that may leave the compute device for one stage."""

    parts: tuple[tuple[str, torch.nn.Module], ...]
    device: torch.device
    """Where they are now (the compute device)."""
    card: emulate.EmulatedCard | None = None
    """The emulated card they count on (CPU emulation), if any."""
    move_seconds: float = 0.0
    """Time the copies off and back took in the last move (0 on an emulated card)."""
    owner: Any = None
    """The checkpoint they belong to (:meth:`back` leaves them where they are once the host has
    switched to another checkpoint: it moved the old one itself)."""
    still_current: Any = None
    """``() -> bool``: whether :attr:`owner` is still the host's checkpoint (None: always)."""
    _moved: list[torch.nn.Module] | None = field(default=None, repr=False)
    _resident: int | None = field(default=None, repr=False)
    _hooks: list[Any] = field(default_factory=list, repr=False)
    _lock: Any = field(default_factory=threading.RLock, repr=False)

    @property
    def names(self) -> str:
        return ", ".join(name for name, _ in self.parts)

    @property
    def nbytes(self) -> int:
        return emulate.module_bytes(m for _, m in self.parts)

    @property
    def is_off(self) -> bool:
        return self._moved is not None or self._resident is not None

    def off(self, *, wake_on_use: bool = False) -> int:
        """Move the parts to the CPU until :meth:`back`; returns the bytes moved. A part whose
        copy fails comes back with those moved before it, and the error propagates.
        ``wake_on_use``: the first forward of any of their modules calls :meth:`back` first."""
        with self._lock:
            if self.is_off:
                return 0
            n = self.nbytes
            self.move_seconds = 0.0
            if self.card is not None and self.device.type == "cpu":
                self._resident = self.card.resident_bytes
                self.card.set_resident(max(0, self._resident - n))
            else:
                moved: list[torch.nn.Module] = []
                t0 = time.perf_counter()
                try:
                    for _, m in self.parts:
                        m.to("cpu")
                        moved.append(m)
                except BaseException:
                    self._back(moved)
                    raise
                self._moved = moved
                self.move_seconds = time.perf_counter() - t0
            if wake_on_use:
                self._wake_hooks()
            return n

    def back(self) -> None:
        """Put the parts back on the device (idempotent). An out-of-memory error on the way back
        releases the cache and tries once more (see :meth:`_back`)."""
        with self._lock:
            self._unhook()
            resident, self._resident = self._resident, None
            moved, self._moved = self._moved, None
            if resident is not None and self.card is not None:
                self.card.set_resident(resident)
            if moved is None:
                return
            if self.still_current is not None and not self.still_current():
                logger.info(
                    "VRAM Guard: the %s stay where the WebUI put them: it switched to another checkpoint",
                    self.names,
                )
                return
            t1 = time.perf_counter()
            self._back(moved)
            self.move_seconds += time.perf_counter() - t1

    @contextlib.contextmanager
    def moved_off(self) -> Iterator[int]:
        """Move the parts to the CPU for the ``with`` block and back after it (also after an
        error); yields the bytes moved."""
        n = self.off()
        try:
            yield n
        finally:
            self.back()

    def _wake_hooks(self) -> None:
        ref = weakref.ref(self)

        def wake(module: torch.nn.Module, args: Any) -> None:
            idle = ref()
            if idle is not None and idle.is_off:
                logger.info("VRAM Guard: the %s are needed now: back on the card", idle.names)
                idle.back()

        for _, part in self.parts:
            for m in part.modules():
                self._hooks.append(m.register_forward_pre_hook(wake))

    def _unhook(self) -> None:
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()

    def _back(self, moved: list[torch.nn.Module]) -> None:
        for m in moved:
            try:
                m.to(self.device)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                # what the failed pass left in the cache: release it and try once more (the
                # sampler needs these weights back on the device)
                release(self.device)
                m.to(self.device)


def find_idle_models(
    sd_model: Any, *, unet: bool, text_encoders: bool, device: torch.device, vae: bool = False
) -> IdleModels | None:
    """The parts that can leave ``device`` for a stage, or None when nothing can (see the
    module docstring)."""
    if sd_model is None or getattr(sd_model, "forge_objects", None) is not None:
        return None
    if getattr(sd_model, "lowvram", False):
        return None  # the host moves models itself
    card = emulate.running_here(device)
    parts = []
    for name, m in idle_parts(sd_model, unet=unet, text_encoders=text_encoders, vae=vae):
        where = _device_of(m)
        if where is None or where.type == "meta":
            continue
        on_card = where.type == device.type and (where.index == device.index or device.index is None)
        if on_card and (device.type != "cpu" or card is not None):
            parts.append((name, m))
    if not parts:
        return None
    return IdleModels(tuple(parts), device, card if device.type == "cpu" else None, owner=sd_model)
