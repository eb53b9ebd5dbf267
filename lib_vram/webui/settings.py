"""What a job runs with: the user's options + the preset, resolved at generation time.

Pure (no WebUI import): the adapter passes in the device's total memory and capabilities.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class JobSettings:
    """The effective, resolved settings of one job (what the hooks read)."""

    preset: str
    """The preset name used (``"Auto (8GB)"`` for a resolved Auto, ``"Custom"``)."""
    vae_tiling: str
    """``"Auto"``, ``"Always"`` or ``"Off"``."""
    vae_mode: str
    """Engine mode: ``"auto"`` (untiled when it fits, else exact), ``"exact"`` or ``"fast"``."""
    vae_tile: int | None
    vae_dtype: torch.dtype | None
    """Forced VAE compute dtype; ``None`` keeps the WebUI's."""
    upscale_tiling: bool
    upscale_tile: int | None
    upscale_batch: int | None
    upscale_precision: str
    """``"auto"``, ``"fp16"``, ``"bf16"`` or ``"fp32"`` (the upscale engine resolves ``auto``)."""
    release_at: frozenset[str] = field(default_factory=frozenset)
    offload_unet: bool = True
    """The UNet may leave the card for a VAE pass that does not fit with it there."""
    offload_text_encoders: bool = True
    """The same for the text encoders."""
    guard_sampling: bool = True
    """'Guard sampling': plan each sampling pass, make room, micro-batch, stop early
    (:mod:`lib_vram.webui.sampling`)."""
    sampling_margin_bytes: int = 0
    """Memory a sampling plan keeps free (the preset's safety margin for this card)."""
    stream_unet: bool = True
    """A sampling pass that does not fit even at micro-batch 1 streams the UNet
    (:mod:`lib_vram.webui.stream`) instead of stopping with the named error."""

    def describe(self) -> str:
        dtype = {v: k for k, v in _DTYPES.items()}.get(self.vae_dtype, "host")
        return (
            f"preset {self.preset}; VAE {self.vae_tiling.lower()} {self.vae_mode} "
            f"t{self.vae_tile or 'auto'} {dtype}; upscale {'on' if self.upscale_tiling else 'off'} "
            f"t{self.upscale_tile or 'auto'} b{self.upscale_batch or 'auto'} {self.upscale_precision}; "
            f"release at {sorted(self.release_at) or 'none'}"
        )


def normalise_preset_name(name: str | None) -> str | None:
    """Case-insensitive preset name (``"auto"`` → ``"Auto"``, ``"24gb+"`` → ``"24GB+"``)."""
    if name is None or not str(name).strip():
        return None
    from lib_vram.planning.presets import PRESET_NAMES

    wanted = str(name).strip().lower()
    for candidate in (*PRESET_NAMES, "Custom"):
        if candidate.lower() == wanted:
            return candidate
    raise ValueError(f"`preset` must be one of {[*PRESET_NAMES, 'Custom']}, got {name!r}")


def resolve(
    options: object,
    *,
    total_bytes: int,
    caps: object | None,
    preset_override: str | None = None,
) -> JobSettings:
    """Resolve ``options`` (a :class:`lib_vram.webui.options.VRAMGuardOptions`) against the preset.

    ``preset_override`` (the ``--vram-guard-preset`` flag) wins over the accordion's preset.
    Controls left on Auto/0 follow the preset; explicit controls win.
    """
    from lib_vram.planning.presets import RELEASE_POINTS, resolve_preset

    name = normalise_preset_name(preset_override) or options.preset  # type: ignore[attr-defined]
    preset = resolve_preset(name, total_bytes, caps) if name != "Custom" else None
    label = name if preset is None or not preset.resolved_from else f"{name} ({preset.resolved_from})"

    tiling = options.vae_tiling  # type: ignore[attr-defined]
    if tiling == "Auto" and preset is not None and preset.vae_mode == "off":
        tiling = "Off"
    # Always: the chosen mode on every pass. Auto: the engine's auto mode (untiled when the whole
    # pass fits the free memory, else exact tiles). Off: the hooks call the original forward.
    mode = options.vae_mode if tiling == "Always" else "auto"  # type: ignore[attr-defined]

    vae_dtype = _DTYPES.get(options.precision_vae.lower())  # type: ignore[attr-defined]

    up_precision = options.precision_upscale.lower()  # type: ignore[attr-defined]
    if up_precision == "auto" and preset is not None:
        up_precision = preset.precision_upscale

    release_at = frozenset({"failure"})
    if options.release_between_stages:  # type: ignore[attr-defined]
        release_at = frozenset(preset.release_at if preset is not None else RELEASE_POINTS)

    return JobSettings(
        preset=label,
        vae_tiling=tiling,
        vae_mode=mode,
        vae_tile=options.vae_tile or None,  # type: ignore[attr-defined]
        vae_dtype=vae_dtype,
        upscale_tiling=bool(options.upscale_tiling),  # type: ignore[attr-defined]
        upscale_tile=options.upscale_tile or None,  # type: ignore[attr-defined]
        upscale_batch=options.upscale_batch or None,  # type: ignore[attr-defined]
        upscale_precision=up_precision,
        release_at=release_at,
        offload_unet=preset.offload_unet_during_vae if preset is not None else True,
        offload_text_encoders=preset.offload_text_encoder_during_vae if preset is not None else True,
        guard_sampling=bool(getattr(options, "guard_sampling", True)),
        sampling_margin_bytes=preset.safety_margin(total_bytes) if preset is not None else 0,
    )
