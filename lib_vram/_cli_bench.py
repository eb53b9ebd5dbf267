"""``python -m lib_vram bench TARGET``: side-by-side benchmarks, each case in a fresh process.

Targets are registered in :data:`TARGETS` (name -> module path); each target module exposes
``configure(parser)`` and ``run(args) -> int``. Add yours with one line.
"""

from __future__ import annotations

import argparse
import importlib

NAME = "bench"
HELP = "Run a benchmark (vae, ...) side by side against the alternatives; see docs/benchmarks.md."

TARGETS: dict[str, str] = {
    "vae": "lib_vram.bench.vae",
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", metavar="TARGET")
    sub.required = True
    for name, module_path in TARGETS.items():
        module = importlib.import_module(module_path)
        p = sub.add_parser(
            name, help=getattr(module, "HELP", name), description=getattr(module, "HELP", name)
        )
        module.configure(p)
        p.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
