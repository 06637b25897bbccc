"""The layer declaration (`layers.toml`), the code's imports resolved against it, and the generated
part of docs/architecture.md.

`python -m tests.layers` prints the generated block; `python -m tests.layers --write` puts it into
docs/architecture.md between its markers (`make docs-layers`). tests/test_layering.py checks the
code against the declaration and the page against this rendering.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
DECLARATION: Final = ROOT / "layers.toml"
PAGE: Final = ROOT / "docs" / "architecture.md"
TREES: Final = ("prototype", "sim")
BEGIN: Final = "<!-- generated from layers.toml by `make docs-layers`: do not edit by hand -->"
END: Final = "<!-- end of generated part -->"
IO_KINDS: Final = ("none", "asyncio", "any", "entry")


@dataclass(frozen=True)
class Module:
    name: str  # dotted: prototype.wire.schemas
    layer: str
    owns: str
    io: str
    numpy: bool


@dataclass(frozen=True)
class Layer:
    name: str
    package: str
    summary: str
    uses: tuple[str, ...]
    modules: dict[str, Module] = field(default_factory=dict)


@cache
def declaration() -> tuple[Layer, ...]:
    """Every layer, bottom up, with its modules (the names dotted in full)."""
    data = tomllib.loads(DECLARATION.read_text(encoding="utf-8"))
    layers = []
    for raw in data["layer"]:
        modules = {}
        for short, spec in raw.get("modules", {}).items():
            name = f"{raw['package']}.{short}"
            modules[name] = Module(name, raw["name"], spec["owns"], spec["io"], spec.get("numpy", True))
        layers.append(Layer(raw["name"], raw["package"], raw["summary"], tuple(raw["uses"]), modules))
    return tuple(layers)


def declared_modules() -> dict[str, Module]:
    return {name: module for layer in declaration() for name, module in layer.modules.items()}


@cache
def module_files() -> dict[str, Path]:
    """Every module of the trees by dotted name (package `__init__` files are not modules here)."""
    found = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if path.name != "__init__.py":
                found[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return found


def package_inits() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("__init__.py"))


def imported_names(path: Path) -> set[str]:
    """What a module imports, as dotted names resolved against its package (relative imports too;
    `from a import b` gives both `a` and `a.b`, since `b` may be a module); `TYPE_CHECKING` imports
    included."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1] if path.name != "__init__.py" else parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def internal_imports(path: Path) -> set[str]:
    """The modules of the trees a module imports (a name that is a package resolves to nothing:
    package `__init__` files hold no code)."""
    known = module_files()
    return {name for name in imported_names(path) if name in known} - {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
    }


def top_packages(path: Path) -> set[str]:
    """Top-level package names a module imports."""
    return {name.split(".")[0] for name in imported_names(path) if name}


def layer_of() -> dict[str, str]:
    return {name: module.layer for name, module in declared_modules().items()}


def render() -> str:
    """The generated block of docs/architecture.md: the layers top down, then every module."""
    layers = declaration()
    width = max(len(layer.name) for layer in layers)
    lines = [
        BEGIN,
        "",
        "## Layers",
        "",
        "Top down; each layer may import only the layers it names (`layers.toml`).",
        "",
        "```",
    ]
    for layer in reversed(layers):
        if layer.package in TREES:  # a root layer: its modules
            where = ", ".join(name.replace(".", "/") + ".py" for name in layer.modules)
        else:
            where = layer.package.replace(".", "/") + "/"
        lines.append(f"{layer.name:<{width}}  {where}")
        lines.append(f"{'':<{width}}  {layer.summary}")
        lines.append(f"{'':<{width}}  uses: {', '.join(layer.uses) or 'nothing'}")
    lines += ["```", "", "## What each module owns", "", "| module | layer | I/O | owns |", "|---|---|---|---|"]
    for layer in reversed(layers):
        for name, module in layer.modules.items():
            path = name.replace(".", "/") + ".py"
            lines.append(f"| `{path}` | {layer.name} | {module.io} | {module.owns} |")
    lines += ["", END]
    return "\n".join(lines) + "\n"


def page_with(block: str, page: str) -> str:
    """`page` with its generated part replaced by `block`."""
    head, found, rest = page.partition(BEGIN)
    if not found:
        raise ValueError(f"{PAGE} has no generated part (a line {BEGIN!r})")
    _, found, tail = rest.partition(END)
    if not found:
        raise ValueError(f"{PAGE}'s generated part has no end ({END!r})")
    return head + block.rstrip("\n") + tail


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        PAGE.write_text(page_with(render(), PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        sys.stdout.write(render())
