"""The host's VAE and UNet classes for benchmarks, profiling and tests: the one place that imports
ldm (the WebUI's Stable Diffusion code; its prints silenced), and diffusers' VAE in the same layout."""

from __future__ import annotations

import contextlib
import importlib
import io
from types import ModuleType

from lib_vram.cli.common import UsageError

# v1-inference.yaml's first_stage_config ddconfig (the SD VAE; other widths: ``{**SD_VAE, "ch": n}``)
SD_VAE = {"ch": 128, "out_ch": 3, "ch_mult": (1, 2, 4, 4), "num_res_blocks": 2, "attn_resolutions": [],
          "in_channels": 3, "resolution": 256, "z_channels": 4}  # fmt: skip


def quiet() -> contextlib.AbstractContextManager:
    return contextlib.redirect_stdout(io.StringIO())


def ldm(module: str, who: str = "this", alternative: str = "") -> ModuleType:
    """``ldm.<module>``; without ldm: :class:`UsageError` in one line (``alternative``: what else works)."""
    try:
        with quiet():
            return importlib.import_module(f"ldm.{module}")
    except ImportError as exc:
        raise UsageError(
            f"{who} needs the ldm package (the WebUI's; stable-diffusion-sdkit){alternative} ({exc})"
        ) from None


def build_ldm(kind: str, cfg: dict | None = None, seed: int | None = 0, **needs: str):
    """An ldm ``Decoder`` (``kind`` ``"decoder"``/``"decode"``) or ``Encoder`` of ``cfg`` (default
    :data:`SD_VAE`), random weights from ``seed`` (None: the current generator), eval mode
    (``needs``: :func:`ldm`'s message)."""
    import torch

    model = ldm("modules.diffusionmodules.model", **needs)
    with quiet():
        if seed is not None:
            torch.manual_seed(seed)
        return (model.Decoder if kind.startswith("dec") else model.Encoder)(**(cfg or SD_VAE)).eval()


def diffusers_vae(cfg: dict | None = None):
    """diffusers' ``AutoencoderKL`` in the layout of the ldm ``cfg`` (default :data:`SD_VAE`), random
    weights from the current generator, eval mode; no quant convolutions (ldm's halves have none)."""
    from diffusers import AutoencoderKL

    cfg = cfg or SD_VAE
    levels = len(cfg["ch_mult"])
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels,
        block_out_channels=[cfg["ch"] * m for m in cfg["ch_mult"]],
        layers_per_block=cfg["num_res_blocks"],
        latent_channels=cfg["z_channels"],
        norm_num_groups=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


def sdp_attn_forward(block):
    """The ldm AttnBlock computed with SDPA (what the WebUI's --opt-sdp-attention installs)."""
    import torch

    def forward(x):
        h = block.norm(x)
        q, k, v = block.q(h), block.k(h), block.v(h)
        b, c, hh, ww = q.shape
        # contiguous, as the WebUI's sdp_attnblock_forward makes them: a transposed view sends the
        # CPU (and CUDA flash) SDPA to the math path, which holds the N x N matrix
        q, k, v = (t.flatten(2).transpose(1, 2).contiguous().unsqueeze(1) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + block.proj_out(o.squeeze(1).transpose(1, 2).reshape(b, c, hh, ww))

    return forward


def diffusers_from_ldm(dec, enc):
    """diffusers' ``AutoencoderKL`` holding the weights of the ldm ``dec`` and ``enc`` (:data:`SD_VAE`)."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    sd = {f"decoder.{k}": v for k, v in dec.state_dict().items()}
    sd.update({f"encoder.{k}": v for k, v in enc.state_dict().items()})
    vae = diffusers_vae()
    missing, unexpected = vae.load_state_dict(convert_ldm_vae_checkpoint(sd, vae.config), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weight conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return vae
