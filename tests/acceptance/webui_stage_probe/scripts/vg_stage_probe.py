"""Acceptance probe for a real WebUI (not part of VRAM Guard; never installed by it).

Symlinked into the WebUI's ``extensions/`` for an acceptance run only, and active only when the
WebUI's environment has ``VG_STAGE_DUMP=<folder>``: it wraps the two host functions through which
every txt2img/img2img job's VAE stages go (``modules.processing.decode_latent_batch`` and
``images_tensor_to_samples`` as imported into ``modules.processing``) and writes what goes in and
what comes out of each call, in call order, as ``NNNN-<stage>-<in|out>.npy`` (float32). For a hires
fix job: first-pass decode in/out, the hires encode's input (= the hires upscale's output, the
8-bit image / 255) and output latent, then the final decode in/out. VRAM Guard hooks the VAE modules
below these functions, so the probe records the host's own stage outputs with or without it.

With ``VG_STAGE_DETAIL=1`` as well (Forge's hires investigation, issue 14) it also writes, into
``<folder>/detail/`` (so the stage files above keep their numbering): torch's global CPU generator
state at the entry and exit of each VAE stage call and of the hires upscale
(``modules.images.resize_image``), the upscale's output picture, and the img2img sampling pass's
input latent, noise and output (``sample_img2img`` of the k-diffusion and timesteps samplers).
The global generator matters because the hires/img2img encode samples the latent posterior from
it (``torch.randn`` in the host's ``DiagonalGaussianDistribution.sample``).
"""

import itertools
import logging
import os

DUMP = os.environ.get("VG_STAGE_DUMP")
DETAIL = os.environ.get("VG_STAGE_DETAIL") == "1"
logger = logging.getLogger(__name__)

if DUMP:
    import numpy as np
    import torch
    from modules import processing

    _count = itertools.count()

    def _save(stage, part, value, folder=None, counter=None):
        if isinstance(value, (list, tuple)):  # decode_latent_batch: one tensor per image
            for v in value:
                _save(stage, part, v, folder, counter)
            return
        # float32 CPU tensors (--no-half on the CPU): .to() and .numpy() allocate nothing, so an
        # emulated card counts nothing for the probe
        if isinstance(value, np.ndarray):
            arr = value
        elif value.dtype == torch.uint8:  # a generator state
            arr = value.numpy()
        else:
            arr = value.detach().to("cpu", torch.float32).numpy()
        folder = folder or DUMP
        name = f"{next(counter or _count):04d}-{stage}-{part}.npy"
        tmp = os.path.join(folder, f".{name}.tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, arr)
        os.replace(tmp, os.path.join(folder, name))

    _dcount = itertools.count()
    _ddir = os.path.join(DUMP, "detail")

    def _detail(stage, part, value=None):
        """Detail mode: the global generator's state, and ``value`` if given."""
        if not DETAIL:
            return
        _save(stage, f"{part}-rng", torch.get_rng_state(), _ddir, _dcount)
        if value is not None:
            _save(stage, part, value, _ddir, _dcount)

    _decode = processing.decode_latent_batch
    _encode = processing.images_tensor_to_samples

    def decode_latent_batch(model, batch, *args, **kwargs):
        _save("decode", "in", batch)
        _detail("decode", "in")
        out = _decode(model, batch, *args, **kwargs)
        _save("decode", "out", out)
        _detail("decode", "out")
        return out

    def images_tensor_to_samples(image, *args, **kwargs):
        _save("encode", "in", image)
        _detail("encode", "in")
        out = _encode(image, *args, **kwargs)
        _save("encode", "out", out)
        _detail("encode", "out")
        return out

    os.makedirs(DUMP, exist_ok=True)
    processing.decode_latent_batch = decode_latent_batch
    processing.images_tensor_to_samples = images_tensor_to_samples

    if DETAIL:
        from modules import images

        os.makedirs(_ddir, exist_ok=True)
        _resize = images.resize_image

        def resize_image(*args, **kwargs):
            _detail("resize", "in")
            out = _resize(*args, **kwargs)
            _detail("resize", "out", np.asarray(out.convert("RGB"), dtype=np.float32))
            return out

        images.resize_image = resize_image

        def _wrap_sampler(cls):
            original = cls.sample_img2img

            def sample_img2img(self, p, x, noise, *args, **kwargs):
                _detail("img2img_sampling", "x", x)
                _save("img2img_sampling", "noise", noise, _ddir, _dcount)
                out = original(self, p, x, noise, *args, **kwargs)
                _detail("img2img_sampling", "out", out)
                return out

            cls.sample_img2img = sample_img2img

        from modules import sd_samplers_kdiffusion, sd_samplers_timesteps

        _wrap_sampler(sd_samplers_kdiffusion.KDiffusionSampler)
        _wrap_sampler(sd_samplers_timesteps.CompVisSampler)
    logger.warning("vg_stage_probe: VAE stage inputs/outputs are written to %s", DUMP)
