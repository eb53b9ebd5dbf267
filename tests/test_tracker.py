from __future__ import annotations

import threading

import pytest
import torch

from lib_vram.core.tracker import StageTracker

MiB = 2**20


def _hold(nbytes: int) -> torch.Tensor:
    # torch.ones touches every page, so the memory is resident (torch.empty would not be).
    return torch.ones(nbytes // 4, dtype=torch.float32)


def test_peak_of_known_allocation_within_10_percent():
    tracker = StageTracker("cpu")
    size = 256 * MiB
    with tracker.stage("alloc") as rec:
        t = _hold(size)
        del t
    assert rec.ok and rec.measure == "rss"
    assert rec.delta_peak_bytes == pytest.approx(size, rel=0.10)


def test_nested_stages_peaks_and_parents():
    tracker = StageTracker("cpu")
    with tracker.stage("outer") as outer:
        a = _hold(64 * MiB)
        with tracker.stage("inner") as inner:
            b = _hold(192 * MiB)
            del b
        del a
        with tracker.stage("inner2") as inner2:
            # above glibc's largest dynamic mmap threshold (32 MiB): fresh pages whatever earlier
            # tests freed (a heap chunk could reuse pages that are still resident)
            c = _hold(96 * MiB)
            del c
    names = [r.name for r in tracker.records]
    assert names == ["inner", "inner2", "outer"]
    assert inner.parent == "outer" and inner.depth == 1 and outer.depth == 0
    assert inner.delta_peak_bytes == pytest.approx(192 * MiB, rel=0.10)
    assert inner2.delta_peak_bytes == pytest.approx(96 * MiB, rel=0.25)
    # The outer stage saw 64 MiB held while the inner one added 192 MiB.
    assert outer.delta_peak_bytes == pytest.approx(256 * MiB, rel=0.10)
    assert outer.peak_bytes >= inner.peak_bytes


def test_exception_marks_stage_failed_and_propagates():
    tracker = StageTracker("cpu")
    with pytest.raises(RuntimeError, match="boom"), tracker.stage("decode"):
        x = _hold(16 * MiB)
        raise RuntimeError("boom")
    rec = tracker.last("decode")
    assert rec is not None and not rec.ok and "boom" in rec.error
    del x
    # The tracker is still usable and has no stage open.
    with tracker.stage("after") as ok:
        pass
    assert ok.ok and ok.depth == 0


def test_note_attaches_plan_to_innermost_stage():
    tracker = StageTracker("cpu")
    with tracker.stage("outer"), tracker.stage("vae_decode"):
        tracker.note("exact t64", tiles=4)
    rec = tracker.last("vae_decode")
    assert rec.plan == "exact t64" and rec.notes == {"tiles": 4}
    assert tracker.last("outer").plan is None


def test_stages_from_two_threads_do_not_corrupt_each_other():
    tracker = StageTracker("cpu", sample_interval=0.005)
    errors = []

    def work(i):
        try:
            for _ in range(5):
                with tracker.stage(f"t{i}"):
                    _hold(MiB)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(tracker.records) == 10


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="sample_interval"):
        StageTracker("cpu", sample_interval=0)
    with pytest.raises(ValueError, match="name"), StageTracker("cpu").stage(""):
        pass
