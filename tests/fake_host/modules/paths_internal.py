"""Host paths: the WebUI's data folder and its default outputs folder (``data_path/outputs``)."""

import os

data_path = os.getcwd()
default_output_dir = os.path.join(data_path, "outputs")
