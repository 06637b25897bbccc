"""The layer declaration (`layers.toml`), the code's imports resolved against it, the generated
part of docs/architecture.md, and that page's request paths read back for the checks.

`python -m tests.layers` prints the generated block; `python -m tests.layers --write` puts it into
docs/architecture.md between its markers (`make docs-layers`). tests/test_layering.py checks the
code against the declaration and the page against this rendering.
"""

from __future__ import annotations

import ast
import re
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
    """The generated block of docs/architecture.md: the layers from the ground floor up, then each
    tree's modules, from the ground floor up."""
    layers = declaration()
    width = max(len(layer.name) for layer in layers)
    lines = [
        BEGIN,
        "",
        "## Layers",
        "",
        "From the ground floor up; each layer may import only the layers it names (`layers.toml`).",
        "",
        "```",
    ]
    for layer in layers:
        if layer.package in TREES:  # a root layer: its modules
            where = ", ".join(name.replace(".", "/") + ".py" for name in layer.modules)
        else:
            where = layer.package.replace(".", "/") + "/"
        lines.append(f"{layer.name:<{width}}  {where}")
        lines.append(f"{'':<{width}}  {layer.summary}")
        lines.append(f"{'':<{width}}  uses: {', '.join(layer.uses) or 'nothing'}")
    lines += ["```", "", "## What each module owns", "", "Each tree from the ground floor up."]
    for tree in TREES:
        lines += ["", f"### {tree}/", "", "| module | layer | I/O | owns |", "|---|---|---|---|"]
        for layer in layers:
            if layer.package.split(".")[0] != tree:
                continue
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


# -- the life of a request (docs/architecture.md) ------------------------------------------------------

PATHS_HEADING: Final = "## The life of a request"
_ITEM = re.compile(r"^(\d+)\. (.*(?:\n {3,}\S.*)*)", re.MULTILINE)
_HOP = re.compile(
    r"`(?P<module>[\w/]+\.py)` · `(?P<name>[\w.]+)`(?:, through `(?P<seam>[\w/]+\.py)` · `(?P<seam_name>[\w.]+)`)?:"
)
_NAMED = re.compile(r"`(?P<module>(?:prototype|sim)/[\w/]+\.py)`(?: · `(?P<name>[\w.]+)`)?")


@dataclass(frozen=True)
class Hop:
    module: str  # dotted
    name: str
    seam: str | None = None  # dotted: a module both ends import, for a hop through a seam
    seam_name: str | None = None


def _dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def request_section(page: str) -> str:
    """The page's request paths: from their heading to the next `## ` heading."""
    _, found, rest = page.partition(PATHS_HEADING + "\n")
    if not found:
        raise ValueError(f"{PAGE} has no section {PATHS_HEADING!r}")
    return rest.split("\n## ", 1)[0]


def request_paths(page: str) -> dict[str, list[Hop]]:
    """Each `### ` path of the section, its numbered hops in order (an item's wrapped lines joined)."""
    paths: dict[str, list[Hop]] = {}
    for block in request_section(page).split("\n### ")[1:]:
        title, _, body = block.partition("\n")
        hops = []
        for number, (index, text) in enumerate(_ITEM.findall(body), 1):
            text = re.sub(r"\s*\n\s*", " ", text)
            match = _HOP.match(text)
            if int(index) != number or match is None:
                raise ValueError(f"{title}: hop {index} is not `module.py` · `name`[, through `seam.py` · `name`]:")
            seam = match["seam"]
            hops.append(Hop(_dotted(match["module"]), match["name"], seam and _dotted(seam), match["seam_name"]))
        paths[title.strip()] = hops
    return paths


def defines(module: str, name: str) -> bool:
    """Whether `module` defines `name` at its top level, or `Class.attr` (a method or class attribute)."""
    path = module_files().get(module)
    if path is None:
        return False
    body = ast.parse(path.read_text(encoding="utf-8")).body
    for part in name.split("."):
        found = [node for node in body if part in _names(node)]
        if not found:
            return False
        body = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return True


def _names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.Assign):
        return {target.id for target in node.targets if isinstance(target, ast.Name)}
    return set()


@cache
def _reach(module: str) -> frozenset[str]:
    """Every module `module` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for name in internal_imports(module_files()[todo.pop()]):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return frozenset(seen)


def _layer_reach(layer: str) -> set[str]:
    """A layer and every layer it may import, directly or through others."""
    uses = {item.name: item.uses for item in declaration()}
    seen, todo = {layer}, [layer]
    while todo:
        for name in uses[todo.pop()]:
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def path_problems(paths: dict[str, list[Hop]], section: str = "") -> list[str]:
    """What in the request paths the code does not bear out: a module that is not declared, a name
    it does not define, a hop not linked to the one before it (neither imports the other, nor do
    both import the seam it names), or linked against the declared layers."""
    declared = layer_of()
    problems = []
    for match in _NAMED.finditer(section):
        module, name = _dotted(match["module"]), match["name"]
        if module not in declared:
            problems.append(f"the section names {match['module']}, which layers.toml does not declare")
        elif name is not None and not defines(module, name):
            problems.append(f"the section names {module}.{name}, which is not defined")
    for title, hops in paths.items():
        for number, hop in enumerate(hops, 1):
            where = f"{title}, hop {number}"
            for module, name in ((hop.module, hop.name), (hop.seam, hop.seam_name)):
                if module is None or name is None:
                    continue
                if module not in declared:
                    problems.append(f"{where}: {module} is not declared in layers.toml")
                elif not defines(module, name):
                    problems.append(f"{where}: {module} does not define {name}")
            a, b = hops[number - 2].module if number > 1 else None, hop.module
            if a is None or not {a, b, hop.seam or b} <= declared.keys():
                continue
            if hop.seam is not None:
                linked = all(hop.seam == end or hop.seam in _reach(end) for end in (a, b))
                layered = {declared[hop.seam]} <= _layer_reach(declared[a]) & _layer_reach(declared[b])
            else:
                linked = a == b or b in _reach(a) or a in _reach(b)
                layered = declared[b] in _layer_reach(declared[a]) or declared[a] in _layer_reach(declared[b])
            if not linked:
                through = f" through {hop.seam}" if hop.seam else ""
                problems.append(f"{where}: {a} and {b} are not linked by imports{through}")
            elif not layered:
                problems.append(f"{where}: {declared[a]} and {declared[b]} are not ordered by the declared layers")
    return problems


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        PAGE.write_text(page_with(render(), PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        sys.stdout.write(render())
