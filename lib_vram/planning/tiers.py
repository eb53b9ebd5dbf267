"""Memory tiers: which class of card a device's total memory falls in.

A pure function of numbers. Cards report a little less than their nominal size (an "8 GB" card
shows ~7.6-7.8 GiB to PyTorch, a "12 GB" one ~11.7 GiB), so a tier is reached at
``TIER_TOLERANCE`` of its nominal size.
"""

from __future__ import annotations

GiB = 1024**3

TIERS_GB: tuple[int, ...] = (4, 6, 8, 12, 16, 24)
"""Nominal card sizes VRAM Guard has presets for; the last one means "24 GB or more"."""

TIER_TOLERANCE = 0.9
"""A device belongs to a tier when its total memory is at least this fraction of the nominal size."""


def tier_for_total(total_bytes: int) -> int:
    """The nominal tier (in GB) for a device with ``total_bytes`` of memory.

    Devices smaller than 90 % of 4 GB still get the 4 GB tier (the most conservative one).
    """
    if total_bytes < 0:
        raise ValueError(f"`total_bytes` must be >= 0, got {total_bytes}")
    return max((gb for gb in TIERS_GB if total_bytes >= TIER_TOLERANCE * gb * GiB), default=TIERS_GB[0])


def tier_label(tier_gb: int) -> str:
    """Human label of a tier: ``"6GB"``, ``"24GB+"``."""
    if tier_gb not in TIERS_GB:
        raise ValueError(f"unknown tier {tier_gb!r}; known tiers: {TIERS_GB}")
    return f"{tier_gb}GB+" if tier_gb == TIERS_GB[-1] else f"{tier_gb}GB"
