"""A small GPU in software: an emulated device memory of N bytes on any machine.

``with EmulatedCard(4 * GiB):`` puts the code inside on a 4 GiB card (docs/how-it-works.md, "The
emulated card"). On the CPU every tensor storage an operator creates in that thread counts against
the capacity (:class:`lib_vram.core.livebytes.LiveBytesCounter` with a capped ledger; convolutions
also count ``predict.WORKSPACE_TERMS``' scratch), and the allocation that would cross it raises
``torch.OutOfMemoryError``: the exception CUDA raises, so :func:`lib_vram.core.device.is_oom_error`,
the engines' retries and the WebUI's own error handling see the real thing. On CUDA the switch caps
the process with ``torch.cuda.set_per_process_memory_fraction`` and puts the previous fraction back.
Weights already "on the card" are passed as ``resident`` (bytes or modules). The memory probes
(:func:`lib_vram.core.device.memory_info`, ``free_bytes``) report the card while it is active in the
calling thread or installed process-wide (:func:`install`: the ``--emulate-vram`` and
``--vram-guard-emulate-vram`` flags).

Tensors that an engine keeps in *host* memory (parked tile state, a CPU-side accumulator) are
device memory too when the device is the CPU; engines call :func:`to_host` / :func:`to_device` on
them so that the card counts what a GPU would hold. :func:`separate_host` tells an engine whether
host and device memory are distinct for a device (always on an accelerator; on the CPU only under
an emulated card).

Dispatch modes are per thread: a card entered in one thread does not see another thread's
operators. Enter it in each thread that should run on it (the WebUI adapter does this per job).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch

from .livebytes import Ledger, LiveBytesCounter, _storage_of, tensors_of

logger = logging.getLogger(__name__)

GiB = 1024**3
MiB = 1024**2

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|g|mib|mb|m)?\s*$", re.IGNORECASE)


def parse_size(text: str | int, option: str = "--emulate-vram", *, allow_zero: bool = False) -> int:
    """``"6GB"``/``"6G"``/``"6GiB"`` -> 6 GiB, ``"4096MB"`` -> 4 GiB (card sizes are binary: a "6 GB"
    card has 6 GiB). Integers are bytes. One clear error naming ``option`` otherwise."""
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m and str(text).strip().startswith("-"):
            raise ValueError(f"`{option}` must be {bound}, got {text!r}")
        if not m:
            raise ValueError(f"`{option}` must look like 6GB, 5.5GiB or 4096MB, got {text!r}")
        mult = GiB if (m.group(2) or "gb").lower().startswith("g") else MiB
        value = int(float(m.group(1)) * mult)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"`{option}` must be {bound}, got {text!r}")
    return value


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


def module_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes of the distinct parameter/buffer storages of ``modules`` (weights "on the card")."""
    seen: set[int] = set()
    total = 0
    for t in tensors_of(modules):
        st = None if t.device.type == "meta" else _storage_of(t)
        if st is None or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += int(st.nbytes())
    return total


class _CardLedger(Ledger):
    """A ledger that refuses to cross the card's capacity."""

    def __init__(self, card: EmulatedCard) -> None:
        super().__init__()
        self._card = weakref.ref(card)

    def admit(self, nbytes: int, transient: bool = False) -> None:
        card = self._card()
        if card is not None:
            card._admit(self.live_bytes, nbytes, transient)


