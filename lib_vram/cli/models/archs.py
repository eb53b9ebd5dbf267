"""Small random-weight models of every spandrel architecture the tiling matrix covers, saved to a
file and loaded back through spandrel as a user's would be. Tiny sizes (the whole matrix runs on a
CPU in seconds); window sizes stay the shipped models' where they shape the tiling.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from .synthetic import compact_net, rrdb_net


def _spandrel(name: str, **kwargs: object) -> Callable[[], torch.nn.Module]:
    """A builder of the spandrel class ``name`` (``Module.Class`` under ``spandrel.architectures``)."""

    def build() -> torch.nn.Module:
        import importlib

        module, _, cls = name.rpartition(".")
        return getattr(importlib.import_module(f"spandrel.architectures.{module}"), cls)(**kwargs)

    build.arch = name.split(".")[0]  # type: ignore[attr-defined]  # the id spandrel loads it as
    return build


# fmt: off
BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "compact-x1": lambda: compact_net(scale=1),
    "compact-x2": lambda: compact_net(scale=2),
    "span": _spandrel("SPAN.SPAN", num_in_ch=3, num_out_ch=3, feature_channels=8, upscale=2),
    "rrdb-x4": lambda: rrdb_net(scale=4),
    "rrdb-x2": lambda: rrdb_net(scale=2),
    "rrdb-x1": lambda: rrdb_net(scale=1),
    "plksr": _spandrel("PLKSR.PLKSR", dim=16, n_blocks=2, upscaling_factor=2, kernel_size=9),
    "safmn": _spandrel("SAFMN.SAFMN", dim=8, n_blocks=1, upscaling_factor=2),
    "swinir": _spandrel("SwinIR.SwinIR", embed_dim=12, depths=[2], num_heads=[2], window_size=8, upscale=2,
        upsampler="pixelshuffle", mlp_ratio=2.0),
    "swin2sr": _spandrel("Swin2SR.Swin2SR", embed_dim=12, depths=[2], num_heads=[2], window_size=8, upscale=2,
        upsampler="pixelshuffle", mlp_ratio=2.0),
    "hat": _spandrel("HAT.HAT", embed_dim=12, depths=(2,), num_heads=(2,), window_size=8, upscale=2,
        num_feat=16, squeeze_factor=4, compress_ratio=3, mlp_ratio=2.0),
    "dat": _spandrel("DAT.DAT", embed_dim=16, split_size=[4, 8], depth=[2], num_heads=[2], upscale=2,
        expansion_factor=2.0),
    "drct": _spandrel("DRCT.DRCT", embed_dim=12, depths=(1,), num_heads=(2,), window_size=8, upscale=2,
        upsampler="pixelshuffle", gc=8),
    "ditn": _spandrel("DITN.arch.DITN_Real.DITN_Real", dim=12, ITL_blocks=1, SAL_blocks=1, UFONE_blocks=1,
        patch_size=8, upscale=2),
    "scunet": _spandrel("SCUNet.SCUNet", config=[1, 1, 1, 1, 1, 1, 1], dim=64),
    "omnisr": _spandrel("OmniSR.OmniSR", num_feat=16, block_num=1, window_size=8, res_num=1, up_scale=2),
    "realcugan": _spandrel("RealCUGAN.UpCunet2x"),
    "realcugan-x4": _spandrel("RealCUGAN.UpCunet4x"),
    "realplksr": _spandrel("PLKSR.RealPLKSR", dim=16, n_blocks=2, upscaling_factor=2, kernel_size=9),
    "atd": _spandrel("ATD.ATD", embed_dim=12, depths=(2,), num_heads=(2,), window_size=8, category_size=32,
        num_tokens=8, reducted_dim=4, convffn_kernel_size=3, mlp_ratio=2.0, upscale=2,
        upsampler="pixelshuffle"),
    "craft": _spandrel("CRAFT.CRAFT", embed_dim=12, depths=[1], num_heads=[2], window_size=16, split_size_0=4,
        split_size_1=16, mlp_ratio=2.0, upscale=2),
    "dctlsa": _spandrel("DCTLSA.DCTLSA", nf=10, num_modules=6, upscale=2, num_head=5),  # spandrel: 6 and 5
    "drunet": _spandrel("DRUNet.DRUNet", in_nc=4, out_nc=3, nc=[8, 8, 8, 8], nb=2),
    "dncnn": _spandrel("DnCNN.DnCNN", in_nc=3, out_nc=3, nc=8, nb=5, act_mode="BR"),
    "fdncnn": _spandrel("DnCNN.DnCNN", in_nc=4, out_nc=3, nc=8, nb=8, act_mode="R", mode="FDnCNN"),
    "fbcnn": _spandrel("FBCNN.FBCNN", nc=[8, 8, 8, 512], nb=2),  # its quality head is fixed at 512 features
    "fftformer": _spandrel("FFTformer.FFTformer", dim=8, num_blocks=[1, 1, 1], num_refinement_blocks=1,
        ffn_expansion_factor=1),
    "grl": _spandrel("GRL.GRL", embed_dim=16, upscale=2, upsampler="pixelshuffle", depths=[1],
        num_heads_window=[1], num_heads_stripe=[1], window_size=8, stripe_size=[8, 8], mlp_ratio=2.0),
    "ipt": _spandrel("IPT.IPT", patch_size=48, n_feats=8, num_heads=1, num_layers=1, scale=[2]),
    "kbnet-s": _spandrel("KBNet.KBNet_s", width=8, middle_blk_num=1, enc_blk_nums=[1], dec_blk_nums=[1]),
    "kbnet-l": _spandrel("KBNet.KBNet_l", dim=24, num_blocks=[1, 1, 1, 1], num_refinement_blocks=1,
        heads=[1, 1, 1, 1]),
    "mmrealsr": _spandrel("MMRealSR.MMRealSR", num_in_ch=3, num_out_ch=3, scale=4, num_feat=8, num_block=1,
        num_grow_ch=8, num_feats=[8, 8, 8, 8], num_blocks=[1, 1, 1, 1]),
    "mixdehazenet": _spandrel("MixDehazeNet.MixDehazeNet", embed_dims=[8, 16, 32, 16, 8],
        depths=[1, 1, 1, 1, 1]),
    "nafnet": _spandrel("NAFNet.NAFNet", width=8, middle_blk_num=1, enc_blk_nums=[1], dec_blk_nums=[1]),
    "rgt": _spandrel("RGT.RGT", embed_dim=12, depth=[1], num_heads=[2], mlp_ratio=2.0, upscale=2,
        split_size=[8, 8]),
    "safmn-bcie": _spandrel("SAFMNBCIE.SAFMN_BCIE", dim=8, n_blocks=1, num_layers=1, upscaling_factor=2),
    "swiftsrgan": _spandrel("SwiftSRGAN.SwiftSRGAN", num_channels=8, num_blocks=1, upscale_factor=2),
    "uformer": _spandrel("Uformer.Uformer", img_size=128, embed_dim=8, depths=[1] * 9, num_heads=[1] * 9,
        win_size=8, mlp_ratio=2.0),
}
# fmt: on
"""Every image-to-image architecture spandrel 0.3.4 registers, built tiny (the first rows: the ones the
tiling matrix started with)."""


REFUSED_BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    # spandrel assumes 512 px, 6 levels and attention at 16 px: narrow channels keep it small
    "restoreformer": _spandrel("RestoreFormer.arch.restoreformer_arch.RestoreFormer", n_embed=16,
                               embed_dim=32, ch=32, ch_mult=(1,) * 6, num_res_blocks=1, z_channels=32,
                               head_size=1),
}  # fmt: skip
"""Architectures spandrel loads that are not image-to-image upscalers (the engine refuses them)."""


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
    return {**BUILDERS, **REFUSED_BUILDERS}[name]().eval()


def save_and_load(net: torch.nn.Module, path, *, new_keys: bool = False):  # noqa: ANN001
    """Save ``net``'s weights as safetensors and load them back through spandrel's ModelLoader."""
    import spandrel

    save(net, path, new_keys=new_keys)
    return spandrel.ModelLoader().load_from_file(str(path))


def save(net: torch.nn.Module, path, *, new_keys: bool = False) -> None:  # noqa: ANN001
    """``net``'s weights as a safetensors file (``new_keys``: an ESRGAN's in the BasicSR key format)."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    save_file(dict(new_esrgan_keys(state)) if new_keys else state, str(path))
