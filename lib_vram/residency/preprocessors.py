"""sd-webui-controlnet's preprocessor models (its annotators) in the one owner.

A ControlNet preprocessor that needs a model (CLIP vision for IP-Adapter, depth, openpose, lineart,
normal ...) loads it onto ControlNet's device at its first call and keeps it there between jobs,
in holders of its own: its registry's preprocessor objects, the annotator modules' globals, a
detector's ``model``, a dict of encoders. With VRAM Guard's job each such model joins the owner
(role ``preprocessor``): counted, on the card while its preprocessor runs (room made first; a wake
that runs out of memory, or a first load that does, gets everything idle off the card and one more
try), parked in host memory after it (a copy back, not a disk load: the next call wakes it from
there). ControlNet's own unload paths keep working: a model it moves to ``meta`` or drops leaves the
owner; one it moves to the CPU is where the owner keeps it anyway.

On the emulated card a model a preprocessor call leaves loaded counts on the card, as on a GPU,
until the owner parks it or ControlNet moves it off (``to("cpu")``, ``cpu()``, ``to("meta")``) or
drops it: the plain WebUI runs out of memory where the model stayed.

Host-free: ControlNet's objects are read by attribute names; the WebUI adapter passes the
preprocessor class and the holders' roots.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from lib_vram.core.device import is_oom_error
from lib_vram.residency import CARD, HOST, Model
from lib_vram.residency._modules import ModuleMover, admit, nbytes_of, tensors_of

logger = logging.getLogger(__name__)

MiB = 1 << 20
STAGE = "preprocessor"
DEPTH = 5
"""Attribute levels below a root (ControlNet's openpose model: module global -> its model holder ->
detector -> body estimator -> the network)."""


class PreprocessorOutOfMemory(RuntimeError):
    """A preprocessor's model could not be put on the card: one line (contains "out of memory")."""


_LEAVES = (
    str, bytes, int, float, torch.Tensor, type, functools.partial,
    types.FunctionType, types.MethodType, types.BuiltinFunctionType,
)  # fmt: skip


def models_in(roots: Iterable[Any], depth: int = DEPTH, width: int = 64) -> list[torch.nn.Module]:
    """The ``torch.nn.Module`` objects held under ``roots`` (Python modules' globals, objects'
    attributes, dict values, list items; ``width`` items of each), outermost only, each once."""
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()
    todo = [(r, depth, True) for r in roots]
    while todo:
        obj, left, root = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found[id(obj)] = obj
            continue
        if left == 0 or isinstance(obj, _LEAVES):
            continue
        if isinstance(obj, types.ModuleType) and not root:
            continue
        if isinstance(obj, dict):
            values = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            values = list(obj)
        else:
            try:
                values = list(vars(obj).values())
            except TypeError:
                continue
        keep = values if isinstance(obj, types.ModuleType) else values[:width]  # (every global)
        todo.extend((v, left - 1, False) for v in keep if v is not None)
    inner = {id(m) for outer in found.values() for m in list(outer.modules())[1:]}
    return [m for i, m in found.items() if i not in inner]


def _loaded(module: torch.nn.Module) -> bool:
    first = next(iter(tensors_of([module])), None)
    return first is not None and first.device.type != "meta"


@dataclass(eq=False)
class _Entry:
    ref: weakref.ReferenceType
    name: str
    nbytes: int
    model: Model | None = None
    """Its model in the owner (None: not VRAM Guard's, a plain job loaded it)."""
    counted: int = 0
    """Bytes it counts on the emulated card outside the owner (a plain job left it there)."""
    users: set[str] = field(default_factory=set)
    """The preprocessors that ran it."""
    hook: Any = None


