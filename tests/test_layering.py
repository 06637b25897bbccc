"""Layering, enforced by walking the import statements of every module.

* `prototype/` imports `sim/` only in its composition root, `prototype/server.py`.
* The sans-IO core (wire types, state machines, framing, rendering) and all of
  `sim/` except its async adapters (`runtime/realtime.py`: live costs on the wall clock; `runtime/virtual.py`: the
  virtual-time loop; `inprocess.py`: the socket-less transport; `experiment.py`: composes
  a live or in-process server; `tools.py`: tool subprocesses) import no asyncio,
  aiohttp or uvloop.
* uvloop is chosen only in entry points.
* The same, transitively: a fresh interpreter imports each pure module and must not
  have loaded asyncio, aiohttp, uvloop, redis or sqlite3 (and numpy where the module
  has no token arrays) by the end.
"""

from __future__ import annotations

import ast
import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IO_MODULES = {"asyncio", "aiohttp", "uvloop"}
PURE_CORE = {
    "schemas",
    "connection",
    "cache",
    "stream",
    "sse",
    "conversation",
    "model",
    "errors",
    "ids",
    "clock",
    "tokenizer",
    "timing",
    "constraints",
    "wsevents",
    "lanes",
    "frames",
    "conncache",
    "pauses",
    "steering",
    "agents",
    "agents_wire",
    "tables",
    "config",
    "options",
}
# Loaded by no pure module, directly or through another (numpy is allowed where tokens live:
# token arrays are numpy arrays).
BANNED_TRANSITIVELY = {"asyncio", "aiohttp", "uvloop", "redis", "sqlite3"}
NO_NUMPY = {"schemas", "sse", "errors", "ids", "clock", "constraints", "options"}
ENTRY_POINTS = {
    ROOT / "prototype" / "server.py",
    ROOT / "sim" / "__main__.py",
    ROOT / "sim" / "bench" / "__main__.py",  # the benchmark's load generator
    ROOT / "sim" / "bench" / "server.py",  # the benchmark's server process
}


def imports(path: Path) -> set[str]:
    """Top-level package names imported by a module, resolving relative imports against its package."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.parent.name
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add(package)
            elif node.module:
                names.add(node.module.split(".")[0])
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", modules("prototype"), ids=lambda p: p.name)
def test_prototype_imports_sim_only_at_the_composition_root(path: Path) -> None:
    if path == ROOT / "prototype" / "server.py":
        return
    assert "sim" not in imports(path), f"{path.name} imports sim/"


@pytest.mark.parametrize("path", [p for p in modules("prototype") if p.stem in PURE_CORE], ids=lambda p: p.name)
def test_sans_io_core_does_no_io(path: Path) -> None:
    assert not imports(path) & IO_MODULES, f"{path.name} imports {imports(path) & IO_MODULES}"


# experiment: composes servers; tools: real tool subprocesses; wsclient: the benchmark's socket client;
# contract: the benchmark's rollout client (sim.bench contract)
# lanes: the benchmark's lanes-against-sockets load; client: the harness's measuring client (HTTP, SSE, WebSocket);
# agents_client: its Agents API counterpart (HTTP, SSE)
# llamacpp, backend, rates: the real engine's HTTP client, its process's lifetime, its measured rates (sim/engine/)
SIM_ASYNC_ADAPTERS = {
    "llamacpp.py",
    "rates.py",
    "backend.py",
    "realtime.py",
    "virtual.py",
    "inprocess.py",
    "experiment.py",
    "tools.py",
    "wsclient.py",
    "contract.py",
    "lanes.py",
    "client.py",
    "agents_client.py",
}


@pytest.mark.parametrize("path", [p for p in modules("sim") if p.name not in SIM_ASYNC_ADAPTERS], ids=lambda p: p.name)
def test_sim_uses_asyncio_only_in_realtime(path: Path) -> None:
    allowed = IO_MODULES if path in ENTRY_POINTS else set()  # entry points compose the live server
    assert not (imports(path) & IO_MODULES) - allowed, f"{path.name} imports {imports(path) & IO_MODULES}"


@pytest.mark.parametrize("path", modules("prototype") + modules("sim"), ids=lambda p: p.name)
def test_uvloop_only_in_entry_points(path: Path) -> None:
    if path not in ENTRY_POINTS:
        assert "uvloop" not in imports(path)


def prototype_imports(path: Path) -> set[str]:
    """The prototype/ modules a prototype/ module imports (relative imports, `TYPE_CHECKING` ones too)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                names.add(node.module.split(".")[0])
            else:
                names.update(alias.name for alias in node.names)
    return names


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_prototype_has_no_import_cycles() -> None:
    graph = {path.stem: prototype_imports(path) for path in modules("prototype")}
    assert not import_cycles(graph)


