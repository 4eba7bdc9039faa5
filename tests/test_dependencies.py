"""Every third-party module hf_unlearn imports is declared in pyproject.toml (core or an extra), read from the
installed metadata, so that a fresh `pip install` has it; and a missing one is one line naming what to install."""

from __future__ import annotations

import ast
import sys
from importlib.metadata import packages_distributions

import pytest

from hf_unlearn.requirements import declared_requirements, missing_dependency_message, normalize

from .conftest import ROOT


def imported_modules(folder) -> dict[str, set[str]]:
    """``{top-level module: {files importing it}}`` for every absolute import anywhere in a file (module level,
    inside functions, under ``if TYPE_CHECKING``), and ``importlib.import_module("name")`` with a literal name."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                  and not node.args[0].value.startswith(".")):
                names = [node.args[0].value]
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def third_party(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: files for m, files in modules.items() if m not in sys.stdlib_module_names and m != "hf_unlearn"}


def test_the_scan_sees_lazy_and_dynamic_imports(tmp_path, monkeypatch):
    """The walker itself: an import inside a function, under TYPE_CHECKING and by import_module all count."""
    import tests.test_dependencies as me

    monkeypatch.setattr(me, "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import alpha.sub\n"
        "def f():\n    from beta import x\n    import importlib\n    return importlib.import_module('gamma.y')\n"
        "from . import sibling\n")
    assert set(third_party(imported_modules(tmp_path / "pkg"))) == {"alpha", "beta", "gamma"}


def test_every_imported_third_party_module_is_declared():
    declared = declared_requirements()
    assert declared, "hf_unlearn is not installed (pip install -e '.[dev]')"
    assert "" in declared.get("torch", set()) and "" in declared.get("cryptography", set())
    dists = packages_distributions()
    undeclared = {}
    for module, files in sorted(third_party(imported_modules(ROOT / "hf_unlearn")).items()):
        providers = {normalize(d) for d in dists.get(module, [])}
        if not providers & set(declared):
            undeclared[module] = (sorted(providers) or ["not installed"], sorted(files)[:3])
    assert undeclared == {}, f"imported but not declared in pyproject.toml (module: distributions, files): {undeclared}"


def test_receipts_need_nothing_beyond_the_core_dependencies():
    """Keys, the ledger and receipts are core (every deletion request gets a signed receipt): every module they
    import is declared by the dependencies, not by an extra."""
    declared = declared_requirements()
    dists = packages_distributions()
    modules = {m for m, files in third_party(imported_modules(ROOT / "hf_unlearn")).items()
               if any(f.startswith(("hf_unlearn/keys.py", "hf_unlearn/deletion/")) for f in files)}
    assert "cryptography" in modules
    for module in modules:
        providers = {normalize(d) for d in dists.get(module, [])}
        assert any("" in declared.get(p, set()) for p in providers), f"{module}: not a core dependency"


def test_declared_requirements_expand_the_packages_own_extras():
    declared = declared_requirements()
    assert {"trl", "all", "dev"} <= declared["trl"]  # trl is in [trl], and [all] and [dev] pull [trl] in
    assert declared["pytest"] == {"dev"}


@pytest.mark.parametrize("module, expected", [
    ("cryptography.hazmat.primitives", "pip install -U hf_unlearn"),
    ("trl", "pip install 'hf_unlearn[trl]'"),
    ("sklearn", "'scikit-learn', from the extra [analysis]"),
    ("not_a_module_anyone_declares", "'not_a_module_anyone_declares' is not installed"),
])
def test_a_missing_module_is_one_line_naming_what_to_install(module, expected):
    message = missing_dependency_message(module)
    assert expected in message and "\n" not in message, message


def test_requests_add_prints_what_to_install_not_a_traceback(tmp_path, monkeypatch, capsys):
    """`hf-unlearn requests add` where cryptography cannot be imported: one line naming the package, exit 1."""
    from hf_unlearn.cli import main

    from .test_trace_common import get_recorded, ids_at_step

    run = get_recorded()
    ids = tmp_path / "ids.jsonl"
    ids.write_text(f"{ids_at_step(run, 3)[0]}\n")
    monkeypatch.setitem(sys.modules, "cryptography", None)  # `import cryptography...` now raises ModuleNotFoundError
    for name in [m for m in sys.modules if m.startswith("cryptography.") or m == "hf_unlearn.keys"]:
        monkeypatch.delitem(sys.modules, name)
    capsys.readouterr()
    code = main(["requests", "add", str(run), "--ledger", str(tmp_path / "ledger"), "--ids", str(ids)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err and "ModuleNotFoundError" not in err, err
    assert "'cryptography'" in err and "pip install" in err, err


def test_constraints_pin_every_declared_requirement_and_the_makefiles_torch():
    """CI installs with ``-c constraints.txt``: a requirement the file does not pin would come at whatever version
    the registry serves that day, the way kernels 0.19.1 turned CI red. Regenerate with ``make constraints``."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[normalize(name)] = version.strip()
    missing = sorted(name for name, extras in declared_requirements().items() if "dev" in extras and name not in pins)
    assert not missing, f"not pinned in constraints.txt (run `make constraints`): {missing}"
    makefile_torch = next(line.split("?=")[1].strip() for line in (ROOT / "Makefile").read_text().splitlines()
                          if line.startswith("TORCH_VERSION"))
    assert pins["torch"] == makefile_torch
