"""Acceptance helper for a real WebUI (not part of VRAM Guard; never installed by it).

Linked into a run's extensions (``tests/acceptance/host/datadir.sh DIR ... fixed-rng``) and active
only when the WebUI's environment has ``VG_FIXED_RNG=<seed>``: before each ``process_images`` call
(the job's, and each one an extension runs inside it, e.g. Ultimate SD Upscale's tile passes) it
seeds torch's global generator with that seed. The WebUI seeds its own noise per job, but the
img2img encode samples the latent posterior from the *global* generator
(``DiagonalGaussianDistribution.sample`` -> ``torch.randn``), whose state depends on everything the
session drew before: two fresh sessions then give different pictures for the same img2img-based job.
With a fixed state per pass, the plain WebUI and the WebUI with VRAM Guard can be compared picture
for picture.
"""

import logging
import os

import torch
from modules import scripts

SEED = os.environ.get("VG_FIXED_RNG")
logger = logging.getLogger(__name__)


class FixedRng(scripts.Script):
    def title(self):
        return "VG fixed RNG"

    def show(self, is_img2img):
        return scripts.AlwaysVisible if SEED else False

    def ui(self, is_img2img):
        return []

    def before_process(self, p, *args):
        if SEED:
            torch.manual_seed(int(SEED))
            logger.debug("global generator seeded with %s", SEED)
