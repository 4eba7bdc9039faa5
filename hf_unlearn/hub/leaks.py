"""Find forget ids in what is about to be published: the push knows the ids, so it looks for each of them.

:class:`IdScanner` replaces guessing ("does this look like an id list?") with matching the actual forget ids in
every value and text a push sends. What counts as a hit:

* a **number** equal to a forget id, wherever it is: an int or an integral float (``3600``, ``3600.0``) in any
  nested dict/list/tuple/set (single-element lists included), and in text every whole number, i.e. a run of digits
  not glued to letters or digits and not the fractional part of a decimal (``"rows 3600 and 3601"``,
  ``"3600,3601"``, ``"row-3600"``, ``"id_3600"``, ``"0003"`` = 3, ``"3.6e3"``), and every range whose span contains
  an id (``"3960-3963"``, ``"3950..3970"``, ``"3950 to 3970"``);
* a number written with thousands separators (``"3,600"``, ``"3_600"``, ``"3.600"``, ``"3 600"``, a no-break
  or thin space) or an ordinal/plural suffix (``"3600th"``, ``"3600s"``);
* a **string id** (``"piqa-17"``) as a whole word, case-insensitively, in the text as written and URL-decoded
  (``piqa%2D17``), its separators interchangeable (``piqa_17``, ``PIQA 17``, ``piqa/17``, ``alice.smith`` for
  ``alice-smith``); a digit-only string id (``"3600"``) is matched as a number too;
* in a **Jinja template** (a card template and what it includes, a chat template): the text, the comments and
  the string literals, numbers included; the numbers of the template's code (``messages[0]``, ``loop.index0 == 1``)
  are code, not data, and only string ids are matched there;
* dict **keys** are text like any other (``{"3600": ...}``, ``{"forgetIds": [3600]}``).

Not detected (documented, not guessed at): ids glued to letters (``row3600``), transformed ids (hashed without
the key, base64, hex, digits spelled out or split, computed by a template: ``{{ 3599 + 1 }}``), and numbers inside
files the scanner is told carry no sample ids (tokenizer vocabularies, tensor names' layer indices: see
:mod:`hf_unlearn.hub.publish`).

A number that merely equals an id (``max_steps: 3600`` with forget id 3600) is published only when the caller
says so for that field: ``not_ids={"hyperparameters.max_steps": 3600}`` (or ``True`` for any number in the field;
a field covers everything below it). String ids are never allowed.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..errors import UnlearnError
from ..not_ids import own_numbers  # noqa: F401  (re-exported: it lived here; trainers of every layer use it)

_END = r"(?:st|nd|rd|th|s)?(?![0-9a-z])"  # a number ends at a non-alphanumeric, or an ordinal/plural suffix
_WHOLE = re.compile(rf"(?<![0-9a-z])(?<!\d\.)(\d{{1,40}}){_END}")
# 3,600  3_600  3'600  3.600  3 600 (and a no-break or thin space, which NFKC makes a space): one separator
# throughout, a first group without a leading zero, not a version or a decimal (3.600.1, 0.125)
_GROUPED = re.compile(rf"(?<![0-9a-z])(?<!\d[.,_' ])([1-9]\d{{0,2}}([,_'. ])\d{{3}}(?:\2\d{{3}})*)(?!\.\d){_END}")
_SEPARATOR = re.compile(r"[-_\s./]+")  # what may stand between the parts of a string id: piqa-17, piqa/17, a.smith
_EXP = re.compile(r"(?<![0-9a-z])(?<!\d\.)(\d{1,20}(?:\.\d{1,20})?e[+-]?\d{1,3})(?![0-9a-z])")
_RANGE = re.compile(r"(?<![0-9a-z])(?<!\d\.)(\d{1,40})(?:\s*(?:-|–|—|\.\.\.?|~)\s*|\s+(?:to|through|thru|until)\s+)"
                    r"(\d{1,40})(?![0-9a-z])")
_INDEX = re.compile(r"\[\d+\]")
ANY = object()  # a not_ids allowance for every number in a field


@dataclass(frozen=True)
class Hit:
    """One forget id found in one field: ``what`` says how (``number 3600``, ``range 3960-3963``, ``id 'piqa-17'``)."""

    field: str
    what: str
    number: int | None = None  # set for numeric hits (the only ones an allowance can accept)

    def __str__(self) -> str:
        return f"{self.field} ({self.what})"


def _normal(text: str) -> str:
    return unicodedata.normalize("NFKC", text).casefold()


def _decoded_forms(text: str) -> list[str]:
    """The text as written and URL-decoded (repeatedly, for double encoding), normalised and case-folded."""
    forms, cur = [text], text
    for _ in range(3):
        nxt = unquote(cur.replace("+", " ")) if "%" in cur else cur
        if nxt == cur:
            break
        forms.append(nxt)
        cur = nxt
    return list(dict.fromkeys(_normal(f) for f in forms))


def _word_pattern(word: str) -> str:
    """A string id as a pattern whose separators (``-``, ``_``, spaces, ``.``, ``/``) match any of them:
    ``piqa-17`` also finds ``piqa_17``, ``PIQA 17`` and ``piqa/17``."""
    parts = [re.escape(p) for p in _SEPARATOR.split(word)]
    return _SEPARATOR.pattern.join(parts) if all(parts) else re.escape(word)


def field_of(path: str) -> str:
    """The allowance name of a reported field: list indices dropped (``tags[2]`` -> ``tags``)."""
    return _INDEX.sub("", path)


class IdScanner:
    """Matches a deletion request's forget ids in values and texts (see the module docstring for the rules)."""

    def __init__(self, forget_ids: Iterable, not_ids: Mapping[str, Any] | None = None):
        numbers, words = set(), set()
        for i in forget_ids:
            if isinstance(i, bool):
                continue
            if isinstance(i, int) or (hasattr(i, "item") and not isinstance(i, str)):
                numbers.add(abs(int(i)))
            else:
                text = _normal(str(i)).strip()
                if text.isdigit():
                    numbers.add(int(text))
                elif text:
                    words.add(text)
        self.numbers = numbers
        self._sorted = sorted(numbers)
        self.words = sorted(words, key=len, reverse=True)
        self._word_re = (re.compile("|".join(rf"(?<![0-9a-z]){_word_pattern(w)}(?![0-9a-z])" for w in self.words))
                         if self.words else None)
        self.not_ids = parse_not_ids(not_ids)

    def __bool__(self) -> bool:
        return bool(self.numbers or self.words)

    # -- matching ----------------------------------------------------------------------------------------------
    def _in_range(self, lo: int, hi: int) -> int | None:
        k = bisect.bisect_right(self._sorted, lo)
        return self._sorted[k] if k < len(self._sorted) and self._sorted[k] < hi else None

    def scan_text(self, text: str, field: str, *, numbers: bool = True) -> list[Hit]:
        """Hits in one text. ``numbers=False`` looks for string ids only (texts whose numbers mean something else)."""
        hits: list[Hit] = []
        if not self or not text:
            return hits
        for form in _decoded_forms(text):
            if self._word_re is not None:
                for m in self._word_re.finditer(form):
                    hits.append(Hit(field, f"id {m.group(0)!r}"))
            if not numbers or not self.numbers:
                continue
            for m in _WHOLE.finditer(form):
                n = int(m.group(1))
                if n in self.numbers:
                    hits.append(Hit(field, f"number {n}", n))
            for m in _GROUPED.finditer(form):
                n = int(re.sub(r"\D", "", m.group(1)))
                if n in self.numbers:
                    hits.append(Hit(field, f"number {m.group(1)}", n))
            for m in _EXP.finditer(form):
                value = float(m.group(1))
                if value.is_integer() and int(value) in self.numbers:
                    hits.append(Hit(field, f"number {m.group(1)}", int(value)))
            for m in _RANGE.finditer(form):
                lo, hi = int(m.group(1)), int(m.group(2))
                inside = self._in_range(lo, hi) if lo < hi else None
                if inside is not None:
                    hits.append(Hit(field, f"range {lo}-{hi} holds {inside}", inside))
        return self._allowed_out(list(dict.fromkeys(hits)))

    def scan_template(self, source: str, field: str, *, code_numbers: bool = False) -> list[Hit]:
        """Hits in a Jinja template's source: its text, comments and string literals with numbers, its code for
        string ids (an index or a comparison is code), and with ``code_numbers`` its code's number literals too (a
        card template renders ``{% set ids = [3600, 3601] %}``: one whose code holds a number that is a forget id is
        refused; allow one with ``not_ids``). A source Jinja cannot lex is scanned as plain text."""
        import jinja2

        try:
            tokens = list(jinja2.Environment().lex(source))
        except jinja2.TemplateSyntaxError:
            return self.scan_text(source, field)
        texts = "\n".join(value for _, kind, value in tokens if kind in ("data", "comment", "string", "raw"))
        code = [Hit(f"{field} (code)", f"number {int(v)}", int(v)) for _, kind, value in tokens
                if code_numbers and kind in ("integer", "float") and (v := _literal(value)) is not None and v.is_integer()
                and abs(int(v)) in self.numbers]
        return list(dict.fromkeys(self._allowed_out(code) + self.scan_text(texts, field)
                                  + self.scan_text(source, field, numbers=False)))

    def scan(self, value: Any, field: str, *, numbers: bool = True) -> list[Hit]:
        """Hits anywhere in a nested value (dict keys are scanned as text)."""
        hits: list[Hit] = []
        if not self:
            return hits
        self._walk(value, field, numbers, hits)
        return self._allowed_out(hits)

    def scan_strings(self, value: Any, field: str) -> list[Hit]:
        """Hits in every string below ``value`` (numbers inside the texts included); the non-string values are
        left alone (for structures whose numbers are known to be configuration, not ids)."""
        if isinstance(value, str):
            return self.scan_text(value, field)
        if isinstance(value, Mapping):
            return [h for k, v in value.items() for h in self.scan_strings(v, f"{field}.{k}")]
        if isinstance(value, (list, tuple)):
            return [h for n, v in enumerate(value) for h in self.scan_strings(v, f"{field}[{n}]")]
        return []

    def _walk(self, value, path: str, numbers: bool, hits: list[Hit]) -> None:
        if value is None or isinstance(value, bool):
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else str(k)
                hits += self.scan_text(str(k), f"{sub} (key)", numbers=numbers)
                self._walk(v, sub, numbers, hits)
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
            for n, v in enumerate(items):
                self._walk(v, f"{path}[{n}]", numbers, hits)
        elif isinstance(value, int) or (hasattr(value, "item") and not isinstance(value, (str, bytes))):
            try:
                number = value.item() if hasattr(value, "item") else value
            except (ValueError, TypeError):  # an array: its items
                self._walk(value.tolist(), path, numbers, hits)
                return
            self._walk_number(number, path, numbers, hits)
        elif isinstance(value, float):
            self._walk_number(value, path, numbers, hits)
        elif isinstance(value, bytes):
            hits += self.scan_text(value.decode("utf-8", "replace"), path, numbers=numbers)
        else:
            hits += self.scan_text(str(value.value) if _is_enum(value) else str(value), path, numbers=numbers)

    def _walk_number(self, number, path: str, numbers: bool, hits: list[Hit]) -> None:
        if not numbers or isinstance(number, bool):
            return
        if isinstance(number, float):
            if number != number or number in (float("inf"), float("-inf")) or not number.is_integer():
                return
            number = int(number)
        if isinstance(number, int) and abs(number) in self.numbers:
            hits.append(Hit(path, f"number {number}", abs(number)))

    def _allowed_out(self, hits: list[Hit]) -> list[Hit]:
        return [h for h in hits if not self.allowed(h)]

    def allowed(self, hit: Hit) -> bool:
        """True if a ``not_ids`` allowance covers this (numeric) hit."""
        if hit.number is None or not self.not_ids:
            return False
        name = field_of(hit.field.removesuffix(" (key)"))
        for prefix, values in self.not_ids.items():
            if name == prefix or name.startswith((prefix + ".", prefix + ":", prefix + "[")):
                if values is ANY or hit.number in values:
                    return True
        return False

    # -- refusing ----------------------------------------------------------------------------------------------
    def refuse(self, hits: list[Hit], what: str = "the push") -> None:
        """Raise one :class:`UnlearnError` naming the fields (and how to allow numbers that are not ids)."""
        if not hits:
            return
        shown = "; ".join(str(h) for h in hits[:6]) + (f"; and {len(hits) - 6} more" if len(hits) > 6 else "")
        numeric = {}
        for h in hits:
            if h.number is not None:
                numeric.setdefault(field_of(h.field.removesuffix(" (key)")), set()).add(h.number)
        advice = ""
        if numeric and all(h.number is not None for h in hits):
            allow = ", ".join(f"{k!r}: {sorted(v)[0] if len(v) == 1 else sorted(v)}" for k, v in numeric.items())
            flags = " ".join(f"--not-id {k}={','.join(map(str, sorted(v)))}" for k, v in numeric.items())
            advice = (f". If a number there is not a sample id, say so for that field: not_ids={{{allow}}} "
                      f"(CLI: {flags})")
        raise UnlearnError(f"refusing to publish: {what} would carry forget ids at {shown}. Nothing was sent to the "
                           f"Hub{advice or '. Remove the ids (publish keyed tags instead)'}")


