"""Idle models off the card for a VAE pass that would not fit with them on it.

While the VAE decodes or encodes, the checkpoint's UNet and text encoders sit idle on the device
(SDXL: 5 GB + 1.6 GB in FP16). When the engine's own plan for a pass does not fit the free memory
(:func:`lib_vram.vae.plan_pass`), or the pass ran out of memory where no tile helps (the
whole-latent stage), the job moves them to the CPU for that pass and back right after it, on
success and on error. Nothing moves when the host already swaps models itself (``--lowvram``,
``--medvram``, ``--medvram-sdxl``: ``sd_model.lowvram``), on Forge (its memory manager owns
placement), for a live preview (decoded on another thread while the sampler may run) or when the
parts are not on the compute device.

On an emulated card (``--vram-guard-emulate-vram``, CPU) the weights already live in host memory:
moving them off is the card's resident bytes going down by theirs for the pass, which is what a
GPU's free memory would do.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


def idle_parts(sd_model: Any, *, unet: bool, text_encoders: bool) -> list[tuple[str, torch.nn.Module]]:
    """The checkpoint's parts that are idle during a VAE pass: ``("UNet", sd_model.model)`` and
    ``("text encoders", sd_model.cond_stage_model or sd_model.conditioner)`` (ldm / sgm)."""
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
    return out


@dataclass
class IdleModels:
    """Parts of the checkpoint that may leave the compute device for one VAE pass."""

    parts: tuple[tuple[str, torch.nn.Module], ...]
    device: torch.device
    """Where they are now (the compute device)."""
    card: emulate.EmulatedCard | None = None
    """The emulated card they count on (CPU emulation), if any."""
    move_seconds: float = 0.0
    """Time the copies off and back took in the last :meth:`moved_off` (0 on an emulated card)."""

    @property
    def names(self) -> str:
        return ", ".join(name for name, _ in self.parts)

    @property
    def nbytes(self) -> int:
        return emulate.module_bytes(m for _, m in self.parts)

    @contextlib.contextmanager
    def moved_off(self) -> Iterator[int]:
        """Move the parts to the CPU for the ``with`` block and back after it (also after an
        error); yields the bytes moved."""
        n = self.nbytes
        self.move_seconds = 0.0
        if self.card is not None and self.device.type == "cpu":
            before = self.card.resident_bytes
            self.card.set_resident(max(0, before - n))
            try:
                yield n
            finally:
                self.card.set_resident(before)
            return
        moved: list[torch.nn.Module] = []
        t0 = time.perf_counter()
        try:
            for _, m in self.parts:
                m.to("cpu")
                moved.append(m)
            self.move_seconds = time.perf_counter() - t0
            yield n
        finally:
            t1 = time.perf_counter()
            self._back(moved)
            self.move_seconds += time.perf_counter() - t1

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
    sd_model: Any, *, unet: bool, text_encoders: bool, device: torch.device
) -> IdleModels | None:
    """The parts that can leave ``device`` for a VAE pass, or None when nothing can (see the
    module docstring)."""
    if sd_model is None or getattr(sd_model, "forge_objects", None) is not None:
        return None
    if getattr(sd_model, "lowvram", False):
        return None  # the host moves models itself
    card = emulate.running_here(device)
    parts = []
    for name, m in idle_parts(sd_model, unet=unet, text_encoders=text_encoders):
        where = _device_of(m)
        if where is None or where.type == "meta":
            continue
        on_card = where.type == device.type and (where.index == device.index or device.index is None)
        if on_card and (device.type != "cpu" or card is not None):
            parts.append((name, m))
    if not parts:
        return None
    return IdleModels(tuple(parts), device, card if device.type == "cpu" else None)
