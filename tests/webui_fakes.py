"""Host-state fakes for the WebUI adapter tests (the VAE/upscaler modules used with them are real).

``FakeHost`` has the same functions as :mod:`lib_vram.webui.host` but reads plain attributes
instead of the WebUI's ``shared``/``devices``; ``FakeP`` is the few fields of a processing object
the adapter reads; ``fake_sd_model`` is an A1111-shaped model holder around real ldm modules.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from ldm.modules.diffusionmodules.model import Decoder, Encoder
from ldm.modules.diffusionmodules.openaimodel import UNetModel

from lib_vram.webui import host as real_host


def tiny_decoder(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(
        ch=32,
        out_ch=3,
        ch_mult=(1, 2),
        num_res_blocks=1,
        attn_resolutions=[],
        in_channels=3,
        resolution=32,
        z_channels=4,
    ).eval()


def tiny_encoder(seed: int = 1) -> Encoder:
    torch.manual_seed(seed)
    return Encoder(
        ch=32,
        out_ch=3,
        ch_mult=(1, 2),
        num_res_blocks=1,
        attn_resolutions=[],
        in_channels=3,
        resolution=32,
        z_channels=4,
    ).eval()


def tiny_unet(seed: int = 2, *, fp16_exact: bool = False) -> UNetModel:
    """The WebUI's SD1/SD2 UNet class, tiny (32 channels, one attention level; the cross-attention
    variant needs omegaconf, which the test environment lacks), with random non-zero weights.
    ``fp16_exact`` rounds every weight through FP16, like an FP16-distributed checkpoint."""
    torch.manual_seed(seed)
    unet = UNetModel(
        image_size=8,
        in_channels=4,
        model_channels=32,
        out_channels=4,
        num_res_blocks=1,
        attention_resolutions=[2],
        channel_mult=(1, 2),
        num_head_channels=16,
    ).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in unet.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            if fp16_exact:
                param.copy_(param.half().float())
    return unet


def tiny_xattn_unet(seed: int = 3, *, context_dim: int = 48) -> UNetModel:
    """The WebUI's SD1 UNet class with cross-attention (SpatialTransformers on both levels), tiny:
    32 channels, 2 and 4 heads of 16, a ``context_dim``-wide context. ldm's constructor checks
    whether ``context_dim`` is an omegaconf ``ListConfig``; without omegaconf installed that type
    check gets a stand-in type (nothing of the model comes from it), removed again after."""
    import sys
    import types

    added = []
    if "omegaconf.listconfig" not in sys.modules:
        try:
            import omegaconf.listconfig  # noqa: F401
        except ImportError:
            om, lc = types.ModuleType("omegaconf"), types.ModuleType("omegaconf.listconfig")
            lc.ListConfig = type("ListConfig", (list,), {})
            om.listconfig = lc
            for name, mod in (("omegaconf", om), ("omegaconf.listconfig", lc)):
                if name not in sys.modules:
                    sys.modules[name] = mod
                    added.append(name)
    try:
        torch.manual_seed(seed)
        unet = UNetModel(
            image_size=8,
            in_channels=4,
            model_channels=32,
            out_channels=4,
            num_res_blocks=1,
            attention_resolutions=[1, 2],
            channel_mult=(1, 2),
            num_head_channels=16,
            use_spatial_transformer=True,
            transformer_depth=1,
            context_dim=context_dim,
        ).eval()
    finally:
        for name in added:
            del sys.modules[name]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in unet.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return unet


def fake_sd_model(
    decoder: torch.nn.Module | None = None,
    encoder: torch.nn.Module | None = None,
    unet: torch.nn.Module | None = None,
) -> Any:
    fsm = SimpleNamespace(decoder=decoder or tiny_decoder(), encoder=encoder or tiny_encoder())
    model = SimpleNamespace(first_stage_model=fsm)
    if unet is not None:
        model.model = SimpleNamespace(diffusion_model=unet)
    return model


class FakeState:
    """``shared.state``'s job entry points (host state): ``begin`` starts a job (a new
    ``time_start``, the job token), ``do_set_current_image`` decodes a live preview of
    ``current_latent`` with ``preview_decoder`` and, like the WebUI, swallows its errors."""

    def __init__(self, host: FakeHost) -> None:
        self.host = host
        self.begun = 0
        self.ended = 0
        self.current_latent: Any = None
        self.current_image: Any = None
        self.preview_decoder: Any = None
        self.preview_errors: list[BaseException] = []

    def begin(self, job: str = "(unknown)") -> None:
        self.begun += 1
        self.host.token = float(self.begun)

    def end(self) -> None:
        self.ended += 1

    def do_set_current_image(self) -> None:
        if self.current_latent is None:
            return
        try:
            with torch.no_grad():
                self.current_image = self.preview_decoder(self.current_latent)
        except Exception as exc:  # the WebUI's errors.record_exception(): the preview is skipped
            self.preview_errors.append(exc)


class FakeHost:
    def __init__(self, model: Any = None) -> None:
        self.token: Any = 1.0
        self.state = FakeState(self)
        self.progress = SimpleNamespace(finish_task=lambda id_task: None)
        self.model = model
        self.scalers: list[Any] = []
        self.dtype = torch.float32
        self.comments: list[str] = []
        self.flags: dict[str, Any] = {}
        self.loaded: list[Any] = []
        self.unet = real_host.UNetState(torch.float32, False)  # devices.dtype_unet/unet_needs_upcast
        self.opts: dict[str, Any] = {}

    def job_token(self) -> Any:
        return self.token

    def interrupted(self) -> bool:
        return False

    def cmd_opt(self, name: str, default: Any = None) -> Any:
        return self.flags.get(name, default)

    def device(self) -> torch.device:
        return torch.device("cpu")

    def esrgan_device(self) -> torch.device:
        return torch.device("cpu")

    def sd_model(self) -> Any:
        return self.model

    def loaded_sd_model(self) -> Any:
        return self.model

    def job_entry_points(self) -> dict[str, tuple[Any, str]]:
        return {
            "begin": (self.state, "begin"),
            "end": (self.state, "end"),
            "preview": (self.state, "do_set_current_image"),
            "finish_task": (self.progress, "finish_task"),
        }

    def vae_of(self, model: Any) -> Any:
        return real_host.vae_of(model)  # pure: reads attributes only

    def unet_of(self, model: Any) -> Any:
        return real_host.unet_of(model)  # pure: reads attributes only

    def unet_state(self) -> Any:
        return self.unet

    def set_unet_state(self, state: Any) -> None:
        self.unet = state

    def upcast_attn(self) -> bool:
        return bool(self.opts.get("upcast_attn", False))

    def batch_cond_uncond(self) -> bool:
        return bool(self.opts.get("batch_cond_uncond", True))

    def cross_attention(self) -> str | None:
        return self.opts.get("cross_attention", "")  # ldm's own attention (none applied)

    def live_previews_full(self) -> bool:
        return self.opts.get("show_progress_type") == "Full"

    def upscaler_instances(self) -> list[Any]:
        return list(self.scalers)

    def dtype_vae(self) -> torch.dtype:
        return self.dtype

    def add_comment(self, p: Any, text: str) -> None:
        self.comments.append(text)

    def forge_load_vae(self, vae: Any) -> None:
        self.loaded.append(vae)


class FakeP:
    """The fields of ``StableDiffusionProcessing`` the adapter reads, and ``close()``."""

    def __init__(self, *, enable_hr: bool = False) -> None:
        self.extra_generation_params: dict[str, Any] = {}
        self.enable_hr = enable_hr
        self.is_hr_pass = False
        self.closed = 0
        self.comments: list[str] = []

    def close(self) -> None:
        self.closed += 1

    def comment(self, text: str) -> None:
        self.comments.append(text)
