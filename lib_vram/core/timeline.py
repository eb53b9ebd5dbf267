"""A job's memory over time: bounded, cheap samples, stage bands, events, and its SVG.

A :class:`Timeline` is attached to a :class:`~lib_vram.core.tracker.StageTracker` (``tracker.timeline``);
the tracker feeds it from what it already reads:

* a **sample** at every :meth:`StageTracker.sample` call (the engines call it after every tile
  step; the WebUI adapter at every sampling step) and at every stage boundary: the time, the memory
  in use (accelerator: ``torch.cuda.memory_allocated`` and ``memory_reserved``; CPU: the process's
  resident set size; on an emulated card, :mod:`lib_vram.core.emulate`, its use) — two counters, no
  allocation on the device, no synchronisation;
* a **band** per top-level stage (its name, start and end, plan, peak and outcome);
* **events**: VRAM Guard released memory at a stage boundary, recovered from (or stopped at) an
  out-of-memory error.

Bounded: at most ``max_points`` points (default 400) whatever the job's length. When the buffer is
full, neighbouring points are merged pairwise — each merged point keeps the *highest* of the
samples it stands for, at that sample's time — and from then on each point stands for twice as
many samples (``stride``). So the sampled peak is never lost, and the plot's shape keeps its
maxima. Bands and events are capped too (``max_bands``, ``max_events``; what did not fit is
counted in ``dropped``).

:func:`render_svg` draws :meth:`Timeline.to_dict` as inline SVG (no dependency): stage bands
numbered and named (by number only where a band is narrow: :func:`legend_html` names those), the
card's total labelled at its right end, the memory line(s), the peak marked, events as markers in a
strip of their own, and hover values (``<title>`` elements) per column, per band and per event. No
label is drawn on a marker.
"""

from __future__ import annotations

import bisect
import html
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_MAX_POINTS = 400
DEFAULT_MAX_BANDS = 40
DEFAULT_MAX_EVENTS = 32
TEXT_CAP = 160
"""Longest event text, stage error or plan kept (characters): the payload stays bounded."""

SAMPLE_KINDS = ("tile", "step", "stage", "release", "offload", "timer", "start")
"""Why a sample was taken: an engine's tile step, a sampling step, a stage boundary, after a
release, after idle models left the card, the tracker's background sampler, the job's start."""


@dataclass
class _Band:
    stage: str
    t0: float
    t1: float | None = None
    plan: str | None = None
    ok: bool = True
    error: str | None = None
    peak_bytes: int | None = None
    exact: bool = True
    samples: int = 0
    thread: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["thread"]  # (which thread's stage it is: internal)
        d["t0"], d["t1"] = round(self.t0, 4), None if self.t1 is None else round(self.t1, 4)
        return d


@dataclass
class _Event:
    t: float
    kind: str
    text: str
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"t": round(self.t, 4), "kind": self.kind, "text": self.text, **self.data}


