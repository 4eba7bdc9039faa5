"""A griffe extension for the API reference: the docstrings' Sphinx roles (``:class:`X```, ``:func:`~a.b.f```) become
links when they name a public object the API page renders, and plain code otherwise (instead of the raw role text).

A target is looked up as written, as ``hf_unlearn.NAME`` and as a bare public name, against ``hf_unlearn._LAZY``
(public name -> defining module); a link uses mkdocs-autorefs' ``[title][identifier]`` syntax, so a link to an object
that is not rendered fails the strict build instead of pointing nowhere.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc):`~?\.?([\w.]+)`")


def _public() -> dict[str, str]:
    """Every way a docstring may name a public object -> the identifier it is rendered under."""
    from hf_unlearn import _LAZY

    out = {}
    for name, module in _LAZY.items():
        full = f"{module}.{name}"
        out.update({name: full, f"hf_unlearn.{name}": full, full: full})
    return out


class SphinxRoles(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self.public = _public()

    def _convert(self, text: str) -> str:
        def link(m: re.Match) -> str:
            target = m.group(1)
            shown = target.rpartition(".")[2] if m.group(0).count("~") else target
            ident = self.public.get(target)
            return f"[`{shown}`][{ident}]" if ident else f"`{shown}`"

        return ROLE.sub(link, text)

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = self._convert(obj.docstring.value)
