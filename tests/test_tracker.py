from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from lib_vram.core.tracker import StageTracker

MiB = 2**20


def _hold(nbytes: int) -> torch.Tensor:
    # torch.ones touches every page, so the memory is resident (torch.empty would not be).
    return torch.ones(nbytes // 4, dtype=torch.float32)


def _in_fresh_process(check: str) -> None:
    """Run ``check`` (a function of this module) in a new interpreter with the collector off.

    A process's resident set also drops when other memory is freed: garbage of earlier tests
    collected mid-stage, or a thread an earlier test left running. The measured peak is exact only
    for the memory the stage holds, so the check runs where nothing else comes or goes.
    """
    code = (
        f"import gc, sys; gc.disable(); sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"sys.path.insert(0, {str(Path(__file__).parent.parent)!r}); "
        f"import test_tracker; test_tracker.{check}()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _check_known_allocation() -> None:
    tracker = StageTracker("cpu")
    size = 256 * MiB
    with tracker.stage("alloc") as rec:
        t = _hold(size)
        del t
    assert rec.ok and rec.measure == "rss", rec
    assert abs(rec.delta_peak_bytes - size) <= 0.10 * size, rec.delta_peak_bytes


def _check_nested() -> None:
    tracker = StageTracker("cpu")
    with tracker.stage("outer") as outer:
        a = _hold(64 * MiB)
        with tracker.stage("inner") as inner:
            b = _hold(192 * MiB)
            del b
        del a
        with tracker.stage("inner2") as inner2:
            # above glibc's largest dynamic mmap threshold (32 MiB): fresh pages
            c = _hold(96 * MiB)
            del c
    names = [r.name for r in tracker.records]
    assert names == ["inner", "inner2", "outer"], names
    assert inner.parent == "outer" and inner.depth == 1 and outer.depth == 0
    assert abs(inner.delta_peak_bytes - 192 * MiB) <= 0.10 * 192 * MiB, inner.delta_peak_bytes
    assert abs(inner2.delta_peak_bytes - 96 * MiB) <= 0.25 * 96 * MiB, inner2.delta_peak_bytes
    # The outer stage saw 64 MiB held while the inner one added 192 MiB.
    assert abs(outer.delta_peak_bytes - 256 * MiB) <= 0.10 * 256 * MiB, outer.delta_peak_bytes
    assert outer.peak_bytes >= inner.peak_bytes, (outer.peak_bytes, inner.peak_bytes)


def test_peak_of_known_allocation_within_10_percent():
    _in_fresh_process("_check_known_allocation")


def test_nested_stages_peaks_and_parents():
    _in_fresh_process("_check_nested")


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


def test_on_an_emulated_card_a_stage_below_an_earlier_peak_is_exact_and_the_cards_peak_stays():
    """The WebUI's tracker (``owns_peak_counters=False``) on an emulated card: a stage whose peak is
    below an earlier one (a placed checkpoint's conditioning woke 3119 MiB of text encoders before
    the pass) gets its own peak exactly, nested stages too, and the card's own peak (the job's, which
    the status route and tests read) is not reset."""
    from lib_vram.core.emulate import EmulatedCard

    tracker = StageTracker("cpu", owns_peak_counters=False)
    with EmulatedCard(64 * MiB) as card:
        with tracker.stage("conditioning"):
            big = torch.ones(8 * MiB // 4)
            del big
        with tracker.stage("sampling") as rec:
            keep = torch.ones(MiB // 4)
            with tracker.stage("forward") as inner:
                t = torch.ones(2 * MiB // 4)
                del t
            card.set_resident(card.resident_bytes + MiB)  # (a model woken mid-stage)
        del keep
        assert card.peak_bytes == 8 * MiB
    assert rec.exact and inner.exact, (rec, inner)
    assert inner.peak_bytes == 3 * MiB and inner.start_bytes == MiB, inner
    assert rec.peak_bytes == 3 * MiB and rec.start_bytes == 0, rec
    assert rec.end_bytes == 2 * MiB  # (1 MiB kept + 1 MiB resident)
