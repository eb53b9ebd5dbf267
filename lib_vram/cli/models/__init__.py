"""Real models from random weights, built small (no downloads): spandrel architectures
(:mod:`.archs`, :mod:`.synthetic`), ldm UNets with the host's attention forwards (:mod:`.unet`) and a
ControlNet in cldm's layout (:mod:`.controlnet`). ``bench``, ``profile`` and the tests build from here.
"""
