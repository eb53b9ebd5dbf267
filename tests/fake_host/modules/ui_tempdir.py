"""The WebUI's registry of files its page may serve: gradio 3.41 serves a file through ``file=``
when its absolute path is in ``demo.temp_file_sets`` (or under an allowed folder)."""

import os


def register_tmp_file(gradio, filename):
    if hasattr(gradio, "temp_file_sets"):
        gradio.temp_file_sets[0] = gradio.temp_file_sets[0] | {os.path.abspath(filename)}
