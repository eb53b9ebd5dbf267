"""A minimal stand-in for the WebUI's ``modules`` package: host *state* only (for
tests/test_webui_script.py). It holds what ``scripts/vram_guard.py`` and ``lib_vram.webui.host``
touch, nothing more; the VAE, upscaler models and gradio used with it in tests are real."""
