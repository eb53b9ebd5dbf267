"""Loading upscaler model files through spandrel, with a small bounded cache.

The WebUI reads an ESRGAN file from disk on every upscale; :class:`ModelCache` keeps the last few
loaded models keyed by file identity (path, mtime, size) and placement (device, dtype).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from lib_vram.core.device import is_oom_error, release, resolve_device

from ._adapter import IMAGE_TO_IMAGE, NOT_AN_UPSCALER, REFUSED
from ._types import UpscaleError

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".pth", ".pt", ".ckpt", ".safetensors")
CONSTRUCTION_WAIT_S = 300.0
"""How long a load waits for another thread's temporary torch patches to go away (see
:func:`patched_construction`)."""
_CONSTRUCTION_HOOKS = (
    ("Module", "to"),
    ("Module", "load_state_dict"),
    ("Module", "_load_from_state_dict"),
    ("Linear", "__init__"),
    ("Conv2d", "__init__"),
    ("MultiheadAttention", "__init__"),
)
"""What the WebUI's ``InitializeOnMeta``/``LoadStateDictOnMeta`` replace for the duration of a
checkpoint load. Not the per-layer ``_load_from_state_dict`` of ``Linear``/``Conv2d``: the WebUI's
built-in Lora extension replaces those for good (and they load our weights correctly)."""


def patched_construction() -> list[str]:
    """The ``torch.nn`` construction/loading methods currently replaced by code outside torch.

    A host can replace them for a while, process-wide, to build its own model cheaply: the WebUI
    v1.10.1 builds its checkpoint under ``InitializeOnMeta`` (``Linear``/``Conv2d`` created on the
    meta device, ``Module.to`` a no-op) and loads it under ``LoadStateDictOnMeta``. It does so in a
    background thread at startup, so a model built at the same time in another thread (the first
    Extras request) would come out without data."""
    out = []
    for cls_name, attr in _CONSTRUCTION_HOOKS:
        fn = getattr(torch.nn, cls_name).__dict__.get(attr)
        if fn is None:
            continue
        if not (getattr(fn, "__module__", None) or "").startswith("torch"):
            out.append(f"{cls_name}.{attr}")
    return out


def _wait_for_construction(name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    patched = patched_construction()
    if patched:
        logger.info("%s: waiting for another model load to finish (torch.nn %s replaced)", name, patched)
    while patched and time.monotonic() < deadline:
        time.sleep(0.05)
        patched = patched_construction()


def _check_materialised(path: Path, descriptor: object) -> None:
    net = descriptor.model  # type: ignore[attr-defined]
    meta = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if meta:
        raise UpscaleError(
            f"{path.name}: the model was built without data ({len(meta)} tensors on the meta device, "
            f"e.g. {meta[0]}): another thread was building a model under a meta-device patch "
            f"({', '.join(patched_construction()) or 'now gone'}); try again"
        )


def _load_uncached(path: Path, device: torch.device, dtype: torch.dtype | None) -> object:
    try:
        import spandrel
    except ImportError as exc:
        raise UpscaleError(f"{path.name}: spandrel is not installed ({exc})") from exc
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise UpscaleError(
            f"{path.name}: unsupported file type {path.suffix or '(none)'!r}; use one of {SUPPORTED_SUFFIXES}"
        )
    try:
        descriptor = spandrel.ModelLoader(device=device).load_from_file(str(path))
    except spandrel.UnsupportedModelError as exc:
        msg = f"{path.name}: unsupported model architecture (spandrel does not know it)"
        raise UpscaleError(msg) from exc
    except Exception as exc:  # torch.load/safetensors raise many types for a damaged file
        if isinstance(exc, (KeyboardInterrupt, MemoryError)):
            raise
        if is_oom_error(exc):  # the device (or an emulated card) is full: not the file's fault
            raise UpscaleError(
                f"{path.name}: out of memory loading the model ({str(exc).split('.')[0]})"
            ) from exc
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg = f"{path.name}: corrupt or unreadable model file ({type(exc).__name__}: {reason})"
        raise UpscaleError(msg) from exc
    _check_materialised(path, descriptor)
    if not isinstance(descriptor, spandrel.ImageModelDescriptor):
        raise UpscaleError(
            f"{path.name}: a {type(descriptor).__name__} ({descriptor.architecture.name}) is not an "
            "image-to-image upscaler"
        )
    purpose = getattr(descriptor, "purpose", "SR")
    if purpose not in IMAGE_TO_IMAGE:
        kind = REFUSED.get(purpose, f"{purpose} model")
        raise UpscaleError(f"{path.name}: a {descriptor.architecture.name} {kind}, {NOT_AN_UPSCALER}")
    if dtype is not None and dtype != torch.float32:
        try:
            descriptor.to(dtype)
        except spandrel.UnsupportedDtypeError as exc:
            msg = f"{path.name}: {descriptor.architecture.name} does not support {dtype}"
            raise UpscaleError(msg) from exc
    descriptor.eval()
    return descriptor


class ModelCache:
    """A bounded LRU of loaded models keyed by ``(path, mtime, size, device, dtype)``.

    A file changed on disk gets a new key (and is reloaded); the oldest entry is dropped when more
    than ``max_models`` are held. :meth:`clear` drops all and releases device memory. A load waits
    (up to ``construction_wait_s``) while another thread has torch.nn's constructors patched (see
    :func:`patched_construction`: a model built then has no data, and a cached one would fail every
    later call), and a model that still came out on the meta device is refused, never cached.
    """

    def __init__(self, max_models: int = 2, construction_wait_s: float = CONSTRUCTION_WAIT_S) -> None:
        if not isinstance(max_models, int) or max_models < 1:
            raise ValueError(f"`max_models` must be an int >= 1, got {max_models!r}")
        self.max_models = max_models
        self.construction_wait_s = construction_wait_s
        self._items: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0
        """How many times a file was actually read (cache misses)."""

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def key(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
        st = path.stat()
        return (str(path.resolve()), st.st_mtime_ns, st.st_size, str(device), str(dtype or torch.float32))

    def get(self, path: str | os.PathLike, device: torch.device, dtype: torch.dtype | None = None) -> object:
        if not isinstance(path, (str, os.PathLike)):
            raise UpscaleError(f"`path` must be a model file path (str or os.PathLike), got {path!r}")
        p = Path(path)
        if not p.is_file():
            raise UpscaleError(f"{p.name}: no such model file ({p})")
        key = self.key(p, device, dtype)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        _wait_for_construction(p.name, self.construction_wait_s)
        model = _load_uncached(p, device, dtype)
        with self._lock:
            self.loads += 1
            self._items[key] = model
            self._items.move_to_end(key)
            while len(self._items) > self.max_models:
                old_key, _ = self._items.popitem(last=False)
                logger.debug("model cache: dropped %s", old_key[0])
        return model

    def clear(self) -> None:
        """Drop every cached model and release the memory they held."""
        with self._lock:
            devices = {k[3] for k in self._items}
            self._items.clear()
        for dev in devices:
            release(dev)


_default: ModelCache | None = None
_default_lock = threading.Lock()


def default_cache() -> ModelCache:
    """The process-wide cache used when :func:`load_model` gets none (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = ModelCache()
        return _default


def load_model(
    path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    cache: ModelCache | None = None,
    dtype: torch.dtype | None = None,
) -> object:
    """Load an upscaler (``.pth``, ``.pt``, ``.ckpt``, ``.safetensors``) as a spandrel
    ``ImageModelDescriptor`` on ``device``, through ``cache`` (default: :func:`default_cache`).

    Raises :class:`UpscaleError` naming the file and the reason when it is missing, damaged, of an
    unknown architecture or not an image-to-image model.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise UpscaleError(f"`path` must be a model file path (str or os.PathLike), got {path!r}")
    try:
        dev = resolve_device(device)
    except (RuntimeError, TypeError):
        raise UpscaleError(
            f"`device` {device!r} is not a device name (cpu, cuda, cuda:N, mps, xpu)"
        ) from None
    return (cache if cache is not None else default_cache()).get(path, dev, dtype)
