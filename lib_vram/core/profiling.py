"""What took the memory: one stage under ``torch.profiler`` (``profile_memory=True``), summarised
per operator, and on CUDA a ``torch.cuda.memory._record_memory_history`` snapshot.

:class:`StageProfiler` wraps a stage (the profiler and the memory history are stopped also on an
exception or Ctrl-C) and then holds a :class:`ProfileSummary`; :meth:`StageProfiler.save` writes a
Chrome trace, the summary as JSON and, on CUDA, the snapshot that https://pytorch.org/memory_viz opens.

Attribution: PyTorch's own "self memory" of an operator credits a convolution's output to the
``aten::empty`` it calls, which answers nothing. Here every allocation the profiler saw is credited
to the *outermost* ``aten::`` operator running when it happened (the operator the model's Python
code called: ``aten::conv2d``, ``aten::group_norm``, ...), gross (every allocation, temporary
buffers included) and net (what it still held when it returned). Allocations outside any operator
are listed as ``(outside operators)``.

Pure: torch only (no WebUI, no gradio). Written for torch 2.1 (the WebUI's) to current: the few
attributes that were renamed are read through fallbacks.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .files import write_atomic

logger = logging.getLogger(__name__)

OUTSIDE = "(outside operators)"
HISTORY_ENTRIES = 100_000
"""Allocation events the CUDA memory history keeps (the oldest are dropped)."""
VIEW_HINTS = {
    "trace": "open it in chrome://tracing or https://ui.perfetto.dev",
    "snapshot": "open it in https://pytorch.org/memory_viz",
    "summary": "JSON: the top operators and the peaks",
}
SNAPSHOT_NOTE = "the memory snapshot (pytorch.org/memory_viz) is CUDA-only; not written on {device}"


@dataclass
class OpStat:
    """One operator (by name) over the stage."""

    name: str
    calls: int = 0
    alloc_bytes: int = 0
    """Bytes allocated while it ran (gross: temporary buffers included)."""
    net_bytes: int = 0
    """Bytes it still held when it returned (allocated minus freed), summed over its calls."""
    cpu_ms: float = 0.0
    """Wall time on the CPU, children included."""
    device_ms: float = 0.0
    """Kernel time on the accelerator (0 on the CPU)."""
    largest_call_bytes: int = 0
    largest_call_shapes: list = field(default_factory=list)
    """Input shapes of its call that allocated the most (``record_shapes``)."""


@dataclass
class ProfileSummary:
    """What :class:`StageProfiler` found (see the module docstring)."""

    stage: str
    device: str
    ops: list[OpStat]
    """Every operator, most bytes allocated first."""
    peak_bytes: int | None
    """Most tensor bytes allocated at once on the stage's device, above what was live when the
    stage began (from the profiler's allocation events; None when they are unreadable)."""
    alloc_bytes: int
    """All bytes allocated on the stage's device during the stage."""
    seconds: float = 0.0
    ok: bool = True
    error: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    """``trace``, ``summary``, ``snapshot`` -> written path."""
    notes: list[str] = field(default_factory=list)

    def top(self, n: int = 10) -> list[OpStat]:
        return self.ops[: max(0, n)]

    def to_dict(self, top: int | None = None) -> dict:
        d = asdict(self)
        if top is not None:
            d["ops"] = d["ops"][:top]
        return d

    def table(self, n: int = 10) -> str:
        """The top ``n`` operators as aligned text (MiB, ms)."""
        rows = [("operator", "calls", "allocated", "held", "CPU ms", "device ms", "largest call")]
        for op in self.top(n):
            rows.append(
                (
                    op.name,
                    str(op.calls),
                    mib(op.alloc_bytes),
                    mib(op.net_bytes),
                    f"{op.cpu_ms:.1f}",
                    f"{op.device_ms:.1f}" if op.device_ms else "-",
                    _shapes_text(op.largest_call_shapes),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = []
        for r in rows:
            cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:])]
            lines.append("  ".join(cells + [r[-1]]).rstrip())
        return "\n".join(lines)


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _shapes_text(shapes: list) -> str:
    kept = [s for s in shapes or [] if s]
    return " ".join("x".join(str(d) for d in s) for s in kept[:3])


# -- reading the profiler's events (names changed between torch 2.1 and now) ------------------


