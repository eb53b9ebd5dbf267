"""The sampling ladder's last rung in the WebUI: stream the UNet for a pass that does not fit.

When the sampling guard (:mod:`lib_vram.webui.sampling`) finds that a pass does not fit even at
micro-batch 1, it asks :func:`plan_pass` here before it stops: a
:class:`~lib_vram.sampling.StreamPlan` that keeps as much of the UNet on the card as the budget
allows (the sampling plan's own activations, not a second estimate) and streams the rest
(docs/streaming.md). :meth:`StreamPass.enter` puts a :class:`~lib_vram.sampling.StreamedUNet` on
the pass's ``ExitStack``, so the streamed weights come back at the pass's end, on an error (the
job's close), at the next run (the WebUI skips ``postprocess`` after an error) and at script
unload (:meth:`Session.close_all`). A move back that itself could not fit stays pending and is
retried by :func:`restore_pending` (next job, unload).
"""

from __future__ import annotations

import logging
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from lib_vram.sampling import SamplingPlan, StreamedUNet, StreamPlan, UNetSpec, plan_stream

from .models import model_skip_reason

logger = logging.getLogger(__name__)

MiB = 1 << 20

_PENDING: list[StreamedUNet] = []
_LOCK = threading.Lock()


def skip_reason(sd_model: Any, settings: Any = None) -> str | None:
    """Why the UNet may not stream for this model (None: it may)."""
    if settings is not None and not getattr(settings, "stream_unet", True):
        return "'Stream the UNet' is off"
    return model_skip_reason(sd_model)


@dataclass
class StreamPass:
    """A streamed plan for one sampling pass, not yet in force."""

    plan: StreamPlan
    unet: torch.nn.Module
    device: torch.device
    streamer: StreamedUNet | None = None

    @property
    def label(self) -> str:
        """``"UNet streamed: X of Y MiB resident"`` (readout, infotext)."""
        return self.plan.label

    @property
    def resident_bytes(self) -> int:
        """The UNet's bytes on the card for the pass (between its streamed units' forwards)."""
        return self.plan.resident_bytes

    def describe(self) -> str:
        p = self.plan
        return (
            f"{p.label}: {len(p.streamed)} of {len(p.streamed) + len(p.resident)} blocks stream in for their "
            f"forward ({p.bytes_moved_per_step / MiB:.0f} MiB per step; --lowvram would move "
            f"{p.lowvram_bytes_per_step / MiB:.0f} MiB)"
        )

    def enter(self, stack: ExitStack) -> StreamedUNet:
        """Stream the UNet until ``stack`` closes (the pass's end, an error, the next run, unload).
        A move back that cannot fit then does not raise out of the job's close: it warns, and the
        weights wait in host memory for :func:`restore_pending`."""
        s = StreamedUNet(self.unet, self.plan, self.device)
        s.__enter__()

        def close(exc_type: Any, exc: Any, tb: Any) -> bool:
            st = s.stats
            per = st.bytes_in / st.forwards if st.forwards else 0
            logger.info(
                "VRAM Guard: UNet streamed for %d forward(s): %.0f MiB copied to the card (%.0f MiB per "
                "forward), %.0f MiB written back; %d units prefetched, %d on demand",
                st.forwards, st.bytes_in / MiB, per / MiB, st.bytes_back / MiB, st.prefetched, st.on_demand,
            )  # fmt: skip
            try:
                s.__exit__(exc_type, exc, tb)
            except RuntimeError as err:
                if not s.pending:
                    raise
                logger.warning("%s", err)
                with _LOCK:
                    if s not in _PENDING:
                        _PENDING.append(s)
            return False

        stack.push(close)
        self.streamer = s
        return s


@dataclass
class MoreStreamed(StreamPass):
    """A placed checkpoint's pass that does not fit beside what the placement keeps on the card
    (a ControlNet, a larger hires pass): ``plan`` names resident units of the placed UNet that a
    second streamer carries for this pass only (:func:`lib_vram.sampling.more_streamed`); at the
    pass's end they are resident again. ``controls``: the ControlNet units whose models stream
    block by block for the pass as well (:func:`lib_vram.residency.controlnet.stream`)."""

    placed: Any = None
    nbytes: int = 0
    buffer_bytes: int = 0
    controls: list = field(default_factory=list)
    control_bytes: int = 0

    @property
    def label(self) -> str:
        n, mib = len(self.controls), self.control_bytes / MiB
        also = f" and {n} ControlNet model{'s' if n > 1 else ''} ({mib:.0f} MiB)" if n else ""
        return f"{len(self.plan)} more UNet blocks ({self.nbytes / MiB:.0f} MiB){also} stream for the pass"

    def enter(self, stack: ExitStack) -> StreamedUNet | None:
        return super().enter(stack) if self.plan else None

    @property
    def resident_bytes(self) -> int:
        return self.placed.unet_resident_bytes - self.nbytes

    def describe(self) -> str:
        return (
            f"{self.label}: the UNet keeps {self.resident_bytes / MiB:.0f} of "
            f"{self.placed.plan.unet_bytes / MiB:.0f} MiB on the card "
            f"(their buffer {self.buffer_bytes / MiB:.0f} MiB)"
        )


def restore_pending() -> int:
    """Retry the moves back that could not fit when their pass ended (next job, script unload);
    returns how many are still pending."""
    with _LOCK:
        todo = list(_PENDING)
    left = 0
    for s in todo:
        try:
            s.restore()
        except RuntimeError as exc:
            logger.warning("%s", exc)
        with _LOCK:
            if not s.pending and s in _PENDING:
                _PENDING.remove(s)
            elif s.pending:
                left += 1
    return left


def plan_pass(
    sd_model: Any,
    unet: torch.nn.Module,
    spec: UNetSpec,
    sampling: SamplingPlan,
    *,
    settings: Any = None,
    **step: Any,
) -> StreamPass | None:
    """The streamed plan for a pass whose ``sampling`` plan does not fit (None when streaming may
    not be used, see :func:`skip_reason`, or does not fit either). ``step``: the sampling guard's
    arguments of :func:`lib_vram.sampling.plan_stream` for the same pass (``resident_bytes``: what
    stays on the card beside the UNet after the idle parts moved)."""
    why = skip_reason(sd_model, settings)
    if why is not None:
        logger.debug("VRAM Guard: the UNet does not stream: %s", why)
        return None
    plan = plan_stream(unet, spec, batch=sampling.batch, sampling=sampling, **step)
    if not plan.fits or not plan.streamed:
        return None
    device = next(unet.parameters()).device
    return StreamPass(plan, unet, device)
