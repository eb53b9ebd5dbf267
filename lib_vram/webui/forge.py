"""Forge: route its VAE through VRAM Guard with the ``model_options`` wrappers (host-api §10.1).

On Forge ``sd_model.first_stage_model`` is ``None``; the VAE is ``sd_model.forge_objects.vae`` and
its ``decode(samples)`` / ``encode(pixels)`` call ``patcher.model_options["model_vae_decode_wrapper"]``
(``wrapper(decode_inner, samples)``) and ``"model_vae_encode_wrapper"`` when set. The VAE object is
shared by every ``forge_objects`` copy, so a slot we set persists across runs: it lives in the
job's ``ExitStack`` like every other patch. A wrapper another extension set before us is kept and
still wraps the call; one set after us survives our removal (ours becomes a pass-through).

Contract of the slots (Forge ``backend/patcher/vae.py``): decode takes latents B,C,h,w (already
divided by the scaling factor) and returns pixels **B,H,W,C in [0, 1] on ``vae.output_device``**;
encode takes pixels B,H,W,C in [0, 1] and returns sampled latents B,C,h,w on ``output_device``.
Forge's inner VAE (``IntegratedAutoencoderKL``) has the ldm layout (``decoder``/``encoder`` with
``conv_in``, ``mid``, ``up``/``down``), ``post_quant_conv``/``quant_conv`` (may be ``None``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .patching import patch_slot

logger = logging.getLogger(__name__)

DECODE_SLOT = "model_vae_decode_wrapper"
ENCODE_SLOT = "model_vae_encode_wrapper"
REGULATION_SLOT = "model_vae_regulation"


def _plain(inner: Callable[[Any], Any], x: Any) -> Any:
    return inner(x)


def install(job: Any, vae: Any, *, load_vae: Callable[[Any], None] | None = None) -> bool:
    """Put our decode/encode wrappers into ``vae.patcher.model_options`` until ``job`` closes.

    ``load_vae(vae)`` moves the VAE onto its device the way Forge's own ``decode_inner`` does
    (default: ``backend.memory_management.load_model_gpu(vae.patcher)``).
    """
    installed = job.__dict__.setdefault("_forge_vaes", [])
    if any(v is vae for v in installed):
        return True
    options = vae.patcher.model_options
    if load_vae is None:
        from . import host

        load_vae = host.forge_load_vae

    def decode(previous: Callable[..., Any], inner: Callable[[Any], Any], samples: torch.Tensor) -> Any:
        if not job.current() or not _vae_is_ours(job):
            return previous(inner, samples)
        return previous(lambda s: _decode(vae, load_vae, s), samples)

    def encode(previous: Callable[..., Any], inner: Callable[[Any], Any], pixels: torch.Tensor) -> Any:
        if (
            not job.current()
            or not _vae_is_ours(job)
            or vae.patcher.model_options.get(REGULATION_SLOT) is not None
        ):
            return previous(inner, pixels)
        return previous(lambda x: _encode(vae, load_vae, x), pixels)

    patch_slot(options, DECODE_SLOT, decode, job.stack, default=_plain)
    patch_slot(options, ENCODE_SLOT, encode, job.stack, default=_plain)
    installed.append(vae)
    return True


def _vae_is_ours(job: Any) -> bool:
    """Whether the job's settings change the VAE passes at all (tiling not Off, or a forced dtype).

    When they do not, Forge's own ``decode_inner``/``encode_inner`` run unchanged: its memory
    manager, its out-of-memory fallback to tiled decoding and "Never OOM"'s always-tiled VAE stay
    the user's (our decoder/encoder hooks still see the passes, untiled, for the readout)."""
    return job.settings.vae_tiling != "Off" or job.settings.vae_dtype is not None


def _decode(vae: Any, load_vae: Callable[[Any], None], samples: torch.Tensor) -> torch.Tensor:
    load_vae(vae)
    fsm = vae.first_stage_model
    outs = []
    for i in range(samples.shape[0]):
        z = samples[i : i + 1].to(device=vae.device, dtype=vae.vae_dtype)
        if getattr(fsm, "post_quant_conv", None) is not None:
            z = fsm.post_quant_conv(z)
        x = fsm.decoder(z)  # our hook on the decoder (installed by the job) does the tiling
        outs.append(torch.clamp((x.to(vae.output_device).float() + 1.0) / 2.0, min=0.0, max=1.0))
    return torch.cat(outs).movedim(1, -1)


def _encode(vae: Any, load_vae: Callable[[Any], None], pixels: torch.Tensor) -> torch.Tensor:
    load_vae(vae)
    fsm = vae.first_stage_model
    x_all = pixels.movedim(-1, 1)
    means, stds = [], []
    for i in range(x_all.shape[0]):
        x = (2.0 * x_all[i : i + 1] - 1.0).to(device=vae.device, dtype=vae.vae_dtype)
        h = fsm.encoder(x)  # our hook on the encoder (installed by the job) does the tiling
        if getattr(fsm, "quant_conv", None) is not None:
            h = fsm.quant_conv(h)
        mean, logvar = torch.chunk(h, 2, dim=1)
        means.append(mean)
        stds.append(torch.exp(0.5 * torch.clamp(logvar, -30.0, 20.0)))
    mean, std = torch.cat(means), torch.cat(stds)
    # The posterior sample as Forge draws it (``DiagonalGaussianDistribution.sample``): one float32
    # draw for the whole batch from the CPU generator, moved to the device; the sum is float32.
    # Drawing on the device or in the VAE's dtype would give other noise than Forge's own encode.
    z = mean + std * torch.randn(mean.shape).to(device=mean.device)
    return z.to(vae.output_device).float()
