"""Plan choice: a pure function of numbers.

Inputs: the free memory, the safety margin, and candidate plans (untiled, tile sizes, batches),
each with its predicted peak. Output: the chosen plan, whether it fits, and a warning when even the
smallest plan does not. No torch, no device: table-driven tests cover it.

Policy
------
``budget = free_bytes - safety_margin_bytes``. Candidates are ordered by preference: untiled
first, then larger tiles before smaller, then larger batches before smaller (fewer passes, less
halo overhead). The first candidate whose predicted peak is within the budget is chosen. If none
is, the candidate with the smallest predicted peak is chosen with ``fits=False`` and a warning, so
the caller can say so *before* the run.

Because more memory only ever adds candidates that fit, more memory never gives a less preferred
plan (and never a smaller tile): ``tests/test_planner.py`` checks it with hypothesis.

Learning within the process
---------------------------
An OOM can still happen (fragmentation, other processes, a calibration that is off). The engines'
retry path reports it to :class:`PlanMemory`, keyed by stage, model and shape: a plan whose
predicted peak was at least the one that failed is not chosen again for that key, and a measured
peak above the prediction raises later predictions for that key by the observed ratio.
"""

from __future__ import annotations

import logging
import threading
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

    @property
    def headroom_bytes(self) -> int:
        """Budget left over at the predicted peak (negative when it does not fit)."""
        return self.budget_bytes - self.candidate.peak_bytes


def order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates in preference order (see the module docstring)."""
    return sorted(candidates, key=lambda c: c.preference)


def choose(candidates: Sequence[Candidate], free_bytes: int, safety_margin_bytes: int) -> Choice:
    """The most preferred candidate that fits ``free_bytes - safety_margin_bytes``.

    When none fits, the one with the smallest predicted peak, ``fits=False`` and a warning.
    """
    if not candidates:
        raise ValueError("`candidates` must not be empty")
    if free_bytes < 0:
        raise ValueError(f"`free_bytes` must be >= 0, got {free_bytes}")
    if safety_margin_bytes < 0:
        raise ValueError(f"`safety_margin_bytes` must be >= 0, got {safety_margin_bytes}")
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


def tile_ladder(tile_min: int, tile_max: int, step: int = 8, *, factor: float = 0.8) -> list[int]:
    """Tile sizes from ``tile_max`` down to ``tile_min``, each ~``factor`` of the one before,
    rounded down to a multiple of ``step`` (both bounds included)."""
    if step < 1:
        raise ValueError(f"`step` must be >= 1, got {step}")
    if not (0 < tile_min <= tile_max):
        raise ValueError(f"`tile_min`/`tile_max` must satisfy 0 < min <= max, got {tile_min}, {tile_max}")
    if not (0.0 < factor < 1.0):
        raise ValueError(f"`factor` must be in (0, 1), got {factor}")
    sizes = [tile_max]
    t = float(tile_max)
    while True:
        t *= factor
        s = max(tile_min, int(t) // step * step)
        if s >= sizes[-1]:
            s = sizes[-1] - step
        if s <= tile_min:
            break
        sizes.append(s)
    if sizes[-1] != tile_min:
        sizes.append(tile_min)
    return sizes


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class Outcome:
    """What happened when a plan ran (reported by an engine or the integration)."""

    plan: str
    predicted_peak_bytes: int
    measured_peak_bytes: int | None = None
    oom: bool = False


class PlanMemory:
    """What this process learned about plans, per key (stage, model, shape, dtype).

    Thread-safe; lives as long as the process (:data:`MEMORY` is the shared instance).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._oom_cap: dict[Hashable, int] = {}
        self._ratio: dict[Hashable, float] = {}
        self._history: dict[Hashable, list[Outcome]] = {}

    def record(self, key: Hashable, outcome: Outcome) -> None:
        """Remember ``outcome`` for ``key``."""
        with self._lock:
            self._history.setdefault(key, []).append(outcome)
            del self._history[key][:-32]
            if outcome.oom:
                cap = self._oom_cap.get(key)
                p = outcome.predicted_peak_bytes
                self._oom_cap[key] = p if cap is None else min(cap, p)
                logger.info(
                    "plan %s ran out of memory for %s: plans predicted >= %s avoided", outcome.plan, key, p
                )
            elif outcome.measured_peak_bytes is not None and outcome.predicted_peak_bytes > 0:
                ratio = outcome.measured_peak_bytes / outcome.predicted_peak_bytes
                if ratio > self._ratio.get(key, 1.0):
                    self._ratio[key] = ratio

    def history(self, key: Hashable) -> list[Outcome]:
        with self._lock:
            return list(self._history.get(key, []))

    def adjust(self, key: Hashable, candidates: Sequence[Candidate]) -> list[Candidate]:
        """``candidates`` with learned corrections: peaks scaled by the worst measured/predicted
        ratio seen for ``key``; plans predicted at or above a peak that ran out of memory are given
        an infinite-like peak so they are only chosen when nothing else is left."""
        with self._lock:
            ratio = self._ratio.get(key, 1.0)
            cap = self._oom_cap.get(key)
        out = []
        for c in candidates:
            peak = int(c.peak_bytes * ratio)
            if cap is not None and c.peak_bytes >= cap:
                peak = max(peak, 2**62)
            out.append(replace(c, peak_bytes=peak))
        return out

    def clear(self) -> None:
        with self._lock:
            self._oom_cap.clear()
            self._ratio.clear()
            self._history.clear()


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