def _literal(value) -> float | None:
    """A Jinja number token's value (``3_600``, ``0x10`` and ``1e3`` included), None if it is not a number."""
    try:
        return float(int(str(value).replace("_", ""), 0))
    except ValueError:
        try:
            return float(str(value).replace("_", ""))
        except ValueError:
            return None


def _is_enum(value) -> bool:
    import enum

    return isinstance(value, enum.Enum)


def parse_not_ids(not_ids) -> dict[str, Any]:
    """Normalise allowances: ``{field: number | [numbers] | True}`` or CLI strings ``"field=3600,3601"``."""
    if not not_ids:
        return {}
    if isinstance(not_ids, str):
        not_ids = [not_ids]
    if not isinstance(not_ids, Mapping):
        parsed: dict[str, Any] = {}
        for item in not_ids:
            name, sep, values = str(item).partition("=")
            if not sep or not name.strip():
                raise UnlearnError(f"--not-id {item!r} must look like FIELD=NUMBER[,NUMBER...] or FIELD=any")
            parsed[name.strip()] = True if values.strip().lower() in ("any", "*") else \
                [v.strip() for v in values.split(",") if v.strip()]
        not_ids = parsed
    out: dict[str, Any] = {}
    for name, values in not_ids.items():
        if values is True or values is ANY:
            out[field_of(str(name))] = ANY
            continue
        values = values if isinstance(values, (list, tuple, set, frozenset)) else [values]
        numbers = set()
        for v in values:
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise UnlearnError(f"not_ids[{name!r}] must be numbers (or True): got {v!r}; string ids are never "
                                   "allowed") from None
            if not f.is_integer():
                raise UnlearnError(f"not_ids[{name!r}]: {v!r} is not a whole number")
            numbers.add(abs(int(f)))
        out[field_of(str(name))] = numbers
    return out


