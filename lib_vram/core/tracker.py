"""Per-stage peak memory and time.

``with tracker.stage("vae_decode"):`` records the stage's peak memory, duration and outcome.
Stages nest; an exception inside a stage marks it failed and propagates.

How peaks are measured (docs/how-it-works.md, "How per-stage peaks are measured"): the WebUI's
memory monitor (``modules/memmon.py``) resets the accelerator's peak counters at job start and reads
them at the end, so with ``owns_peak_counters=False`` (the WebUI) they are never reset: a stage whose
end peak ``P1`` exceeds its start peak ``P0`` gets ``P1`` exactly, any other the largest allocation
sampled at its start, end and :meth:`StageTracker.sample` calls (``exact=False``). With
``owns_peak_counters=True`` (CLI, benchmarks) the counters are reset at every stage boundary after
folding the value read so far into every open stage, so nested stages are exact. On the CPU the
same fold-before-reset rule runs on Linux's resettable ``VmHWM`` (reset by writing ``5`` to
``/proc/self/clear_refs``); without it, sampling (``exact=False``). An emulated card on the CPU
has a peak counter for the tracker alone (``EmulatedCard.mark_peak_bytes``), reset at every stage
boundary in the WebUI too: its stages are exact.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import emulate
from .device import Backend, backend_of, process_rss, resolve_device
from .timeline import Timeline

logger = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _read_vm_hwm() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_vm_hwm() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@dataclass
class StageRecord:
    """The outcome of one stage."""

    name: str
    depth: int
    """0 for a top-level stage, 1 for a stage inside it, ..."""
    parent: str | None
    start_bytes: int
    """Allocated (accelerator) or RSS (CPU) bytes when the stage began."""
    end_bytes: int = 0
    peak_bytes: int = 0
    """Highest allocated (accelerator) or RSS (CPU) bytes seen during the stage."""
    peak_reserved_bytes: int | None = None
    seconds: float = 0.0
    ok: bool = True
    error: str | None = None
    exact: bool = True
    """False when the peak came from sampling (a lower bound), see the module docstring."""
    measure: str = "allocated"
    """``"allocated"`` (accelerator allocator), ``"rss"`` (CPU process memory) or ``"emulated"``
    (an emulated card's use, :mod:`lib_vram.core.emulate`)."""
    plan: str | None = None
    """The plan the stage used (e.g. ``"exact t64"``), set by the engine through :meth:`StageTracker.note`."""
    notes: dict = field(default_factory=dict)

    @property
    def delta_peak_bytes(self) -> int:
        """Peak above the memory in use when the stage began (its own working set)."""
        return max(0, self.peak_bytes - self.start_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "delta_peak_bytes": self.delta_peak_bytes}


class _Counter:
    """Backend counters behind one small interface: current, peak, reset.

    While an emulated card (:mod:`lib_vram.core.emulate`) stands for the device, its use and peak are
    the counters (measure ``"emulated"``): that is the memory the card enforces."""

    def __init__(self, device: torch.device, owns_peak_counters: bool) -> None:
        self.device = device
        self.backend = backend_of(device)
        self.owns = owns_peak_counters
        self.accel = self.backend in (Backend.CUDA, Backend.ROCM, Backend.XPU)
        self._measure = "allocated" if self.accel or self.backend is Backend.MPS else "rss"
        self.hwm_ok = False
        if self._measure == "rss":
            self.hwm_ok = _read_vm_hwm() is not None and _reset_vm_hwm()

    def _card(self) -> emulate.EmulatedCard | None:
        card = emulate.current(self.device)
        return card if card is not None and card.device.type == "cpu" else None

    @property
    def measure(self) -> str:
        return "emulated" if self._card() is not None else self._measure

    @property
    def resettable(self) -> bool:
        if self._card() is not None:
            return True  # (its mark counter, the tracker's own)
        if self._measure == "rss":
            return self.hwm_ok
        return self.accel and self.owns

    def _allocated(self, peak: bool) -> int | None:
        """The emulated card's or the CUDA/ROCm/XPU allocator's bytes (now, or the peak), else None."""
        card = self._card()
        if card is not None:
            return card.mark_peak_bytes if peak else card.used_bytes
        if self.backend in (Backend.CUDA, Backend.ROCM, Backend.XPU):
            api = torch.xpu if self.backend is Backend.XPU else torch.cuda
            return int((api.max_memory_allocated if peak else api.memory_allocated)(self.device))
        return None

    def current(self) -> int:
        now = self._allocated(peak=False)
        if now is not None:
            return now
        if self.backend is Backend.MPS:
            return int(torch.mps.current_allocated_memory())
        return process_rss()

    def peak(self) -> int | None:
        """The backend's high-water mark, or ``None`` where there is none."""
        top = self._allocated(peak=True)
        if top is not None:
            return top
        if self._measure == "rss" and self.hwm_ok:
            return _read_vm_hwm()
        return None

    def reserved(self) -> int | None:
        """The allocator's reserved bytes now (CUDA/ROCm), else ``None``."""
        if self.backend in (Backend.CUDA, Backend.ROCM) and self._card() is None:
            return int(torch.cuda.memory_reserved(self.device))
        return None

    def peak_reserved(self) -> int | None:
        cuda = self.backend in (Backend.CUDA, Backend.ROCM)
        return int(torch.cuda.max_memory_reserved(self.device)) if cuda else None

    def reset(self) -> None:
        if not self.resettable:
            return
        card = self._card()
        if card is not None:
            card.reset_mark()
        elif self._measure == "rss":
            _reset_vm_hwm()
        else:  # (resettable: an accelerator with an allocator, CUDA/ROCm/XPU)
            (torch.xpu if self.backend is Backend.XPU else torch.cuda).reset_peak_memory_stats(self.device)


@dataclass
class _Open:
    record: StageRecord
    t0: float
    peak0: int | None
    folded: int = 0
    thread: int = 0


class StageTracker:
    """Records per-stage peak memory and time.

    Thread-safe: stages nest per thread (parent/depth), while memory peaks are folded into every
    open stage of every thread (memory is shared by the process).

    Args:
        device: the compute device to measure (default: best available).
        owns_peak_counters: reset the accelerator's global peak counters at stage boundaries
            (exact nested peaks). Leave ``False`` inside the WebUI (see the module docstring).
        sample_interval: seconds between background samples while a stage is open; ``None``
            disables the sampler (engines still call :meth:`sample`).
        keep: how many finished records to keep (oldest dropped first).
        timeline: a :class:`~lib_vram.core.timeline.Timeline` fed with a sample at every
            :meth:`sample` call and stage boundary, a band per top-level stage and the
            :meth:`event` calls; also settable later as ``tracker.timeline``.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        owns_peak_counters: bool = False,
        sample_interval: float | None = None,
        keep: int = 256,
        timeline: Timeline | None = None,
    ) -> None:
        if sample_interval is not None and sample_interval <= 0:
            raise ValueError(f"`sample_interval` must be > 0 or None, got {sample_interval}")
        if keep < 1:
            raise ValueError(f"`keep` must be >= 1, got {keep}")
        self.device = resolve_device(device)
        self._counter = _Counter(self.device, owns_peak_counters)
        self._lock = threading.RLock()
        self._open: list[_Open] = []
        self._records: list[StageRecord] = []
        self._keep = keep
        self._sample_interval = sample_interval
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self.timeline = timeline

    # -- reading ---------------------------------------------------------------------------
    @property
    def measure(self) -> str:
        return self._counter.measure

    @property
    def records(self) -> list[StageRecord]:
        """Finished stages, in the order they finished."""
        with self._lock:
            return list(self._records)

    def last(self, name: str) -> StageRecord | None:
        with self._lock:
            return next((rec for rec in reversed(self._records) if rec.name == name), None)

    # -- measuring -------------------------------------------------------------------------
    def sample(self, kind: str = "tile") -> None:
        """Fold the current allocation into every open stage's peak (cheap; call between tiles),
        and add it to the timeline (``kind``: why the sample was taken, see
        :data:`lib_vram.core.timeline.SAMPLE_KINDS`)."""
        with self._lock:
            timeline = self.timeline
            if not self._open and timeline is None:
                return
            cur = self._counter.current()
            self._fold(cur)
            if timeline is not None:
                timeline.add(cur, self._counter.reserved(), kind)

    def event(self, kind: str, text: str, **data: object) -> None:
        """Something VRAM Guard did now (``"release"``, ``"oom"``): onto the timeline, if any."""
        timeline = self.timeline
        if timeline is not None:
            timeline.event(kind, text, **data)

    def _thread_stack(self) -> list[_Open]:
        me = threading.get_ident()
        return [op for op in self._open if op.thread == me]

    def note(self, plan: str | None = None, **notes: object) -> None:
        """Attach the plan used (and any notes) to this thread's innermost open stage."""
        with self._lock:
            stack = self._thread_stack()
            if not stack:
                return
            rec = stack[-1].record
            if plan is not None:
                rec.plan = plan
            rec.notes.update(notes)

    def _fold(self, nbytes: int | None) -> None:
        """Fold ``nbytes`` (a sample, the backend's high-water mark before a reset) into every open
        stage's peak."""
        if nbytes is not None:
            for op in self._open:
                op.folded = max(op.folded, nbytes)

    @contextlib.contextmanager
    def stage(self, name: str, *, plan: str | None = None) -> Iterator[StageRecord]:
        """Measure the enclosed block as stage ``name``."""
        if not name:
            raise ValueError("a stage needs a non-empty `name`")
        with self._lock:
            stack = self._thread_stack()
            parent = stack[-1].record.name if stack else None
            cur = self._counter.current()
            if self._counter.resettable:
                self._fold(self._counter.peak())
                self._counter.reset()
                peak0 = None
            else:
                peak0 = self._counter.peak()
            rec = StageRecord(
                name=name,
                depth=len(stack),
                parent=parent,
                start_bytes=cur,
                measure=self._counter.measure,
                plan=plan,
            )
            op = _Open(
                record=rec, t0=time.perf_counter(), peak0=peak0, folded=cur, thread=threading.get_ident()
            )
            self._open.append(op)
            timeline = self.timeline
            if timeline is not None:
                timeline.measure = rec.measure
                if rec.depth == 0:
                    timeline.begin(name, op.thread)
                timeline.add(cur, self._counter.reserved(), "stage")
            self._ensure_sampler()
        try:
            yield rec
        except BaseException as exc:
            rec.ok = False
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
            raise
        finally:
            self._close(op)

    def _close(self, op: _Open) -> None:
        with self._lock:
            rec = op.record
            cur = self._counter.current()
            op.folded = max(op.folded, cur)
            peak = self._counter.peak()
            if self._counter.resettable:
                # The counter was reset when this stage (or a later nested one) began, and every
                # nested reset folded the value before it: the maximum is exact.
                if peak is not None:
                    op.folded = max(op.folded, peak)
                rec.exact = peak is not None
            elif peak is not None and op.peak0 is not None and peak > op.peak0:
                op.folded = max(op.folded, peak)
                rec.exact = True
            else:
                rec.exact = False
            rec.peak_bytes = op.folded
            rec.end_bytes = cur
            rec.peak_reserved_bytes = self._counter.peak_reserved()
            rec.seconds = time.perf_counter() - op.t0
            # Pop this stage (normally the innermost one) and propagate its peak outwards.
            if op in self._open:
                self._open.remove(op)
            self._fold(op.folded)
            self._records.append(rec)
            del self._records[: -self._keep]
            timeline = self.timeline
            if timeline is not None:
                timeline.add(cur, self._counter.reserved(), "stage")
                if rec.depth == 0:
                    timeline.end(rec.name, plan=rec.plan, ok=rec.ok, error=rec.error,
                                 peak_bytes=rec.peak_bytes, exact=rec.exact, thread=op.thread)  # fmt: skip
            if not self._open:
                self._stop.set()
        logger.debug(
            "stage %s: peak %.1f MiB (%s%s), %.3f s, %s",
            rec.name,
            rec.peak_bytes / 2**20,
            rec.measure,
            "" if rec.exact else ", sampled",
            rec.seconds,
            "ok" if rec.ok else f"failed ({rec.error})",
        )

    def _ensure_sampler(self) -> None:
        if self._sample_interval is None or (self._sampler is not None and self._sampler.is_alive()):
            return
        self._stop.clear()
        interval = self._sample_interval

        def run() -> None:
            while not self._stop.wait(interval):
                self.sample("timer")

        self._sampler = threading.Thread(target=run, name="lib_vram-tracker-sampler", daemon=True)
        self._sampler.start()
