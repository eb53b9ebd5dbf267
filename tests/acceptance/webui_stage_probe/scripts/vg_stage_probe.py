"""Acceptance probe for a real WebUI (not part of VRAM Guard; never installed by it).

Symlinked into the WebUI's ``extensions/`` for an acceptance run only, and active only when the
WebUI's environment has ``VG_STAGE_DUMP=<folder>``: it wraps the two host functions through which
every txt2img/img2img job's VAE stages go (``modules.processing.decode_latent_batch`` and
``images_tensor_to_samples`` as imported into ``modules.processing``) and writes what goes in and
what comes out of each call, in call order, as ``NNNN-<stage>-<in|out>.npy`` (float32). For a hires
fix job: first-pass decode in/out, the hires encode's input (= the hires upscale's output, the
8-bit image / 255) and output latent, then the final decode in/out. VRAM Guard hooks the VAE modules
below these functions, so the probe records the host's own stage outputs with or without it.
"""

import itertools
import logging
import os

DUMP = os.environ.get("VG_STAGE_DUMP")
logger = logging.getLogger(__name__)

if DUMP:
    import numpy as np
    import torch
    from modules import processing

    _count = itertools.count()

    def _save(stage, part, value):
        if isinstance(value, (list, tuple)):  # decode_latent_batch: one tensor per image
            for v in value:
                _save(stage, part, v)
            return
        # float32 CPU tensors (--no-half on the CPU): .to() and .numpy() allocate nothing, so an
        # emulated card counts nothing for the probe
        arr = value.detach().to("cpu", torch.float32).numpy()
        name = f"{next(_count):04d}-{stage}-{part}.npy"
        tmp = os.path.join(DUMP, f".{name}.tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, arr)
        os.replace(tmp, os.path.join(DUMP, name))

    _decode = processing.decode_latent_batch
    _encode = processing.images_tensor_to_samples

    def decode_latent_batch(model, batch, *args, **kwargs):
        _save("decode", "in", batch)
        out = _decode(model, batch, *args, **kwargs)
        _save("decode", "out", out)
        return out

    def images_tensor_to_samples(image, *args, **kwargs):
        _save("encode", "in", image)
        out = _encode(image, *args, **kwargs)
        _save("encode", "out", out)
        return out

    os.makedirs(DUMP, exist_ok=True)
    processing.decode_latent_batch = decode_latent_batch
    processing.images_tensor_to_samples = images_tensor_to_samples
    logger.warning("vg_stage_probe: VAE stage inputs/outputs are written to %s", DUMP)
