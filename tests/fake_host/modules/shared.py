"""Host state: ``shared.opts``, ``cmd_opts``, ``state``, ``sd_model``, ``sd_upscalers``, and the
option classes (``OptionInfo``/``OptionHTML``: attributes only, as the settings page reads them)."""

from types import SimpleNamespace


class OptionInfo:
    def __init__(self, default=None, label="", component=None, component_args=None, **kwargs):
        self.default = default
        self.label = label
        self.component = component
        self.component_args = component_args
        self.section = kwargs.get("section")
        self.category_id = kwargs.get("category_id")
        self.comment_after = ""

    def info(self, text):
        self.comment_after += text
        return self


class OptionHTML(OptionInfo):
    def __init__(self, text):
        super().__init__(str(text).strip(), label="")


class _Opts(SimpleNamespace):
    def add_option(self, key, info):
        self.__dict__.setdefault("data_labels", {})[key] = info


opts = _Opts()
cmd_opts = SimpleNamespace(vram_guard_disable=False, vram_guard_preset=None, vram_guard_log_level=None)
state = SimpleNamespace(time_start=1.0, interrupted=False, skipped=False)
sd_model = None
sd_upscalers = []
