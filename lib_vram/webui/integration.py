"""Wiring done once per load: settings page, HTTP routes, logging, conflict checks.

Called from the callbacks ``scripts/vram_guard.py`` registers (``on_ui_settings``,
``on_app_started``); nothing here runs at import.
"""

from __future__ import annotations

import html
import logging
from typing import Any

from . import host as default_host
from .options import FIELDS, defaults_from_settings
from .session import TILED_VAE_NOTE

logger = logging.getLogger(__name__)

SECTION = ("vram_guard", "VRAM Guard", "system")
"""Settings section (id, label, category); every option needs a tuple section (host-api §7.1)."""
STATUS_ROUTE = "/vram-guard/v1/status"
FREE_ROUTE = "/vram-guard/v1/free"


def settings_options() -> list[tuple[str, dict]]:
    """The Settings page: the preset table, then a default for every accordion control."""
    out: list[tuple[str, dict]] = [
        ("vram_guard_presets_table", {"kind": "html", "default": None, "label": presets_table_html()})
    ]
    for f in FIELDS:
        spec = {"default": f.default, "label": f.settings_label, "kind": f.kind, "info": f.info}
        out.append((f.settings_key, {**spec, "component_args": f.component_args()}))
    from .placement import SETTING, SETTING_INFO, SETTING_LABEL

    # session-wide, not an accordion control: the checkpoint placement (issue 22 item 2)
    out.append((SETTING, {"default": False, "label": SETTING_LABEL, "kind": "bool", "info": SETTING_INFO}))
    return out


def presets_table_html() -> str:
    """The presets as a table (they are data in :mod:`lib_vram.planning.presets`; Auto resolves per job)."""
    from lib_vram.planning.presets import PRESETS, RELEASE_POINTS

    rows = []
    for name, p in PRESETS.items():
        release = ", ".join(r for r in RELEASE_POINTS if r in p.release_at)
        margin = f"max({p.safety_margin_bytes // 2**20} MiB, {p.safety_margin_fraction:.0%})"
        parts = (("UNet", p.offload_unet_during_vae), ("text encoders", p.offload_text_encoder_during_vae))
        offload = ", ".join(n for n, on in parts if on) or "nothing"
        cells = (name, p.vae_mode, p.precision_vae, p.precision_upscale, offload, margin, release)
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in cells) + "</tr>")
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "preset",
            "VAE",
            "VAE prec.",
            "upscale prec.",
            "may leave the card for a VAE pass that needs the room",
            "safety margin",
            "release at",
        )
    )
    return (
        "<p>Memory presets. <b>Auto</b> picks the row for this card's total memory when a job starts; "
        "accordion controls left on Auto/0 follow the preset. <code>--vram-guard-preset NAME</code> "
        "overrides the accordion's preset. Tile sizes and batches are chosen per stage from the free "
        "memory, not preset.</p>"
        f"<table class='vram-guard-presets'><tr>{head}</tr>{''.join(rows)}</table>"
    )


def register_settings(host: Any = None) -> None:
    (host or default_host).add_options(SECTION, settings_options())


def defaults(host: Any = None) -> Any:
    """The accordion's defaults from the Settings page (``VRAMGuardOptions``)."""
    return defaults_from_settings((host or default_host).opts_get)


API_PROBE_ROUTE = "/sdapi/v1/txt2img"
"""The WebUI API route whose access control (``--api-auth``) the extension's API routes copy."""


def _api_probe(app: Any) -> Any:
    """The app's :data:`API_PROBE_ROUTE` (the one FastAPI serves: the first), or None."""
    return next((r for r in getattr(app, "routes", []) if getattr(r, "path", None) == API_PROBE_ROUTE), None)


def api_dependencies(app: Any, host: Any = None) -> list:
    """The access control of the WebUI's own API, for the extension's API routes.

    With ``--api`` the WebUI adds ``Depends(Api.auth)`` to every ``/sdapi/v1/*`` route when
    ``--api-auth`` is set: copy that route's dependencies (whatever the WebUI applies there). Without
    ``--api`` but with ``--api-auth``: the same HTTP Basic check on the same credentials.
    """
    route = _api_probe(app)
    if route is not None:
        return list(getattr(route, "dependencies", None) or [])
    creds = (host or default_host).cmd_opt("api_auth", None)
    return [basic_auth_dependency(creds)] if creds else []


def basic_auth_dependency(creds: str) -> Any:
    """``Depends`` on an HTTP Basic check against ``"user:pass,user2:pass2"`` (``--api-auth``)."""
    import secrets

    from fastapi import Depends, HTTPException
    from fastapi.security import HTTPBasic, HTTPBasicCredentials

    users = dict(item.split(":", 1) for item in creds.split(",") if ":" in item)

    def check(credentials=Depends(HTTPBasic())):  # noqa: B008
        want = users.get(credentials.username)
        if want is not None and secrets.compare_digest(credentials.password.encode(), want.encode()):
            return True
        raise HTTPException(
            status_code=401, detail="Incorrect username or password", headers={"WWW-Authenticate": "Basic"}
        )

    # Real classes, not the strings `from __future__ import annotations` leaves (FastAPI reads them).
    check.__annotations__ = {"credentials": HTTPBasicCredentials, "return": bool}
    return Depends(check)