class Preprocessors:
    """ControlNet's preprocessor models for the session (see the module docstring).

    ``cards``: the session's owner and card (``owner``, ``device()``, ``card()``: the emulated card
    or None); ``roots()``: where ControlNet keeps its models now; ``active()``: whether the
    running job is VRAM Guard's (else the models stay where ControlNet puts them); ``stopped``:
    called with the one line when a model cannot be put on the card."""

    def __init__(
        self,
        cards: Any,
        roots: Callable[[], Iterable[Any]],
        active: Callable[[], bool],
        stopped: Callable[[str], None] | None = None,
    ) -> None:
        self.cards = cards
        self.roots = roots
        self.active = active
        self.stopped = stopped
        self.entries: dict[int, _Entry] = {}
        self._calling: list[str] = []

    # -- ControlNet's classes ----------------------------------------------------------------
    def install(self, cls: type, stack: ExitStack) -> bool:
        """Wrap ``cls.cached_call`` (every preprocessor call goes through it) and the registry's
        ``unload`` paths; undone when ``stack`` closes. Idempotent."""
        call = cls.__dict__.get("cached_call")
        if call is None or getattr(call, "_vram_guard", False):
            return call is not None
        guard = self

        def cached_call(pre: Any, *args: Any, **kwargs: Any) -> Any:
            name = getattr(pre, "label", None) or getattr(pre, "name", type(pre).__name__)
            return guard.call(str(name), call, pre, *args, **kwargs)

        cached_call._vram_guard = True  # type: ignore[attr-defined]
        cls.cached_call = cached_call
        stack.callback(setattr, cls, "cached_call", call)
        for c in {type(p) for p in dict(getattr(cls, "all_processors", None) or {}).values()}:
            own = c.__dict__.get("unload")
            unload = own or getattr(c, "unload", None)
            if not callable(unload) or getattr(unload, "_vram_guard", False):
                continue
            c.unload = self._unload(unload)
            stack.callback(*((setattr, c, "unload", own) if own is not None else (delattr, c, "unload")))
        stack.callback(self.forget)
        return True

    def _unload(self, unload: Callable) -> Callable:
        guard = self

        def wrapped(pre: Any, *args: Any, **kwargs: Any) -> Any:
            with _applied() as moved:
                out = unload(pre, *args, **kwargs)
            guard.unloaded(moved)
            return out

        wrapped._vram_guard = True  # type: ignore[attr-defined]
        return wrapped

    # -- one call ----------------------------------------------------------------------------
    def call(self, name: str, run: Callable, *args: Any, **kwargs: Any) -> Any:
        """One preprocessor call (see the module docstring)."""
        self.refresh()
        if self._calling:  # (a preprocessor calling another: the outer call holds the models)
            return run(*args, **kwargs)
        owned = self.active()
        owner = self.cards.owner
        self._calling.append(name)
        try:
            if owned:
                owner.begin(STAGE)
            for attempt in (0, 1):
                try:
                    if owned:
                        for e in self.entries.values():
                            if name in e.users and e.model is not None:
                                self._wake(e, name, attempt)
                    out = run(*args, **kwargs)
                    break
                except Exception as exc:
                    if not (owned and is_oom_error(exc)) or isinstance(exc, PreprocessorOutOfMemory):
                        raise
                    if attempt:
                        raise self._stop(name, exc) from exc
                # (out of the except: its traceback, holding what the failed try allocated, is gone)
                self._found(name, owned)  # (a load that failed in its forward left a model)
                owner.room(STAGE, [], None, why=f"the {name} preprocessor ran out of memory")
                if owner.release is not None:
                    owner.release()
        finally:
            self._calling.pop()
            try:
                self._found(name, owned)
            finally:
                if owned:  # the models it ran go home (host memory); what left for it comes back
                    woken = [e.model for e in self.entries.values() if e.model and e.model.where == CARD]
                    owner.send_home(woken, f"the {name} preprocessor is done")
                    owner.end(STAGE)
        return out

    def _wake(self, e: _Entry, name: str, attempt: int) -> None:
        parked = "again, from host memory (no disk load)" if not attempt else "after the room was made"
        self.cards.owner.use(e.model, STAGE, why=f"the {name} preprocessor runs it {parked}")

    def _ran(self, e: _Entry) -> None:
        """The model's forward starts (a hook on it): it belongs to the running preprocessor; outside
        the owner, on the emulated card, a model ControlNet moved off counts again (its annotator
        moves it to its device at each call)."""
        if self._calling:
            e.users.add(self._calling[-1])
        card = self.cards.card()
        module = e.ref()
        if e.model is None and not e.counted and card is not None and module is not None:
            tensors = tensors_of([module])
            admit(card, tensors)
            card.set_resident(card.resident_bytes + nbytes_of(tensors))
            e.counted = nbytes_of(tensors)

    def _stop(self, name: str, exc: BaseException) -> PreprocessorOutOfMemory:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        line = (
            f"VRAM Guard stopped the job before the {name} preprocessor ran out of memory: its model "
            f"did not fit on the card even with every idle model off it ({first}); nothing was left "
            "half-moved and the input image is kept. A smaller preprocessor resolution or its CPU "
            "option may fit"
        )
        logger.warning("%s", line)
        if self.stopped is not None:
            self.stopped(line)
        return PreprocessorOutOfMemory(line)

    # -- what ControlNet holds ----------------------------------------------------------------
    def _found(self, name: str, owned: bool) -> None:
        """Models the call left loaded that are new: on the card as ControlNet put them (counted
        on the emulated card), joined to the owner in VRAM Guard's job."""
        device, card = self.cards.device(), self.cards.card()
        known = {id(m.mover.module) for m in self.cards.owner.models if hasattr(m.mover, "module")}
        for module in models_in(self.roots()):
            e = self.entries.get(id(module))
            if e is not None:
                continue
            if id(module) in known or not _loaded(module):
                continue
            tensors = tensors_of([module])
            if card is None and tensors[0].device.type != device.type:
                continue  # (ControlNet's "CLIP on CPU" option: not on the card)
            e = _Entry(weakref.ref(module), f"{name or 'ControlNet'} preprocessor model", nbytes_of(tensors))
            e.users.add(name)
            self.entries[id(module)] = e
            e.hook = module.register_forward_pre_hook(lambda _m, _a, e=e: self._ran(e))
            if card is not None:  # the load put it on ControlNet's device: the card a GPU would fill
                for t in tensors:
                    card.ledger.adopt(t.untyped_storage())
                card.set_resident(card.resident_bytes + e.nbytes)
                e.counted = e.nbytes
            logger.info("VRAM Guard: the %s preprocessor loaded a model (%.0f MiB)", name, e.nbytes / MiB)
        if owned:
            for e in self.entries.values():
                if e.model is None:
                    self._join(e)

    def _join(self, e: _Entry) -> None:
        module = e.ref()
        if module is None:
            return
        device, card = self.cards.device(), self.cards.card()
        mover = ModuleMover(module, device, card)
        first = tensors_of([module])[0]
        on_card = e.counted > 0 if card is not None else first.device.type == device.type
        model = Model(e.name, "preprocessor", e.nbytes, mover, dtype=str(first.dtype)[6:], home=HOST)
        model.where = CARD if on_card else HOST
        e.counted, e.model = 0, model  # (the owner's mover counts it from now on)
        mover.on_use = lambda: self.cards.owner.use(model, why="its preprocessor runs it")
        if model.where == HOST:
            mover.hook()
        self.cards.owner.join(model)

    def refresh(self) -> None:
        """Models ControlNet dropped or moved to ``meta`` leave (the owner, the emulated card)."""
        held = {id(m) for m in models_in(self.roots())}
        for key, e in list(self.entries.items()):
            module = e.ref()
            if module is None or key not in held or not _loaded(module):
                self._leave(key, "unloaded by ControlNet")

    def unloaded(self, moved: set[int]) -> None:
        """ControlNet's unload path ran: models it moved (to the CPU or ``meta``) are off the card."""
        for key, e in list(self.entries.items()):
            if key in moved and e.counted:
                self._uncount(e)
        self.refresh()

    def _uncount(self, e: _Entry) -> None:
        card = self.cards.card()
        if card is not None and e.counted:
            card.set_resident(max(0, card.resident_bytes - e.counted))
        e.counted = 0

    def _leave(self, key: int, why: str) -> None:
        e = self.entries.pop(key)
        self._uncount(e)
        if e.hook is not None:
            e.hook.remove()
        module = e.ref()
        if e.model is not None:
            if e.model.where == CARD and (self.cards.card() is not None or (module and _loaded(module))):
                self.cards.owner.send_home([e.model], why)  # (the owner moves it, and logs it)
            e.model.mover.unhook()
            self.cards.owner.leave(e.model)
        logger.info("VRAM Guard: %s left (%s)", e.name, why)

    def forget(self) -> None:
        """Every model out of the owner and off the emulated count (the patches are undone)."""
        for key in list(self.entries):
            self._leave(key, "VRAM Guard unloaded")


@contextlib.contextmanager
def _applied() -> Iterator[set[int]]:
    """The ids of modules whose weights were moved (``to``, ``cpu``, ...) inside the block."""
    moved: set[int] = set()
    original = torch.nn.Module._apply

    def _apply(self: torch.nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
        moved.add(id(self))
        return original(self, fn, *args, **kwargs)

    torch.nn.Module._apply = _apply  # type: ignore[method-assign]
    try:
        yield moved
    finally:
        torch.nn.Module._apply = original  # type: ignore[method-assign]
