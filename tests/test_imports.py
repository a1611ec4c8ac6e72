"""The project's import graph: no cycle among its modules, and imports run bottom to top (DESIGN.md §2:
``models ← infer ← eval ← train, scripts``; models/ imports nothing of ours above it, infer/ only models/, eval/ never
train/ or scripts/). Every import counts, at module level or inside a function: deferring one hides a cycle, it does
not remove it."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

PACKAGES = ("models", "infer", "eval", "train", "scripts")
MAY_IMPORT = {"models": {"models"}, "infer": {"models", "infer"}, "eval": {"models", "infer", "eval"}}
"""What each lower room may import (train/ and scripts/ may import any room)."""
DATA_MAY_IMPORT = {"models", "infer", "eval", "train.data"}
"""Data building (train/data/) sits below the training scripts and their helpers: it imports none of them."""


def project_modules() -> dict[str, str]:
    """Dotted module name → source, for every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = path.read_text()
    return out


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module → the project modules it imports (``from pkg import mod`` imports ``pkg.mod``; ``from mod import name``
    imports ``mod``)."""

    def owner(name: str) -> str | None:  # the project module that defines ``name`` (a module or a name inside one)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, source in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: relative import (the project imports absolutely)"
                deps.add(owner(node.module))
                deps |= {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
        graph[name] = deps - {None, name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules, the first repeated at the end), or [] when it is acyclic."""
    done, path = set(), []

    def visit(node: str) -> list[str]:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return []
        path.append(node)
        for dep in sorted(graph[node]):
            cycle = visit(dep)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return []

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return []


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    modules = {
        "train.data.dataset": "from train.data.answerer import answer\n",
        "train.data.answerer": "def f():\n    from train.data.dataset import render\n",  # a deferred import counts
        "train.data.chat_render": "import re\n",
        "infer": "",
        "infer.families": "from infer import family\n",
        "infer.family": "",
    }
    graph = import_graph(modules)
    assert graph["infer.families"] == {"infer", "infer.family"}
    assert find_cycle(graph) == ["train.data.answerer", "train.data.dataset", "train.data.answerer"]
    modules["train.data.answerer"] = "from train.data.chat_render import render\n"
    assert find_cycle(import_graph(modules)) == []


def test_the_project_has_no_import_cycle():
    graph = import_graph(project_modules())
    assert len(graph) > 50 and graph["infer.families"] >= {"infer.family", "infer.eagle3_proposer"}
    assert find_cycle(graph) == []


def test_imports_run_bottom_to_top():
    upward = {
        name: sorted(d for d in deps if d.split(".")[0] not in MAY_IMPORT[name.split(".")[0]])
        for name, deps in import_graph(project_modules()).items()
        if name.split(".")[0] in MAY_IMPORT
    }
    assert {name: deps for name, deps in upward.items() if deps} == {}


def test_data_building_imports_no_training_module():
    def inside(module: str, rooms: set[str]) -> bool:
        return any(module == room or module.startswith(f"{room}.") for room in rooms)

    data = {name: deps for name, deps in import_graph(project_modules()).items() if inside(name, {"train.data"})}
    assert len(data) > 5
    upward = {name: sorted(d for d in deps if not inside(d, DATA_MAY_IMPORT)) for name, deps in data.items()}
    assert {name: deps for name, deps in upward.items() if deps} == {}
