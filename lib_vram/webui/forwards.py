"""Which forward a sampling pass runs in the WebUI: the stock UNet, or one another extension changed.

:func:`check_pass` collects the changes :func:`lib_vram.sampling.inspect_unet` finds inside the
UNet, plus those around it that decide what the UNet is called with: the model's ``apply_model``
(Mixture of Diffusers replaces it on the instance), the sampler's denoiser and its inner model
(MultiDiffusion replaces ``inner_model.forward``; AnimateDiff the denoiser's forward), and the
torch namespace the UNet's code concatenates its skips through (``openaimodel.th``: FreeU replaces
its ``cat``). A change around the UNet never makes the UNet's own forward couple its samples, so
it is per-sample there; it only means the estimate does not know the shapes the UNet is called
with. ControlNet's hook is not a finding: :mod:`lib_vram.residency.controlnet` handles it (its
units, and the cases that cannot split); neither is a switched-off HyperTile or FreeU wrapper.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from lib_vram.sampling import ForwardCheck, finding, inspect_unet


def check_pass(p: Any, model: Any, dm: Any, *, controlnet: Any = None) -> ForwardCheck:
    """The changes to the forward of the pass ``p`` runs on ``model``'s UNet ``dm`` (see the module
    docstring). ``controlnet``: ControlNet's hook on ``dm`` when VRAM Guard handles its units."""

    def allow(obj: Any, module: Any = None) -> bool:
        if controlnet is not None and module is dm and getattr(obj, "__self__", dm) is dm:
            return True  # ControlNet's forward_webui on the UNet (its own forward as _original_forward)
        params = getattr(module, "__webui_hypertile_params", None) if module is not None else None
        return params is not None and not getattr(params, "enabled", True)

    check = inspect_unet(dm, allow=allow)
    around = []
    for what, obj in _around(p, model, dm):
        f = finding(what, obj)
        if f is not None:
            around.append(dataclasses.replace(f, known=dataclasses.replace(f.known, per_sample=True)))
    return check + ForwardCheck(tuple(around))


def _around(p: Any, model: Any, dm: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    inst = getattr(model, "__dict__", {}).get("apply_model")
    if inst is not None:
        out.append(("the model's apply_model replaced", inst))
    cfg = getattr(getattr(p, "sampler", None), "model_wrap_cfg", None)
    for what, obj in (
        ("the sampler's denoiser", cfg),
        ("the sampler's model", getattr(cfg, "inner_model", None)),
    ):
        if obj is None:
            continue
        if "forward" in getattr(obj, "__dict__", {}):
            out.append((f"{what} replaced", obj.__dict__["forward"]))
        cls_fwd = getattr(type(obj), "forward", None)
        if cls_fwd is not None:
            out.append((f"{what}'s class forward replaced", cls_fwd))
    th = getattr(sys.modules.get(type(dm).__module__), "th", None)
    cat = getattr(th, "__dict__", {}).get("cat")
    if cat is not None and not _switched_off(cat):
        out.append(("torch.cat of the UNet's skips replaced", cat))
    return out


def _switched_off(fn: Any) -> bool:
    """FreeU's ``cat`` wrapper stays installed while FreeU is off: its state says so."""
    state = sys.modules.get("lib_free_u.global_state")
    instance = getattr(state, "instance", None)
    return instance is not None and getattr(instance, "enable", True) is False and "free_u" in repr(fn)
