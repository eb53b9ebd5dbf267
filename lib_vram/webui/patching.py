"""Instance-attribute patches that are always undone and never drop somebody else's patch.

``patch_attr(obj, "name", fn, stack)`` sets ``obj.name`` to a small callable that calls
``fn(previous, *args, **kwargs)``, where ``previous`` is what ``obj.name`` was. The undo is pushed
onto ``stack`` (an ``ExitStack``): it puts the previous value back if ours is still the attribute;
if somebody replaced it after us (wrapping ours), ours turns into a pass-through instead, so their
wrapper keeps working. The same rule as :mod:`lib_vram.core.hooks`, for plain objects and dict slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from contextlib import ExitStack
from typing import Any

logger = logging.getLogger(__name__)

_MISSING = object()


class Patch:
    """A callable standing in for an attribute; ``active=False`` makes it a pass-through."""

    __slots__ = ("active", "fn", "name", "previous")

    def __init__(self, name: str, previous: Callable[..., Any], fn: Callable[..., Any]) -> None:
        self.name = name
        self.previous = previous
        self.fn = fn
        self.active = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.active:
            return self.fn(self.previous, *args, **kwargs)
        return self.previous(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<VRAM Guard patch {self.name} active={self.active}>"


def patch_attr(obj: Any, name: str, fn: Callable[..., Any], stack: ExitStack) -> Patch:
    """Replace ``obj.<name>`` (an instance attribute) by ``fn(previous, *args, **kwargs)`` until
    ``stack`` closes."""
    had_instance = name in getattr(obj, "__dict__", {})
    saved = obj.__dict__[name] if had_instance else _MISSING
    previous = getattr(obj, name)
    if not callable(previous):
        raise TypeError(f"`{name}` of {type(obj).__name__} is not callable")
    patch = Patch(f"{type(obj).__name__}.{name}", previous, fn)
    setattr(obj, name, patch)
    stack.callback(_undo, obj.__dict__, name, patch, saved)
    return patch


def patch_slot(
    mapping: MutableMapping[str, Any],
    key: str,
    fn: Callable[..., Any],
    stack: ExitStack,
    *,
    default: Callable[..., Any] | None = None,
) -> Patch:
    """Like :func:`patch_attr` for a dict slot (e.g. Forge's ``patcher.model_options``).

    ``previous`` is the value that was in the slot, or ``default`` when the slot was empty (then the
    undo removes the key again).
    """
    saved = mapping.get(key, _MISSING)
    previous = saved if saved is not _MISSING else default
    if previous is None:
        raise ValueError(f"slot `{key}` is empty and no `default` was given")
    patch = Patch(key, previous, fn)
    mapping[key] = patch
    stack.callback(_undo, mapping, key, patch, saved)
    return patch


def _undo(mapping: MutableMapping[str, Any], key: str, patch: Patch, saved: Any) -> None:
    """``saved`` back in ``mapping[key]`` (no key when there was none) if ``patch`` is still
    there; else somebody wrapped ours after us and it turns into a pass-through."""
    if mapping.get(key) is not patch:
        patch.active = False
        logger.debug("%s was re-patched by somebody else; ours stays as a pass-through", patch.name)
    elif saved is _MISSING:
        del mapping[key]
    else:
        mapping[key] = saved


def foreign_vae_wrapper(module: Any) -> str | None:
    """Describe an instance-level wrapper on a VAE module that is not ours (e.g. Tiled VAE's
    ``VAEHook``, which also leaves ``original_forward`` on the module), or None."""
    from lib_vram.core.hooks import ATTR

    if module is None:
        return None
    d = getattr(module, "__dict__", {})
    fwd = d.get("forward")
    ours = getattr(fwd, "_vram_guard_trampoline", False)
    reg = d.get(ATTR)
    if "original_forward" in d:
        return f"{type(fwd).__name__} (Tiled VAE's hook)"
    if fwd is not None and not ours and (reg is None or not reg.installed):
        return getattr(fwd, "__qualname__", type(fwd).__name__)
    return None
