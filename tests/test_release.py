from __future__ import annotations

import weakref

import pytest
import torch

from lib_vram.core.device import release
from lib_vram.core.release import LeakCheck, ReleasePolicy
from lib_vram.planning.presets import PRESETS


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
