"""Plan choice: a pure function of numbers (no torch, no device: table-driven tests cover it).

Policy: candidate plans (untiled, then larger tiles, then larger batches first) are tried in order
of preference; the first whose predicted peak is within ``free_bytes - safety_margin_bytes`` wins,
else the smallest peak with ``fits=False`` and a warning. More memory never gives a less preferred
plan (``tests/test_planner.py`` checks it with hypothesis).

Learning within the process: both engines report every out-of-memory retry and every finished
plan to one :class:`PlanMemory` (:data:`MEMORY` unless given another) under :func:`plan_key`, and
choose through :meth:`PlanMemory.adjust` (docs/how-it-works.md, "Planning").
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One way to run a stage and its predicted peak (bytes in use at the stage's peak)."""

    plan: str
    """Human/infotext label, e.g. ``"untiled"``, ``"tile 64"``, ``"tile 256 x2"``."""
    peak_bytes: int
    tile: int | None = None
    """Tile side (``None``: untiled)."""
    batch: int = 1

    def __post_init__(self) -> None:
        if self.peak_bytes < 0:
            raise ValueError(f"`peak_bytes` must be >= 0, got {self.peak_bytes}")
        if self.tile is not None and self.tile <= 0:
            raise ValueError(f"`tile` must be > 0 or None, got {self.tile}")
        if self.batch < 1:
            raise ValueError(f"`batch` must be >= 1, got {self.batch}")

    @property
    def preference(self) -> tuple:
        """Sort key: smaller is preferred (untiled, then larger tile, then larger batch)."""
        return (self.tile is not None, -(self.tile or 0), -self.batch)


@dataclass(frozen=True)
class Choice:
    """The planner's answer for one stage."""

    candidate: Candidate
    fits: bool
    budget_bytes: int
    """Free memory minus the safety margin."""
    free_bytes: int
    safety_margin_bytes: int
    warning: str | None = None

    @property
    def plan(self) -> str:
        return self.candidate.plan

    @property
    def predicted_peak_bytes(self) -> int:
        return self.candidate.peak_bytes


def order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates in preference order (see the module docstring)."""
    return sorted(candidates, key=lambda c: c.preference)


def choose(candidates: Sequence[Candidate], free_bytes: int, safety_margin_bytes: int) -> Choice:
    """The most preferred candidate that fits ``free_bytes - safety_margin_bytes``.

    When none fits, the one with the smallest predicted peak, ``fits=False`` and a warning.
    """
    if not candidates:
        raise ValueError("`candidates` must not be empty")
    for name, value in (("free_bytes", free_bytes), ("safety_margin_bytes", safety_margin_bytes)):
        if value < 0:
            raise ValueError(f"`{name}` must be >= 0, got {value}")
    budget = free_bytes - safety_margin_bytes
    ranked = order(candidates)
    for cand in ranked:
        if cand.peak_bytes <= budget:
            return Choice(cand, True, budget, free_bytes, safety_margin_bytes)
    smallest = min(ranked, key=lambda c: (c.peak_bytes, c.preference))
    warning = (
        f"even the smallest plan ({smallest.plan}) needs {_mib(smallest.peak_bytes)} but only "
        f"{_mib(max(budget, 0))} is available ({_mib(free_bytes)} free - {_mib(safety_margin_bytes)} "
        "safety margin): expect an out-of-memory error"
    )
    return Choice(smallest, False, budget, free_bytes, safety_margin_bytes, warning)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def plan_key(stage: str, model: Hashable, shape: Iterable[int], dtype: object, *extra: Hashable) -> tuple:
    """The key under which :class:`PlanMemory` learns: what runs (``stage``: e.g. ``"vae_decode"``,
    ``"upscale"``), with which model (an architecture signature: layout, channels, ...), on which
    input ``shape``, in which ``dtype`` (and ``extra``: e.g. the tiled mode)."""
    return (str(stage), model, tuple(int(s) for s in shape), str(dtype).replace("torch.", ""), *extra)


@dataclass(frozen=True)
class Outcome:
    """What happened when a plan ran (reported by an engine or the integration)."""

    plan: str
    predicted_peak_bytes: int
    """The plan's prediction *before* learned corrections (what :meth:`PlanMemory.adjust` scales)."""
    measured_peak_bytes: int | None = None
    oom: bool = False
    candidate: Candidate | None = None
    """The plan's size (tile, batch), when known: an out-of-memory error then also rules out every
    plan at least as large in both (whatever its prediction says)."""

    @classmethod
    def of(
        cls, candidate: Candidate, *, oom: bool = False, measured_peak_bytes: int | None = None
    ) -> Outcome:
        return cls(candidate.plan, candidate.peak_bytes, measured_peak_bytes, oom, candidate)


EXCLUDED = 2**62
"""Added to the peak of a plan that learning rules out: chosen only when nothing else is left (and
then the smallest of them)."""


def _dominates(failed: Candidate, c: Candidate) -> bool:
    """True if ``c`` is at least as large as ``failed`` in tile (untiled = largest) and batch."""
    return c.batch >= failed.batch and (c.tile is None or (failed.tile is not None and c.tile >= failed.tile))


