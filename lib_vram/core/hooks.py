"""Named forward hooks on a torch module, kept in one registry attribute.

Wrapping ``module.forward`` is how VRAM Guard reaches a VAE the host calls itself. Doing it by
assigning a closure to ``module.forward`` and later assigning the "original" back breaks as soon as
somebody else wraps the same method in between: restoring would drop their wrapper, and if they
restore later they re-install ours. This module does it the way ``diffusers.hooks`` does:

* the module gets **one** attribute, :data:`ATTR`, holding a :class:`HookRegistry`;
* the registry installs **one** trampoline as the instance's ``forward``; the trampoline runs the
  registered hooks, each as ``hook(module, call_next, *args, **kwargs)``, around the method that
  was there before (the class's ``forward`` looked up at call time, or an instance-level wrapper
  another extension had installed first);
* hooks have names (a duplicate name raises), and removing one re-links the chain;
* removing the last hook restores the module exactly (instance ``forward`` deleted, or the earlier
  instance wrapper put back, registry attribute deleted) — *unless* another wrapper was installed on
  top of our trampoline after us. Then the trampoline stays where it is as a pass-through, so that
  wrapper keeps working and computes ``foreign(original)``.

Thread safety: the list of hooks is an immutable tuple swapped under a lock, and each call takes one
snapshot of it, so a call running on another thread (the WebUI's live previews) sees either the old
or the new chain, never a half-built one.

Pure torch: nothing here knows the WebUI.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

ATTR = "_vram_guard_hooks"
"""The one attribute VRAM Guard sets on a hooked module."""

Hook = Callable[..., Any]
"""``hook(module, call_next, *args, **kwargs) -> output``; ``call_next(*args, **kwargs)`` runs the
rest of the chain (eventually the original forward)."""


@dataclass(frozen=True)
class _Entry:
    name: str
    fn: Hook


class HookRegistry:
    """The named hooks of one module (see the module docstring). Get it with :meth:`of`."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module_ref = weakref.ref(module)
        self._lock = threading.RLock()
        self._hooks: tuple[_Entry, ...] = ()
        self._previous: Any = None
        """The instance-level ``forward`` that was there before us, or ``None`` (class method)."""
        self._trampoline: Callable[..., Any] | None = None

    # -- access ------------------------------------------------------------------------------
    @classmethod
    def of(cls, module: torch.nn.Module, *, create: bool = False) -> HookRegistry | None:
        """The registry of ``module``; with ``create=True`` one is made if there is none."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"`module` must be a torch.nn.Module, got {type(module).__name__}")
        reg = module.__dict__.get(ATTR)
        if reg is None and create:
            reg = cls(module)
            object.__setattr__(module, ATTR, reg)
        return reg

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self._hooks)

    def __repr__(self) -> str:
        module = self._module_ref()
        kind = type(module).__name__ if module is not None else "<dead>"
        return f"HookRegistry({kind}, hooks={list(self.names)}, installed={self.installed})"

    @property
    def installed(self) -> bool:
        """Whether our trampoline is in the module's ``forward`` chain."""
        return self._trampoline is not None

    # -- changing ----------------------------------------------------------------------------
    def register(self, name: str, fn: Hook, *, replace: bool = False) -> None:
        """Add hook ``name`` as the outermost hook; ``replace=True`` swaps an existing one in place."""
        if not name:
            raise ValueError("a hook needs a non-empty `name`")
        if not callable(fn):
            raise TypeError(f"`fn` must be callable, got {type(fn).__name__}")
        with self._lock:
            new = _Entry(name, fn)
            if name not in self.names:
                self._hooks = (*self._hooks, new)
            elif replace:
                self._hooks = tuple(new if e.name == name else e for e in self._hooks)
            else:
                raise ValueError(f"hook `name`={name!r} is already registered on this module")
            self._install()

    def remove(self, name: str) -> bool:
        """Remove hook ``name``; returns whether it was there. The last removal restores the module."""
        with self._lock:
            hooks = tuple(e for e in self._hooks if e.name != name)
            if len(hooks) == len(self._hooks):
                return False
            self._hooks = hooks
            if not hooks:
                self._uninstall()
            return True

    # -- internals ---------------------------------------------------------------------------
    def _install(self) -> None:
        module = self._module_ref()
        if module is None:
            return
        if self._trampoline is not None and "forward" in module.__dict__:
            return  # ours, or a wrapper on top of ours
        # (else none yet, or the wrapper that sat on top of ours was removed without putting ours
        # back: a new trampoline over what is there now)
        self._previous = module.__dict__.get("forward")
        ref = weakref.ref(self)
        module_ref = self._module_ref

        def forward(*args: Any, **kwargs: Any) -> Any:
            reg = ref()
            mod = module_ref()
            if reg is None or mod is None:  # pragma: no cover - only during interpreter teardown
                raise RuntimeError("VRAM Guard hook called on a module that no longer exists")
            return reg._call(mod, args, kwargs)

        forward._vram_guard_trampoline = True  # type: ignore[attr-defined]
        self._trampoline = forward
        object.__setattr__(module, "forward", forward)

    def _uninstall(self) -> None:
        module = self._module_ref()
        if module is None or self._trampoline is None:
            return
        if module.__dict__.get("forward") is self._trampoline:
            if self._previous is None:
                del module.__dict__["forward"]
            else:
                object.__setattr__(module, "forward", self._previous)
            self._trampoline = None
            self._previous = None
            if module.__dict__.get(ATTR) is self:
                del module.__dict__[ATTR]
        else:
            # Somebody wrapped our trampoline after us: leave it as a pass-through so their wrapper
            # still computes foreign(original). The registry stays to be reused.
            logger.debug("another wrapper sits on top of ours on %s; ours stays as a pass-through", module)

    def _call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        hooks = self._hooks  # one snapshot per call (tuple swap is atomic)
        call = self._previous
        if call is None:  # the class's, looked up at call time: a class-level patch made after us applies
            call = type(module).forward.__get__(module, type(module))
        for entry in hooks:
            call = functools.partial(entry.fn, module, call)
        return call(*args, **kwargs)


def register_hook(module: torch.nn.Module, name: str, fn: Hook, *, replace: bool = False) -> HookRegistry:
    """Register ``fn`` as hook ``name`` on ``module`` (see :class:`HookRegistry`)."""
    reg = HookRegistry.of(module, create=True)
    assert reg is not None
    reg.register(name, fn, replace=replace)
    return reg


def remove_hook(module: torch.nn.Module, name: str) -> bool:
    """Remove hook ``name`` from ``module``; ``False`` when it was not there."""
    reg = HookRegistry.of(module)
    return reg.remove(name) if reg is not None else False