def _ns(obj: Any, what: str) -> int:
    """``<what>_ns()`` of a kineto event or result (``<what>_us()`` in torch 2.1)."""
    fn = getattr(obj, f"{what}_ns", None)
    return int(fn()) if fn is not None else int(getattr(obj, f"{what}_us")()) * 1000


def _device_attr(evt: Any, what: str) -> float:
    """An event's ``device_<what>`` (``cuda_<what>`` in torch 2.1), 0 where it has none."""
    value = getattr(evt, f"device_{what}", None)
    return (getattr(evt, f"cuda_{what}", 0) if value is None else value) or 0


def _is_device_record(device_type: Any) -> bool:
    name = str(device_type).rsplit(".", 1)[-1].upper()
    return name in ("CUDA", "HIP", "XPU", "PRIVATEUSE1", "MPS")


def _top_level(events: list) -> list:
    """The outermost ``aten::`` operators (no ``aten::`` operator above them)."""
    out = []
    for evt in events:
        if not evt.name.startswith("aten::") or getattr(evt, "device_type", None) not in (None, _CPU):
            continue
        parent = evt.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            out.append(evt)
    return out


try:
    from torch.autograd import DeviceType as _DeviceType

    _CPU: Any = _DeviceType.CPU
except ImportError:  # pragma: no cover - every supported torch has it
    _CPU = None


def summarize(prof: Any, *, stage: str, device: torch.device) -> ProfileSummary:
    """Operators and peak of a finished ``torch.profiler.profile`` (see the module docstring)."""
    accel = device.type != "cpu"
    tops = sorted(_top_level(list(prof.events())), key=lambda e: e.time_range.start)
    stats: dict[str, OpStat] = {}
    per_call: dict[int, int] = {}
    for evt in tops:
        st = stats.setdefault(evt.name, OpStat(evt.name))
        st.calls += 1
        st.net_bytes += int(_device_attr(evt, "memory_usage") if accel else evt.cpu_memory_usage or 0)
        st.cpu_ms += (evt.time_range.end - evt.time_range.start) / 1000
        st.device_ms += float(_device_attr(evt, "time_total")) / 1000
    peak: int | None = None
    total = 0
    outside = 0
    try:
        results = prof.profiler.kineto_results
        t0 = _ns(results, "trace_start")
        records = sorted(
            (_ns(e, "start"), int(e.nbytes()))
            for e in results.events()
            if e.name() == "[memory]" and _is_device_record(e.device_type()) == accel
        )
    except (AttributeError, RuntimeError, TypeError) as exc:  # raw events unreadable: net only
        logger.debug("profiler allocation events unavailable: %s", exc)
        records = None
    if records is not None:
        starts = [e.time_range.start for e in tops]
        live = high = 0
        for t_ns, nbytes in records:
            live += nbytes
            high = max(high, live)
            if nbytes <= 0:
                continue
            total += nbytes
            t_us = (t_ns - t0) / 1000
            i = bisect.bisect_right(starts, t_us) - 1
            if i >= 0 and tops[i].time_range.end >= t_us:
                evt = tops[i]
                stats[evt.name].alloc_bytes += nbytes
                per_call[id(evt)] = per_call.get(id(evt), 0) + nbytes
            else:
                outside += nbytes
        peak = high
        for evt in tops:
            got = per_call.get(id(evt), 0)
            st = stats[evt.name]
            if got > st.largest_call_bytes:
                st.largest_call_bytes = got
                st.largest_call_shapes = [list(s) for s in (evt.input_shapes or [])]
    else:
        for st in stats.values():
            st.alloc_bytes = max(0, st.net_bytes)
    ops = list(stats.values())
    if outside:
        ops.append(OpStat(OUTSIDE, alloc_bytes=outside))
    ops.sort(key=lambda s: (-s.alloc_bytes, -s.net_bytes, -s.cpu_ms))
    return ProfileSummary(stage=stage, device=str(device), ops=ops, peak_bytes=peak, alloc_bytes=total)


# -- the profiler around a stage ---------------------------------------------------------------


def profiler_running() -> bool:
    """True when a torch profiler is already collecting in this process (another can't start)."""
    fn = getattr(torch.autograd.profiler, "_is_profiler_enabled", None)
    if isinstance(fn, bool):
        return fn
    check = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(check()) if check is not None else False


