"""The memory core: what every other layer builds on.

Device probes and release (:mod:`.device`), the emulated card (:mod:`.emulate`), live-byte
counting on real and fake tensors (:mod:`.livebytes`, :mod:`.predict`), per-stage tracking
(:mod:`.tracker`), the per-job memory timeline (:mod:`.timeline`), operator profiles
(:mod:`.profiling`), release between stages (:mod:`.release`), the readout payload (:mod:`.readout`),
named forward hooks (:mod:`.hooks`), tile geometry (:mod:`.geometry`) and logging (:mod:`.log`).

Imports nothing else of ``lib_vram`` (a test checks the layering: core <- planning <- engines <-
host adapters and CLI).
"""
