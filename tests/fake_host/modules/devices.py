"""Host state: the devices the WebUI picked (modules/devices.py)."""

import torch

device = torch.device("cpu")
device_esrgan = torch.device("cpu")
dtype_vae = torch.float32
dtype_unet = torch.float32
unet_needs_upcast = False
