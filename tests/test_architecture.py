"""The package's architecture holds: its import contracts (.importlinter) are kept, every module is placed on a floor,
no import circle exists anywhere (imports inside functions included), and docs/architecture's map is the code's.

The import graph is grimp's (what import-linter checks): every ``import`` statement of every module, at module level
or inside a function, so a lazy import that points up or closes a circle is found like any other.
"""

from __future__ import annotations

import configparser
import importlib.util
import re

import pytest

from .conftest import ROOT

grimp = pytest.importorskip("grimp", reason="the architecture checks need import-linter (the dev extra)")
CONFIG = ROOT / ".importlinter"


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("hf_unlearn", cache_dir=None)


def _tool():
    spec = importlib.util.spec_from_file_location("architecture_tool", ROOT / "tools" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _contracts() -> dict[str, dict[str, str]]:
    parser = configparser.ConfigParser()
    parser.read(CONFIG, encoding="utf-8")
    return {s.split(":", 2)[2]: dict(parser[s]) for s in parser.sections() if s.startswith("importlinter:contract:")}


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def modules_from_files(package=ROOT / "hf_unlearn") -> set[str]:
    """Every module of the package as its files say: each ``.py`` file, a package's ``__init__.py`` as the package."""
    found = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def unplaced(modules: set[str], contracts: dict[str, dict[str, str]]) -> list[str]:
    """The modules no layers contract places: a room of ``hf_unlearn`` that is on no floor of a contract whose
    container is ``hf_unlearn``, or a module of a room that has its own layers contract and is on none of its floors.
    A package that no ``acyclic_siblings`` contract covers is reported too."""
    placed: dict[str, set[str]] = {}  # container -> the names on its floors
    acyclic: set[str] = set()
    for contract in contracts.values():
        if contract.get("type") == "layers":
            names = {n.strip().strip("()") for line in _lines(contract["layers"]) for n in re.split(r"[|:]", line)}
            for container in _lines(contract.get("containers", "")):
                placed.setdefault(container, set()).update(names)
        elif contract.get("type") == "acyclic_siblings":
            acyclic.update(_lines(contract["ancestors"]))
    problems = []
    for module in sorted(modules):
        parts = module.split(".")
        for depth in range(1, len(parts)):
            container, name = ".".join(parts[:depth]), parts[depth]
            if container in placed and name not in placed[container]:
                problems.append(f"{module}: {name} is on no floor of {container}'s layers contract")
                break
    packages = {m for m in modules if any(o.startswith(m + ".") for o in modules)}
    for package in sorted(packages):
        if package not in acyclic and not ("hf_unlearn.**" in acyclic and package != "hf_unlearn"):
            problems.append(f"{package}: no acyclic_siblings contract covers it")
    if "hf_unlearn" not in placed:
        problems.append("no layers contract has hf_unlearn as its container")
    return problems


def import_circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative): each is a set of modules
    that reach each other, i.e. at least one import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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


def _describe(graph, circle: list[str]) -> str:
    members = set(circle)
    edges = []
    for importer in circle:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            lines = sorted({d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)})
            edges.append(f"    {importer} -> {imported} (line {', '.join(map(str, lines))})")
    return f"  a circle of {len(circle)} modules:\n" + "\n".join(edges)


def test_the_import_contracts_hold(capsys, monkeypatch):
    """`lint-imports` in this process: the floors of .importlinter, the methods' and the deletion path's inner floors
    and no circle inside any package. The use case, not the console script's entry: the script reconfigures logging
    with ``logging.config.dictConfig``, which disables every logger already created in the process (the library's
    warnings would then vanish from the tests that run after it)."""
    from importlinter import configuration
    from importlinter.application.use_cases import lint_imports

    configuration.configure()  # what the console script does first: the readers of .importlinter and the printer
    monkeypatch.chdir(ROOT)
    passed = lint_imports(config_filename=str(CONFIG), cache_dir=None, no_logo=True)
    out = capsys.readouterr().out
    assert passed, f"lint-imports found broken contracts:\n{out[out.find('Broken contracts'):][-8000:]}"


def test_every_module_is_placed_on_a_floor(graph):
    modules = modules_from_files()
    assert modules - set(graph.modules) == set(), "files grimp does not see as modules (a folder without __init__.py?)"
    assert unplaced(modules, _contracts()) == []


def test_a_new_module_on_no_floor_is_reported():
    """The check itself: a new room, a new module of a room with inner floors, and a package no acyclic contract
    covers are each reported; the package as it is is not."""
    contracts = _contracts()
    modules = modules_from_files()
    assert unplaced(modules | {"hf_unlearn.newroom"}, contracts) == [
        "hf_unlearn.newroom: newroom is on no floor of hf_unlearn's layers contract"]
    assert unplaced(modules | {"hf_unlearn.methods.new_method"}, contracts) == [
        "hf_unlearn.methods.new_method: new_method is on no floor of hf_unlearn.methods's layers contract"]
    narrow = {**contracts, "acyclic": {"type": "acyclic_siblings", "ancestors": "hf_unlearn"}}
    assert "hf_unlearn.trace: no acyclic_siblings contract covers it" in unplaced(modules, narrow)


def test_no_import_circle_anywhere(graph):
    """Zero circles in the whole module graph, imports inside functions included (a lazy import is an import)."""
    circles = import_circles(graph)
    assert circles == [], "import circles:\n" + "\n".join(_describe(graph, c) for c in circles)


def test_the_circle_finder_finds_a_long_circle_and_only_it():
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d", "p.e"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.c")
    g.add_import(importer="p.c", imported="p.a", line_number=9, line_contents="from .a import x")  # closes a -> b -> c
    g.add_import(importer="p.d", imported="p.e")
    assert import_circles(g) == [["p.a", "p.b", "p.c"]]
    g.remove_import(importer="p.c", imported="p.a")
    assert import_circles(g) == []


def test_nothing_imports_the_package_root(graph):
    """``hf_unlearn/__init__.py`` is the public facade, above every floor (it reaches every room by name): a module
    that imports it points up."""
    assert graph.find_modules_that_directly_import("hf_unlearn") == set()


def test_the_architecture_map_is_fresh(graph):
    """docs/architecture/rooms.txt (the floors and every arrow between rooms) is what the code says today: a new
    arrow between rooms, or a new floor, needs `make architecture` (and a look at the picture)."""
    tool = _tool()
    floor_list = tool.present_floors(graph, tool.floors(CONFIG))
    fresh = tool.listing(floor_list, tool.room_arrows(graph))
    committed = (ROOT / "docs" / "architecture" / "rooms.txt").read_text(encoding="utf-8")
    assert committed == fresh, "docs/architecture is stale: run `make architecture` and commit rooms.txt and rooms.svg"
    svg = (ROOT / "docs" / "architecture" / "rooms.svg").read_text(encoding="utf-8")
    rooms = {room for floor in floor_list for room in floor}
    assert {room for room in rooms if f">{room}<" not in svg} == set(), "rooms.svg misses rooms: make architecture"
