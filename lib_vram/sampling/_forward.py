"""What runs in a UNet's forward: the stock blocks, or code the estimate does not know.

The sampling estimate (:mod:`._estimate`) walks the stock ldm/sgm ``UNetModel`` forward, and a
micro-batch (:mod:`._micro`) is only right where every module of that forward computes each sample
from that sample alone. Extensions change the forward: they put modules of their own into the
UNet's blocks (AnimateDiff's motion modules, which treat the batch as frames), replace a module's
``forward`` on the instance (HyperTile, Self-Attention Guidance, IP-Adapter) or on its class
(AnimateDiff's ``GroupNorm32`` hack, LoRA), or hook it. :func:`inspect_unet` lists every such
change of one UNet as a :class:`Finding`, each with the extension that made it (from the file its
code lives in), whether it is known to keep samples independent (``per_sample``) and whether the
estimate models it (``modelled``); anything not in :data:`KNOWN` is neither. A
:class:`ForwardCheck` holds the findings of one pass; the sampling guard micro-batches only a
``per_sample`` forward and acts on the estimate only for a ``modelled`` one (docs/sampling.md,
"Extensions that change the forward").

Torch only: the WebUI and the extensions are recognised by the paths and module names of their
code, nothing of them is imported.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Known:
    """What VRAM Guard knows of an extension's change to the forward."""

    name: str
    per_sample: bool
    """Each sample's output is computed from that sample alone (read in its code)."""
    modelled: bool
    """The estimate counts its memory."""


KNOWN: dict[str, Known] = {
    # the WebUI and the model code: the stock forward (its attention optimizations, hypernetworks)
    "webui": Known("the WebUI", True, True),
    "lora": Known("LoRA", True, True),  # extensions-builtin/Lora: merges weights at each layer
    # tiles of one sample's tokens; tokens merged within each sample: both modelled where
    # lib_vram.webui.selfattn reads their state off the UNet (else the pass is measured)
    "hypertile": Known("HyperTile", True, True),
    "tomesd": Known("token merging", True, True),
    "sd-webui-freeu": Known("FreeU", True, False),  # per-sample scales and FFT of the skips
    "sd-webui-kohya-hiresfix": Known("Kohya Hires.fix (Deep Shrink)", True, False),  # interpolate
    "multidiffusion-upscaler-for-automatic1111": Known("Tiled Diffusion", True, False),
    "sd-webui-animatediff": Known("AnimateDiff", False, False),  # the batch is the frames
    "sd_webui_sag": Known("Self-Attention Guidance", False, False),  # keeps the last attention map
    "sd-webui-controlnet": Known("ControlNet", False, False),  # IP-Adapter, reference: per case
}
"""Extensions by the folder their code lives in (``extensions/<folder>``, lower case)."""

_ALIASES = {
    # module names, for a folder cloned under another name
    "lib_free_u": "sd-webui-freeu",
    "khrfix": "sd-webui-kohya-hiresfix",
    "tile_methods": "multidiffusion-upscaler-for-automatic1111",
    "tilediffusion": "multidiffusion-upscaler-for-automatic1111",
    "motion_module": "sd-webui-animatediff",
    "animatediff": "sd-webui-animatediff",
    "sag": "sd_webui_sag",
    "networks": "lora",
    "lora_patches": "lora",
    "tomesd": "tomesd",
    "hypertile": "hypertile",
}


_WEBUI_OPTIONS = ("hypertile",)
"""The WebUI's own modules (``modules/<stem>.py``) that change the forward: its Settings options,
not the stock forward."""


@dataclass(frozen=True)
class Finding:
    """One change to the stock forward."""

    what: str
    """E.g. ``"module VanillaTemporalModule in input_blocks.1"``, ``"GroupNorm32.forward replaced"``."""
    origin: str
    """Where its code lives: an extension's folder, a package or a module name."""
    known: Known

    @property
    def name(self) -> str:
        return self.known.name


@dataclass(frozen=True)
class ForwardCheck:
    """The changes to one pass's forward (none: the stock forward)."""

    findings: tuple[Finding, ...] = ()

    @property
    def per_sample(self) -> bool:
        return all(f.known.per_sample for f in self.findings)

    @property
    def modelled(self) -> bool:
        return all(f.known.modelled for f in self.findings)

    @property
    def names(self) -> tuple[str, ...]:
        """The extensions behind the findings the estimate does not model, in order, once each."""
        return tuple(dict.fromkeys(f.name for f in self.findings if not f.known.modelled))

    def reason(self) -> str:
        """One phrase for the readout and the stop line: who changes the forward, and how."""
        parts = []
        for name in dict.fromkeys(f.name for f in self.findings if not f.known.modelled):
            whats = list(dict.fromkeys(f.what for f in self.findings if f.name == name))
            more = f", {len(whats) - 2} more" if len(whats) > 2 else ""
            parts.append(f"{name} ({', '.join(whats[:2])}{more})")
        return "the UNet's forward is changed by " + "; ".join(parts) if parts else "the stock forward"

    def __add__(self, other: ForwardCheck) -> ForwardCheck:
        return ForwardCheck(tuple(dict.fromkeys(self.findings + other.findings)))


