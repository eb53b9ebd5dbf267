"""Small random-weight models of every spandrel architecture the tiling matrix covers.

Each builder returns an ``nn.Module`` whose state dict spandrel recognises (saved to a file and
loaded back through ``spandrel.ModelLoader``, as a user's file would be). Sizes are tiny so that the
whole matrix runs on a CPU in seconds; window sizes stay those of the shipped models where they
shape the tiling (8 for SwinIR/HAT/Swin2SR/OmniSR, 64 for SCUNet's fixed grid).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch


def _rrdb(scale: int, blocks: int = 1, filters: int = 8) -> torch.nn.Module:
    from ._synthetic import make_imagelike_rrdb, rrdb_class

    net = rrdb_class()(in_nc=3, out_nc=3, num_filters=filters, num_blocks=blocks, scale=scale)
    return make_imagelike_rrdb(net) if scale == 4 else net


def _compact(scale: int) -> torch.nn.Module:
    from ._synthetic import compact_class, make_imagelike_compact

    net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=8, num_conv=4, upscale=scale)
    return make_imagelike_compact(net)


def _swinir() -> torch.nn.Module:
    from spandrel.architectures.SwinIR import SwinIR

    return SwinIR(
        embed_dim=12,
        depths=[2],
        num_heads=[2],
        window_size=8,
        upscale=2,
        upsampler="pixelshuffle",
        mlp_ratio=2.0,
    )


def _hat() -> torch.nn.Module:
    from spandrel.architectures.HAT import HAT

    return HAT(
        embed_dim=12,
        depths=(2,),
        num_heads=(2,),
        window_size=8,
        upscale=2,
        num_feat=16,
        squeeze_factor=4,
        compress_ratio=3,
        mlp_ratio=2.0,
    )


def _swin2sr() -> torch.nn.Module:
    from spandrel.architectures.Swin2SR import Swin2SR

    return Swin2SR(
        embed_dim=12,
        depths=[2],
        num_heads=[2],
        window_size=8,
        upscale=2,
        upsampler="pixelshuffle",
        mlp_ratio=2.0,
    )


def _dat() -> torch.nn.Module:
    from spandrel.architectures.DAT import DAT

    return DAT(embed_dim=16, split_size=[4, 8], depth=[2], num_heads=[2], upscale=2, expansion_factor=2.0)


def _omnisr() -> torch.nn.Module:
    from spandrel.architectures.OmniSR import OmniSR

    return OmniSR(num_feat=16, block_num=1, window_size=8, res_num=1, up_scale=2)


def _realcugan() -> torch.nn.Module:
    from spandrel.architectures.RealCUGAN import UpCunet2x

    return UpCunet2x()


def _scunet() -> torch.nn.Module:
    from spandrel.architectures.SCUNet import SCUNet

    return SCUNet(config=[1, 1, 1, 1, 1, 1, 1], dim=64)


def _span() -> torch.nn.Module:
    from spandrel.architectures.SPAN import SPAN

    return SPAN(num_in_ch=3, num_out_ch=3, feature_channels=8, upscale=2)


def _plksr() -> torch.nn.Module:
    from spandrel.architectures.PLKSR import PLKSR

    return PLKSR(dim=16, n_blocks=2, upscaling_factor=2, kernel_size=9)


def _safmn() -> torch.nn.Module:
    from spandrel.architectures.SAFMN import SAFMN

    return SAFMN(dim=8, n_blocks=1, upscaling_factor=2)


def _ditn() -> torch.nn.Module:
    from spandrel.architectures.DITN.arch.DITN_Real import DITN_Real

    return DITN_Real(dim=12, ITL_blocks=1, SAL_blocks=1, UFONE_blocks=1, patch_size=8, upscale=2)


def _drct() -> torch.nn.Module:
    from spandrel.architectures.DRCT import DRCT

    return DRCT(
        embed_dim=12, depths=(1,), num_heads=(2,), window_size=8, upscale=2, upsampler="pixelshuffle", gc=8
    )


BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "compact-x1": lambda: _compact(1),
    "compact-x2": lambda: _compact(2),
    "span": _span,
    "rrdb-x4": lambda: _rrdb(4),
    "rrdb-x2": lambda: _rrdb(2),
    "rrdb-x1": lambda: _rrdb(1),
    "plksr": _plksr,
    "safmn": _safmn,
    "swinir": _swinir,
    "swin2sr": _swin2sr,
    "hat": _hat,
    "dat": _dat,
    "drct": _drct,
    "ditn": _ditn,
    "scunet": _scunet,
    "omnisr": _omnisr,
    "realcugan": _realcugan,
}


def new_esrgan_keys(state: dict[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    """An old-format ESRGAN state dict (``model.N...``) in the BasicSR/Real-ESRGAN key format
    (``conv_first``, ``body.N.rdbM.convK``, ``conv_body``, ``conv_upN``, ``conv_hr``, ``conv_last``)."""
    import re

    ups = sorted({int(m.group(1)) for k in state if (m := re.match(r"model\.(\d+)\.weight", k))})
    last, hr = ups[-1], ups[-2]
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for k, v in state.items():
        m = re.match(r"model\.1\.sub\.(\d+)\.RDB(\d)\.conv(\d)\.0\.(weight|bias)", k)
        if m:
            out[f"body.{m.group(1)}.rdb{m.group(2)}.conv{m.group(3)}.{m.group(4)}"] = v
            continue
        m = re.match(r"model\.1\.sub\.(\d+)\.(weight|bias)", k)
        if m:
            out[f"conv_body.{m.group(2)}"] = v
            continue
        m = re.match(r"model\.(\d+)\.(weight|bias)", k)
        assert m is not None, k
        n, kind = int(m.group(1)), m.group(2)
        name = {0: "conv_first", hr: "conv_hr", last: "conv_last"}.get(n) or f"conv_up{n // 3}"
        out[f"{name}.{kind}"] = v
    return out


def build(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[name]().eval()


def save_and_load(net: torch.nn.Module, path, *, new_keys: bool = False):  # noqa: ANN001
    """Save ``net``'s weights as safetensors and load them back through spandrel's ModelLoader."""
    import spandrel
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    if new_keys:
        state = dict(new_esrgan_keys(state))
    save_file(state, str(path))
    return spandrel.ModelLoader().load_from_file(str(path))
