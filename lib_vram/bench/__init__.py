"""Benchmark targets of ``python -m lib_vram bench <target>`` (one module per target)."""
