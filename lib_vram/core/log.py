"""The ``lib_vram`` logger: one named logger, a handler only if the host has none."""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "lib_vram"
PREFIX = "[VRAM Guard]"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (test runners and hosts swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # the base class assigns it; we always follow sys.stderr
        pass


def configure(level: str | int | None = None) -> logging.Logger:
    """Give the ``lib_vram`` logger a stderr handler (once) and set its level.

    Hosts that configure logging themselves keep their handlers: we add ours only when the
    logger has none, and we do not propagate twice to the root logger in that case.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if level is not None:
        if isinstance(level, str):
            value = logging.getLevelName(level.upper())
            if not isinstance(value, int):
                raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
            level = value
        logger.setLevel(level)
    if not any(getattr(h, "_lib_vram", False) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(f"{PREFIX} %(levelname)s %(name)s: %(message)s"))
        handler._lib_vram = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    return logger
