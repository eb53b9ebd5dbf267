"""Planning policy: numbers in, a choice out.

Plan choice and in-process learning (:mod:`.planner`), presets and their resolution
(:mod:`.presets`), card tiers (:mod:`.tiers`) and the reference architectures that stand in for a
model when none is loaded (:mod:`.reference`). Imports only :mod:`lib_vram.core`; the engines
(:mod:`lib_vram.vae`, :mod:`lib_vram.upscale`) own the functions that predict their own plans'
peaks and call into this package for the choice.
"""
