"""The copy engine of :class:`~._stream.StreamedUNet`: a streamed unit's weights between host and device.

A streamed unit's weights live in host memory; they come to the device just before the unit's
forward and leave right after it. Leaving is free (the host copy is kept) unless a weight changed
on the device: ``param._version`` moved, as when the WebUI's Lora extension merges its weights in
place inside the forward; then the device copy is written back to the host copy, so the merge is
neither lost nor applied twice.

A copy made ahead (prefetch) runs on CUDA on a side stream from pinned host memory, the compute
stream waiting on the copy's event and each buffer marked as used by the compute stream
(``record_stream``) so the caching allocator does not hand it out again before the forward that
reads it has run. On the CPU and on an emulated card the same code runs with plain copies; each
arriving weight is a real allocation on the card (it counts, and it can raise the card's
out-of-memory error), each leaving one is freed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.device import is_oom_error, release

from ._units import nbytes, tensors

logger = logging.getLogger("lib_vram.sampling._stream")  # the streamer's log, as before the split

MiB = 1 << 20


@dataclass(eq=False)
class _Slot:
    """One tensor of a streamed unit."""

    owner: torch.nn.Module
    name: str
    is_param: bool
    host: torch.Tensor
    """The host copy (pinned on CUDA); the tensor the module holds while the unit is away."""
    origin: torch.Tensor | None = None
    """Where the tensor was before streaming (its data), restored at the end."""
    dev: torch.Tensor | None = None
    version: int = 0

    def current(self) -> torch.Tensor:
        return getattr(self.owner, self.name)

    def put(self, t: torch.Tensor) -> None:
        if self.is_param:
            self.owner._parameters[self.name].data = t
        else:
            self.owner._buffers[self.name] = t

    def version_now(self) -> int:
        return int(self.current()._version)


@dataclass(eq=False)
class _Unit:
    name: str
    module: torch.nn.Module
    slots: list[_Slot]
    nbytes: int
    state: str = "away"
    """``away`` (host copy in place), ``coming`` (prefetch issued), ``here`` (device copy in place)."""
    event: Any = None


@dataclass
class StreamStats:
    """What a :class:`StreamedUNet` did."""

    forwards: int = 0
    bytes_in: int = 0
    """Host->device bytes of streamed weights."""
    bytes_back: int = 0
    """Device->host bytes written back because a weight changed on the device."""
    prefetched: int = 0
    """Arrivals issued ahead (prefetch) ..."""
    on_demand: int = 0
    """... and arrivals loaded when the unit's forward began (nothing was prefetched)."""
    most_units_here: int = 0
    """The most streamed units on the device at once (2 at prefetch depth 1)."""
    prefetch_ooms: int = 0
    """Prefetches that ran out of memory (the unit then came on demand, after the current left)."""
    trace: list[tuple[str, str, int, int]] = field(default_factory=list)
    """(what, unit, first allocation, last allocation) on an emulated card: ``fetch`` (on
    demand), ``prefetch``, ``back``
    with the card's allocation counter around it (how the tests aim an out-of-memory error)."""


