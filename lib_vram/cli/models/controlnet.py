"""A ControlNet in cldm's layout over a real ldm UNet's encoder, and the forward ControlNet's hook runs
(``bench sampling``'s ControlNet cases and the tests).

cldm's ``ControlNet`` (what sd-webui-controlnet loads) is the UNet's down path and middle block with
its own weights, a zero convolution after each input block and after the middle, and a hint block
that takes the control image down 8x (:data:`HINT_BLOCK`); this project's own code. Its zero
convolutions get random weights (a zero convolution would hide a wrong residual).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lib_vram.cli.hostmodels import ldm
from lib_vram.sampling._spec import HINT_BLOCK


class ControlNet(nn.Module):
    """cldm's layout over a copy of ``unet``'s encoder."""

    def __init__(self, unet: nn.Module, hint_channels: int = 3, seed: int = 7) -> None:
        seq = ldm("modules.diffusionmodules.openaimodel").TimestepEmbedSequential
        super().__init__()
        torch.manual_seed(seed)
        self.in_channels, self.model_channels = unet.in_channels, unet.model_channels
        self.channel_mult, self.num_res_blocks = unet.channel_mult, unet.num_res_blocks
        self.time_embed = copy.deepcopy(unet.time_embed)
        self.input_blocks = copy.deepcopy(unet.input_blocks)
        self.middle_block = copy.deepcopy(unet.middle_block)
        convs = [_out_channels(b) for b in self.input_blocks]
        self.zero_convs = nn.ModuleList(seq(nn.Conv2d(c, c, 1)) for c in convs)
        mid = _out_channels(self.middle_block)
        self.middle_block_out = seq(nn.Conv2d(mid, mid, 1))
        layers: list[nn.Module] = []
        cin = hint_channels
        for cout, stride in HINT_BLOCK:
            layers += [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.SiLU()]
            cin = cout
        self.input_hint_block = seq(*layers, nn.Conv2d(cin, self.model_channels, 3, padding=1))
        for p in (*self.zero_convs.parameters(), *self.middle_block_out.parameters()):
            nn.init.normal_(p, std=0.05)
        self.eval()

    def forward(self, x, hint, timesteps, context, y=None, **kwargs):  # noqa: ANN001, ANN201
        emb = self.time_embed(_embedding(timesteps, self.model_channels))
        guided = self.input_hint_block(hint, emb, context)
        outs, h = [], x
        for module, zero_conv in zip(self.input_blocks, self.zero_convs):
            h = module(h, emb, context)
            if guided is not None:
                h += guided
                guided = None
            outs.append(zero_conv(h, emb, context))
        h = self.middle_block(h, emb, context)
        outs.append(self.middle_block_out(h, emb, context))
        return outs


def _embedding(timesteps, channels: int):  # noqa: ANN001, ANN202
    return ldm("modules.diffusionmodules.util").timestep_embedding(timesteps, channels, repeat_only=False)


def _out_channels(block: nn.Module) -> int:
    return [m.out_channels for m in block.modules() if isinstance(m, nn.Conv2d)][-1]


def controlled(unet, controls, hints, x, timesteps, context, weights=None):  # noqa: ANN001, ANN201
    """The UNet's forward with the residuals of ``controls`` (run on ``hints``), as
    sd-webui-controlnet's hook computes them; ``controls`` empty: the UNet's own forward."""
    total = None
    for i, (control, hint) in enumerate(zip(controls, hints)):
        w = 1.0 if weights is None else weights[i]
        outs = [c * w for c in control(x=x, hint=hint, timesteps=timesteps, context=context)]
        total = outs if total is None else [c + t for c, t in zip(outs, total)]
    forward = unet.__dict__.get("_original_forward", unet.forward)
    if total is None:
        return forward(x, timesteps=timesteps, context=context)
    emb = unet.time_embed(_embedding(timesteps, unet.model_channels))
    hs, h = [], x
    for module in unet.input_blocks:
        h = module(h, emb, context)
        hs.append(h)
    h = unet.middle_block(h, emb, context) + total.pop()
    for module in unet.output_blocks:
        h = module(torch.cat([h, hs.pop() + total.pop()], dim=1), emb, context)
    return unet.out(h)
