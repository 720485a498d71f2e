"""The layers of the installed package (README, "What is here"), read from every module's imports with `ast`.

Data flows one way: app -> (HTTP) -> engine -> kernels. Kernels import nothing of ours; the engine
imports no app, storage, evals or bench module; the app imports no engine module (it learns the model
from the engine's JSON) and nothing of bench; bench may import anything, and nothing imports bench.
Beside the packages sit a few modules of their own: `limits`, `processes` and `protocol` (the words of our
API beyond OpenAI's) import nothing of ours (any layer may use them), `api_client` (the one client of our
API, for the app, the evaluations and the benchmarks) only `protocol`, `perfmodel` (used by the app and the
benchmarks) reads the engine's config rules, and `cli` only names the commands' modules.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PARTS = ("kernels", "engine", "storage", "evals", "app", "bench", "static")
LEAVES = {"limits", "processes", "protocol"}  # beside the packages, importing nothing of ours

# What each layer may import (besides itself and the leaves); None: anything.
ALLOWED: dict[str, set[str] | None] = {
    "kernels": set(),
    "engine": {"kernels"},
    "storage": set(),
    "evals": {"engine", "storage", "api_client"},
    "app": {"evals", "storage", "perfmodel", "api_client"},
    "bench": None,
    "static": set(),
    "limits": set(),
    "processes": set(),
    "protocol": set(),
    "api_client": set(),  # and the leaves (protocol)
    "perfmodel": {"engine.config"},  # the engine's own schedule rules, not its runtime
    "cli": None,  # imports each command's module by name, as a string
    "__main__": {"cli"},
}


def layer_of(module: str) -> str:
    """`laneplay.engine.model` -> "engine", `laneplay.limits` -> "limits"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def installed_modules() -> dict[str, Path]:
    """Every module of the installed `laneplay` package: dotted name -> file."""
    root = Path(next(iter(importlib.util.find_spec("laneplay").submodule_search_locations)))
    out = {f"laneplay.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    for part in PARTS:
        spec = importlib.util.find_spec(f"laneplay.{part}")
        assert spec is not None, f"laneplay.{part} is not installed"
        folder = Path(next(iter(spec.submodule_search_locations)))
        for p in folder.rglob("*.py"):
            rel = p.relative_to(folder).with_suffix("").parts
            name = ".".join(("laneplay", part, *rel))
            out[name.removesuffix(".__init__")] = p
    return out


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported laneplay module) for every import in the file, at any depth (lazy imports too)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from laneplay.kernels import lowbit` imports the module laneplay.kernels.lowbit
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name == "laneplay" or name.startswith("laneplay.")]


def allowed(src: str, dst: str) -> bool:
    a, b = layer_of(src), layer_of(dst)
    if a == b or b in LEAVES or b == "":
        return True
    rule = ALLOWED.get(a, set())
    if rule is None:
        return True
    sub = dst.split(".", 1)[1]  # "engine.config.ModelConfig"
    return any(b == r or sub == r or sub.startswith(r + ".") for r in rule)


def violations(edges: list[tuple[str, int, str]]) -> list[str]:
    return [f"{src}:{line} imports {dst}" for src, line, dst in edges if not allowed(src, dst)]


def layer_cycles(edges: list[tuple[str, int, str]]) -> list[list[str]]:
    """Cycles in the graph of layers (each layer one node)."""
    graph: dict[str, set[str]] = {}
    for src, _, dst in edges:
        a, b = layer_of(src), layer_of(dst)
        if a != b and b:
            graph.setdefault(a, set()).add(b)
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


@pytest.fixture(scope="module")
def edges() -> list[tuple[str, int, str]]:
    return [(name, line, dst) for name, path in sorted(installed_modules().items())
            for line, dst in imports_of(name, path)]


def test_every_part_of_the_package_is_read(edges):
    mods = installed_modules()
    for part in ("kernels", "engine", "app", "bench", "evals", "storage"):
        assert sum(layer_of(m) == part for m in mods) >= 3, part
    assert {"laneplay.limits", "laneplay.processes", "laneplay.protocol", "laneplay.api_client", "laneplay.perfmodel",
            "laneplay.cli"} <= set(mods)
    assert ("laneplay.engine.lowbit_step", "laneplay.kernels.lowbit") in {(s, d) for s, _, d in edges}


def test_no_import_goes_from_a_lower_layer_to_a_higher_one(edges):
    assert violations(edges) == []


def test_the_layers_have_no_cycle(edges):
    assert layer_cycles(edges) == []


def test_the_app_and_the_kernels_import_no_engine_module(edges):
    assert [f"{s}:{n} {d}" for s, n, d in edges if layer_of(s) in ("app", "kernels") and layer_of(d) == "engine"] == []
    assert [f"{s}:{n} {d}" for s, n, d in edges if layer_of(d) == "bench" and layer_of(s) != "bench"] == []


def test_the_checks_see_a_breach():
    """The rules above, on made-up edges: each forbidden direction is reported, each allowed one is not."""
    bad = [("laneplay.kernels.lowbit", 1, "laneplay.engine.model.rms_norm"),
           ("laneplay.engine.loader", 2, "laneplay.storage.Store"),
           ("laneplay.app.dtpview", 3, "laneplay.engine.config.ModelConfig"),
           ("laneplay.app.dtpview", 4, "laneplay.bench.perfmodel"),
           ("laneplay.perfmodel", 5, "laneplay.engine.model"),
           ("laneplay.engine.server", 11, "laneplay.api_client.EngineClient")]
    good = [("laneplay.engine.model", 6, "laneplay.kernels.lowbit"),
            ("laneplay.app.params", 7, "laneplay.limits"),
            ("laneplay.app.dtpview", 8, "laneplay.perfmodel.predict"),
            ("laneplay.bench.decode", 9, "laneplay.app.supervisor.LocalEngine"),
            ("laneplay.perfmodel", 10, "laneplay.engine.config.ModelConfig"),
            ("laneplay.engine.server", 12, "laneplay.protocol.sse_comment"),
            ("laneplay.evals.engine_generate", 13, "laneplay.api_client.SyncEngineClient")]
    assert len(violations(bad)) == len(bad) and violations(good) == []
    assert layer_cycles([("laneplay.app.x", 1, "laneplay.bench.y"), ("laneplay.bench.y", 2, "laneplay.app.z")])
    assert layer_cycles(good) == []
