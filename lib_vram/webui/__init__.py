"""VRAM Guard's host adapter for the AUTOMATIC1111 WebUI (and Forge).

The only package of ``lib_vram`` that touches WebUI objects; it imports ``modules`` only inside
:mod:`lib_vram.webui.host`'s functions, so importing it has no side effects and needs no WebUI.
Imported only by ``scripts/vram_guard.py``.
"""

from __future__ import annotations

from .integration import (
    FREE_ROUTE,
    SECTION,
    STATUS_ROUTE,
    api_defaults_follow_settings,
    check_conflicts,
    configure_logging,
    defaults,
    mount_routes,
    register_settings,
    settings_options,
    start_emulation,
    start_placement,
)
from .job import HOOK_NAME, Job
from .patching import foreign_vae_wrapper
from .session import ScriptJobs, Session
from .settings import JobSettings, resolve

__all__ = [
    "api_defaults_follow_settings",
    "FREE_ROUTE",
    "HOOK_NAME",
    "SECTION",
    "STATUS_ROUTE",
    "Job",
    "JobSettings",
    "ScriptJobs",
    "Session",
    "check_conflicts",
    "configure_logging",
    "defaults",
    "foreign_vae_wrapper",
    "mount_routes",
    "register_settings",
    "resolve",
    "settings_options",
    "start_emulation",
    "start_placement",
]
