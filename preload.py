"""Command-line flags of VRAM Guard, added to the WebUI's parser before it parses.

Import-light on purpose: it runs before torch and the UI are set up.
"""

from __future__ import annotations

import argparse


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
