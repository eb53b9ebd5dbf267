"""Device and memory probing, and explicit memory release.

Backend-agnostic: CUDA (also ROCm builds, which present themselves as ``cuda``), MPS, XPU and CPU.
Everything here is plain PyTorch + psutil; nothing imports the WebUI.

The functions are small wrappers over the backend APIs so that the policy code elsewhere
(planner, presets, tile choice) can stay a pure function of numbers.
"""

from __future__ import annotations

import enum
import gc
import importlib.util
import logging
import os
from dataclasses import asdict, dataclass

import psutil
import torch

from . import emulate

logger = logging.getLogger(__name__)


class Backend(str, enum.Enum):
    """The kind of compute device."""

    CUDA = "cuda"
    """NVIDIA CUDA (``torch.version.cuda`` set)."""
    ROCM = "rocm"
    """AMD ROCm/HIP build of PyTorch; uses the ``torch.cuda`` API."""
    MPS = "mps"
    """Apple Metal (unified memory)."""
    XPU = "xpu"
    """Intel GPUs through ``torch.xpu``."""
    CPU = "cpu"
    """No accelerator: memory means process RSS and system RAM."""


def backend_of(device: torch.device | str | None = None) -> Backend:
    """The backend of ``device`` (default: the best available device)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return Backend.ROCM if getattr(torch.version, "hip", None) else Backend.CUDA
    return {"mps": Backend.MPS, "xpu": Backend.XPU}.get(dev.type, Backend.CPU)


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """Normalise ``device``; ``None`` picks CUDA/ROCm, then XPU, then MPS, then CPU."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and hasattr(xpu, "is_available") and xpu.is_available():
        return torch.device("xpu", 0)
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@dataclass(frozen=True)
class MemoryInfo:
    """One reading of device and host memory, in bytes.

    ``total``/``free`` describe the compute device (for CPU: system RAM). ``allocated``/``reserved``
    and their peaks are the framework allocator's counters; ``None`` where the backend has none.
    """

    device: str
    backend: str
    total: int
    free: int
    allocated: int | None
    reserved: int | None
    peak_allocated: int | None
    peak_reserved: int | None
    process_rss: int
    system_total: int
    system_available: int
    emulated: str | None = None
    """The emulated card's label when ``total``/``free`` describe one (:mod:`lib_vram.core.emulate`)."""

    @property
    def used(self) -> int:
        return max(0, self.total - self.free)

    def to_dict(self) -> dict:
        return asdict(self)


_statm: tuple[int, int] | None = None
"""(pid, fd) of this process's open ``/proc/self/statm`` (Linux), opened at the first call."""
_statm_failed = False


def _statm_rss() -> int | None:
    """RSS from ``/proc/self/statm`` through a kept file descriptor (~2 µs, a tenth of psutil's
    cost: the trackers sample it after every tile); ``None`` where that is unavailable."""
    global _statm, _statm_failed
    if _statm_failed:
        return None
    pid = os.getpid()
    try:
        if _statm is None or _statm[0] != pid:  # first call, or a forked child (its own /proc)
            _statm = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError, AttributeError):
        _statm_failed = True
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") and "SC_PAGE_SIZE" in os.sysconf_names else 4096


def process_rss() -> int:
    """Resident set size of this process in bytes."""
    rss = _statm_rss()
    return rss if rss is not None else int(psutil.Process().memory_info().rss)


def memory_info(device: torch.device | str | None = None) -> MemoryInfo:
    """Read total/free device memory, allocator counters, process RSS and system RAM."""
    dev = resolve_device(device)
    backend = backend_of(dev)
    vm = psutil.virtual_memory()
    rss = process_rss()
    allocated = reserved = peak_alloc = peak_res = None
    total, free = int(vm.total), int(vm.available)
    if backend in (Backend.CUDA, Backend.ROCM, Backend.XPU):
        api = torch.xpu if backend is Backend.XPU else torch.cuda
        allocated, reserved = int(api.memory_allocated(dev)), int(api.memory_reserved(dev))
        peak_alloc, peak_res = int(api.max_memory_allocated(dev)), int(api.max_memory_reserved(dev))
        if hasattr(api, "mem_get_info"):
            free, total = (int(v) for v in api.mem_get_info(dev))
        else:  # (older XPU builds)
            total = int(getattr(api.get_device_properties(dev), "total_memory", total))
            free = max(0, total - reserved)
    elif backend is Backend.MPS:
        mps = torch.mps
        allocated = int(mps.current_allocated_memory())
        reserved = int(mps.driver_allocated_memory())
        # Unified memory: the device shares system RAM; what is free is what the OS has free.
        recommended = getattr(mps, "recommended_max_memory", None)
        total = int(recommended()) if recommended is not None else total
        free = max(0, min(int(vm.available), total - reserved))
    card = emulate.current(dev)
    if card is not None:
        # an emulated card (``--emulate-vram``): its size and use stand for the device's
        total, free = card.capacity, card.free_bytes
        if backend is Backend.CPU:
            allocated = reserved = card.used_bytes
            peak_alloc = peak_res = card.peak_bytes
    return MemoryInfo(
        device=str(dev), backend=backend.value, emulated=None if card is None else card.label, total=total,
        free=free, allocated=allocated, reserved=reserved, peak_allocated=peak_alloc, peak_reserved=peak_res,
        process_rss=rss, system_total=int(vm.total), system_available=int(vm.available),
    )  # fmt: skip


