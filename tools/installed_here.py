"""Exit 0 when hf_unlearn is installed editable from CHECKOUT and CHECKOUT/pyproject.toml has not changed since.

``make demo`` and ``make test`` run ``pip install -e .[all]`` only when this says no: an editable install already
serves every code change, and the install itself took about 30 s on every run. A changed pyproject.toml (new
dependencies, extras, entry points) or an install from another folder still reinstalls.

Usage: python tools/installed_here.py [CHECKOUT]   (default: the current folder)
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from urllib.parse import unquote, urlsplit


def installed_here(checkout: Path) -> bool:
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
    return pyproject.is_file() and pyproject.stat().st_mtime <= record.stat().st_mtime


if __name__ == "__main__":
    sys.exit(0 if installed_here(Path(sys.argv[1] if len(sys.argv) > 1 else ".")) else 1)
