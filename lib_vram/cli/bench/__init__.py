"""``python -m lib_vram bench TARGET``: side-by-side benchmarks (CLI modules: they may print).

A target is a module with ``HELP``, ``configure(parser)`` and ``run = runner(bench)`` (:mod:`._harness`),
registered in ``TARGETS``. Every target but ``gpu`` (``JSON = False``: it writes a file) gets ``--json``.
"""

from __future__ import annotations

import argparse
import importlib

from lib_vram.cli import add_emulate_argument

NAME = "bench"
HELP = "Run a benchmark (each case in a fresh process) and print a side-by-side table."

TARGETS: dict[str, str] = {
    "vae": "lib_vram.cli.bench.vae",
    "upscale": "lib_vram.cli.bench.upscale",
    "planner": "lib_vram.cli.bench.planner",
    "vae-estimate": "lib_vram.cli.bench.vae_estimate",
    "emulate": "lib_vram.cli.bench.emulate",
    "gpu": "lib_vram.cli.bench.gpu",
    "timeline": "lib_vram.cli.bench.timeline",
    "sampling": "lib_vram.cli.bench.sampling",
    "sampling-stream": "lib_vram.cli.bench.sampling_stream",
    "soak": "lib_vram.cli.bench.soak",
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", metavar="TARGET")
    sub.required = True
    for name, module_name in TARGETS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        add_emulate_argument(p)
        if getattr(module, "JSON", True):
            p.add_argument("--json", action="store_true", help="print the records as JSON only")
        getattr(module, "configure", lambda p: None)(p)
        p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a case in a fresh process
        p.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    from lib_vram.cli.common import check_device

    check_device(getattr(args, "device", None))  # one clear line before any benchmark starts
    return int(args._bench_run(args) or 0)
