"""Acceptance helper for a real WebUI (not part of VRAM Guard; never installed by it).

Symlinked into the WebUI's ``extensions/`` for an acceptance run only, and active only when the
WebUI's environment has ``VG_VAE_DTYPE_ROUTE=1``. It lets a CPU WebUI started with ``--no-half``
(the only way the UNet runs on a CPU) put its **VAE** into FP16, the state a GPU WebUI is in
without ``--no-half``/``--no-half-vae``: v1.10.1 then has ``devices.dtype_vae = torch.float16``
(``modules/shared_init.py``) and casts ``sd_model.first_stage_model`` to it after loading
(``modules/sd_models.py``, "apply dtype to VAE"); a VAE file loaded later is cast to
``devices.dtype_vae`` too (``sd_vae._load_vae_dict``). With the VAE in FP16 and ``devices.dtype``
FP32, ``devices.autocast()`` is a null context, so the decode runs in plain FP16, and
``processing.decode_latent_batch``'s NaN check and its fallback ("Automatically revert VAE to
32-bit floats", ``auto_vae_precision``) run exactly as the WebUI ships them.

Routes (between jobs; nothing else is changed):

* ``GET  /vg-accept/vae-dtype`` -> ``devices.dtype_vae``, the VAE parameters' dtype, the fallback
  options and the precision flags.
* ``POST /vg-accept/vae-dtype`` ``{"dtype": "float16"|"float32"}`` -> sets ``devices.dtype_vae``
  and casts ``shared.sd_model.first_stage_model`` to it (what the two host lines above do).
"""

import logging
import os

logger = logging.getLogger(__name__)

if os.environ.get("VG_VAE_DTYPE_ROUTE") == "1":
    import torch
    from fastapi import HTTPException
    from modules import devices, script_callbacks, shared

    _DTYPES = {"float16": torch.float16, "float32": torch.float32}

    def _state() -> dict:
        vae = shared.sd_model.first_stage_model
        dtypes = sorted({str(p.dtype) for p in vae.parameters()})
        return {
            "dtype_vae": str(devices.dtype_vae),
            "vae_parameter_dtypes": dtypes,
            "dtype": str(devices.dtype),
            "no_half": bool(shared.cmd_opts.no_half),
            "no_half_vae": bool(shared.cmd_opts.no_half_vae),
            "auto_vae_precision": bool(shared.opts.auto_vae_precision),
            "auto_vae_precision_bfloat16": bool(shared.opts.auto_vae_precision_bfloat16),
        }

    def _get() -> dict:
        return _state()

    def _post(req: dict) -> dict:
        dtype = _DTYPES.get(str(req.get("dtype")))
        if dtype is None:
            raise HTTPException(status_code=422, detail=f"dtype must be one of {sorted(_DTYPES)}")
        devices.dtype_vae = dtype
        shared.sd_model.first_stage_model.to(dtype)
        logger.warning("vg_vae_dtype: devices.dtype_vae and the VAE set to %s", dtype)
        return _state()

    def _routes(_demo, app) -> None:
        app.add_api_route("/vg-accept/vae-dtype", _get, methods=["GET"])
        app.add_api_route("/vg-accept/vae-dtype", _post, methods=["POST"])

    script_callbacks.on_app_started(_routes)
    logger.warning("vg_vae_dtype: /vg-accept/vae-dtype routes enabled")