class CopyEngine:
    """Moves the streamed units of ``unet`` between host memory and ``device`` (the base of
    :class:`~._stream.StreamedUNet`, which decides when; its docstring has the arguments)."""

    def __init__(
        self,
        unet: torch.nn.Module,
        device: torch.device | str,
        card: emulate.EmulatedCard | None,
        adopt_host: bool,
    ) -> None:
        self.unet = unet
        self.adopt_host = bool(adopt_host)
        """(The checkpoint placement, issue 22 item 2) a streamed weight already in host memory while
        ``device`` is CUDA is taken as its host copy (pinned) instead of being left alone: the
        placement loads the streamed units on the CPU and never has them on the card at once; a
        streamed ControlNet's model, issue 42). On the emulated card: the weights are not resident
        (nothing leaves the card's count)."""
        self.device = torch.device(device)
        self._card_arg = card
        self.card: emulate.EmulatedCard | None = None
        self.stats = StreamStats()
        self.pending = False
        self._units: list[_Unit] = []
        self._side: Any = None
        self._resident_removed: int | None = None
        self._cuda = self.device.type == "cuda"

    @property
    def streamed_bytes(self) -> int:
        return sum(u.nbytes for u in self._units)

    def _take_all(self, units: Iterable[tuple[str, torch.nn.Module]]) -> None:
        """Move the weights of ``units`` to host memory; the emulated card's resident bytes drop by
        theirs while they are away."""
        self.card = self._card_arg
        if self.card is None and self.device.type == "cpu":
            self.card = emulate.running_here(self.device)
        seen: set[int] = set()
        shared = set()
        for o, n, _ in tensors(self.unet):
            k = id(getattr(o, n))
            if k in seen:
                shared.add(k)
            seen.add(k)
        if self._cuda:
            self._side = torch.cuda.Stream(self.device)
        for name, module in units:
            self._units.append(self._take(name, module, shared))
        if self.card is not None and self.device.type == "cpu" and not self.adopt_host:
            # what leaves the card's resident count; given back as a delta at the end, so
            # that parts which came back meanwhile (the idle VAE/text encoders woken by the
            # next stage before this pass's stack closed) stay counted
            self._resident_removed = min(self.card.resident_bytes, self.streamed_bytes)
            self.card.set_resident(self.card.resident_bytes - self._resident_removed)

    def _take(self, name: str, module: torch.nn.Module, shared: set[int]) -> _Unit:
        """Move ``name``'s weights to host memory (on the CPU they already are: nothing copies)."""
        slots: list[_Slot] = []
        unit = _Unit(name, module, slots, 0)
        try:
            for o, n, is_param in tensors(module):
                t = getattr(o, n)
                adopt = self.adopt_host and self._cuda and t.device.type == "cpu"  # (placement)
                if id(t) in shared or (t.device.type != self.device.type and not adopt):
                    continue  # tied weights and weights elsewhere stay where they are
                origin = t.data if is_param else t
                if adopt:
                    host = origin.pin_memory()
                elif self._cuda and t.device.type == "cuda":
                    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                    host.copy_(origin)
                else:
                    host = origin
                slot = _Slot(o, n, is_param, host, origin)
                slots.append(slot)
                slot.put(host)
                unit.nbytes += nbytes(host)
        except BaseException:
            for s in slots:
                s.put(s.origin)
            raise
        for s in slots:
            if self._cuda:
                s.origin = None  # the device copy is freed; the move back makes a new one
        return unit

    def _arrive(self, unit: _Unit) -> None:
        if unit.state == "away":
            self._fetch(unit, ahead=False)
        if unit.state == "coming":
            if unit.event is not None:
                torch.cuda.current_stream(self.device).wait_event(unit.event)
                cur = torch.cuda.current_stream(self.device)
                for s in unit.slots:
                    if s.dev is not None:
                        s.dev.record_stream(cur)
                unit.event = None
            for s in unit.slots:
                s.put(s.dev)
                s.version = s.version_now()
            unit.state = "here"

    def _fetch(self, unit: _Unit, *, ahead: bool) -> None:
        """Copy ``unit``'s weights to the device (side stream on CUDA); they are put in place at
        :meth:`_arrive`."""
        first = self.card.allocations if self.card is not None else 0
        unit.state = "coming"
        try:
            if self._cuda:
                with torch.cuda.stream(self._side):
                    for s in unit.slots:
                        s.dev = torch.empty_like(s.host, device=self.device)
                        s.dev.copy_(s.host, non_blocking=True)
                    unit.event = torch.cuda.Event()
                    unit.event.record(self._side)
            else:
                for s in unit.slots:
                    d = torch.empty_like(s.host)
                    d.copy_(s.host)
                    s.dev = d
        except BaseException:
            # a copy that could not be made (out of memory, an interrupt): the unit is away again,
            # with no half-made device copies, so the next forward (a smaller micro-batch, the next
            # pass) fetches it afresh instead of putting a missing tensor in place
            for s in unit.slots:
                s.dev = None
            unit.event = None
            unit.state = "away"
            raise
        self.stats.bytes_in += unit.nbytes
        here = sum(u.state != "away" for u in self._units)
        self.stats.most_units_here = max(self.stats.most_units_here, here)
        if ahead:
            self.stats.prefetched += 1
        else:
            self.stats.on_demand += 1
        if self.card is not None:
            what = "prefetch" if ahead else "fetch"
            self.stats.trace.append((what, unit.name, first + 1, self.card.allocations))

    def _leave(self, unit: _Unit) -> None:
        """Put the host copies back in place; a weight changed on the device is written back first."""
        if unit.state == "away":
            return
        if unit.event is not None:
            unit.event.synchronize()
            unit.event = None
        for s in unit.slots:
            if unit.state == "here" and s.dev is not None and s.version_now() != s.version:
                s.host.copy_(s.current().detach())
                self.stats.bytes_back += nbytes(s.host)
            s.put(s.host)
            s.dev = None
        unit.state = "away"

    def _send_away(self) -> None:
        """Every streamed unit away (its host copy in place, changed weights written back)."""
        if self._side is not None:
            self._side.synchronize()
        for u in self._units:
            self._leave(u)

    def _bring_back(self) -> None:
        """Every streamed weight back on the device; an out-of-memory error releases the cache and
        tries once more, then raises with the weights left in host memory (:attr:`pending`)."""
        try:
            self._move_back()
        except BaseException as exc:
            if not is_oom_error(exc):
                raise
            logger.info("VRAM Guard: moving the streamed UNet back ran out of memory; releasing and retrying")
            release(self.device)
            try:
                self._move_back()
            except BaseException as exc2:
                if is_oom_error(exc2):
                    self.pending = True
                    raise RuntimeError(
                        "VRAM Guard: the streamed UNet's weights could not move back to the device "
                        f"({self.streamed_bytes / MiB:.0f} MiB); they stay in host memory until the next job"
                    ) from exc2
                raise
        self.pending = False

    def _move_back(self) -> None:
        if not self._units:
            return
        first = self.card.allocations if self.card is not None else 0
        if self.card is not None and self.device.type == "cpu":
            # the weights are in place already; the card admits their bytes one tensor at a time
            # (each may raise its out-of-memory error) and then counts them as resident again
            admitted: list[torch.Tensor] = []
            try:
                for u in self._units:
                    for s in u.slots:
                        self.card.to_device(s.host)
                        admitted.append(s.host)
            finally:
                for t in admitted:
                    self.card.to_host(t)
            self.card.set_resident(self.card.resident_bytes + (self._resident_removed or 0))
            self._resident_removed = 0
        elif self._cuda and self._model_device().type == "cpu":
            # the host moved the rest of the UNet to the CPU meanwhile (a Refiner or checkpoint
            # switch unloaded this model): the streamed units stay with it, in host memory
            for u in self._units:
                for s in u.slots:
                    s.put(s.host)
        elif self._cuda:
            for u in self._units:
                for s in u.slots:
                    if s.current().device.type != "cuda":  # (a retry skips what already moved)
                        s.put(s.host.to(self.device))
        else:
            for u in self._units:
                for s in u.slots:
                    s.put(s.origin)
        if self.card is not None:
            self.stats.trace.append(("back", "*", first + 1, self.card.allocations))
        self._units.clear()

    def _model_device(self) -> torch.device:
        """Where the UNet's resident weights are now: the device while any of them is there (a
        placed checkpoint's own streamed units are in host memory beside them), else where the
        first of them is."""
        streamed = {s.host.data_ptr() for u in self._units for s in u.slots}
        first = None
        for t in self.unet.parameters():
            if t.device.type != "meta" and t.data_ptr() not in streamed:
                if t.device.type == self.device.type:
                    return self.device
                first = first or t.device
        return first or self.device

    def _to_host(self) -> None:
        """End streaming with every streamed unit's host copy in place; nothing moves to the device."""
        for u in self._units:
            for s in u.slots:
                s.put(s.host)
        self._units.clear()
        self._resident_removed = 0
        self.pending = False
