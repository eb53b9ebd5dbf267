"""Where a checkpoint lives when it does not fit the card: the placed plan, host-free.

A checkpoint is *placed* when its weights plus a working margin (the safety margin and one default
pass's activations and inputs) exceed the card: the text encoders and the VAE wait in host memory
until a stage uses them, as much of the UNet as the budget holds stays on the card, and the rest
streams through it for each forward (:func:`lib_vram.sampling.plan_stream`). The resident part
leaves room for the largest parked part beside it, so that a part that wakes always finds room
once the other parked parts have gone home (:class:`~lib_vram.residency.Owner`).

The same function serves the WebUI's placement at load (live modules) and ``plan`` (reference
architectures): one plan, one set of numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lib_vram.sampling import StreamPlan, UNetSpec, choose_resident, unit_bytes
from lib_vram.sampling import plan_stream as _plan_stream
from lib_vram.sampling._plan import MAX_BUDGET

MiB = 1 << 20
ROUNDS = 16
"""Each round keeps fewer UNet units resident until the largest parked part fits beside them."""
STAGES = (("conditioning", "text encoders"), ("sampling", "UNet"), ("decode", "VAE"))
"""A job's stages and the parked part each uses (:meth:`CheckpointPlan.stage_rows`)."""


@dataclass(frozen=True)
class CheckpointPlan:
    """The placed plan of one checkpoint on one card."""

    stream: StreamPlan
    """The UNet's units: resident ones, streamed ones, bytes per step (against ``--lowvram``'s)."""
    card_bytes: int
    safety_bytes: int
    leftover_bytes: int
    """The checkpoint's own buffers (e.g. ``alphas_cumprod``): on the card."""
    parked: tuple[tuple[str, int], ...]
    """(name, bytes) of the parts in host memory until used (text encoders, VAE)."""

    @property
    def budget_bytes(self) -> int:
        return max(0, self.card_bytes - self.safety_bytes - self.leftover_bytes)

    @property
    def fits(self) -> bool:
        """The default pass fits, and the largest parked part finds room beside the resident UNet
        when it wakes."""
        room = self.budget_bytes - self.unet_resident_bytes
        return self.stream.fits and self.largest_parked_bytes <= room

    @property
    def unet_resident_bytes(self) -> int:
        return self.stream.resident_bytes if self.stream.streamed else self.stream.unet_bytes

    @property
    def largest_parked_bytes(self) -> int:
        return max((b for _, b in self.parked), default=0)

    @property
    def host_bytes(self) -> int:
        """What stays in host memory between stages: the parked parts and the streamed units' copies."""
        streamed = self.stream.unet_bytes - self.unet_resident_bytes
        return streamed + sum(b for _, b in self.parked)

    def stage_rows(self, stages: Sequence[tuple[str, str]] = STAGES) -> list[dict]:
        """Per stage ((stage, the parked part it uses) of ``stages``): which model is where, the
        MiB of it on the card and its MiB in all."""

        def row(name: str, where: str, card_bytes: int, nbytes: int) -> dict:
            return {"name": name, "where": where, "card_mib": card_bytes / MiB, "mib": nbytes / MiB}

        where = "streamed" if self.stream.streamed else "card"
        rows = []
        for stage, uses in stages:
            models = [row("UNet", where, self.unet_resident_bytes, self.stream.unet_bytes)]
            models += [row(n, "card", b, b) if n == uses else row(n, "host", 0, b) for n, b in self.parked]
            rows.append({"stage": stage, "models": models})
        return rows


def host_shortfall(nbytes: int) -> int | None:
    """The host memory available now when ``nbytes`` do not fit in it (None: they fit, or the
    machine cannot tell)."""
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        return None
    return available if nbytes > available else None


def plan_checkpoint(
    unet: torch.nn.Module | Sequence[tuple[str, int]],
    spec: UNetSpec,
    *,
    card_bytes: int,
    safety_bytes: int,
    leftover_bytes: int,
    parked: Sequence[tuple[str, int]],
    batch: int,
    **step: Any,
) -> CheckpointPlan:
    """The placed plan (see the module docstring). ``unet``: the live UNet or its
    :func:`~lib_vram.sampling.unit_bytes`; ``parked``: (name, bytes) of the text encoders and VAE;
    ``batch`` and ``step``: the default pass the resident part leaves room for, as
    :func:`~lib_vram.sampling.plan_stream`'s keywords (``latent_hw`` ... ``backend``)."""
    budget = min(max(0, card_bytes - safety_bytes - leftover_bytes), MAX_BUDGET)

    def plan_stream(budget_bytes: int) -> StreamPlan:
        try:
            return _plan_stream(unet, spec, budget_bytes=budget_bytes, batch=batch, **step)
        except ValueError as exc:
            if "can be planned" not in str(exc):
                raise
            # no micro-batch can be planned at this budget (the attention refuses): nothing fits
            units = unit_bytes(unet) if isinstance(unet, torch.nn.Module) else list(unet)
            none = choose_resident(
                units, weights_budget_bytes=-1, activation_bytes=0, forwards_per_step=max(1, min(batch, 64))
            )
            return replace(none, batch=batch, notes=(str(exc),))

    plan = plan_stream(budget)
    largest = max((b for _, b in parked), default=0)
    less = budget
    for _ in range(ROUNDS):
        # the largest parked part must find room beside the resident UNet when it wakes (between
        # passes the activations' room is free): else keep less of the UNet resident
        short = largest - (budget - plan.resident_bytes)
        if not plan.fits or short <= 0 or less == 0:
            break
        less = max(0, less - max(short, MiB))
        plan = plan_stream(less)
    return CheckpointPlan(plan, card_bytes, safety_bytes, leftover_bytes, tuple(parked))
