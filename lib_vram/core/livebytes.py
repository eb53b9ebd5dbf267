"""Live tensor bytes: the one counter behind predictions, calibrations and the emulated card.

:class:`LiveBytesCounter` is a ``TorchDispatchMode``: every operator's output storages are
registered once (views and in-place results share a storage and are not counted twice), and a
``weakref.finalize`` on each storage subtracts its bytes when Python frees it. The running total
and its high-water mark are kept by a :class:`Ledger`. It works the same on fake tensors (the
planner's dry runs), on real tensors (per-model calibration, benchmarks) and under an emulated
device memory (:mod:`lib_vram.core.emulate`, whose ledger refuses an allocation that would cross the
card's capacity).

Dispatch modes are per thread: a counter sees the operators of the thread that entered it. The
ledger is thread-safe, so one ledger can be fed by modes in several threads.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CONV_OPS = frozenset(
    {
        # what the dispatcher shows: ``convolution`` normally, the composite ``convN d`` entry points
        # under ``torch.inference_mode`` (the engines run there)
        "aten::convolution",
        "aten::_convolution",
        "aten::mkldnn_convolution",
        "aten::conv1d",
        "aten::conv2d",
        "aten::conv3d",
        "aten::conv_transpose1d",
        "aten::conv_transpose2d",
        "aten::conv_transpose3d",
    }
)


# Both per operator overload, cached: they run for every operator (``func.name()`` costs a call).
@functools.cache
def _returns_alias(func) -> bool:  # noqa: ANN001
    """Whether all of ``func``'s results alias an input (views, in-place operators)."""
    schema = getattr(func, "_schema", None)
    returns = getattr(schema, "returns", None)
    return bool(returns) and all(getattr(r, "alias_info", None) is not None for r in returns)


@functools.cache
def _is_conv(func) -> bool:  # noqa: ANN001
    return func.name() in CONV_OPS


WorkspaceTerm = Callable[[tuple, tuple, tuple, int, bool], int]
"""``(input_shape, weight_shape, output_shape, element_size, input_contiguous) -> bytes``."""


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, no storage
        return None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``, without allocating anything (a bookkeeping tensor would
    count against an emulated card)."""
    size = getattr(dtype, "itemsize", None)  # torch >= 2.1
    if size is not None:
        return int(size)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return info.bits // 8


def tensors_of(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The parameters and buffers of ``modules``, each once."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


class Ledger:
    """Running total and high-water mark of tracked storages' bytes (thread-safe)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.mark_bytes = 0
        """A second high-water mark, reset on its own (:meth:`reset_mark`: the stage tracker's)."""
        self._sizes: dict[int, int] = {}
        self._lock = threading.RLock()

    def admit(self, nbytes: int, transient: bool = False) -> None:
        """Called before ``nbytes`` more bytes are counted; a capped ledger raises here."""

    def add(self, storage: torch.UntypedStorage) -> bool:
        """Count ``storage`` until it is freed (once); True if it was new."""
        key = id(storage)
        nbytes = int(storage.nbytes())
        with self._lock:
            if key in self._sizes:
                return False
            self.admit(nbytes)
            self._sizes[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.mark_bytes = max(self.mark_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key, nbytes)
        return True

    def adopt(self, storage: torch.UntypedStorage) -> None:
        """Know ``storage`` with 0 bytes until it is freed: memory accounted elsewhere (an emulated
        card's resident weights). Its views and in-place results are then not new allocations
        (a Linear's ``weight.t()`` would otherwise count the weight again, for good)."""
        key = id(storage)
        with self._lock:
            nbytes = self._sizes.pop(key, 0)
            self.live_bytes -= nbytes
            self._sizes[key] = 0
        weakref.finalize(storage, self._free, key, 0)

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._sizes.get(key) == nbytes:
                del self._sizes[key]
                self.live_bytes -= nbytes

    def remove(self, storage: torch.UntypedStorage) -> int:
        """Stop counting ``storage`` (it moved elsewhere); returns the bytes it had."""
        with self._lock:
            nbytes = self._sizes.pop(id(storage), 0)
            self.live_bytes -= nbytes
            return nbytes

    def transient(self, nbytes: int) -> None:
        """Scratch that lives while one operator runs, next to its output: a transient peak."""
        with self._lock:
            self.admit(nbytes, transient=True)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes + nbytes)
            self.mark_bytes = max(self.mark_bytes, self.live_bytes + nbytes)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def reset_mark(self) -> None:
        with self._lock:
            self.mark_bytes = self.live_bytes


class LiveBytesCounter(TorchDispatchMode):
    """Counts the bytes of live tensor storages created by operators, and their peak.

    Use it inside a ``FakeTensorMode`` or on real tensors. Storages that existed before the counter
    was entered (weights, inputs) are not counted unless :meth:`track` is called on them.

    Args:
        workspace: scratch term for convolutions (``predict.WORKSPACE_TERMS``); ``None``: not counted.
        ledger: where the bytes are kept (default: a fresh :class:`Ledger`); an emulated card passes
            its own, capped one.
    """

    def __init__(
        self, workspace: WorkspaceTerm | None = None, *, ledger: Ledger | None = None, real_only: bool = False
    ) -> None:
        super().__init__()
        self.ledger = ledger if ledger is not None else Ledger()
        self.workspace = workspace
        self.paused = False
        """While True (:func:`lib_vram.core.emulate.host_work`), nothing is counted: host-side work."""
        self.real_only = real_only
        """Count only real tensors: skip meta and fake ones (a planner's dry run inside an emulated
        card allocates nothing)."""
        self.ops = 0

    # the ledger's numbers, under the names callers use
    @property
    def live_bytes(self) -> int:
        return self.ledger.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self.ledger.peak_bytes

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (once) until it is freed."""
        storage = _storage_of(tensor)
        if storage is not None:
            self.ledger.add(storage)

    def reset_peak(self) -> None:
        self.ledger.reset_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if self.paused:
            return out
        if _returns_alias(func):
            # views and in-place results share an input's storage: nothing was allocated (also for
            # storages created before the count started: weights, inputs, host-side tensors)
            return out
        # the common case (one tensor out) without the pytree walk: this runs for every operator
        if isinstance(out, torch.Tensor):
            outs = [out]
        else:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.real_only:
            outs = [t for t in outs if t.device.type != "meta" and not isinstance(t, FakeTensor)]
        for t in outs:
            self.track(t)
        if self.workspace is None or not outs or not isinstance(out, torch.Tensor):
            return out
        if _is_conv(func):
            inp, weight = args[0], args[1]
            contiguous = inp.is_contiguous() or inp.is_contiguous(memory_format=torch.channels_last)
            scratch = self.workspace(
                tuple(inp.shape), tuple(weight.shape), tuple(out.shape), out.element_size(), contiguous
            )
            self.ledger.transient(scratch)
        return out