class Timeline:
    """One job's memory timeline (see the module docstring). Thread-safe.

    Args:
        total_bytes: the card's total memory (CPU: system RAM; emulated card: its capacity).
        measure: what ``used`` is: ``"allocated"``, ``"rss"`` or ``"emulated"`` (the tracker's).
        max_points: bound on stored points (>= 8).
        max_bands, max_events: bounds on stored bands and events (>= 1).
        clock: seconds (monotonic); ``time.perf_counter`` by default.
    """

    def __init__(
        self,
        *,
        total_bytes: int | None = None,
        measure: str = "allocated",
        max_points: int = DEFAULT_MAX_POINTS,
        max_bands: int = DEFAULT_MAX_BANDS,
        max_events: int = DEFAULT_MAX_EVENTS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_points < 8:
            raise ValueError(f"`max_points` must be >= 8, got {max_points}")
        if max_bands < 1 or max_events < 1:
            raise ValueError(f"`max_bands` and `max_events` must be >= 1, got {max_bands}, {max_events}")
        self.total_bytes = None if total_bytes is None else int(total_bytes)
        self.measure = measure
        self.max_points = int(max_points)
        self.max_bands = int(max_bands)
        self.max_events = int(max_events)
        self._clock = clock
        self._t0 = clock()
        self._t_end: float | None = None
        self._lock = threading.Lock()
        self._points: list[tuple[float, int, int | None]] = []
        """(t, used, reserved) per point; reserved is None where there is no allocator."""
        self._stride = 1
        self._bucket: tuple[float, int, int | None] | None = None
        self._bucket_n = 0
        self.counts: dict[str, int] = dict.fromkeys(SAMPLE_KINDS, 0)
        self._bands: list[_Band] = []
        self._open: dict[int, _Band] = {}
        self._events: list[_Event] = []
        self._dropped = {"bands": 0, "events": 0}
        self._peak: tuple[float, int] | None = None

    # -- recording -----------------------------------------------------------------------------
    def now(self) -> float:
        return self._clock() - self._t0

    def add(self, used: int, reserved: int | None = None, kind: str = "tile") -> None:
        """One sample: ``used`` bytes (and ``reserved`` where there is an allocator) now."""
        t = self._clock() - self._t0
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            for band in self._open.values():
                band.samples += 1
            if self._peak is None or used > self._peak[1]:
                self._peak = (t, used)
            new = (t, used, reserved)
            self._bucket = new if self._bucket is None else _merge(self._bucket, new)
            self._bucket_n += 1
            if self._bucket_n >= self._stride:  # (the bucket is full: one more point)
                self._points.append(self._bucket)
                self._bucket, self._bucket_n = None, 0
                if len(self._points) >= self.max_points:
                    self._halve()

    def _halve(self) -> None:
        """Merge neighbouring points pairwise (each keeps the higher one); double the stride."""
        p = self._points
        merged = [_merge(a, b) for a, b in zip(p[::2], p[1::2])]
        self._points = merged + p[2 * len(merged) :]  # (an odd last point stays as it is)
        self._stride *= 2

    def begin(self, stage: str, thread: int = 0) -> None:
        """A top-level stage starts (the tracker calls this; a sample follows)."""
        with self._lock:
            if len(self._bands) >= self.max_bands:
                self._dropped["bands"] += 1
                return
            band = _Band(stage=str(stage)[:64], t0=self.now(), thread=thread)
            self._bands.append(band)
            self._open[id(band)] = band

    def end(
        self,
        stage: str,
        *,
        plan: str | None = None,
        ok: bool = True,
        error: str | None = None,
        peak_bytes: int | None = None,
        exact: bool = True,
        thread: int = 0,
    ) -> None:
        """The innermost open band of ``stage`` (in ``thread``) ends."""
        with self._lock:
            for band in reversed(self._bands):
                if band.stage == str(stage)[:64] and band.t1 is None and band.thread == thread:
                    band.t1 = self.now()
                    band.plan = None if plan is None else str(plan)[:TEXT_CAP]
                    band.ok, band.error = ok, None if error is None else str(error)[:TEXT_CAP]
                    band.peak_bytes, band.exact = peak_bytes, exact
                    self._open.pop(id(band), None)
                    return

    def event(self, kind: str, text: str, **data: Any) -> None:
        """Something VRAM Guard did at this moment (``"release"``, ``"oom"``, ``"offload"``), in one line."""
        with self._lock:
            if len(self._events) >= self.max_events:
                self._dropped["events"] += 1
                return
            self._events.append(_Event(self.now(), str(kind)[:32], str(text)[:TEXT_CAP], dict(data)))

    def finish(self) -> None:
        """The job ended: the plot's time axis stops here."""
        with self._lock:
            if self._t_end is None:
                self._t_end = self.now()

    # -- reading -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot (keys in docs/api.md, "The `timeline` key"; bounded by the caps)."""
        with self._lock:
            pts = self._points + ([] if self._bucket is None else [self._bucket])
            end = self._t_end if self._t_end is not None else self.now()
            has_res = any(p[2] is not None for p in pts)
            peak = None
            if self._peak is not None:
                pt, pb = self._peak
                peak = {
                    "t": round(pt, 4),
                    "bytes": pb,
                    "stage": _stage_at([(b.t0, b.t1, b.stage) for b in self._bands], pt),
                }
            return {
                "measure": self.measure,
                "total_bytes": self.total_bytes,
                "seconds": round(end, 4),
                "running": self._t_end is None,
                "stride": self._stride,
                "max_points": self.max_points,
                "samples": {k: v for k, v in self.counts.items() if v},
                "points": {
                    "t": [round(p[0], 4) for p in pts],
                    "used": [p[1] for p in pts],
                    "reserved": [p[2] or 0 for p in pts] if has_res else None,
                },
                "peak": peak,
                "bands": [b.to_dict() for b in self._bands],
                "events": [e.to_dict() for e in self._events],
                "dropped": dict(self._dropped),
            }


def _merge(
    a: tuple[float, int, int | None], b: tuple[float, int, int | None]
) -> tuple[float, int, int | None]:
    """Two points as one: the higher ``used`` (the earlier one on a tie) at its time, and the
    higher ``reserved``."""
    hi = a if a[1] >= b[1] else b
    return hi[0], hi[1], a[2] if b[2] is None else b[2] if a[2] is None else max(a[2], b[2])


def _stage_at(spans: list[tuple[float, float | None, str]], t: float) -> str | None:
    """The stage of the latest band (t0, t1 or None while open, stage) that holds time ``t``."""
    return next((s for t0, t1, s in reversed(spans) if t0 <= t and (t1 is None or t <= t1)), None)


# -- SVG ---------------------------------------------------------------------------------------
W, H = 480, 184
"""The SVG's viewBox (it scales to the readout's width)."""
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 50, 8, 30, 22
"""Room around the plot: the y axis's labels (left), the x axis's (bottom), and above the plot two
strips: the stage bands' names (baseline :data:`_LABEL_Y`) and the event markers (centred on
:data:`_EVENT_Y`), so that no label sits on a marker. The card's total is labelled right of the plot
(the right pad grows by its label's width)."""
_LABEL_Y, _EVENT_Y, _EVENT_R = 12, 22, 5
FONT = 12
"""The SVG's text size (px of the viewBox)."""
COLUMNS = 64
"""Hover columns: each carries a ``<title>`` with the highest values in its time range."""
EVENT_LABELS = {"release": "released memory", "oom": "out of memory", "offload": "idle models off the card"}
EVENT_GLYPHS = {"release": "↓", "offload": "↓", "oom": "!"}
"""The glyph in an event's marker (another kind: its first letter); the legend says what each means."""
HIDDEN_EVENTS = frozenset({"plan"})
"""Event kinds the plot leaves out: a sampling pass's plan is its stage row's (and its band's hover
text), a marker would say it again."""


def text_width(text: str, size: float = FONT) -> float:
    """A generous estimate of ``text``'s width in a sans-serif font of ``size`` px (the layout keeps
    labels apart with it; the browser's own measure is narrower)."""
    return 0.62 * size * len(text)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def format_bytes(n: float | None, mib_digits: int = 2) -> str:
    """``1536 MiB`` → ``"1.50 GiB"``; ``None`` → ``"n/a"``."""
    if n is None:
        return "n/a"
    v = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(v) < 1024:
            return f"{v:.{mib_digits if unit == 'MiB' else 0}f} {unit}"
        v /= 1024
    return f"{v:.2f} GiB"


def _fmt(n: float | None) -> str:
    return format_bytes(n, mib_digits=1)


def _nice_step(span: float, n: int) -> float:
    """A round step (1, 2, 2.5 or 5 times a power of ten) that cuts ``span`` into about ``n``."""
    raw = max(span, 1e-9) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _byte_ticks(span: float, top: float) -> tuple[float, float, str]:
    """(step in bytes, unit in bytes, unit name) for a y axis of ``span`` bytes reaching ``top``:
    round steps in the unit the labels use."""
    unit, name = (2**30, "GiB") if top >= 2**30 else (2**20, "MiB") if top >= 2**20 else (1024, "KiB")
    return _nice_step(span / unit, 5) * unit, unit, name


TOTAL_NEAR = 0.3
"""The card's total is drawn on the plot when the job's highest sample reaches this share of it;
below, the axis keeps to the job's own range and the legend gives the total."""
_TOP_ROOM = 0.12
"""Share of the plot's height above its highest value (the total's label sits there)."""


def _y_range(data: Mapping[str, Any]) -> tuple[float, float, bool]:
    """(bottom, top, whether the card's total is drawn) of the plot's y axis.

    The axis spans the range the job used, from its lowest sample to its highest (and up to the
    card's total when the job came within :data:`TOTAL_NEAR` of it), with a little room around:
    never from 0 when the job never went near 0, so a job that keeps most of the card filled (a
    resident checkpoint) shows its movement instead of a flat line along the total."""
    pts = data.get("points") or {}
    used = list(pts.get("used") or []) or [0]
    res = [v for v in (pts.get("reserved") or []) if v]
    band_peaks = [int(b["peak_bytes"]) for b in (data.get("bands") or []) if b.get("peak_bytes")]
    top = max([*used, *res, *band_peaks, 1])
    total = data.get("total_bytes") or 0
    near = bool(total) and top >= TOTAL_NEAR * total
    high = max(top, total) if near else top
    low = min(used)
    span = max(high - low, high * 0.02, 1.0)  # (a flat job: not its noise blown up)
    bottom = max(0.0, low - 0.1 * span)
    if bottom < 0.5 * _byte_ticks(high - bottom, high)[0]:
        bottom = 0.0  # (near 0 anyway: from 0)
    return bottom, high + (high - bottom) * _TOP_ROOM / (1 - _TOP_ROOM), near


MEASURE_WORDS = {
    "allocated": ("allocated", "reserved"),
    "rss": ("process RAM (RSS)", None),
    "emulated": ("emulated card use", None),
}


@dataclass
class _Frame:
    """Where the plot sits in the viewBox and what its axes span."""

    x0: float
    x1: float
    y0: float
    y1: float
    t_end: float
    y_lo: float
    y_max: float
    total_on_scale: bool
    total_label: tuple[str, str] | None

    def X(self, t: float) -> float:
        return self.x0 + (self.x1 - self.x0) * max(0.0, min(1.0, t / self.t_end))

    def Y(self, b: float) -> float:
        span = self.y_max - self.y_lo
        return self.y1 - (self.y1 - self.y0) * max(0.0, min(1.0, (b - self.y_lo) / span))


def _frame(data: Mapping[str, Any]) -> _Frame:
    ts = list((data.get("points") or {}).get("t") or [0.0])
    t_end = max(float(data.get("seconds") or 0.0), ts[-1], 1e-3)
    y_lo, y_max, on_scale = _y_range(data)
    total = data.get("total_bytes") or None
    label = ("total", _fmt(total)) if total and on_scale else None
    pad_r = _PAD_R + (6 + max(text_width(t, FONT - 1) for t in label) if label else 0)
    return _Frame(_PAD_L, W - pad_r, _PAD_T, H - _PAD_B, t_end, y_lo, y_max, on_scale, label)


@dataclass
class _BandLabel:
    index: int
    """The band's position in ``data["bands"]``."""
    number: int
    """The stage's number (stages numbered in the order they first ran)."""
    name: str
    text: str | None
    """What the strip above the plot shows (``"3 Hires upscale"``, ``"3"``), None where no room."""
    x: float


def _band_labels(data: Mapping[str, Any], frame: _Frame, label: Callable[[str], str]) -> list[_BandLabel]:
    """Each band's label in the strip above the plot: its stage's number and name where the band is
    wide enough, else the number alone, left out where an earlier label takes the room (the
    legend names every stage a band does not)."""
    numbers: dict[str, int] = {}
    out: list[_BandLabel] = []
    free = frame.x0  # (the strip is free from here on)
    bands = list(data.get("bands") or [])
    order = sorted(range(len(bands)), key=lambda i: float(bands[i].get("t0") or 0.0))
    for i in order:
        b = bands[i]
        stage = str(b.get("stage"))
        n = numbers.setdefault(stage, len(numbers) + 1)
        name = label(stage)
        t1 = float(b["t1"]) if b.get("t1") is not None else frame.t_end
        bx0, bx1 = frame.X(float(b.get("t0") or 0.0)), frame.X(t1)
        x = max(bx0 + 2, free)
        full, num = f"{n} {name}", str(n)
        text = None
        if x + text_width(full) <= bx1 - 2:
            text = full
        elif x < max(bx1, bx0 + 3) and x + text_width(num) <= W - 2:  # (it starts inside its band)
            text = num
        if text is not None:
            free = x + text_width(text) + 4
        out.append(_BandLabel(i, n, name, text, x))
    return out


def render_svg(
    data: Mapping[str, Any], *, label: Callable[[str], str] = str, plan: Callable[[str], str] = str
) -> str:
    """The timeline ``data`` (:meth:`Timeline.to_dict`) as an inline ``<svg>`` element (valid XML,
    everything escaped); ``""`` when there is nothing to draw. ``label`` maps a stage id to its
    readable name, ``plan`` a band's plan to the words its hover text uses."""
    pts = data.get("points") or {}
    ts = list(pts.get("t") or [])
    used = list(pts.get("used") or [])
    res = list(pts.get("reserved") or []) or None
    if not ts or len(ts) != len(used):
        return ""
    bands = list(data.get("bands") or [])
    events = [ev for ev in data.get("events") or [] if str(ev.get("kind")) not in HIDDEN_EVENTS]
    total = data.get("total_bytes") or None
    measure = str(data.get("measure") or "allocated")
    used_word, res_word = MEASURE_WORDS.get(measure, (measure, "reserved"))
    f = _frame(data)
    t_end, y_lo, y_max = f.t_end, f.y_lo, f.y_max
    x0, x1, y0, y1 = f.x0, f.x1, f.y0, f.y1
    X, Y = f.X, f.Y

    out = [
        f'<svg class="vram-guard-timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" '
        f'width="100%" role="img" aria-label="memory timeline" font-size="{FONT}" '
        f'font-family="sans-serif">',
        f"<title>Memory over the job ({_e(used_word)}), {t_end:.1f} s</title>",
    ]
    # stage bands: a tinted column each (overlapping ones, e.g. a live preview, a second lane,
    # tinted darker), its number and name in the strip above the plot
    labels = {bl.index: bl for bl in _band_labels(data, f, label)}
    lanes: list[float] = []
    for i, b in enumerate(bands):
        t0 = float(b.get("t0") or 0.0)
        t1 = float(b["t1"]) if b.get("t1") is not None else t_end
        lane = next((k for k, end in enumerate(lanes) if end <= t0 + 1e-9), len(lanes))
        lanes[lane : lane + 1] = [t1]  # (the first free lane, else a new one)
        bx0, bx1 = X(t0), X(t1)
        bl = labels[i]
        peak = b.get("peak_bytes")
        tip = f"{bl.name}: {t0:.2f}-{t1:.2f} s"
        if peak:
            tip += f", peak {'' if b.get('exact', True) else 'at least '}{_fmt(peak)}"
        if b.get("plan"):
            tip += f", plan: {plan(str(b['plan']))}"
        if b.get("samples"):
            tip += f", {b['samples']} samples"
        if not b.get("ok", True):
            tip += f" — failed: {b.get('error') or 'error'}"
        cls = "vram-guard-tl-band" + ("" if b.get("ok", True) else " vram-guard-tl-failed")
        fill = "#dc2626" if not b.get("ok", True) else ("#3b82f6" if i % 2 == 0 else "#8b5cf6")
        out.append(
            f'<g class="{cls}" data-stage="{_e(b.get("stage"))}"><title>{_e(tip)}</title>'
            f'<rect x="{bx0:.1f}" y="0" width="{max(0.8, bx1 - bx0):.1f}" height="{y1}" '
            f'fill="{fill}" fill-opacity="{0.06 if lane == 0 else 0.12}"/>'
        )
        if peak:
            yp = Y(peak)
            out.append(
                f'<line class="vram-guard-tl-bandpeak" x1="{bx0:.1f}" x2="{bx1:.1f}" y1="{yp:.1f}" '
                f'y2="{yp:.1f}" stroke="{fill}" stroke-dasharray="3 2" stroke-width="1"/>'
            )
        if bl.text:
            out.append(
                f'<text x="{bl.x:.1f}" y="{_LABEL_Y}" fill="currentColor" class="vram-guard-tl-label">'
                f"{_e(bl.text)}</text>"
            )
        out.append("</g>")
    # axes: y ticks in bytes, x ticks in seconds
    ystep, unit, unit_name = _byte_ticks(y_max - y_lo, y_max)
    first = math.ceil(y_lo / ystep - 1e-6)  # round values inside the range (its bottom need not be)
    for i in range(first, int(y_max / ystep + 1e-6) + 1):
        k = i * ystep
        yy = Y(k)
        out.append(
            f'<line x1="{x0}" x2="{x1}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="currentColor" '
            f'stroke-opacity="0.12"/><text x="{x0 - 3}" y="{yy + 3:.1f}" text-anchor="end" '
            f'fill="currentColor" fill-opacity="0.7">{round(k / unit, 3):g} {unit_name}</text>'
        )
    tstep = _nice_step(t_end, 6)
    for i in range(int(t_end / tstep + 1e-9) + 1):
        k = round(i * tstep, 6)
        out.append(
            f'<text x="{X(k):.1f}" y="{H - 6}" text-anchor="middle" fill="currentColor" '
            f'fill-opacity="0.7">{k:g} s</text>'
        )
    # the card's total: a red line, labelled right of the plot (no marker is there)
    if total and f.total_label is not None:  # (off the scale: the legend says where it is)
        yt = Y(total)
        word, size = f.total_label
        out.append(
            f'<g class="vram-guard-tl-total"><title>card total {_e(_fmt(total))}</title>'
            f'<line x1="{x0}" x2="{x1}" y1="{yt:.1f}" y2="{yt:.1f}" stroke="#dc2626" '
            f'stroke-width="1.5"/><text x="{x1 + 6:.1f}" y="{yt - 2:.1f}" fill="#dc2626" '
            f'font-size="{FONT - 1}"><tspan>{_e(word)} </tspan>'
            f'<tspan x="{x1 + 6:.1f}" dy="{FONT}">{_e(size)}</tspan></text></g>'
        )
    # the memory line(s)
    if res is not None and len(res) == len(ts):
        line = " ".join(f"{X(t):.1f},{Y(v):.1f}" for t, v in zip(ts, res, strict=True))
        out.append(
            f'<polyline class="vram-guard-tl-reserved" points="{line}" fill="none" stroke="#f97316" '
            f'stroke-opacity="0.55" stroke-dasharray="4 2" stroke-width="1.2"/>'
        )
    line = " ".join(f"{X(t):.1f},{Y(v):.1f}" for t, v in zip(ts, used, strict=True))
    out.append(
        f'<polyline class="vram-guard-tl-used" points="{line}" fill="none" stroke="#f97316" '
        f'stroke-width="1.6" stroke-linejoin="round"/>'
    )
    # events: a marker in their strip above the plot, a dashed line down through it; events whose
    # markers would touch share one (its hover lists each; red when one was out of memory)
    event_xs = []
    for group in _marker_groups(events, X):
        ex = X(float(group[0].get("t") or 0.0))
        event_xs.append(ex)
        kinds = [str(ev.get("kind")) for ev in group]
        kind = "oom" if "oom" in kinds else kinds[0]
        color = "#dc2626" if kind == "oom" else "#16a34a"
        glyph = EVENT_GLYPHS.get(kind, kind[:1].upper())
        tip = "\n".join(
            f"{float(ev.get('t') or 0.0):.2f} s: {EVENT_LABELS.get(k, k)} — {ev.get('text', '')}"
            for ev, k in zip(group, kinds, strict=True)
        )
        out.append(
            f'<g class="vram-guard-tl-event" data-kind="{_e(kind)}"><title>{_e(tip)}</title>'
            f'<line x1="{ex:.1f}" x2="{ex:.1f}" y1="{_EVENT_Y + _EVENT_R}" y2="{y1}" stroke="{color}" '
            f'stroke-width="1" stroke-dasharray="2 2"/>'
            f'<circle cx="{ex:.1f}" cy="{_EVENT_Y}" r="{_EVENT_R}" fill="{color}"/>'
            f'<text x="{ex:.1f}" y="{_EVENT_Y + 3}" text-anchor="middle" fill="#fff" font-size="9">'
            f"{_e(glyph)}</text></g>"
        )
    # the peak: the highest sample, and a band's recorded peak where that is higher
    peak = data.get("peak") or None
    if peak:
        pb = int(peak["bytes"])
        where = label(str(peak["stage"])) if peak.get("stage") else None
        best_band = max(bands, key=lambda b: int(b.get("peak_bytes") or 0), default=None)
        note = f"peak {_fmt(pb)}" + (f" ({where})" if where else "") + f" at {float(peak['t']):.2f} s"
        if best_band is not None and int(best_band.get("peak_bytes") or 0) > pb:
            note += (
                f"; {label(str(best_band['stage']))} recorded "
                f"{_fmt(int(best_band['peak_bytes']))} between samples"
            )
        px, py = X(float(peak["t"])), Y(pb)
        text = f"peak {_fmt(pb)}"
        tx, ty = _peak_label_at(f, px, py, text_width(text, FONT + 1), event_xs, Y(total) if total else None)
        out.append(
            f'<g class="vram-guard-tl-peak"><title>{_e(note)}</title>'
            f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="none" stroke="#dc2626" stroke-width="1.5"/>'
            f'<text x="{tx:.1f}" y="{ty:.1f}" fill="currentColor" font-weight="bold">{_e(text)}</text></g>'
        )
    # hover columns: the highest values in each slice of time
    n_cols = min(COLUMNS, len(ts))
    spans = [
        (float(b.get("t0") or 0), None if b.get("t1") is None else float(b["t1"]), str(b.get("stage")))
        for b in bands
    ]
    width = (x1 - x0) / n_cols
    j = 0
    for c in range(n_cols):
        c_t1 = t_end * (c + 1) / n_cols
        k = bisect.bisect_right(ts, c_t1, lo=j)  # (the points are in time order)
        if k == j:
            continue
        best_u, best_r = max(used[j:k]), None if res is None else max(res[j:k])
        j = k
        mid = t_end * (c + 0.5) / n_cols
        stage = _stage_at(spans, mid)
        stage = None if stage is None else label(stage)
        tip = f"{t_end * c / n_cols:.1f}-{c_t1:.1f} s" + (f" {stage}" if stage else "")
        tip += f": {used_word} {_fmt(best_u)}"
        if best_r is not None and res_word:
            tip += f", {res_word} {_fmt(best_r)}"
        out.append(
            f'<rect class="vram-guard-tl-hover" x="{x0 + c * width:.1f}" y="{y0}" width="{width:.1f}" '
            f'height="{y1 - y0}" fill="transparent"><title>{_e(tip)}</title></rect>'
        )
    out.append("</svg>")
    return "".join(out)


def _marker_groups(events: list[Mapping[str, Any]], X: Callable[[float], float]) -> list[list[Mapping]]:
    """The events in time order, grouped so that no two markers touch: an event whose marker would
    touch its group's first joins that group."""
    groups: list[list[Mapping[str, Any]]] = []
    for ev in sorted(events, key=lambda e: float(e.get("t") or 0.0)):
        x = X(float(ev.get("t") or 0.0))
        if groups and x - X(float(groups[-1][0].get("t") or 0.0)) < 2 * _EVENT_R + 1:
            groups[-1].append(ev)
        else:
            groups.append([ev])
    return groups


def _peak_label_at(
    f: _Frame, px: float, py: float, w: float, event_xs: list[float], y_total: float | None
) -> tuple[float, float]:
    """(left x, baseline y) of the peak's label: inside the plot, clear of the events' dashed lines
    and of the total's line, as near the peak's circle as that allows (beside it, else beside the
    nearest event line), above the point where there is room, else below it."""
    above = max(f.y0 + FONT, py - 4)
    below = min(py + 14, f.y1 - 2)
    near_total = y_total is not None and f.total_on_scale and py - y_total < 16
    lefts = [px + 6, px - 6 - w] + [x for ex in event_xs for x in (ex + 3, ex - 3 - w)]
    ok = [
        left
        for left in lefts
        if f.x0 <= left <= f.x1 - w
        and (left >= px + 5 or left + w <= px - 5)  # (not on the peak's own circle)
        and not any(left - 2 <= ex <= left + w + 2 for ex in event_xs)
    ]
    # (beside the point first: the nearer side; then the place nearest to it)
    left = min(ok, key=lambda x: abs(x + w / 2 - px)) if ok else min(max(px + 6, f.x0), f.x1 - w)
    return left, below if near_total else above  # (above a point near the total would cross it)


def legend_html(data: Mapping[str, Any], *, label: Callable[[str], str] = str) -> str:
    """One line under the plot: what the lines and markers are, the stages the plot shows by number
    only, how many samples, what was left out."""
    measure = str(data.get("measure") or "allocated")
    used_word, res_word = MEASURE_WORDS.get(measure, (measure, "reserved"))
    pts = data.get("points") or {}
    parts = [f"solid: {used_word}"]
    if pts.get("reserved") and res_word:
        parts.append(f"dashed: {res_word}")
    total = data.get("total_bytes")
    if total and pts.get("t") and not _y_range(data)[2]:
        parts.append(f"total {_fmt(total)}: far above the plot")
    kinds = [str(ev.get("kind")) for ev in data.get("events") or []]
    glyphs: dict[str, list[str]] = {}
    for kind in kinds:
        if kind not in HIDDEN_EVENTS:
            words = glyphs.setdefault(EVENT_GLYPHS.get(kind, kind[:1].upper()), [])
            if EVENT_LABELS.get(kind, kind) not in words:
                words.append(EVENT_LABELS.get(kind, kind))
    parts += [f"{g}: {' or '.join(w)}" for g, w in glyphs.items()]
    if pts.get("t"):
        names: dict[int, str] = {}
        named: set[int] = set()  # (stages a band shows by name)
        for bl in _band_labels(data, _frame(data), label):
            names.setdefault(bl.number, bl.name)
            if bl.text is not None and bl.text != str(bl.number):
                named.add(bl.number)
        stages = [f"{n} {name}" for n, name in names.items() if n not in named]
        if stages:
            parts.append("stages " + ", ".join(stages))
    n = sum(int(v) for v in (data.get("samples") or {}).values())
    parts.append(f"{n} samples, {len(pts.get('t') or [])} points")
    dropped = data.get("dropped") or {}
    if dropped.get("bands"):
        parts.append(f"{dropped['bands']} later stages not drawn")
    if dropped.get("events"):
        parts.append(f"{dropped['events']} later events not drawn")
    return f'<div class="vram-guard-tl-legend">{_e("; ".join(parts))}</div>'