def origin_of(obj: object) -> str:
    """Where the code of a function, method, ``functools.partial`` or class lives: ``"webui"``,
    ``"lib_vram"``, ``"torch"``, ``"model"`` (ldm/sgm), an extension's folder name (lower case),
    a package name or a module name. The file wins over ``__module__``: ``functools.wraps`` copies
    the wrapped function's ``__module__`` onto the wrapper (HyperTile's), not its code. A torch
    decorator (``@torch.no_grad()`` over Tiled Diffusion's forward) is looked through to what it
    decorates (its ``__wrapped__``)."""
    fn = obj
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):
            fn = fn.__func__
        else:
            break
    code = getattr(fn, "__code__", None)
    path = code.co_filename if code is not None else ""
    module = getattr(fn, "__module__", None) or ""
    if not path:
        path = getattr(sys.modules.get(module), "__file__", None) or ""
    origin = _origin(path.replace("\\", "/"), module)
    inner = getattr(fn, "__wrapped__", None)
    if origin == "torch" and inner is not None and inner is not fn:
        return origin_of(inner)
    return origin


def _origin(path: str, module: str) -> str:
    parts = [p for p in path.split("/") if p]
    if "lib_vram" in parts or module.startswith("lib_vram"):
        return "lib_vram"  # (first: VRAM Guard is itself under extensions/ in the WebUI)
    for i, part in enumerate(parts[:-1]):
        if part in ("extensions", "extensions-builtin"):
            return parts[i + 1].lower()
    top = module.split(".", 1)[0]
    if "torch" in parts or top == "torch":
        return "torch"
    if top in ("ldm", "sgm") or "ldm" in parts or "sgm" in parts:
        return "model"
    stem = parts[-1].rsplit(".", 1)[0].lower() if parts else top.lower()
    if top == "modules" or (len(parts) > 1 and parts[-2] == "modules"):
        return stem if stem in _WEBUI_OPTIONS else "webui"
    return top.lower() if top and top not in ("__main__", "builtins") else stem


def known(origin: str) -> Known | None:
    """What VRAM Guard knows of code from ``origin`` (None: nothing: neither per-sample nor
    modelled; torch, ldm/sgm and VRAM Guard's own code are the stock forward, not findings)."""
    key = _ALIASES.get(origin, origin)
    return KNOWN.get(key)


def _unknown(origin: str) -> Known:
    return Known(f"the extension '{origin}'" if origin else "an unknown extension", False, False)


def _stock(origin: str) -> bool:
    return origin in ("torch", "model", "lib_vram", "k_diffusion")


def finding(what: str, obj: object) -> Finding | None:
    """A finding for ``obj`` (code that runs in the forward), None for stock code."""
    origin = origin_of(obj)
    if _stock(origin):
        return None
    k = known(origin)
    if k is not None and k.name == "the WebUI":
        return None
    return Finding(what, origin, k if k is not None else _unknown(origin))


def _hooks(module: torch.nn.Module) -> Iterable[Callable]:
    for attr in ("_forward_pre_hooks", "_forward_hooks"):
        yield from (getattr(module, attr, None) or {}).values()


def _through_ours(module: torch.nn.Module, fn: object) -> object:
    """An instance ``forward`` with VRAM Guard's own wrappers looked through (a patch keeps what it
    wraps as ``previous``): the first foreign callable, or None when only the class's forward is
    under them."""
    for _ in range(8):
        if fn is None or origin_of(fn) != "lib_vram":
            break
        fn = getattr(fn, "previous", None)
    if getattr(fn, "__self__", None) is module and getattr(fn, "__func__", None) is getattr(
        type(module), "forward", None
    ):
        return None
    return fn


def inspect_unet(
    unet: torch.nn.Module, *, allow: Callable[[object, torch.nn.Module | None], bool] | None = None
) -> ForwardCheck:
    """The changes to ``unet``'s forward (see the module docstring): modules whose class is not
    torch's, ldm's or sgm's; class ``forward`` methods from elsewhere; instance ``forward``
    attributes; forward hooks (module and global). ``allow(obj)``: code the caller knows and
    handles itself (ControlNet's hook on the UNet; ``module``: the module it is on, None for a
    class), skipped. VRAM Guard's own hooks and wrappers are stock (an instance ``forward`` of ours
    is looked through to what it wraps)."""
    found: list[Finding] = []
    classes: dict[type, str] = {}

    def add(what: str, obj: object, module: torch.nn.Module | None = None) -> None:
        if allow is not None and allow(obj, module):
            return
        f = finding(what, obj)
        if f is not None:
            found.append(f)

    for name, module in unet.named_modules():
        cls = type(module)
        if cls not in classes:
            classes[cls] = name or "the UNet"
            add(f"module {cls.__name__} in {name or 'the UNet'}", cls)
            fwd = cls.__dict__.get("forward") or getattr(cls, "forward", None)
            if fwd is not None:
                add(f"{cls.__name__}.forward replaced", fwd)
        inst = _through_ours(module, module.__dict__.get("forward"))
        if inst is not None:
            add(f"forward of {name or 'the UNet'} replaced", inst, module)
        for hook in _hooks(module):
            add(f"a hook on {name or 'the UNet'}", hook, module)
    for attr in ("_global_forward_pre_hooks", "_global_forward_hooks"):
        for hook in (getattr(torch.nn.modules.module, attr, None) or {}).values():
            add("a hook on every module", hook)
    return ForwardCheck(tuple(dict.fromkeys(found)))
