"""A ControlNet in cldm's layout (what sd-webui-controlnet loads for SD1.5/SDXL control models),
made of a real ldm ``UNetModel``'s encoder, for the tests.

cldm's ``ControlNet`` is the UNet's down path and middle block (``time_embed``, ``input_blocks``,
``middle_block``: here the real ldm modules of a UNet built at reduced width, with their own
copies of the weights), a zero convolution after each input block (``zero_convs``) and after the
middle (``middle_block_out``), and a hint block (``input_hint_block``: 3x3 convolutions with SiLU
that take the control image down 8x). sd-webui-controlnet wraps it as ``PlugableControlModel``
(``.control_model``); its hook calls ``control_model(x=, hint=, timesteps=, context=)`` and adds the
13 outputs to the UNet's skips and middle. Not importable from PyPI (the extension is not a
package): this is the layout, written here, with the weights random (not zero: a zero convolution
would make every control a no-op and hide a wrong residual).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lib_vram.sampling._spec import HINT_BLOCK


class ControlNet(nn.Module):
    """cldm's layout over a copy of ``unet``'s encoder (see the module docstring)."""

    def __init__(self, unet: nn.Module, hint_channels: int = 3, seed: int = 7) -> None:
        from ldm.modules.diffusionmodules.openaimodel import TimestepEmbedSequential

        super().__init__()
        torch.manual_seed(seed)
        self.in_channels = unet.in_channels
        self.model_channels = unet.model_channels
        self.channel_mult = unet.channel_mult
        self.num_res_blocks = unet.num_res_blocks
        self.dtype = next(unet.parameters()).dtype
        self.time_embed = copy.deepcopy(unet.time_embed)
        self.input_blocks = copy.deepcopy(unet.input_blocks)
        self.middle_block = copy.deepcopy(unet.middle_block)
        chans = [_out_channels(b) for b in self.input_blocks]
        self.zero_convs = nn.ModuleList(TimestepEmbedSequential(nn.Conv2d(c, c, 1)) for c in chans)
        mid = _out_channels(self.middle_block)
        self.middle_block_out = TimestepEmbedSequential(nn.Conv2d(mid, mid, 1))
        layers: list[nn.Module] = []
        cin = hint_channels
        for cout, stride in HINT_BLOCK:
            layers += [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.SiLU()]
            cin = cout
        layers.append(nn.Conv2d(cin, self.model_channels, 3, padding=1))
        self.input_hint_block = TimestepEmbedSequential(*layers)
        for p in (*self.zero_convs.parameters(), *self.middle_block_out.parameters()):
            nn.init.normal_(p, std=0.05)
        self.eval()

    def forward(self, x, hint, timesteps, context, y=None, **kwargs):
        from ldm.modules.diffusionmodules.util import timestep_embedding

        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels, repeat_only=False))
        guided = self.input_hint_block(hint, emb, context)
        outs = []
        h = x
        for module, zero_conv in zip(self.input_blocks, self.zero_convs):
            h = module(h, emb, context)
            if guided is not None:
                h += guided
                guided = None
            outs.append(zero_conv(h, emb, context))
        h = self.middle_block(h, emb, context)
        outs.append(self.middle_block_out(h, emb, context))
        return outs


class PlugableControlModel(nn.Module):
    """sd-webui-controlnet's wrapper: ``.control_model``; ``fullvram()`` moves it to the device."""

    def __init__(self, control_model: ControlNet, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.control_model = control_model
        self.device = torch.device(device)

    def forward(self, *args, **kwargs):
        return self.control_model(*args, **kwargs)

    def fullvram(self) -> None:
        self.to(self.device)


def _out_channels(block: nn.Module) -> int:
    last = None
    for m in block.modules():
        if isinstance(m, nn.Conv2d):
            last = m.out_channels
    assert last is not None
    return last


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
            total = None
            for param in outer.control_params:
                if param.disabled_by_hr_option(outer.hires):
                    continue
                control = param.control_model(x=x, hint=param.hint_cond, timesteps=timesteps, context=context)
                control = [c * param.weight for c in control]
                total = control if total is None else [c + t for c, t in zip(control, total)]
            try:
                return _unet_with_residuals(model, x, timesteps, context, total)
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


def _unet_with_residuals(unet, x, timesteps, context, residuals):
    """The ldm UNet's forward with ControlNet's residuals added to the skips and the middle (what
    ControlNet's hooked forward computes; ``residuals`` None: the UNet's own forward)."""
    from ldm.modules.diffusionmodules.util import timestep_embedding

    if residuals is None:
        return unet._original_forward(x, timesteps=timesteps, context=context)
    res = list(residuals)
    emb = unet.time_embed(timestep_embedding(timesteps, unet.model_channels, repeat_only=False))
    hs, h = [], x
    for module in unet.input_blocks:
        h = module(h, emb, context)
        hs.append(h)
    h = unet.middle_block(h, emb, context) + res.pop()
    for module in unet.output_blocks:
        h = torch.cat([h, hs.pop() + res.pop()], dim=1)
        h = module(h, emb, context)
    return unet.out(h)
