"""sd-webui-controlnet's objects as far as VRAM Guard reads them, for the tests.

The control model is :class:`lib_vram.cli.models.controlnet.ControlNet` (cldm's layout over a real
ldm UNet's encoder, random weights); sd-webui-controlnet wraps it as ``PlugableControlModel``
(``.control_model``), keeps each unit's ``ControlParams`` and hooks the UNet with ``UnetHook``;
its script is found in ``p.scripts.alwayson_scripts`` by its ``latest_network``. The extension is
not a package (not importable here): these classes hold what its v1.1.455 objects hold.
"""

from __future__ import annotations

import torch
from torch import nn

from lib_vram.cli.models.controlnet import ControlNet, controlled

__all__ = ["ControlNet", "ControlNetScript", "ControlParams", "PlugableControlModel", "Runner", "UnetHook"]


class PlugableControlModel(nn.Module):
    """sd-webui-controlnet's wrapper: ``.control_model``; ``fullvram()`` moves it to the device."""

    def __init__(self, control_model: ControlNet, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.control_model = control_model
        self.device = torch.device(device)

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.control_model(*args, **kwargs)

    def fullvram(self) -> None:
        self.to(self.device)


class ControlParams:
    """The fields of sd-webui-controlnet's ``ControlParams`` that VRAM Guard reads."""

    LOW_RES_ONLY, HIGH_RES_ONLY, BOTH = "low", "high", "both"

    def __init__(self, control_model: nn.Module, hint: torch.Tensor, *, hr_option: str = "both") -> None:
        self.control_model = control_model
        self.hint_cond = hint
        self.hr_option = hr_option
        self.weight = 1.0

    def disabled_by_hr_option(self, is_in_high_res_fix: bool) -> bool:
        if self.hr_option == self.LOW_RES_ONLY:
            return is_in_high_res_fix
        if self.hr_option == self.HIGH_RES_ONLY:
            return not is_in_high_res_fix
        return False


class UnetHook:
    """What sd-webui-controlnet's ``UnetHook`` does to the UNet, as far as memory and placement go
    (its ``scripts/hook.py``, v1.1.455): ``hook()`` replaces the UNet's ``forward`` (keeping
    ``_original_forward``); at each forward every unit's model goes to the device (``fullvram()``,
    skipped for a model with ``disable_memory_management``), each unit not switched off for the
    pass computes its residuals on the whole batch (scaled by its weight, summed over the units),
    the UNet runs with them added to its skips and middle, and with Low VRAM every model goes back
    to the CPU after the forward. ``restore()`` undoes the hook. ``moves`` counts the ``to`` calls
    that reached a model (what VRAM Guard holds for a pass)."""

    def __init__(self, lowvram: bool = False, device: torch.device | str = "cpu") -> None:
        self.lowvram = lowvram
        self.device = torch.device(device)
        self.model: nn.Module | None = None
        self.control_params: list[ControlParams] | None = None
        self.hires = False
        self.calls = 0

    def hook(self, model: nn.Module, control_params: list[ControlParams]) -> None:
        self.model, self.control_params = model, control_params
        model._original_forward = model.forward
        outer = self

        def forward(x, timesteps=None, context=None, **kwargs):
            outer.calls += 1
            for param in outer.control_params:
                if not getattr(param.control_model, "disable_memory_management", False):
                    param.control_model.fullvram()
            used = [p for p in outer.control_params if not p.disabled_by_hr_option(outer.hires)]
            controls, hints = [p.control_model for p in used], [p.hint_cond for p in used]
            try:
                return controlled(model, controls, hints, x, timesteps, context, [p.weight for p in used])
            finally:
                if outer.lowvram:
                    for param in outer.control_params:
                        param.control_model.to("cpu")

        model.forward = forward

    def restore(self) -> None:
        if self.model is not None and "_original_forward" in self.model.__dict__:
            del self.model.forward
            del self.model._original_forward
        self.control_params = None


class ControlNetScript:
    """The ControlNet script as ``p.scripts.alwayson_scripts`` holds it (its ``latest_network``)."""

    def __init__(self, net: UnetHook | None = None) -> None:
        self.latest_network = net


class Runner:
    def __init__(self, *scripts: object) -> None:
        self.alwayson_scripts = list(scripts)