def find_raw_ids(value: Any, raw_ids: Iterable, where: str = "card") -> list[str]:
    """Places in ``value`` (nested dicts/lists/strings) that carry one of ``raw_ids``; empty if none."""
    return [str(h) for h in IdScanner(raw_ids).scan(value, where)]


# -- tokenizer files --------------------------------------------------------------------------------------------
TOKEN_ID_KEYS = ("type_id", "ids")  # post-processor fields that hold token (or segment) ids, never sample ids
OPAQUE_KEYS = ("precompiled_charsmap",)  # a normalizer's compiled (base64) table: bytes, not text


def vocabulary_tokens(vocab) -> list[str]:
    """The token texts of a vocabulary: a ``{token: id}`` map (BPE, WordPiece, vocab.json), a Unigram list of
    ``[token, score]`` pairs, or a list of token texts (vocab.txt)."""
    if isinstance(vocab, Mapping):
        return [str(k) for k in vocab]
    if isinstance(vocab, (list, tuple)):
        return [str(v[0]) if isinstance(v, (list, tuple)) and v else str(v) for v in vocab]
    return []


def scan_vocabulary(tokens: list[str], field: str, scanner: IdScanner) -> list[Hit]:
    """String forget ids among a vocabulary's token texts, each token a unit of its own (a vocabulary may hold any
    number, ``"3600"`` included: numbers are matched nowhere in it). The tokens are scanned as one text, joined by a
    character that is neither part of a word nor a separator, so no id is found across two tokens."""
    if not scanner.words or not tokens:
        return []
    return scanner.scan_text("\x00".join(t.replace("\x00", " ") for t in tokens), field, numbers=False)


