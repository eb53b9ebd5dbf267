"""``python -m lib_vram`` command line: one sub-command per module.

Each sub-command lives in its own ``lib_vram/cli/<name>.py`` module with ``NAME``, ``HELP``,
``configure(parser)`` and ``run(args) -> int``; register it in ``COMMANDS``.

Errors: a bad option or file is one line on stderr (``error: ...``) and exit code 2; anything else
that goes wrong is one line and exit code 1. ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import traceback

from lib_vram import __version__
from lib_vram.core.log import configure as configure_logging

from .common import card_size, check_device, warnings_filtered

COMMANDS: tuple[str, ...] = (
    "lib_vram.cli.doctor",
    "lib_vram.cli.plan",
    "lib_vram.cli.upscale",
    "lib_vram.cli.bench",
    "lib_vram.cli.profile",
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``prog: error: ...``) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        # "argument --width: must be <= ..." -> "`--width` must be <= ...", as the run-time checks say it
        m = re.match(r"argument ([^:]+?): (.*)$", message, re.DOTALL)
        if m and not m.group(2).startswith(("expected", "invalid")):
            message = f"`{m.group(1).split('/')[0]}` {m.group(2)}"
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add_debug(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--debug", action="store_true", default=default, help="show the full traceback of an error"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m lib_vram",
        description="VRAM Guard: memory-bounded VAE, upscaling and memory planning for Stable Diffusion.",
    )
    parser.add_argument("--version", action="version", version=f"VRAM Guard {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    _add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        if getattr(module, "RUNS_MODELS", False):
            add_emulate_argument(p)
        module.configure(p)
        # Also accepted after the command name; SUPPRESS keeps a --debug given before it.
        _add_debug(p, argparse.SUPPRESS)
        p.set_defaults(_run=module.run)
    return parser


EMULATE_ENV = "VRAM_GUARD_EMULATE_VRAM"
"""Set by ``--emulate-vram`` for the benchmarks' child processes (each case runs in a fresh one)."""


def add_emulate_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--emulate-vram",
        metavar="SIZE",
        default=None,
        help="run on an emulated card of this size (e.g. 4GB; at most 1024GB): device memory is "
        "counted in software and an allocation past SIZE raises CUDA's out-of-memory error; on CUDA, "
        "caps this process at SIZE (torch.cuda.set_per_process_memory_fraction). For seeing what a "
        "small card does on any machine.",
    )


def emulated_card(args: argparse.Namespace):  # noqa: ANN201
    """The card ``--emulate-vram`` (or the environment a parent process set) asks for, or None.
    Raises ValueError naming the option for a bad size or device."""
    size = getattr(args, "emulate_vram", None)
    if size is None:
        size = os.environ.get(EMULATE_ENV) or None
    if size is None:
        return None  # an empty --emulate-vram is an error (card_size), not "no card"
    import torch

    from lib_vram.core.emulate import EmulatedCard

    capacity = card_size(size, "--emulate-vram")
    device = getattr(args, "device", None)
    kind = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"`--emulate-vram` emulates a card on the CPU or CUDA, not on {kind!r}")
    os.environ[EMULATE_ENV] = size  # the benchmarks' child processes run on the same card
    return EmulatedCard(capacity, device=kind)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level)
    except ValueError as exc:
        parser.error(str(exc))
    debug = bool(getattr(args, "debug", False))
    log = logging.getLogger("lib_vram")
    with warnings_filtered():
        try:
            check_device(getattr(args, "device", None))  # before anything uses it (also --emulate-vram)
            env_before = os.environ.get(EMULATE_ENV)
            card = emulated_card(args)
            if card is None:
                return int(args._run(args) or 0)
            from lib_vram.core import emulate

            previous = emulate.install(card)
            log.warning(
                "running on an %s (--emulate-vram): memory is counted in software, not a real GPU", card.label
            )
            try:
                with card:
                    return int(args._run(args) or 0)
            finally:
                emulate.install(previous)
                # the variable is for this command's child processes; an in-process caller gets its
                # environment back
                if env_before is None:
                    os.environ.pop(EMULATE_ENV, None)
                else:
                    os.environ[EMULATE_ENV] = env_before
        except (KeyboardInterrupt, Exception) as exc:  # one line, not a traceback (unless --debug)
            interrupted = isinstance(exc, KeyboardInterrupt)
            if not interrupted:
                log.debug("command failed", exc_info=True)
            if debug:
                traceback.print_exc()
            if interrupted:
                print("interrupted", file=sys.stderr)
                return 130
            if isinstance(exc, (ValueError, FileNotFoundError)):
                print(f"error: {_one_line(exc)}", file=sys.stderr)
                return 2
            where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _one_line(exc)
            print(
                f"error: {type(exc).__name__}: {reason}{where} (run with --debug for the traceback)",
                file=sys.stderr,
            )
            return 1
