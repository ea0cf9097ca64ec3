"""The source tree's layout rules (issue: a newcomer tells the core from the tools at a glance).

- No import circles: no module reaches itself through its imports, module-level or inside a function.
- No package holds more than 12 modules.
- The README's "Where things are" section names every package, and names only packages that exist.
- pyproject's package list names every package (a non-editable install, as the GPU machine's, leaves out the rest).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject's package-dir).
FOLDERS = {"rlspec": "rlspec", "spec": "rlspec.spec", "backends": "rlspec.backends", "sync": "rlspec.sync",
           "conformance": "rlspec.conformance"}
MAX_MODULES = 12


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every source module by its import name -> (file, is a package's __init__)."""
    found = {}
    for folder, package in FOLDERS.items():
        for file in sorted((ROOT / folder).rglob("*.py")):
            parts = list(file.relative_to(ROOT / folder).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            if is_init:
                parts.pop()
            found[".".join([package, *parts])] = (file, is_init)
    return found


def _imports(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the rlspec modules it imports (a name imported from a package that is a module counts as it)."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, (file, is_init) in modules.items():
        package = name if is_init else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circles():
    assert _circles(_imports(_modules())) == []


def test_the_circle_finder_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]


def test_no_package_holds_more_than_twelve_modules():
    sizes: dict[str, int] = {}
    for name, (_, is_init) in _modules().items():
        if not is_init:
            sizes[name.rpartition(".")[0]] = sizes.get(name.rpartition(".")[0], 0) + 1
    assert {p: n for p, n in sizes.items() if n > MAX_MODULES} == {}


def test_the_readme_says_where_every_package_is():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([\w/]+)/` \|", section, re.M))
    packages = {str(f.parent.relative_to(ROOT)) for f in ROOT.glob("*/**/__init__.py")
                if f.parent.relative_to(ROOT).parts[0] in FOLDERS}
    packages.discard("rlspec")
    assert named == packages
    for first in re.findall(r"^\| `[\w/]+/` \| .*? \| `([\w/.]+)` \|$", section, re.M):
        assert (ROOT / first).is_file(), first


def test_pyproject_installs_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, (_, is_init) in _modules().items() if is_init}
    assert packages - listed == set(), "add them to [tool.setuptools] packages in pyproject.toml"