def learnable_peak(record: object, input_bytes: int = 0) -> int | None:
    """The measured peak of a finished stage, comparable with a plan's prediction, or None.

    ``record`` is a :class:`lib_vram.core.tracker.StageRecord`: used only when it succeeded, its peak is
    exact and it counts allocated accelerator memory. Its working set (peak above the memory in use
    when the stage began) plus ``input_bytes`` (the stage's input, resident before it began and
    counted by the predictions) is returned. A CPU record (``measure == "rss"``) is not used: the
    resident set also holds the C allocator's retained heap and libraries' one-time state, which
    depend on the process's history, not on the plan (see docs/benchmarks.md, "Planner").
    """
    if record is None or not getattr(record, "ok", False) or not getattr(record, "exact", False):
        return None
    if getattr(record, "measure", None) not in ("allocated", "emulated"):
        return None
    return max(0, int(record.peak_bytes) - int(record.start_bytes)) + int(input_bytes)


class PlanMemory:
    """What this process learned about plans, per key (:func:`plan_key`: stage, model, shape, dtype).

    Thread-safe; lives as long as the process (:data:`MEMORY` is the shared instance, the one both
    engines report to).

    * An out-of-memory error caps the key: plans predicted at or above the failed plan's prediction,
      and (when its size is known) plans at least as large in tile and batch, are ruled out.
    * Once a key has such a cap, a plan that completed marks the safe side: plans no larger than it
      (tile and batch) stay allowed whatever their prediction, and other plans predicted above the
      largest completed one below the cap are ruled out, so the next call starts at the plan that
      worked instead of probing the band between it and the failure again (predictions need not
      be monotonic in the tile: a halo's overhead can make a smaller tile's estimate larger).
    * A measured peak above the prediction scales later predictions for the key by the largest
      measured/predicted ratio seen (never down).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._oom_cap: dict[Hashable, int] = {}
        self._ratio: dict[Hashable, float] = {}
        # per key, the last 32 of each: outcomes, failed and completed sizes, completed predictions
        self._history: defaultdict[Hashable, deque[Outcome]] = defaultdict(lambda: deque(maxlen=32))
        self._failed: defaultdict[Hashable, deque[Candidate]] = defaultdict(lambda: deque(maxlen=32))
        self._ok_sizes: defaultdict[Hashable, deque[Candidate]] = defaultdict(lambda: deque(maxlen=32))
        self._ok: defaultdict[Hashable, deque[int]] = defaultdict(lambda: deque(maxlen=32))

    def record(self, key: Hashable, outcome: Outcome) -> None:
        """Remember ``outcome`` for ``key``."""
        with self._lock:
            self._history[key].append(outcome)
            p = outcome.predicted_peak_bytes
            if outcome.oom:
                self._oom_cap[key] = min(self._oom_cap.get(key, p), p)
                if outcome.candidate is not None:
                    self._failed[key].append(outcome.candidate)
                logger.info(
                    "plan %s ran out of memory for %s: plans predicted >= %s avoided", outcome.plan, key, p
                )
                return
            self._ok[key].append(p)
            if outcome.candidate is not None:
                self._ok_sizes[key].append(outcome.candidate)
            if outcome.measured_peak_bytes is not None and p > 0:
                ratio = outcome.measured_peak_bytes / p
                if ratio > self._ratio.get(key, 1.0):
                    self._ratio[key] = ratio
                    logger.info("plan %s for %s measured %.2fx its prediction", outcome.plan, key, ratio)

    def history(self, key: Hashable) -> list[Outcome]:
        with self._lock:
            return list(self._history.get(key, []))

    def ratio(self, key: Hashable) -> float:
        """The measured/predicted factor applied to ``key``'s predictions (1.0: none learned)."""
        with self._lock:
            return self._ratio.get(key, 1.0)

    def limit(self, key: Hashable) -> int | None:
        """Predictions above this are ruled out for ``key`` (None: no out-of-memory error seen)."""
        with self._lock:
            return self._limit(key)

    def _limit(self, key: Hashable) -> int | None:
        cap = self._oom_cap.get(key)
        if cap is None:
            return None
        return max((p for p in self._ok.get(key, ()) if p < cap), default=cap - 1)

    def adjust(self, key: Hashable, candidates: Sequence[Candidate]) -> list[Candidate]:
        """``candidates`` with learned corrections: peaks scaled by the worst measured/predicted
        ratio seen for ``key``; plans ruled out by an out-of-memory error (see the class docstring)
        get a huge peak so they are only chosen when nothing else is left."""
        with self._lock:
            ratio = self._ratio.get(key, 1.0)
            limit = self._limit(key)
            failed = list(self._failed.get(key, ()))
            worked = list(self._ok_sizes.get(key, ()))
        out = []
        for c in candidates:
            peak = int(c.peak_bytes * ratio)
            too_big = any(_dominates(f, c) for f in failed)
            unproven = (
                limit is not None and c.peak_bytes > limit and not any(_dominates(c, w) for w in worked)
            )
            if too_big or unproven:
                peak += EXCLUDED
            out.append(replace(c, peak_bytes=peak))
        return out

    def clear(self) -> None:
        with self._lock:
            for d in (self._oom_cap, self._failed, self._ok, self._ok_sizes, self._ratio, self._history):
                d.clear()


MEMORY = PlanMemory()
"""The process-wide plan memory."""


def choose_learned(
    key: Hashable,
    candidates: Sequence[Candidate],
    free_bytes: int,
    safety_margin_bytes: int,
    memory: PlanMemory | None = None,
) -> Choice:
    """:func:`choose` after applying what ``memory`` (default :data:`MEMORY`) learned for ``key``."""
    mem = MEMORY if memory is None else memory
    return choose(mem.adjust(key, candidates), free_bytes, safety_margin_bytes)
