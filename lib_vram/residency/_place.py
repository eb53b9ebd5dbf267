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
from dataclasses import dataclass

import torch

from lib_vram.sampling import StreamPlan, UNetSpec, plan_stream
from lib_vram.sampling._plan import MAX_BUDGET

MiB = 1 << 20
ROUNDS = 16
"""Each round keeps fewer UNet units resident until the largest parked part fits beside them."""


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
    def fits(self) -> bool:
        return self.stream.fits

    @property
    def checkpoint_bytes(self) -> int:
        return self.leftover_bytes + self.stream.unet_bytes + sum(b for _, b in self.parked)

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

    def stage_rows(self) -> list[dict]:
        """Per stage (conditioning, sampling, decode): which model is where; resident/streamed MiB."""
        unet_where = "streamed" if self.stream.streamed else "card"
        rows = []
        for stage, uses in (("conditioning", "text encoders"), ("sampling", "UNet"), ("decode", "VAE")):
            models = [{"name": "UNet", "where": unet_where, "card_mib": self.unet_resident_bytes / MiB}]
            for name, b in self.parked:
                on = name == uses
                models.append(
                    {"name": name, "where": "card" if on else "host", "card_mib": b / MiB if on else 0.0}
                )
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
    latent_hw: tuple[int, int],
    context_tokens: int,
    attention: str,
    dtype: torch.dtype,
    backend: str = "cuda",
) -> CheckpointPlan:
    """The placed plan (see the module docstring). ``unet``: the live UNet or its
    :func:`~lib_vram.sampling.unit_bytes`; ``parked``: (name, bytes) of the text encoders and VAE;
    the step (``batch`` .. ``backend``) is the default pass the resident part leaves room for."""
    step = dict(
        batch=batch,
        latent_hw=latent_hw,
        context_tokens=context_tokens,
        attention=attention,
        dtype=dtype,
        backend=backend,
    )
    budget = min(max(0, card_bytes - safety_bytes - leftover_bytes), MAX_BUDGET)
    plan = plan_stream(unet, spec, budget_bytes=budget, **step)
    largest = max((b for _, b in parked), default=0)
    less = budget
    for _ in range(ROUNDS):
        # the largest parked part must find room beside the resident UNet when it wakes (between
        # passes the activations' room is free): else keep less of the UNet resident
        short = largest - (budget - plan.resident_bytes)
        if not plan.fits or short <= 0 or less == 0:
            break
        less = max(0, less - max(short, MiB))
        plan = plan_stream(unet, spec, budget_bytes=less, **step)
    return CheckpointPlan(plan, card_bytes, safety_bytes, leftover_bytes, tuple(parked))