class EmulatedCard:
    """An emulated device memory of ``capacity`` bytes (see the module docstring).

    Args:
        capacity: the card's size in bytes (or a string such as ``"4GB"``).
        device: the device it stands for: ``"cpu"`` (counted by a dispatch mode) or ``"cuda"``
            (capped with ``set_per_process_memory_fraction``).
        resident: bytes already on the card when it starts, or modules whose weights are.
        workspace: count the backend's convolution scratch as a transient allocation (default True;
            the planner's predictions count it too).
        label: how the readout and the log name it (default ``"emulated 4.00 GiB card"``).
        inject_oom_at: make the n-th allocation after the card started (1 = the first) fail once
            with the card's out-of-memory error, whatever the capacity says, as when another process
            takes the memory for a moment: how tests make the error fire at the first, a middle and
            the last allocation of a stage. :attr:`allocations` counts them (a dry run tells n).
    """

    def __init__(
        self,
        capacity: int | str,
        *,
        device: torch.device | str = "cpu",
        resident: int | Iterable[torch.nn.Module] = 0,
        workspace: bool = True,
        label: str | None = None,
        inject_oom_at: int | None = None,
    ) -> None:
        self.capacity = parse_size(capacity)
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"an emulated card stands for the CPU or a CUDA device, not {self.device.type!r}"
            )
        self.resident_bytes = resident if isinstance(resident, int) else module_bytes(resident)
        self.label = label or f"emulated {_gib(self.capacity)} card"
        self.ledger = _CardLedger(self)
        self.ooms = 0
        """How many allocations this card refused."""
        self.last_oom: str | None = None
        self._workspace = workspace
        self._local = threading.local()
        self._lock = threading.RLock()
        self._cuda_depth = 0
        self._cuda_saved: float | None = None
        self.peak_used_bytes = self.mark_used_bytes = self.resident_bytes
        self.allocations = 0
        """Allocations counted so far (tensors and convolution scratch)."""
        self.inject_oom_at = inject_oom_at
        self.injected = False
        """Whether the injected error (``inject_oom_at``) has fired."""

    # -- accounting --------------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        """Bytes of tensors allocated on the card since it started, alive now."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self.ledger.live_bytes

    @property
    def used_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_reserved(self.device))
        return self.resident_bytes + self.ledger.live_bytes

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity - self.used_bytes)

    @property
    def peak_bytes(self) -> int:
        """Highest use (resident + live) since the card started or :meth:`reset_peak`."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(self.peak_used_bytes, self.resident_bytes + self.ledger.peak_bytes)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.ledger.reset_peak()
        self.peak_used_bytes = self.used_bytes

    @property
    def mark_peak_bytes(self) -> int:
        """(CPU) Highest use since :meth:`reset_mark`: a peak counter of the stage tracker's own,
        which leaves :attr:`peak_bytes` (the card's since it started) alone."""
        return max(self.mark_used_bytes, self.resident_bytes + self.ledger.mark_bytes)

    def reset_mark(self) -> None:
        self.ledger.reset_mark()
        self.mark_used_bytes = self.used_bytes

    def set_resident(self, resident: int | Iterable[torch.nn.Module]) -> None:
        """Replace the resident bytes (a new checkpoint was loaded between jobs; idle models left
        the card for a pass and came back).

        The peak so far is kept as the card had it: the live peak reached under the old resident
        bytes is folded in with those, and the live peak starts again from what is alive now, so
        that live bytes reached while fewer bytes were resident are never added to the new resident
        (a use the card never had: above its capacity, which it refuses)."""
        new = resident if isinstance(resident, int) else module_bytes(resident)
        if self.device.type != "cuda":
            self.peak_used_bytes, self.mark_used_bytes = self.peak_bytes, self.mark_peak_bytes
            self.ledger.reset_peak()
            self.ledger.reset_mark()
        self.resident_bytes = new

    def _admit(self, live: int, nbytes: int, transient: bool) -> None:
        used = self.resident_bytes + live
        self.allocations += 1
        inject = not self.injected and self.inject_oom_at == self.allocations
        if used + nbytes <= self.capacity and not inject:
            return
        self.injected = self.injected or inject
        self.ooms += 1
        what = ("scratch" if transient else "tensor") + (", injected" if inject else "")
        msg = (
            f"CUDA out of memory. Tried to allocate {_gib(nbytes)} ({what}). {self.label} has a total "
            f"capacity of {_gib(self.capacity)} of which {_gib(max(0, self.capacity - used))} is free. "
            f"Of the allocated memory {_gib(live)} is allocated by tensors and {_gib(self.resident_bytes)} "
            "was resident when the card started (VRAM Guard's emulated device memory, not a real GPU)."
        )
        self.last_oom = msg
        logger.debug("%s refused %d bytes: %s", self.label, nbytes, msg)
        raise torch.OutOfMemoryError(msg)

    # -- host/device roles ------------------------------------------------------------------
    def to_host(self, tensor: torch.Tensor) -> None:
        """``tensor`` is held in host memory from now on: stop counting it against the card."""
        storage = _storage_of(tensor) if self.device.type == "cpu" else None
        if storage is not None:
            self.ledger.remove(storage)

    def to_device(self, tensor: torch.Tensor) -> None:
        """``tensor`` is back on the device: count it again (may raise the card's OOM)."""
        storage = _storage_of(tensor) if self.device.type == "cpu" else None
        if storage is not None:
            self.ledger.add(storage)

    # -- entering ---------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCard:
        if self.device.type == "cuda":
            self._enter_cuda()
        else:
            from .predict import WORKSPACE_TERMS

            mode = LiveBytesCounter(
                WORKSPACE_TERMS.get("cpu") if self._workspace else None, ledger=self.ledger, real_only=True
            )
            mode.__enter__()
            _thread_stack(self._local).append(mode)
        _thread_stack(_tls).append(self)
        with _ACTIVE_LOCK:
            _ACTIVE.append(weakref.ref(self))
        return self

    def __exit__(self, *exc: object) -> None:
        stack = getattr(_tls, "stack", [])
        if stack and stack[-1] is self:
            stack.pop()
        with _ACTIVE_LOCK:  # (its latest entry: a card may be entered again, nested)
            i = next((i for i in reversed(range(len(_ACTIVE))) if _ACTIVE[i]() is self), None)
            if i is not None:
                del _ACTIVE[i]
        if self.device.type == "cuda":
            self._exit_cuda()
            return
        self._local.stack.pop().__exit__(None, None, None)
        self.peak_used_bytes, self.mark_used_bytes = self.peak_bytes, self.mark_peak_bytes

    @property
    def active_here(self) -> bool:
        """Whether this thread runs on the card now."""
        return bool(getattr(self._local, "stack", None)) or (
            self.device.type == "cuda" and self._cuda_depth > 0
        )

    def _enter_cuda(self) -> None:
        with self._lock:
            self._cuda_depth += 1
            if self._cuda_depth > 1:
                return
            total = torch.cuda.get_device_properties(self.device).total_memory
            fraction = min(1.0, self.capacity / total)
            getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            self._cuda_saved = float(getter(self.device)) if getter is not None else 1.0
            torch.cuda.set_per_process_memory_fraction(fraction, self.device)
            logger.info("%s: CUDA capped at %.4f of %s", self.label, fraction, _gib(total))

    def _exit_cuda(self) -> None:
        with self._lock:
            self._cuda_depth -= 1
            if self._cuda_depth > 0:
                return
            torch.cuda.set_per_process_memory_fraction(
                self._cuda_saved if self._cuda_saved is not None else 1.0, self.device
            )

    def describe(self) -> dict:
        """What the readout and the status route show about the card."""
        return {
            "label": self.label,
            "capacity_bytes": self.capacity,
            "resident_bytes": self.resident_bytes,
            "used_bytes": self.used_bytes,
            "peak_bytes": self.peak_bytes,
            "ooms": self.ooms,
        }

    def __repr__(self) -> str:
        return f"<EmulatedCard {self.label} on {self.device}, used {_gib(self.used_bytes)}>"


# -- which card is active ------------------------------------------------------------------

_tls = threading.local()


def _thread_stack(local: threading.local) -> list:
    if not hasattr(local, "stack"):
        local.stack = []
    return local.stack


_ACTIVE: list[weakref.ref[EmulatedCard]] = []
_ACTIVE_LOCK = threading.Lock()
_INSTALLED: EmulatedCard | None = None


def install(card: EmulatedCard | None) -> EmulatedCard | None:
    """Make ``card`` the process-wide emulated card (memory probes report it even where no thread
    has entered it); ``None`` removes it. Returns the previous one."""
    global _INSTALLED
    previous, _INSTALLED = _INSTALLED, card
    if card is not None:
        logger.info("VRAM Guard: running on an %s (emulated device memory, not a real GPU)", card.label)
    return previous


def installed() -> EmulatedCard | None:
    return _INSTALLED


def _first(cards: Iterable[EmulatedCard | None], device: torch.device | str | None) -> EmulatedCard | None:
    """The first of ``cards`` that stands for ``device`` (``None``: any)."""
    dtype = None if device is None else torch.device(device).type
    return next((c for c in cards if c is not None and (dtype is None or c.device.type == dtype)), None)


def current(device: torch.device | str | None = None) -> EmulatedCard | None:
    """The emulated card that stands for ``device`` (``None``: any): the one entered by this thread,
    else one entered by another thread, else the installed one; ``None`` when there is none."""
    with _ACTIVE_LOCK:
        others = [r() for r in reversed(_ACTIVE)]
    return _first([*reversed(getattr(_tls, "stack", [])), *others, _INSTALLED], device)


def running_here(device: torch.device | str | None = None) -> EmulatedCard | None:
    """The card this thread's operators are counted on now (entered in this thread), or ``None``."""
    return _first(reversed(getattr(_tls, "stack", [])), device)


def separate_host(device: torch.device | str) -> bool:
    """Whether host memory is distinct from ``device``'s memory: always on an accelerator; on the
    CPU only while this thread runs on an emulated card (then host memory is what the card does not
    count)."""
    dev = torch.device(device)
    return dev.type != "cpu" or running_here(dev) is not None


def to_host(tensor: torch.Tensor | None) -> None:
    """Tell the card this thread runs on (if any) that ``tensor`` now lives in host memory."""
    _tell(tensor, "to_host")


def to_device(tensor: torch.Tensor | None) -> None:
    """Tell the card this thread runs on (if any) that ``tensor`` is device memory again."""
    _tell(tensor, "to_device")


def _tell(tensor: torch.Tensor | None, what: str) -> None:
    card = None if tensor is None else running_here(tensor.device)
    if card is not None:
        getattr(card, what)(tensor)


@contextlib.contextmanager
def host_work() -> Iterator[None]:
    """``with host_work():`` the enclosed tensors are host memory, not the card's: image <-> tensor
    conversions and other CPU-side work that a GPU run does in host RAM. On a real accelerator (or
    without a card running in this thread) it changes nothing."""
    card = running_here("cpu")
    stack = getattr(card._local, "stack", None) if card is not None else None
    mode: LiveBytesCounter | None = stack[-1] if stack else None
    if mode is None:
        yield
        return
    before = mode.paused
    mode.paused = True
    try:
        yield
    finally:
        mode.paused = before


@contextlib.contextmanager
def running_on(card: EmulatedCard | None) -> Iterator[EmulatedCard | None]:
    """``with running_on(card):`` enters ``card`` in this thread unless it already runs here
    (re-entrant use from nested stages); ``None`` does nothing."""
    if card is None or card.active_here:
        yield card
        return
    with card:
        yield card