def test_the_cycle_finder_finds_cycles() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("path", modules("prototype"), ids=lambda p: p.name)
def test_prototype_imports_only_at_module_level(path: Path) -> None:
    """An import inside a function hides a dependency (and, in prototype/, usually a cycle)."""
    tree = ast.parse(path.read_text(), str(path))
    nested = [
        node.lineno
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    assert not nested, f"{path.name} imports inside a function at lines {nested}"


def test_the_checker_sees_imports() -> None:
    server = imports(ROOT / "prototype" / "server.py")
    assert {"sim", "uvloop", "prototype", "aiohttp"} <= server


def loaded_by(module: str) -> set[str]:
    """Top-level packages in `sys.modules` after a fresh interpreter imports `module`."""
    code = (
        "import json, sys\n"
        f"before = set(sys.modules)\nimport {module}\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(done.stdout))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PURE_CORE))
def test_sans_io_core_loads_no_io_transitively(name: str) -> None:
    loaded = loaded_by(f"prototype.{name}")
    banned = BANNED_TRANSITIVELY | ({"numpy"} if name in NO_NUMPY else set())
    assert not loaded & banned, f"importing prototype.{name} loads {sorted(loaded & banned)}"


@pytest.mark.slow
def test_the_transitive_checker_sees_imports() -> None:
    assert {"asyncio", "aiohttp"} <= loaded_by("prototype.serve.app")


@pytest.mark.slow
def test_the_session_core_loads_no_aiohttp() -> None:
    """`prototype.serve.session` drives both the live server and the in-process transport: no aiohttp."""
    loaded = loaded_by("prototype.serve.session")
    assert "asyncio" in loaded and not loaded & {"aiohttp", "uvloop"}, sorted(loaded)


# asyncio's private loop state, read by the virtual-time loop only (sim/runtime/virtual.py).
PRIVATE_LOOP_STATE = ("_run_once", "_ready", "_scheduled", "_stopping", "_clock_resolution")


@pytest.mark.parametrize("path", modules("prototype") + modules("sim"), ids=lambda p: p.name)
def test_asyncio_private_loop_state_is_read_in_one_module(path: Path) -> None:
    if path == ROOT / "sim" / "runtime" / "virtual.py":
        return
    tree = ast.parse(path.read_text(), str(path))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not used & set(PRIVATE_LOOP_STATE), f"{path.name} reads {sorted(used & set(PRIVATE_LOOP_STATE))}"


def test_this_python_has_the_private_loop_state_the_virtual_loop_reads() -> None:
    """Fails loudly on a Python whose event loop lacks what sim/runtime/virtual.py relies on (written
    against CPython 3.11 to 3.13)."""
    import asyncio  # here, not at the top: this module is about who imports asyncio

    assert (3, 11) <= sys.version_info[:2] <= (3, 13), f"sim/runtime/virtual.py is unverified on Python {sys.version}"
    loop = asyncio.new_event_loop()
    try:
        assert isinstance(loop, asyncio.BaseEventLoop)
        missing = [name for name in PRIVATE_LOOP_STATE if not hasattr(loop, name)]
        assert not missing, f"asyncio's loop lacks {missing}: sim/runtime/virtual.py needs updating"
        assert isinstance(loop._ready, collections.deque)  # type: ignore[attr-defined]
        assert isinstance(loop._scheduled, list)  # type: ignore[attr-defined]
    finally:
        loop.close()


MAX_CLASS_LINES = 400  # h11's `Connection` is about 500 lines; a class past this owns too much


@pytest.mark.parametrize("path", modules("prototype"), ids=lambda p: p.name)
def test_no_class_in_prototype_is_over_400_lines(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    sizes = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None
    }
    assert not {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}, sizes
