"""One checkpoint placed by VRAM Guard (:class:`Placed`): its UNet's plan and streamer, its parked
parts, and what of it a GPU holds (the emulated card's count). Made by :mod:`.placement`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lib_vram.core import emulate

logger = logging.getLogger("lib_vram.webui.placement")  # (the placement's log lines, one logger)

MiB = 1 << 20


@dataclass(eq=False)
class Placed:
    """One placed checkpoint."""

    model: Any
    unet: torch.nn.Module
    plan: Any
    """The :class:`~lib_vram.sampling.StreamPlan` (nothing streamed when the UNet fits whole)."""
    parked: tuple[tuple[str, torch.nn.Module], ...]
    """The text encoders and the VAE: in host memory until used (the owner wakes them)."""
    device: torch.device
    card: emulate.EmulatedCard | None
    streamer: Any = None
    leftover_bytes: int = 0
    owner: Any = None
    """The session's :class:`~lib_vram.residency.Owner` (the parked parts' places)."""
    _logged: tuple[int, int, int, int] = (0, 0, 0, 0)
    """The streamer's (forwards, bytes in, prefetched, on demand) at the last log line."""

    @property
    def unet_resident_bytes(self) -> int:
        return self.plan.resident_bytes if self.streamer is not None else self.plan.unet_bytes

    @property
    def unet_device_bytes(self) -> int:
        """What the UNet takes on the card during a forward: its resident part + the stream buffer."""
        if self.streamer is None:
            return self.plan.unet_bytes
        return self.plan.resident_bytes + self.plan.buffer_bytes

    @property
    def label(self) -> str:
        p = self.plan
        parked = " and ".join(n for n, _ in self.parked)
        return (
            f"checkpoint placed by VRAM Guard: UNet {self.unet_resident_bytes / MiB:.0f} of "
            f"{p.unet_bytes / MiB:.0f} MiB resident, {parked} on the CPU until used"
        )

    def _woken(self) -> list[Any]:
        """The owner's models of the parked parts that are on the card now."""
        if self.owner is None:
            return []
        ids = {id(m) for _, m in self.parked}
        models = self.owner.of(self.model)
        return [m for m in models if id(getattr(m.mover, "module", None)) in ids and m.card_bytes]

    @property
    def parked_on_card_bytes(self) -> int:
        """The woken parked parts' bytes (on the card now)."""
        return sum(m.card_bytes for m in self._woken())

    def recount(self) -> None:
        """The emulated card's resident bytes = what a GPU holds of the placed checkpoint (between
        forwards)."""
        if self.card is not None:
            self.card.set_resident(self.leftover_bytes + self.unet_resident_bytes + self.parked_on_card_bytes)

    def settle(self) -> None:
        """A pass ended (or was cut short): no streamed unit left on the card; its traffic logged."""
        s = self.streamer
        if s is None:
            return
        s.settle()
        st = s.stats
        seen = (st.forwards, st.bytes_in, st.prefetched, st.on_demand)
        forwards, copied, ahead, demand = (now - was for now, was in zip(seen, self._logged))
        self._logged = seen
        if forwards:
            logger.info(
                "VRAM Guard: placed UNet: %d forward(s) this pass, %.0f MiB copied to the card (%.0f MiB per "
                "forward; --lowvram would move %.0f MiB per forward); %d units prefetched, %d on demand",
                forwards,
                copied / MiB,
                copied / forwards / MiB,
                self.plan.lowvram_bytes_per_step / MiB,
                ahead,
                demand,
            )