def free_bytes(device: torch.device | str | None = None) -> int:
    """Memory that a new allocation on ``device`` can use now, in bytes.

    On CUDA this is the driver's free memory plus what PyTorch's cache holds but does not use
    (the cache can be handed out again without asking the driver).
    """
    info = memory_info(device)
    if info.emulated is None and info.backend in ("cuda", "rocm", "xpu"):
        return info.free + max(0, (info.reserved or 0) - (info.allocated or 0))
    return info.free


def empty_cache(device: torch.device | str | None = None) -> None:
    """Hand cached, unused blocks back to the driver (no-op on CPU)."""
    dev = resolve_device(device)
    backend = backend_of(dev)
    if backend in (Backend.CUDA, Backend.ROCM):
        with torch.cuda.device(dev):
            torch.cuda.empty_cache()
            torch.cuda.ipc_collect()
    elif backend is Backend.XPU:
        torch.xpu.empty_cache()
    elif backend is Backend.MPS:
        torch.mps.empty_cache()


@dataclass(frozen=True)
class ReleaseResult:
    """What one :func:`release` did."""

    collected_objects: int
    """Objects ``gc.collect()`` found unreachable."""
    freed_device_bytes: int
    """Drop in the allocator's reserved bytes (CUDA/XPU/MPS); 0 on CPU."""


def release(device: torch.device | str | None = None) -> ReleaseResult:
    """``gc.collect()`` then the backend's cache release; returns what was freed.

    The WebUI's own ``torch_gc`` skips ``gc.collect()``, so tensors held only by reference cycles
    (closures, exceptions with tracebacks) stay allocated; this function collects them first.
    """
    dev = resolve_device(device)
    reserved = memory_info(dev).reserved or 0
    collected = gc.collect()
    empty_cache(dev)
    freed = max(0, reserved - (memory_info(dev).reserved or 0))
    logger.debug(
        "release(%s): %d objects collected, %.1f MiB device memory returned", dev, collected, freed / 2**20
    )
    return ReleaseResult(collected_objects=collected, freed_device_bytes=freed)


def is_oom_error(exc: BaseException) -> bool:
    """True for an out-of-memory error of any backend.

    CUDA raises ``torch.cuda.OutOfMemoryError`` (a ``RuntimeError``); MPS, XPU and older builds
    raise a plain ``RuntimeError`` whose message says "out of memory"; the CPU allocator raises
    ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory``.
    """
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    return isinstance(exc, RuntimeError) and any(
        s in str(exc).lower() for s in ("out of memory", "can't allocate memory")
    )


@dataclass(frozen=True)
class Capabilities:
    """What the device can do; used by the precision policy and ``doctor``."""

    device: str
    backend: str
    name: str
    fp16: bool
    bf16: bool
    sdpa: bool
    xformers: bool
    torch_version: str
    cuda_version: str | None
    hip_version: str | None


def capabilities(device: torch.device | str | None = None) -> Capabilities:
    """Probe precision and attention-kernel support of ``device``."""
    dev = resolve_device(device)
    backend = backend_of(dev)
    # Every backend runs fp16; the CPU's kernels exist for both (bf16 usable, fp16 slow but works).
    fp16 = bf16 = True
    if backend in (Backend.CUDA, Backend.ROCM):
        name = torch.cuda.get_device_name(dev)
        major, _minor = torch.cuda.get_device_capability(dev)
        bf16 = bool(torch.cuda.is_bf16_supported()) and (major >= 8 or backend is Backend.ROCM)
    elif backend is Backend.XPU:
        name = torch.xpu.get_device_name(dev)
    elif backend is Backend.MPS:
        name = "Apple MPS"
        bf16 = hasattr(torch.backends.mps, "is_macos_or_newer") and torch.backends.mps.is_macos_or_newer(
            14, 0
        )
    else:
        import platform

        name = platform.processor() or platform.machine() or "CPU"
    return Capabilities(
        device=str(dev),
        backend=backend.value,
        name=name,
        fp16=fp16,
        bf16=bf16,
        sdpa=hasattr(torch.nn.functional, "scaled_dot_product_attention"),
        xformers=importlib.util.find_spec("xformers") is not None,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        hip_version=getattr(torch.version, "hip", None),
    )
