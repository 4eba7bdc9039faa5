"""The result container every benchmark returns: a summary, per-item values and metadata, as JSON and markdown."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..errors import UnlearnError
from ..utils import atomic_write_text


def _clean(value: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python, NaN/inf to None."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


@dataclass
class EvalResult:
    """``summary`` (metric -> float or None), ``per_item`` (one dict per evaluated item), ``meta`` (what was evaluated:
    split, ids, tokenizer fingerprint, prompt format, settings)."""

    summary: dict[str, Any]
    per_item: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    kind: ClassVar[str] = "eval"

    def to_dict(self) -> dict[str, Any]:
        return _clean({"kind": self.kind, "summary": self.summary, "meta": self.meta, "per_item": self.per_item})

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write the result (atomically) as indented JSON; returns the path."""
        path = Path(path)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n")
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike):
        path = Path(path)
        if not path.is_file():
            raise UnlearnError(f"result file {path} does not exist")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise UnlearnError(f"{path} is not a JSON result file ({e.msg})") from None
        if not isinstance(data, dict) or data.get("kind") != cls.kind:
            found = data.get("kind") if isinstance(data, dict) else type(data).__name__
            raise UnlearnError(f"{path} holds a {found!r} result, not a {cls.kind!r} one")
        return cls(summary=data["summary"], per_item=data.get("per_item", []), meta=data.get("meta", {}))

    def headline(self) -> dict[str, Any]:
        """The few numbers people quote (subclasses choose)."""
        return dict(self.summary)

    def to_markdown(self) -> str:
        lines = [f"## {self.kind.upper()} evaluation", ""]
        described = ", ".join(f"{k}: {v}" for k, v in self.meta.items() if isinstance(v, (str, int, float, bool)))
        if described:
            lines += [described, ""]
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {fmt(v)} |" for k, v in self.headline().items()]
        return "\n".join(lines) + "\n"
