"""Benchmark targets of ``python -m lib_vram bench`` (CLI modules: they may print)."""
