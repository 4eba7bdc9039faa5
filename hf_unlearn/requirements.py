"""What hf_unlearn declares it needs, read from its installed metadata (pyproject.toml's dependencies and extras).

Two users: the CLI, which turns a ``ModuleNotFoundError`` into one line naming what to install (the extra when the
module comes from one), and the test that every third-party module the package imports is declared
(tests/test_dependencies.py).
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

PACKAGE = "hf_unlearn"
# import names whose distribution is spelled otherwise (for a module that is not installed, nothing maps it)
DISTRIBUTION_OF = {"yaml": "pyyaml", "sklearn": "scikit-learn", "google": "protobuf"}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``PyYAML`` == ``pyyaml``, ``rouge-score`` == ``rouge_score``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements(package: str = PACKAGE) -> dict[str, set[str]]:
    """``{distribution: {extras that declare it}}`` for an installed package, ``""`` standing for the core
    dependencies; an extra that names the package itself (``all = ["hf_unlearn[gguf,eval]"]``) is expanded.
    Empty when the package is not installed."""
    try:
        lines = requires(package) or []
    except PackageNotFoundError:
        return {}
    direct: dict[str, set[str]] = {}
    includes: dict[str, set[str]] = {}  # extra -> the package's own extras it pulls in
    for line in lines:
        req = Requirement(line)
        extras = _extras_of(req) or {""}
        if normalize(req.name) == normalize(package):
            for extra in extras:
                includes.setdefault(extra, set()).update(req.extras)
            continue
        direct.setdefault(normalize(req.name), set()).update(extras)
    changed = True
    while changed:  # extra X includes extra Y: every distribution of Y is declared by X as well
        changed = False
        for declared_by in direct.values():
            for extra, pulled in includes.items():
                if declared_by & pulled and extra not in declared_by:
                    declared_by.add(extra)
                    changed = True
    return direct


def _extras_of(req: Requirement) -> set[str]:
    if req.marker is None:
        return set()
    return set(re.findall(r"""extra\s*==\s*["']([^"']+)["']""", str(req.marker)))


def missing_dependency_message(module: str, package: str = PACKAGE) -> str:
    """One line for ``ModuleNotFoundError: No module named MODULE``: what is missing and the command that installs it."""
    top = module.split(".")[0]
    dist = DISTRIBUTION_OF.get(top, top)
    declared = declared_requirements(package).get(normalize(dist))
    if declared is None:
        return f"the Python module '{top}' is not installed: pip install {dist}"
    if "" in declared:
        return (f"'{dist}', a dependency of {package}, is not installed (an install from before it was declared?): "
                f"pip install -U {package}  (or pip install {dist})")
    extra = min(declared - {"all", "dev"} or declared, key=len)
    return f"this command needs '{dist}', from the extra [{extra}]: pip install '{package}[{extra}]'"


def unmet_requirements(extras: tuple[str, ...] = (), package: str = PACKAGE) -> list[str]:
    """The requirements of ``package[extras]`` (core included, the package's own extras expanded) that no installed
    distribution satisfies: ``[]`` when ``pip install package[extras]`` would install nothing new."""
    try:
        lines = requires(package) or []
    except PackageNotFoundError:
        return [package]
    wanted, todo, unmet = {""}, list(extras), []
    while todo:
        extra = todo.pop()
        if extra in wanted:
            continue
        wanted.add(extra)
        for line in lines:
            req = Requirement(line)
            if normalize(req.name) == normalize(package) and req.marker is not None and req.marker.evaluate({"extra": extra}):
                todo.extend(req.extras)
    for line in lines:
        req = Requirement(line)
        if normalize(req.name) == normalize(package):
            continue
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in wanted):
            continue
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            unmet.append(str(req))
            continue
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            unmet.append(f"{req} (installed: {installed})")
    return unmet
