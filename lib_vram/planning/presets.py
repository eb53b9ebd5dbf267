"""Memory presets: one table of data, one place.

A preset bundles the memory-related choices VRAM Guard makes for one class of card (the table and
why each value: docs/how-it-works.md, "Memory presets"). **Auto** is resolved by
:func:`resolve_preset` from the device the job runs on, at generation time, never copied into other
options (the Settings page would write the old values back, ``host-api.md`` §7.1). Tile sizes and
batches are not in a preset: the engines choose them from the stage's budget.

Pure data + pure functions (no torch, no WebUI), so the UI and the settings page import it cheaply.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from .tiers import GiB, tier_for_total, tier_label

MiB = 1024**2

VAE_MODES: tuple[str, ...] = ("auto", "exact", "fast", "off")
"""``auto``: the engine/planner decides (untiled when it fits, else exact tiling, fast when even the
exact mode's state does not fit); ``exact``: tiled with global GroupNorm statistics (matches untiled);
``fast``: one pass with estimated statistics; ``off``: never tile the VAE."""

PRECISIONS: tuple[str, ...] = ("auto", "fp16", "bf16", "fp32")
"""``auto`` resolves per device (:func:`resolve_precision`): bf16 where supported, else fp16 (both
with the engines' non-finite guard), fp32 on the CPU."""


PRESET_NAMES: tuple[str, ...] = ("Auto", "4GB", "6GB", "8GB", "12GB", "16GB", "24GB+")
"""Every preset name, in the order a UI shows them."""

AUTO = "Auto"


RELEASE_POINTS: tuple[str, ...] = (
    "process",
    "before_hr",
    "post_sample",
    "postprocess_batch",
    "job_end",
    "failure",
)
"""Stage boundaries where a preset may run ``gc.collect()`` + cache release:

* ``process`` - job start, before the text encoder and UNet run (drops leftovers of the last job);
* ``before_hr`` - between the first pass and hires fix (the first-pass decode/upscale leftovers);
* ``post_sample`` - after sampling, before the VAE decode (the sampler's activations);
* ``postprocess_batch`` - after each batch's images are decoded;
* ``job_end`` - after the job;
* ``failure`` - when a stage raises or the job is interrupted (always recommended: the traceback's
  frames keep tensors alive until collected).
"""


@dataclass(frozen=True)
class Preset:
    """The memory settings of one card class (every field is explained in docs/how-it-works.md,
    "Memory presets")."""

    name: str
    """Preset name (one of :data:`PRESET_NAMES`; ``"Auto"`` after resolution keeps ``resolved_from``)."""
    tier_gb: int | None
    """Nominal card size in GB this preset is for (``None`` only for the unresolved Auto entry)."""
    vae_mode: str
    """VAE tiling mode, one of :data:`VAE_MODES`."""
    precision_vae: str
    """VAE precision, one of :data:`PRECISIONS`."""
    precision_upscale: str
    """Upscaler precision, one of :data:`PRECISIONS`."""
    release_at: frozenset[str]
    """Stage boundaries (subset of :data:`RELEASE_POINTS`) where memory is released."""
    offload_unet_during_vae: bool
    """The UNet may go to the CPU for a VAE pass whose plan does not fit with it on the card (or
    that ran out of memory there), and comes back right after the pass (:mod:`lib_vram.residency`;
    never when the host swaps models itself, ``--medvram``/``--lowvram``, or on Forge)."""
    offload_text_encoder_during_vae: bool
    """The same for the text encoder(s)."""
    safety_margin_bytes: int
    """Memory kept free beyond every predicted peak: the larger of this and
    ``safety_margin_fraction`` of the device's total memory (see :meth:`safety_margin`)."""
    safety_margin_fraction: float
    """Fraction of the device's total memory kept free beyond every predicted peak."""
    allocator: Mapping[str, object] = field(hash=False)
    """CUDA caching-allocator settings (``PYTORCH_CUDA_ALLOC_CONF`` keys):
    ``garbage_collection_threshold`` (0-1 or ``None``) and ``expandable_segments`` (bool). They only
    take effect when set before CUDA initialises (see :func:`allocator_conf`)."""
    resolved_from: str | None = None
    """For a resolved Auto preset: the tier preset it was resolved to (e.g. ``"8GB"``)."""

    def safety_margin(self, total_bytes: int) -> int:
        """The safety margin in bytes on a device with ``total_bytes`` of memory."""
        if total_bytes < 0:
            raise ValueError(f"`total_bytes` must be >= 0, got {total_bytes}")
        return max(self.safety_margin_bytes, int(self.safety_margin_fraction * total_bytes))

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["release_at"] = sorted(self.release_at, key=RELEASE_POINTS.index)
        out["allocator"] = dict(self.allocator)
        return out


_ALL_RELEASES = frozenset(RELEASE_POINTS)
_TIGHT_RELEASES = frozenset({"before_hr", "post_sample", "job_end", "failure"})
_LIGHT_RELEASES = frozenset({"post_sample", "job_end", "failure"})
_MINIMAL_RELEASES = frozenset({"job_end", "failure"})


# The table, one row per tier; the reason for each value is in docs/how-it-works.md's "Memory
# presets" table (the idle UNet/text encoders leave the card only for a VAE pass that does not fit
# with them: SDXL's 5 GB UNet does not fit beside the VAE on 6 GB, nor beside a 6144² decode's
# 2.9 GiB whole-latent stage on 8 GB).
_TIERS = (
    # name, GB, release at, safety margin, margin fraction, allocator GC threshold, VAE precision
    # 4GB: release at every boundary (~ms per gc.collect, small next to an OOM); 256 MiB covers the
    # CUDA context's growth, cuDNN workspaces and the display; reclaim cached blocks early (60 %)
    ("4GB", 4, _ALL_RELEASES, 256 * MiB, 0.06, 0.6, "auto"),
    ("6GB", 6, _ALL_RELEASES, 320 * MiB, 0.05, 0.6, "auto"),
    # 8GB: postprocess_batch and process releases matter little once the VAE is tiled
    ("8GB", 8, _TIGHT_RELEASES, 384 * MiB, 0.05, 0.7, "auto"),
    ("12GB", 12, _LIGHT_RELEASES, 512 * MiB, 0.05, 0.8, "auto"),
    ("16GB", 16, _LIGHT_RELEASES, 640 * MiB, 0.05, 0.8, "auto"),
    # 24GB+: plenty of memory: let the allocator cache freely (no early GC threshold)
    ("24GB+", 24, _MINIMAL_RELEASES, 1 * GiB, 0.04, None, "fp32"),
)
PRESETS: Mapping[str, Preset] = types.MappingProxyType(
    {
        name: Preset(
            name=name,
            tier_gb=gb,
            vae_mode="auto",
            precision_vae=precision_vae,
            precision_upscale="auto",
            release_at=release_at,
            offload_unet_during_vae=True,
            offload_text_encoder_during_vae=True,
            safety_margin_bytes=margin,
            safety_margin_fraction=fraction,
            allocator=types.MappingProxyType(
                {"garbage_collection_threshold": gc, "expandable_segments": True}
            ),
        )
        for name, gb, release_at, margin, fraction, gc, precision_vae in _TIERS
    }
)
"""The tier presets by name (Auto is resolved by :func:`resolve_preset`, not stored)."""


def tier_preset_name(total_bytes: int) -> str:
    """The tier preset for a device with ``total_bytes`` of memory (``"8GB"``, ``"24GB+"``)."""
    return tier_label(tier_for_total(total_bytes))


def resolve_precision(policy: str, caps: object | None) -> str:
    """A concrete precision (``"fp16"``, ``"bf16"``, ``"fp32"``) for ``policy`` on a device.

    ``caps`` is anything with ``backend``, ``fp16`` and ``bf16`` attributes (e.g.
    :class:`lib_vram.core.device.Capabilities`) or ``None`` (assume a CUDA device with fp16 only).
    ``auto`` prefers bf16 (same range as fp32, so no VAE overflow), then fp16, and picks fp32 on the
    CPU, where half-precision kernels are slower than fp32. An explicit policy the device cannot run
    raises.
    """
    if policy not in PRECISIONS:
        raise ValueError(f"`policy` must be one of {PRECISIONS}, got {policy!r}")
    backend = getattr(caps, "backend", "cuda")
    fp16 = bool(getattr(caps, "fp16", True))
    bf16 = bool(getattr(caps, "bf16", False))
    if policy == "auto":
        return "fp32" if backend == "cpu" else "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if (policy == "fp16" and not fp16) or (policy == "bf16" and not bf16):
        raise ValueError(f"`policy` {policy} is not supported on this {backend} device")
    return policy


def resolve_preset(name: str, total_bytes: int | None = None, caps: object | None = None) -> Preset:
    """The preset to use for ``name`` on a device with ``total_bytes`` of memory.

    A tier name returns its table entry. ``"Auto"`` returns the tier preset of the device (a copy
    named ``"Auto"`` with ``resolved_from`` set), so it must be called at generation time with the
    actual device's total memory; ``caps`` (see :func:`resolve_precision`) turns a device without
    half-precision support to fp32. Pure function of its arguments.
    """
    if name not in PRESET_NAMES:
        raise ValueError(f"`name` must be one of {PRESET_NAMES}, got {name!r}")
    if name != AUTO:
        return PRESETS[name]
    if total_bytes is None:
        raise ValueError("`total_bytes` is required to resolve the Auto preset")
    base = PRESETS[tier_preset_name(total_bytes)]
    changes: dict = {"name": AUTO, "resolved_from": base.name}
    if caps is not None and not getattr(caps, "fp16", True) and not getattr(caps, "bf16", False):
        changes.update(precision_vae="fp32", precision_upscale="fp32")
    return replace(base, **changes)


def allocator_conf(preset: Preset, backend: str = "cuda", platform: str | None = None) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF`` value for ``preset`` on ``backend``/``platform`` (``""``: none).

    Only the CUDA caching allocator reads these keys (ROCm builds read the same variable);
    ``expandable_segments`` is not supported on Windows or macOS builds and is left out there. The
    variable must be set before CUDA initialises (the WebUI's ``webui-user`` script or the
    extension's preload), so a preset picked later only takes effect after a restart.
    """
    if backend not in ("cuda", "rocm"):
        return ""
    plat = sys.platform if platform is None else platform
    parts = []
    gct = preset.allocator.get("garbage_collection_threshold")
    if gct is not None:
        parts.append(f"garbage_collection_threshold:{float(gct):g}")
    if preset.allocator.get("expandable_segments") and plat.startswith("linux"):
        parts.append("expandable_segments:True")
    return ",".join(parts)
