"""Host state: ``shared.opts``, ``cmd_opts``, ``state``, ``sd_model``, ``sd_upscalers``."""

from types import SimpleNamespace

opts = SimpleNamespace()
cmd_opts = SimpleNamespace(vram_guard_disable=False, vram_guard_preset=None, vram_guard_log_level=None)
state = SimpleNamespace(time_start=1.0, interrupted=False, skipped=False)
sd_model = None
sd_upscalers = []
