"""``python -m lib_vram`` command line: one sub-command per module.

Each sub-command lives in its own ``lib_vram/_cli_<name>.py`` module with ``NAME``, ``HELP``,
``configure(parser)`` and ``run(args) -> int``; register it in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import __version__
from .log import configure as configure_logging

COMMANDS: tuple[str, ...] = (
    "lib_vram._cli_doctor",
    "lib_vram._cli_plan",
    "lib_vram._cli_upscale",
    "lib_vram._cli_bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lib_vram",
        description="VRAM Guard: memory-bounded VAE, upscaling and memory planning for Stable Diffusion.",
    )
    parser.add_argument("--version", action="version", version=f"VRAM Guard {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in COMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as exc:
        logging.getLogger("lib_vram").debug("command failed", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        return 2
