"""Each VRAM Guard VAE stage of an SDXL hires job against the host's own stage **on the same input**.

The stage probe (``webui_stage_probe/``) records what goes in and out of each VAE call of a job.
Comparing VRAM Guard's run with the plain run stage by stage mixes two things once an earlier stage
differed by a rounding: the stage's own error and the earlier difference carried through. This
script separates them, outside the WebUI, with the host's own classes (sgm ``Encoder``/``Decoder``
from the WebUI's ``repositories/generative-models``, built without ``sgm/__init__``) and the
checkpoint's VAE weights in FP32:

* decode: the host's decode (``post_quant_conv`` + ``decoder`` of ``z / scale_factor``, what
  ``DiffusionEngine.decode_first_stage`` does) of VRAM Guard's decode input, against VRAM Guard's
  output; the same for the plain run's input and output (how close this offline host is to the
  WebUI's own run);
* encode: the hires encode samples the posterior (``AutoencoderKLInferenceWrapper.encode``:
  ``mean + std * randn``); both runs draw the same noise (same seed and call order), recovered from
  the plain run as ``eps = (z / scale_factor - mean) / std`` with the host's moments of the plain
  input; the host's encode of VRAM Guard's input is then ``scale_factor * (mean' + std' * eps)``.

usage: sdxl_stage_check.py PLAIN_STAGES_DIR VG_STAGES_DIR [--ckpt FILE] [--sgm DIR]  (webui venv)
Prints one JSON line per stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch

SCALE = 0.13025  # sd_xl_base.yaml scale_factor
DD = dict(attn_type="vanilla", double_z=True, z_channels=4, resolution=256, in_channels=3, out_ch=3, ch=128,
          ch_mult=[1, 2, 4, 4], num_res_blocks=2, attn_resolutions=[], dropout=0.0)  # fmt: skip


def host_vae(ckpt: str, sgm: str) -> tuple:
    for name, path in [("sgm", sgm), ("sgm.modules", sgm + "/modules"),
                       ("sgm.modules.diffusionmodules", sgm + "/modules/diffusionmodules")]:  # fmt: skip
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [path]
            sys.modules[name] = m
    from safetensors import safe_open
    from sgm.modules.diffusionmodules.model import Decoder, Encoder

    pre = "first_stage_model."
    with safe_open(ckpt, "pt") as f:
        sd = {k[len(pre) :]: f.get_tensor(k).float() for k in f.keys() if k.startswith(pre)}  # noqa: SIM118
    enc, dec = Encoder(**DD).eval(), Decoder(**DD).eval()
    enc.load_state_dict({k[8:]: v for k, v in sd.items() if k.startswith("encoder.")})
    dec.load_state_dict({k[8:]: v for k, v in sd.items() if k.startswith("decoder.")})
    qc, pqc = torch.nn.Conv2d(8, 8, 1), torch.nn.Conv2d(4, 4, 1)
    qc.load_state_dict({"weight": sd["quant_conv.weight"], "bias": sd["quant_conv.bias"]})
    pqc.load_state_dict({"weight": sd["post_quant_conv.weight"], "bias": sd["post_quant_conv.bias"]})
    return enc, dec, qc, pqc


def lsb(x: np.ndarray) -> np.ndarray:  # the WebUI's 8-bit picture of a decode output
    return (np.clip((x + 1) / 2, 0, 1) * 255).astype(np.uint8)


def psnr8(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plain")
    ap.add_argument("vg")
    ap.add_argument("--ckpt", default="/work/webui/models/Stable-diffusion/sdxl-random.safetensors")
    ap.add_argument("--sgm", default="/work/webui/repositories/generative-models/sgm")
    a = ap.parse_args()
    plain, vg = sorted(Path(a.plain).glob("*.npy")), sorted(Path(a.vg).glob("*.npy"))
    if [p.stem.split("-", 1)[1] for p in plain] != [p.stem.split("-", 1)[1] for p in vg]:
        raise SystemExit("the two runs' probe files are not the same calls")
    enc, dec, qc, pqc = host_vae(a.ckpt, a.sgm)

    def decode(z: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return dec(pqc(torch.from_numpy(z) / SCALE)).numpy()

    def moments(img: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            mean, logvar = torch.chunk(qc(enc(torch.from_numpy(img) * 2 - 1)), 2, dim=1)
        return mean, torch.exp(0.5 * torch.clamp(logvar, -30.0, 20.0))

    for i in range(0, len(plain), 2):
        kind = plain[i].stem.split("-")[1]
        p_in, p_out = np.load(plain[i]), np.load(plain[i + 1])
        v_in, v_out = np.load(vg[i]), np.load(vg[i + 1])
        row: dict = {"call": plain[i].stem, "input_max_abs_vs_plain": float(np.abs(v_in - p_in).max())}
        if kind == "decode":
            h_p, h_v = decode(p_in)[0], decode(v_in)[0]
            row["offline_host_vs_webui_plain_max_abs"] = float(np.abs(h_p - p_out).max())
            row["offline_host_vs_webui_plain_max_lsb"] = int(np.abs(lsb(h_p).astype(int) - lsb(p_out)).max())
            row["vg_vs_host_same_input_max_abs"] = float(np.abs(v_out - h_v).max())
            row["vg_vs_host_same_input_max_lsb"] = int(np.abs(lsb(v_out).astype(int) - lsb(h_v)).max())
            row["vg_vs_host_same_input_psnr8"] = psnr8(lsb(v_out), lsb(h_v))
            # what the input's difference alone does: the host on both inputs
            row["host_vg_input_vs_host_plain_input_max_lsb"] = int(
                np.abs(lsb(h_v).astype(int) - lsb(h_p)).max()
            )
            row["host_vg_input_vs_host_plain_input_psnr8"] = psnr8(lsb(h_v), lsb(h_p))
        else:
            m_p, s_p = moments(p_in)
            eps = (torch.from_numpy(p_out) / SCALE - m_p) / s_p
            m_v, s_v = moments(v_in)
            h_v = (SCALE * (m_v + s_v * eps)).numpy()
            row["recovered_noise_mean_std"] = [float(eps.mean()), float(eps.std())]
            row["vg_vs_host_same_input_and_noise_max_abs"] = float(np.abs(v_out - h_v).max())
            row["host_on_vg_input_vs_plain_max_abs"] = float(np.abs(h_v - p_out).max())
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
