"""Release policy (which stage boundaries free memory) and a leak check across jobs.

:class:`ReleasePolicy` runs :func:`lib_vram.core.device.release` at the boundaries a preset names
(:data:`RELEASE_POINTS`). :meth:`ReleasePolicy.stage` wraps a stage so that the
release also happens when the stage raises or the job is interrupted: before releasing, it clears
the local variables of the failed stage's frames (the traceback keeps them - and every tensor they
hold - alive while the exception propagates, which is why a plain ``torch.cuda.empty_cache()`` in an
``except`` block frees nothing).

:class:`LeakCheck` watches objects that should die after a job (models handed out, per-job
tensors) through weak references and records the memory baseline after each job; its report names
the survivors and the drift.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from .device import ReleaseResult, memory_info, release

logger = logging.getLogger(__name__)

DEFAULT_DRIFT_TOLERANCE = 64 * 2**20
"""Baseline growth over the checked jobs below which :class:`LeakCheck` reports no leak (64 MiB:
above allocator and RSS noise, below a leaked SD VAE tile or image tensor)."""

RELEASE_POINTS: tuple[str, ...] = (
    "process",
    "before_hr",
    "post_sample",
    "postprocess_batch",
    "job_end",
    "failure",
)
"""Stage boundaries where :func:`release_at` may run ``gc.collect()`` + cache release:

* ``process`` - job start, before the text encoder and UNet run (drops leftovers of the last job);
* ``before_hr`` - between the first pass and hires fix (the first-pass decode/upscale leftovers);
* ``post_sample`` - after sampling, before the VAE decode (the sampler's activations);
* ``postprocess_batch`` - after each batch's images are decoded;
* ``job_end`` - after the job;
* ``failure`` - when a stage raises or the job is interrupted (always recommended: the traceback's
  frames keep tensors alive until collected).
"""


class ReleasePolicy:
    """Release memory at the stage boundaries in ``points``.

    Args:
        points: boundary names (subset of :data:`RELEASE_POINTS`), e.g. a
            preset's ``release_at``.
        device: the device whose cache is released (default: the best available).
        releaser: the release function (default :func:`lib_vram.core.device.release`).
    """

    def __init__(
        self,
        points: Iterable[str],
        device: object | None = None,
        releaser: Callable[..., ReleaseResult] | None = None,
    ) -> None:
        pts = frozenset(points)
        unknown = pts - set(RELEASE_POINTS)
        if unknown:
            raise ValueError(f"`points` has unknown boundaries {sorted(unknown)}; known: {RELEASE_POINTS}")
        self.points = pts
        self.device = device
        self._release = releaser or release
        self._lock = threading.Lock()
        self.log: list[tuple[str, ReleaseResult]] = []
        """Every release done: (boundary, result), oldest first (last 64 kept)."""

    def at(self, point: str) -> ReleaseResult | None:
        """Release if ``point`` is one of the policy's boundaries; return what was freed."""
        if point not in RELEASE_POINTS:
            raise ValueError(f"`point` must be one of {RELEASE_POINTS}, got {point!r}")
        if point not in self.points:
            return None
        result = self._release(self.device)
        with self._lock:
            self.log.append((point, result))
            del self.log[:-64]
        logger.debug("release at %s: %d objects collected", point, result.collected_objects)
        return result

    @contextlib.contextmanager
    def stage(self, after: str | None = None) -> Iterator[None]:
        """Run a stage; release at ``after`` when it succeeds, at ``"failure"`` when it raises
        (any exception, ``KeyboardInterrupt`` included - the WebUI's interrupt)."""
        if after is not None and after not in RELEASE_POINTS:
            raise ValueError(f"`after` must be one of {RELEASE_POINTS} or None, got {after!r}")
        try:
            yield
        except BaseException as exc:
            if "failure" in self.points:
                # Frames below this one have finished: drop their locals (tensors) now.
                tb = exc.__traceback__
                if tb is not None and tb.tb_next is not None:
                    traceback.clear_frames(tb.tb_next)
                del tb
                self.at("failure")
            raise
        if after is not None:
            self.at(after)


@dataclass
class LeakReport:
    """What :meth:`LeakCheck.report` found."""

    jobs: int
    baseline_bytes: list[int]
    """Memory in use after each job's release (device allocated bytes, or RSS on CPU)."""
    drift_bytes: int
    """Last baseline minus the first."""
    survivors: list[str] = field(default_factory=list)
    """Labels of watched objects still alive."""
    tolerance_bytes: int = DEFAULT_DRIFT_TOLERANCE

    @property
    def leaked(self) -> bool:
        return bool(self.survivors) or self.drift_bytes > self.tolerance_bytes

    def summary(self) -> str:
        parts = [f"{self.jobs} jobs, baseline drift {self.drift_bytes / 2**20:+.1f} MiB"]
        if self.survivors:
            parts.append("still alive: " + ", ".join(self.survivors))
        return "; ".join(parts)


class LeakCheck:
    """Watches objects that must not outlive a job, and the memory baseline across jobs."""

    def __init__(self, device: object | None = None, tolerance_bytes: int = DEFAULT_DRIFT_TOLERANCE) -> None:
        if tolerance_bytes < 0:
            raise ValueError(f"`tolerance_bytes` must be >= 0, got {tolerance_bytes}")
        self.device = device
        self.tolerance_bytes = tolerance_bytes
        self._watched: list[tuple[str, weakref.ref]] = []
        self._baselines: list[int] = []
        self._lock = threading.Lock()

    def watch(self, obj: object, label: str | None = None) -> object:
        """Watch ``obj`` (e.g. a model handed to a job); returns it unchanged."""
        name = label or f"{type(obj).__name__}@{id(obj):x}"
        with self._lock:
            self._watched.append((name, weakref.ref(obj)))
        return obj

    def job_done(self) -> int:
        """Call after each job: collects garbage, records and returns the baseline."""
        gc.collect()
        info = memory_info(self.device)
        base = info.allocated if info.allocated is not None else info.process_rss
        with self._lock:
            self._baselines.append(base)
        return base

    def survivors(self) -> list[str]:
        gc.collect()
        with self._lock:
            return [name for name, ref in self._watched if ref() is not None]

    def report(self) -> LeakReport:
        with self._lock:
            bases = list(self._baselines)
        alive = self.survivors()
        drift = bases[-1] - bases[0] if len(bases) >= 2 else 0
        rep = LeakReport(len(bases), bases, drift, alive, self.tolerance_bytes)
        if rep.leaked:
            logger.warning("leak check: %s", rep.summary())
        return rep
