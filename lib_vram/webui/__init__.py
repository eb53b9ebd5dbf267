"""VRAM Guard's host adapter for the AUTOMATIC1111 WebUI (and Forge).

The only package of ``lib_vram`` that touches WebUI objects; it imports ``modules`` only inside
:mod:`lib_vram.webui.host`'s functions, so importing it has no side effects and needs no WebUI.
Imported only by ``scripts/vram_guard.py``.
"""

from __future__ import annotations

from .integration import (
    api_defaults_follow_settings,
    check_conflicts,
    configure_logging,
    defaults,
    mount_routes,
    register_settings,
    start_emulation,
)
from .session import ScriptJobs, Session

__all__ = [
    "api_defaults_follow_settings",
    "ScriptJobs",
    "Session",
    "check_conflicts",
    "configure_logging",
    "defaults",
    "mount_routes",
    "register_settings",
    "start_emulation",
]
