from __future__ import annotations

import gc
import logging
import threading
import weakref
from dataclasses import dataclass, field

import torch

from lib_vram.core.device import memory_info

logger = logging.getLogger(__name__)

# -- a leak check across jobs (these tests' own tool) ----------------------------------------------
# It watches objects that should die after a job (models handed out, per-job tensors) through weak
# references and records the memory baseline after each job; its report names the survivors and
# the drift.

DEFAULT_DRIFT_TOLERANCE = 64 * 2**20
"""Baseline growth over the checked jobs below which :class:`LeakCheck` reports no leak (64 MiB:
above allocator and RSS noise, below a leaked SD VAE tile or image tensor)."""


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


def test_leak_check_finds_a_kept_model():
    check = LeakCheck("cpu")
    kept = []
    for job in range(3):
        model = torch.nn.Conv2d(3, 8, 3)
        check.watch(model, f"model-job{job}")
        if job == 1:
            kept.append(model)  # the deliberate leak
        del model
        check.job_done()
    rep = check.report()
    assert rep.survivors == ["model-job1"]
    assert rep.leaked and "model-job1" in rep.summary()
    kept.clear()
    assert check.survivors() == []


def test_leak_check_measures_baseline_drift():
    check = LeakCheck("cpu", tolerance_bytes=48 * 2**20)
    hoard = []
    check.job_done()
    for _ in range(3):
        # 64 MiB per job, touched, kept: above glibc's largest dynamic mmap threshold (32 MiB), so
        # it is fresh memory whatever earlier tests freed (a heap chunk could reuse resident pages)
        hoard.append(torch.ones(16 << 20))
        check.job_done()
    rep = check.report()
    assert rep.jobs == 4 and rep.drift_bytes > 128 * 2**20
    assert rep.leaked and not rep.survivors
    hoard.clear()


def test_leak_check_clean_run():
    check = LeakCheck("cpu", tolerance_bytes=48 * 2**20)
    for _ in range(3):
        x = torch.ones(8 << 20)
        check.watch(x, "job tensor")
        del x
        check.job_done()
    rep = check.report()
    assert not rep.survivors and not rep.leaked, rep.summary()
