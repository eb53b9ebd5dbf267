from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lib_vram.core import device as dev
from lib_vram.planning.tiers import TIERS_GB, tier_for_total, tier_label

GiB = 2**30


def test_cpu_memory_info_is_consistent():
    info = dev.memory_info("cpu")
    assert info.backend == "cpu" and info.device == "cpu"
    assert 0 < info.free <= info.total == info.system_total
    assert info.process_rss > 0
    assert info.allocated is None and info.peak_allocated is None


def test_resolve_device_defaults_to_cpu_without_accelerator():
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    assert dev.resolve_device(None).type in ("cpu", "mps", "xpu")
    assert dev.backend_of("cpu") is dev.Backend.CPU


def test_release_collects_reference_cycles():
    class Holder:
        pass

    a, b = Holder(), Holder()
    a.other, b.other = b, a
    a.tensor = torch.ones(1024)
    ref = weakref.ref(a)
    gc.disable()
    try:
        del a, b
        assert ref() is not None  # only a cycle keeps it alive now
        result = dev.release("cpu")
    finally:
        gc.enable()
    assert ref() is None
    assert result.collected_objects >= 2
    assert result.freed_device_bytes == 0


@pytest.mark.parametrize(
    "exc, expected",
    [
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"), True),
        (MemoryError(), True),
        (RuntimeError("shape mismatch"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_is_oom_error(exc, expected):
    assert dev.is_oom_error(exc) is expected


def test_torch_oom_type_is_recognised():
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    assert dev.is_oom_error(oom("x"))


def test_capabilities_cpu():
    caps = dev.capabilities("cpu")
    assert caps.backend == "cpu" and caps.sdpa and caps.bf16
    assert caps.torch_version == torch.__version__


@pytest.mark.parametrize(
    "total_gib, tier",
    [(2, 4), (3.8, 4), (5.8, 6), (7.6, 8), (11.7, 12), (15.6, 16), (23.6, 24), (80, 24), (139, 24)],
)
def test_tier_for_total(total_gib, tier):
    assert tier_for_total(int(total_gib * GiB)) == tier


def test_tier_labels_and_errors():
    assert [tier_label(t) for t in TIERS_GB] == ["4GB", "6GB", "8GB", "12GB", "16GB", "24GB+"]
    with pytest.raises(ValueError, match="total_bytes"):
        tier_for_total(-1)
    with pytest.raises(ValueError, match="unknown tier"):
        tier_label(5)
