from __future__ import annotations

import gc
import logging
import threading
import weakref
from dataclasses import dataclass, field

import pytest
import torch

from lib_vram.core.device import memory_info, release
from lib_vram.core.release import ReleasePolicy
from lib_vram.planning.presets import PRESETS

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


class Recorder:
    """Wraps the real release() and remembers when it ran."""

    def __init__(self):
        self.calls = 0

    def __call__(self, device=None):
        self.calls += 1
        return release(device)


def test_releases_only_at_policy_boundaries():
    rec = Recorder()
    pol = ReleasePolicy(PRESETS["12GB"].release_at, "cpu", rec)
    assert pol.at("process") is None and rec.calls == 0
    assert pol.at("post_sample") is not None and rec.calls == 1
    assert [p for p, _ in pol.log] == ["post_sample"]
    with pytest.raises(ValueError, match="`point`"):
        pol.at("lunch")
    with pytest.raises(ValueError, match="`points`"):
        ReleasePolicy({"lunch"})


def _stage_that_fails(refs: list) -> None:
    big = torch.ones(1 << 20)  # a tensor only this frame holds
    refs.append(weakref.ref(big))
    raise RuntimeError("boom")


def test_failure_releases_and_frees_the_failed_frames_tensors():
    rec = Recorder()
    pol = ReleasePolicy({"failure", "job_end"}, "cpu", rec)
    refs: list = []
    with pytest.raises(RuntimeError, match="boom") as info, pol.stage(after="job_end"):
        _stage_that_fails(refs)
    # The exception (and its traceback) is still alive here, yet the tensor is gone.
    assert info.value.__traceback__ is not None
    assert refs[0]() is None
    assert rec.calls == 1 and pol.log[-1][0] == "failure"


def test_without_failure_point_the_failed_frame_keeps_its_tensor():
    """The control: the traceback really holds the tensor unless the policy clears it."""
    pol = ReleasePolicy({"job_end"}, "cpu", Recorder())
    refs: list = []
    with pytest.raises(RuntimeError) as info, pol.stage(after="job_end"):
        _stage_that_fails(refs)
    assert refs[0]() is not None
    del info


def test_interrupt_releases_too():
    rec = Recorder()
    pol = ReleasePolicy({"failure"}, "cpu", rec)
    with pytest.raises(KeyboardInterrupt), pol.stage():
        raise KeyboardInterrupt
    assert rec.calls == 1


def test_success_releases_at_the_named_boundary():
    rec = Recorder()
    pol = ReleasePolicy({"before_hr", "failure"}, "cpu", rec)
    with pol.stage(after="before_hr"):
        pass
    with pol.stage(after="postprocess_batch"):
        pass
    assert [p for p, _ in pol.log] == ["before_hr"]


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
