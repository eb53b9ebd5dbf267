"""Acceptance probe for a real WebUI (not part of VRAM Guard; never installed by it).

Symlinked into the WebUI's ``extensions/`` for an acceptance run only, and active only when the
WebUI's environment has ``VG_LOWVRAM_PROBE=<file.json>``: it counts the bytes the WebUI's own
``--lowvram``/``--medvram`` swapping moves between host and card. Those moves are the
``Module.to(...)`` calls made from ``modules/lowvram.py`` (its forward pre-hook sends the module
that is about to run to the device and the previous one back to the CPU); the probe wraps
``torch.nn.Module.to`` and counts, for each call from that file, the module's parameter and buffer
bytes, split into moves of UNet parts (``sd_model.model.diffusion_model``'s modules) and of the
rest, to the device and to the CPU. Calls from sd-webui-controlnet's hook and control model classes (its Low VRAM: the control model
to the device before each forward, back to the CPU after; not its dtype casts) count as ``control``,
only where the module changes side (it sends a model already on the CPU there again, a no-op). It also counts the sampler's steps (``on_cfg_denoiser``: once
per step) and UNet forwards. On the CPU (``--use-cpu all``) the moves are no-ops for torch, but the
calls and their sizes are what ``--lowvram`` does on a GPU, so the counts are its traffic.
The counters are rewritten to the JSON file after every counted call and every step.
"""

import json
import linecache
import logging
import os
import sys

PROBE = os.environ.get("VG_LOWVRAM_PROBE")
logger = logging.getLogger(__name__)

if PROBE:
    import torch
    from modules import script_callbacks, shared

    _LOWVRAM_FILE = os.path.join("modules", "lowvram.py")
    _CONTROLNET_FILES = tuple(
        os.path.join("sd-webui-controlnet", "scripts", f) for f in ("hook.py", "cldm.py", "adapter.py")
    )
    _counts = {"unet_in_bytes": 0, "unet_out_bytes": 0, "other_in_bytes": 0, "other_out_bytes": 0,
               "control_in_bytes": 0, "control_out_bytes": 0, "unet_moves": 0, "steps": 0, "unet_bytes": 0}  # fmt: skip
    _unet_ids: dict[int, int] = {}
    _control_side: dict[int, str] = {}
    _original_to = torch.nn.Module.to

    def _save():
        tmp = PROBE + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(_counts, fh)
        os.replace(tmp, PROBE)

    def _unet_modules():
        model = getattr(shared, "sd_model", None)
        dm = getattr(getattr(model, "model", None), "diffusion_model", None)
        if dm is None:
            return {}
        if not _unet_ids or _counts["unet_bytes"] == 0:
            _unet_ids.clear()
            _unet_ids.update({id(m): 1 for m in dm.modules()})
            _counts["unet_bytes"] = sum(t.numel() * t.element_size() for t in dm.parameters())
        return _unet_ids

    def _nbytes(module):
        return sum(t.numel() * t.element_size() for t in module.parameters()) + sum(
            t.numel() * t.element_size() for t in module.buffers()
        )

    def _to(self, *args, **kwargs):
        frame = sys._getframe(1)
        name = frame.f_code.co_filename
        line = linecache.getline(name, frame.f_lineno).replace('"', "'")
        control = name.endswith(_CONTROLNET_FILES) and "dtype" not in line
        if control or name.endswith(_LOWVRAM_FILE):
            # --use-cpu all: the device is the CPU too, so the direction comes from the call's
            # source line: ``module_in_gpu.to(cpu)`` / ``.to('cpu')`` send back, ``.to(device)`` in
            direction = "out" if ".to(cpu)" in line or ".to('cpu')" in line else "in"
            where = "control" if control else "unet" if id(self) in _unet_modules() else "other"
            if control and _control_side.get(id(self)) == direction:
                return _original_to(self, *args, **kwargs)
            _control_side[id(self)] = direction
            _counts[f"{where}_{direction}_bytes"] += _nbytes(self)
            if where == "unet":
                _counts["unet_moves"] += 1
            _save()
        return _original_to(self, *args, **kwargs)

    def _on_step(params):
        _counts["steps"] += 1
        _save()

    torch.nn.Module.to = _to
    script_callbacks.on_cfg_denoiser(_on_step)
    logger.info("lowvram probe: counting --lowvram's module moves into %s", PROBE)
