"""Exit 0 when hf_unlearn is installed editable from CHECKOUT, CHECKOUT/pyproject.toml has not changed since, and
every requirement of hf_unlearn[EXTRAS] (core included) is installed at a version it allows.

``make demo`` and ``make test`` run ``pip install -e .[all]`` / ``.[dev]`` only when this says no: an editable
install already serves every code change, and the install itself took about 30 s on every run. A changed
pyproject.toml (new dependencies, extras, entry points), an install from another folder, or a requirement of the
extras that is missing (``make demo`` then ``make test`` in a new virtual environment) still installs.

Usage: python tools/installed_here.py [CHECKOUT] [EXTRA,...]   (default: the current folder, no extra)
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from urllib.parse import unquote, urlsplit


def installed_here(checkout: Path, extras: tuple[str, ...] = ()) -> bool:
    try:
        dist = distribution("hf_unlearn")
        origin = json.loads(dist.read_text("direct_url.json") or "{}")
    except (PackageNotFoundError, ValueError):
        return False
    url = urlsplit(origin.get("url", ""))
    if not (origin.get("dir_info") or {}).get("editable") or url.scheme != "file":
        return False
    if Path(unquote(url.path)).resolve() != checkout.resolve():
        return False
    record = Path(str(getattr(dist, "_path", "") or dist.locate_file("")))  # the install's .dist-info folder
    pyproject = checkout / "pyproject.toml"
    if not (pyproject.is_file() and pyproject.stat().st_mtime <= record.stat().st_mtime):
        return False
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # (last: the installed metadata must win)
    try:
        from hf_unlearn.requirements import unmet_requirements
    except ImportError:  # packaging missing: let pip sort it out
        return False
    return unmet_requirements(extras) == []


if __name__ == "__main__":
    extras = tuple(e for e in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if e)
    sys.exit(0 if installed_here(Path(sys.argv[1] if len(sys.argv) > 1 else "."), extras) else 1)
