"""The package layout is the architecture: imports point one way and no modules import each other.

Layers (docs/architecture.md): ``core`` <- ``planning`` <- engines (``vae``, ``upscale``,
``sampling``) <- the owner of the card (``residency``) <- host adapter and UI (``webui``) and the
command line (``cli``, benchmarks included). A module may import
its own layer and the layers below it, never one above; the two engines do not import each other,
nor do ``webui`` and ``cli``. Every import counts, including the ones inside functions (a lazy
import is still a dependency). The package root ``lib_vram/__init__.py`` is a facade over the core
and is not part of any layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lib_vram"
LAYER = {
    "core": 0,
    "planning": 1,
    "vae": 2,
    "upscale": 2,
    "sampling": 2,
    "residency": 3,
    "webui": 4,
    "cli": 4,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, source: str | None = None) -> set[str]:
    """Every ``lib_vram`` module ``path`` imports (relative imports resolved; ``from pkg import
    mod`` counts as ``pkg.mod`` when ``mod`` is a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lib_vram"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("lib_vram"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if _is_module(sub) else target)
    found.discard(name)
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def all_modules() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYER else None


def test_no_flat_pile_of_modules():
    """Only the facade and ``python -m`` entry point live at the top; everything else is in a layer."""
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "__main__.py"]
    packages = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
    assert packages == sorted(LAYER)


def test_imports_point_down():
    wrong = []
    for module, deps in all_modules().items():
        src = layer_of(module)
        if src is None:
            continue
        for dep in deps:
            dst = layer_of(dep)
            if dst is None or dst == src:
                continue
            if LAYER[dst] >= LAYER[src]:
                wrong.append(f"{module} -> {dep}")
    assert wrong == [], "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = all_modules()
    graph = {m: {d for d in deps if d in graph and not _is_package_of(d, m)} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _is_package_of(dep: str, module: str) -> bool:
    """A module importing its own package's ``__init__`` (``from . import x``) is not a cycle."""
    return module.startswith(dep + ".")


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from lib_vram.webui import job\n", {"lib_vram.webui.job"}),
        ("def f():\n    from ..cli import stageplan\n", {"lib_vram.cli.stageplan"}),
        ("from .device import memory_info\n", {"lib_vram.core.device"}),
    ],
)
def test_the_scan_sees_imports(source, expected):
    """The checks can fail: top-level, relative and function-level imports are all found."""
    assert imports_of(PKG / "core" / "_layer_probe.py", source) == expected