class StageProfiler:
    """Run a block under the profiler (see the module docstring)::

        with StageProfiler("vae_decode", device) as prof:
            decode(...)
        logger.info("%s", prof.summary.table())
        prof.save(folder, "decode")

    Raises ``RuntimeError`` on entry when another profiler is running. The profiler and the CUDA
    memory history are stopped on every exit; the summary is made also when the block raised (the
    exception propagates; :attr:`ProfileSummary.ok` is False).
    """

    def __init__(
        self, stage: str, device: torch.device | str, *, record_shapes: bool = True, history: bool = True
    ) -> None:
        self.stage = stage
        self.device = torch.device(device)
        self.record_shapes = record_shapes
        self.history = history and self.device.type == "cuda" and torch.cuda.is_available()
        self.prof: Any = None
        self.snapshot: Any = None
        self.summary: ProfileSummary | None = None
        self._t0 = 0.0
        self._history_on = False

    def __enter__(self) -> StageProfiler:
        from torch.profiler import ProfilerActivity, profile

        if profiler_running():
            raise RuntimeError("another torch profiler is already running in this process")
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        if self.history:
            # Python frames only: symbolising C++ frames ("all") can take minutes per snapshot
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=HISTORY_ENTRIES)
            self._history_on = True
        prof = profile(activities=activities, profile_memory=True, record_shapes=self.record_shapes)
        try:
            prof.__enter__()
        except BaseException:
            self._stop_history()
            raise
        self.prof = prof
        self._t0 = time.perf_counter()
        return self

    def _stop_history(self) -> None:
        if not self._history_on:
            return
        self._history_on = False
        try:
            self.snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        seconds = time.perf_counter() - self._t0
        try:
            if self.device.type == "cuda" and torch.cuda.is_available():
                with contextlib.suppress(RuntimeError):  # a failed kernel: stop the profiler anyway
                    torch.cuda.synchronize(self.device)
            self._stop_history()
        finally:
            self.prof.__exit__(None, None, None)
        try:
            summary = summarize(self.prof, stage=self.stage, device=self.device)
        except Exception as err:  # a summary must never replace the stage's own outcome
            if exc_type is None:
                raise
            logger.warning("profile of %s could not be summarised: %s", self.stage, err)
            summary = ProfileSummary(self.stage, str(self.device), [], None, 0)
        summary.seconds = seconds
        if exc_type is not None:
            summary.ok = False
            summary.error = f"{exc_type.__name__}: {exc}".splitlines()[0][:300]
        if self.device.type != "cuda":
            summary.notes.append(SNAPSHOT_NOTE.format(device=self.device.type))
        self.summary = summary

    def outputs(self, folder: Path, stem: str) -> dict[str, Path]:
        """The files :meth:`save` writes (``trace``, ``summary``, and on CUDA ``snapshot``)."""
        out = {"trace": folder / f"{stem}.trace.json", "summary": folder / f"{stem}.summary.json"}
        if self.history:
            out["snapshot"] = folder / f"{stem}.snapshot.pickle"
        return out

    def save(
        self, folder: Path | str, stem: str, *, overwrite: bool = False, top: int = 20
    ) -> dict[str, Path]:
        """Write the trace, the summary (top ``top`` operators) and the snapshot into ``folder``,
        each atomically; an existing file is not replaced without ``overwrite``
        (``FileExistsError``). Returns what was written."""
        if self.summary is None or self.prof is None:
            raise RuntimeError("save() needs a finished profile")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = self.outputs(folder, stem)
        write_atomic(paths["trace"], lambda tmp: self.prof.export_chrome_trace(str(tmp)), overwrite=overwrite)
        written = {"trace": paths["trace"]}
        if "snapshot" in paths and self.snapshot is not None:
            write_atomic(paths["snapshot"], lambda tmp: _pickle(self.snapshot, tmp), overwrite=overwrite)
            written["snapshot"] = paths["snapshot"]
        written["summary"] = paths["summary"]  # (listed in the summary it is about to be written to)
        self.summary.files = {k: str(v) for k, v in written.items()}
        text = json.dumps(self.summary.to_dict(top=top), indent=1)
        write_atomic(paths["summary"], lambda tmp: tmp.write_text(text), overwrite=overwrite)
        return written


def _pickle(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)