def ui_dependencies(app: Any) -> list:
    """The access control of the WebUI's page, for the route its readout polls: when the page has a
    Gradio login (``--gradio-auth``), the request must carry that login's session cookie."""
    if not getattr(app, "auth", None):
        return []
    from fastapi import Depends, HTTPException, Request

    def check(request):
        tokens = getattr(app, "tokens", None) or {}
        token = request.cookies.get("access-token") or request.cookies.get("access-token-unsecure")
        if token and token in tokens:
            return True
        raise HTTPException(status_code=401, detail="Not authenticated")

    check.__annotations__ = {"request": Request, "return": bool}
    return [Depends(check)]


def mount_routes(app: Any, session: Any, host: Any = None) -> None:
    """``GET /vram-guard/v1/status`` and ``POST /vram-guard/v1/free`` on the WebUI's own FastAPI
    app (nothing listens on a new port), behind the WebUI API's access control; and
    ``GET /internal/vram-guard/status`` for the page's readout, behind the page's."""
    from lib_vram.core.readout import UI_STATUS_ROUTE

    status, free = session.status, session.free
    api = api_dependencies(app, host if host is not None else getattr(session, "host", None))
    existing = {getattr(r, "path", None) for r in getattr(app, "routes", [])}
    if STATUS_ROUTE not in existing:
        app.add_api_route(STATUS_ROUTE, status, methods=["GET"], dependencies=api)
    if FREE_ROUTE not in existing:
        app.add_api_route(FREE_ROUTE, free, methods=["POST"], dependencies=api)
    if UI_STATUS_ROUTE not in existing:
        app.add_api_route(UI_STATUS_ROUTE, status, methods=["GET"], dependencies=ui_dependencies(app))
    if api:
        logger.info("VRAM Guard routes require the WebUI API's credentials (--api-auth)")


SCRIPT_TITLE = "VRAM Guard"
_API_DEFAULT_LISTS = {"txt2img": "default_script_arg_txt2img", "img2img": "default_script_arg_img2img"}


def api_defaults_follow_settings(app: Any, session: Any, host: Any = None) -> int:
    """Make an API request that gives no VRAM Guard arguments use the Settings page's values *at
    the time of the request*.

    v1.10.1's ``Api`` reads every script's UI default values once, at startup
    (``init_default_script_args``), and fills them into each request: VRAM Guard's slots would keep
    the Settings of that moment forever. Our slots in those lists become ``None``, which
    :func:`lib_vram.webui.options.from_args` reads as "the current Settings value". Undone by
    ``Session.restore_api_defaults`` (script unload). Returns the number of slots changed.
    """
    api = getattr(getattr(_api_probe(app), "endpoint", None), "__self__", None)
    if api is None:
        return 0  # no --api: only the UI sends arguments, always explicit
    host = host if host is not None else getattr(session, "host", None) or default_host
    changed = 0
    for tab, runner in host.script_runners().items():
        values = getattr(api, _API_DEFAULT_LISTS[tab], None)
        if not isinstance(values, list) or runner is None:
            continue
        for script in getattr(runner, "scripts", []):
            try:
                ours = script.title().lower() == SCRIPT_TITLE.lower() and script.alwayson
            except Exception:  # another extension's title() can raise; not ours then
                ours = False
            if not ours:
                continue
            lo, hi = script.args_from, script.args_to
            if lo is None or hi is None or hi > len(values):
                continue
            session.remember_api_defaults(values, lo, values[lo:hi])
            values[lo:hi] = [None] * (hi - lo)
            changed += hi - lo
    logger.debug("API requests without VRAM Guard arguments follow the Settings (%d slots)", changed)
    return changed


def configure_logging(host: Any = None) -> None:
    from lib_vram.core import log

    log.configure((host or default_host).cmd_opt("vram_guard_log_level", None) or "INFO")


def check_conflicts(session: Any, host: Any = None) -> None:
    """Log that the Tiled VAE extension is installed next to us. Only a job where its hook is on the
    VAE gets a readout note (``ScriptJobs.refresh``: "another extension wraps the VAE decoder")."""
    where = (host or default_host).tiled_vae_extension_installed()
    if where:
        logger.info(TILED_VAE_NOTE.format(where=where))


def start_emulation(session: Any, host: Any = None) -> Any:
    """``--vram-guard-emulate-vram SIZE`` (``on_app_started``): put every job of this WebUI on an
    emulated card of SIZE (:mod:`lib_vram.webui.emulation`); returns the card or None."""
    from . import emulation

    host = host if host is not None else session.host
    size = host.cmd_opt("vram_guard_emulate_vram", None)
    if size in (None, ""):
        return None
    if host.cmd_opt("vram_guard_disable", False):
        logger.warning(
            "VRAM Guard: %s is ignored: --vram-guard-disable is set (nothing is patched)", emulation.FLAG
        )
        return None
    session.stop_emulation()  # a previous load's card (Reload UI)
    session.emulation = emulation.start(size, host=host)
    return session.emulation