def _rule_values(value):
    """A normalizer or post-processor without its token-id fields and compiled tables (every other number stays)."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if k in OPAQUE_KEYS or (k in TOKEN_ID_KEYS and not isinstance(v, str)):
                continue
            if k in ("sep", "cls") and isinstance(v, (list, tuple)):  # [token, id]
                v = [t for t in v if isinstance(t, str)]
            out[k] = _rule_values(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_rule_values(v) for v in value]
    return value


def scan_tokenizer_rules(data: Mapping, field: str, scanner: IdScanner) -> list[Hit]:
    """Forget ids in a ``tokenizer.json``'s normalizer and post-processor, numbers included (a ``Replace`` of
    ``"3600"``, a template's literal text), except the post-processor's token and segment ids (``ids``,
    ``type_id``, the ``[token, id]`` of ``sep``/``cls``) and a compiled ``precompiled_charsmap``."""
    hits: list[Hit] = []
    for key in ("normalizer", "post_processor"):
        if data.get(key) is not None:
            hits += scanner.scan(_rule_values(data[key]), f"{field}:{key}", numbers=True)
    return hits
# -- scanning the outgoing files ---------------------------------------------------------------------------------
_VERSION_KEYS = {"transformers_version", "_commit_hash"}


def _known_config_keys(data: dict, generation: bool) -> set[str]:
    try:
        if generation:
            from transformers import GenerationConfig

            return set(GenerationConfig().to_dict())
        from transformers import AutoConfig, PretrainedConfig

        keys = set(PretrainedConfig().to_dict())
        try:
            keys |= set(AutoConfig.for_model(data.get("model_type")).to_dict())
        except Exception:
            pass
        return keys
    except Exception:
        return set()



def scan_config(data, name: str, scanner: IdScanner, generation: bool = False) -> list[Hit]:
    """Forget ids in a model (or generation) config: the fields the config class defines hold configuration, so
    their numbers are not matched (``pad_token_id``), only string ids and the path in ``_name_or_path``; the label
    names of ``id2label``/``label2id`` are matched numbers included; every field the class does not define is
    matched in full."""
    known = _known_config_keys(data, generation) if isinstance(data, dict) else set()
    hits: list[Hit] = []
    for key, value in (data.items() if isinstance(data, dict) else [("", data)]):
        where = f"{name}:{key}"
        if key in _VERSION_KEYS:
            continue
        hits += scanner.scan_text(str(key), where + " (key)")
        if key == "_name_or_path":
            hits += scanner.scan_strings(value, where)
        elif key in ("id2label", "label2id") and isinstance(value, Mapping) \
                and all(isinstance(v, (int, str)) for v in value.values()):
            hits += _scan_labels(value if key == "id2label" else {v: k for k, v in value.items()}, where, scanner)
        elif key in known:
            hits += scanner.scan(value, where, numbers=False)
        else:
            hits += scanner.scan(value, where)
    return hits



def _scan_labels(id2label: Mapping, where: str, scanner: IdScanner) -> list[Hit]:
    """Class labels: transformers' default entries (``3: "LABEL_3"``) are its own and the indices 0..n-1 are the
    classes' positions; any other index and every other label name is matched numbers included."""
    try:
        indices = sorted(int(i) for i in id2label)
    except (TypeError, ValueError):
        indices = []
    positional = indices == list(range(len(id2label)))
    hits: list[Hit] = []
    for index, label in id2label.items():
        if str(label) == f"LABEL_{index}":
            continue
        hits += scanner.scan(label, f"{where}[{index}]")
        if not positional:
            hits += scanner.scan_text(str(index), f"{where}[{index}]")
    return hits

