"""Host state: callback registrars that only record (modules/script_callbacks.py)."""

registered = []


def _recorder(kind):
    def register(callback, *, name=None):
        registered.append((kind, callback))

    return register


on_ui_settings = _recorder("ui_settings")
on_app_started = _recorder("app_started")
on_list_unets = _recorder("list_unets")
on_model_loaded = _recorder("model_loaded")
on_cfg_denoiser = _recorder("cfg_denoiser")
on_script_unloaded = _recorder("script_unloaded")
