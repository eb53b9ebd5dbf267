"""Command-line flags of VRAM Guard, added to the WebUI's parser before it parses.

Import-light on purpose: it runs before torch and the UI are set up (``lib_vram`` is imported only
to check an ``--vram-guard-emulate-vram`` value, when that flag is given).
"""

from __future__ import annotations

import argparse
import os
import sys

EMULATE_FLAG = "--vram-guard-emulate-vram"
PLACE_FLAG = "--vram-guard-place-checkpoint"


def emulate_size(text: str) -> int:
    """argparse ``type`` of ``--vram-guard-emulate-vram``: the card's size in bytes (``6GB``,
    ``5.5GiB``, ``4096MB``); a bad value is one clear error line from argparse."""
    root = os.path.dirname(os.path.abspath(__file__))
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        from lib_vram.core.emulate import parse_size
    finally:
        if added:
            sys.path.remove(root)
    try:
        return parse_size(text, EMULATE_FLAG)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def preload(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("VRAM Guard")
    group.add_argument(
        "--vram-guard-preset",
        type=str,
        default=None,
        help="VRAM Guard: preset to use instead of the one on the Settings page "
        "(auto, 4GB, 6GB, 8GB, 12GB, 16GB, 24GB+).",
    )
    group.add_argument(
        "--vram-guard-log-level",
        type=str,
        default=None,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="VRAM Guard: log level of the lib_vram logger (default WARNING).",
    )
    group.add_argument(
        "--vram-guard-disable",
        action="store_true",
        help="VRAM Guard: load the extension but never patch anything (troubleshooting).",
    )
    group.add_argument(
        EMULATE_FLAG,
        type=emulate_size,
        default=None,
        metavar="SIZE",
        help="VRAM Guard: run every generation and Extras run on an emulated card of SIZE (e.g. 4GB, "
        "6GiB, 3072MB): device memory counted in software, with the out-of-memory error a GPU raises "
        "at its capacity, the loaded checkpoint resident. Shows on any machine what the plain WebUI "
        "and VRAM Guard do on a small card. Not a real GPU: it is slower, never faster.",
    )
    group.add_argument(
        PLACE_FLAG,
        action="store_true",
        help="VRAM Guard: a checkpoint that does not fit the card at load is placed by budget for the "
        "session instead of failing (text encoders and VAE on the CPU until used, as much of the UNet "
        "on the card as fits, the rest streamed each step); the Settings option, on for this session. "
        "Not with --medvram/--lowvram/--medvram-sdxl.",
    )
