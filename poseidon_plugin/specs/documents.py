"""The one reader of the JSON/YAML documents Poseidon takes from users, and the quoting of values.

Every file we read (cluster, model, profile, plan, stage-level input, the profiler's cache) goes through
:func:`read_document` or :func:`parse_document`, which refuse, with one :class:`InputError` line naming
the file and the place, what ``json.loads`` / ``yaml.safe_load`` would accept or choke on:

* files over :data:`MAX_DOCUMENT_BYTES` (checked before reading them whole) and bytes that are not UTF-8
  (the message gives the byte offset);
* nesting deeper than :data:`MAX_NESTING_DEPTH` (checked before building the value: no RecursionError);
* duplicate keys (the parsers silently keep the last one);
* ``NaN`` / ``Infinity`` / ``1e999`` (JSON) and ``.nan`` / ``.inf`` (YAML), named by their field path;
* YAML aliases (``*name``): none of our documents needs one, and they are how a small file expands into a
  huge value (the "billion laughs").

:func:`quote` renders a value for an error message in at most about :data:`MAX_QUOTE_CHARS` characters;
every message that shows a user's value uses it, so a 5 MB string makes a short line.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import reprlib
import sys
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable

import yaml

from ..errors import InputError

MAX_DOCUMENT_BYTES = 64 << 20
"""Largest document read (64 MiB): a measured profile or a plan of a 1M-device cluster is far smaller."""

MAX_NESTING_DEPTH = 64
"""Deepest nesting of lists/objects (our formats need a handful of levels)."""

MAX_QUOTE_CHARS = 80
"""Characters of a value that an error message shows (longer values are cut, with their length)."""

MAX_INTEGER_DIGITS = 100
"""Longest integer literal read (Python refuses more than 4300 digits with a confusing message)."""

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 3, 8, 8, 4
_SHORT.maxset = _SHORT.maxfrozenset = 4
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = MAX_QUOTE_CHARS, MAX_QUOTE_CHARS, 40


def quote(value: Any, limit: int = MAX_QUOTE_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, without ever building the whole repr."""
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits>"  # no str(): slow
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def is_yaml_name(name: str | Path) -> bool:
    """YAML by extension (``.yaml`` / ``.yml``); everything else is read as JSON."""
    return str(name).endswith((".yaml", ".yml"))


Rule = Callable[[str], str]


def read_document(path: str | Path, what: str, *, allow_stdin: bool = False,
                  nonfinite: Rule | None = None) -> Any:
    """Read and parse one JSON/YAML file (``-`` is stdin when ``allow_stdin``) as plain data.

    ``what`` names the document in the can't-read error (``"cluster"``, ``"plan"``). ``nonfinite(path)``
    may return the text that follows ``<path> = NaN`` (e.g. ``is not a valid time; ...``); ``""`` keeps
    the default ``is not allowed: numbers must be finite``.
    """
    stdin = allow_stdin and str(path) == "-"
    source = "<stdin>" if stdin else str(path)
    try:
        if stdin:
            data = sys.stdin.buffer.read(MAX_DOCUMENT_BYTES + 1)
        else:
            with open(path, "rb") as fh:
                size = _file_size(fh)
                if size > MAX_DOCUMENT_BYTES:
                    raise _too_big(source, size)
                data = fh.read(MAX_DOCUMENT_BYTES + 1)  # a special file may report size 0 and be endless
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InputError(f"cannot read {what} file {quote(source)}: {reason}") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise _too_big(source, None)
    return parse_document(data, source, yaml_syntax=is_yaml_name(path) and not stdin,
                          nonfinite=nonfinite)


def parse_document(data: bytes | str, source: str, *, yaml_syntax: bool = False,
                   nonfinite: Rule | None = None) -> Any:
    """Parse JSON (or YAML) text or UTF-8 bytes with this module's checks; errors start with ``source``."""
    if isinstance(data, (bytes, bytearray)):
        if len(data) > MAX_DOCUMENT_BYTES:
            raise _too_big(source, len(data))
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{source}: not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset "
                             f"{exc.start:,} is invalid; save the file as UTF-8") from None
    else:
        text = data
        if len(text) > MAX_DOCUMENT_BYTES:
            raise _too_big(source, len(text))
    if text.startswith("\ufeff"):  # a UTF-8 byte-order mark, as some editors write
        text = text[1:]
    marks = _Marks()
    try:
        doc = _parse_yaml(text, marks) if yaml_syntax else _parse_json(text, marks)
    except _Refused as exc:
        raise InputError(f"{source}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}: malformed JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
                         ) from None
    except yaml.YAMLError as exc:
        raise InputError(f"{source}: malformed YAML: {_yaml_reason(exc)}") from None
    except RecursionError:  # only the pure-Python YAML composer (no libyaml) recurses before our check
        raise InputError(f"{source}: nested too deeply (more than {MAX_NESTING_DEPTH} levels)") from None
    if marks.any:
        found = _find_marked(doc, "")
        if found is not None:
            path, item = found
            if isinstance(item, _DuplicateKeys):
                raise InputError(f"{source}: {path + ': ' if path else ''}duplicate key "
                                 f"{quote(item.duplicate)}; keep one")
            rule = (nonfinite(path) if nonfinite is not None and item.nonfinite else "") or item.reason
            raise InputError(f"{source}: {path or 'the document'} = {item!r} {rule}")
    return doc


# --- JSON ----------------------------------------------------------------------------------------

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}
_CHUNK = 1 << 16


def _check_json_depth(text: str) -> None:
    """Refuse nesting deeper than the limit from the bracket skeleton, before ``json.loads`` recurses."""
    skeleton = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    depth = 0
    for start in range(0, len(skeleton), _CHUNK):
        levels = list(accumulate(map(_DELTA.__getitem__, skeleton[start:start + _CHUNK]), initial=depth))
        if max(levels) > MAX_NESTING_DEPTH:
            raise _Refused(f"nested more than {MAX_NESTING_DEPTH} levels deep; Poseidon documents need "
                           "only a few levels (is this the right file?)")
        depth = levels[-1]


def _parse_json(text: str, marks: "_Marks") -> Any:
    _check_json_depth(text)

    def pairs(items: list) -> dict:
        out = dict(items)
        if len(out) == len(items):
            return out
        seen: set = set()
        dup = next(k for k, _v in items if k in seen or seen.add(k))
        marks.any = True
        return _DuplicateKeys(out, dup)

    def number(token: str) -> Any:
        value = float(token)
        if math.isfinite(value):
            return value
        marks.any = True
        return _BadValue(token, _NONFINITE, nonfinite=True)

    def constant(token: str) -> Any:
        marks.any = True
        return _BadValue(token, _NONFINITE, nonfinite=True)

    def integer(token: str) -> Any:
        if len(token.lstrip("-")) <= MAX_INTEGER_DIGITS:
            return int(token)
        marks.any = True
        return _BadValue(token, f"is not allowed: integers have at most {MAX_INTEGER_DIGITS} digits")

    return json.loads(text, object_pairs_hook=pairs, parse_float=number, parse_constant=constant,
                      parse_int=integer)


# --- YAML ----------------------------------------------------------------------------------------

_YAML_BASE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built: 50x faster


class _DocumentLoader(_YAML_BASE):  # type: ignore[misc, valid-type]
    """``yaml.safe_load`` minus aliases and duplicate keys, with non-finite floats marked for a path."""

    refused: "_Marks"  # not "marks": the pure-Python scanner uses that name

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
        out: dict = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in out
            except TypeError:
                raise _Refused(f"{_where(key_node)}: a mapping key must be a plain value, got "
                               f"{type(key).__name__}") from None
            if duplicate:
                raise _Refused(f"{_where(key_node)}: duplicate key {quote(key)}; keep one")
            out[key] = self.construct_object(value_node, deep=deep)
        return out

    def construct_yaml_float(self, node):
        value = super().construct_yaml_float(node)
        if math.isfinite(value):
            return value
        self.refused.any = True
        return _BadValue(str(node.value), _NONFINITE, nonfinite=True)

    def construct_yaml_int(self, node):
        digits = sum(ch.isdigit() for ch in str(node.value))
        if digits > MAX_INTEGER_DIGITS:
            self.refused.any = True
            return _BadValue(str(node.value), f"is not allowed: integers have at most "
                                              f"{MAX_INTEGER_DIGITS} digits")
        return super().construct_yaml_int(node)


_DocumentLoader.add_constructor("tag:yaml.org,2002:float", _DocumentLoader.construct_yaml_float)
_DocumentLoader.add_constructor("tag:yaml.org,2002:int", _DocumentLoader.construct_yaml_int)


def _parse_yaml(text: str, marks: "_Marks") -> Any:
    loader = _DocumentLoader(text)
    loader.refused = marks
    try:
        node = loader.get_single_node()   # libyaml itself stops at 1000 levels; the tree is not built yet
        if node is None:
            return None
        _check_yaml_nodes(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_yaml_nodes(root) -> None:
    """Refuse aliases (a node reached twice) and deep nesting, walking the node tree without recursion."""
    seen: set[int] = set()
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if id(node) in seen:
            raise _Refused(f"{_where(node)}: this value is anchored (&name) and used again through an alias "
                           "(*name); Poseidon documents do not allow YAML aliases: write the value out "
                           "where it is used")
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            continue
        if depth > MAX_NESTING_DEPTH:
            raise _Refused(f"{_where(node)}: nested more than {MAX_NESTING_DEPTH} levels deep; Poseidon "
                           "documents need only a few levels (is this the right file?)")
        stack.extend((child, depth + 1) for child in children)


def _where(node) -> str:
    mark = node.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_reason(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        context = f"{exc.context}: " if exc.context else ""
        return f"{context}{exc.problem}{at}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# --- marked values and their paths ---------------------------------------------------------------

class _Refused(Exception):
    """A document refused while parsing; the message lacks only the source."""


class _Marks:
    """Set by the parse hooks when the value holds a marked item, so clean documents are not walked."""

    __slots__ = ("any",)

    def __init__(self) -> None:
        self.any = False


_NONFINITE = "is not allowed: numbers must be finite"


class _BadValue:
    """Stands in for a refused scalar (``NaN``, ``1e999``, a 5000-digit integer) until its path is known."""

    __slots__ = ("token", "reason", "nonfinite")

    def __init__(self, token: str, reason: str, *, nonfinite: bool = False) -> None:
        self.token, self.reason, self.nonfinite = token, reason, nonfinite

    def __repr__(self) -> str:
        return self.token if len(self.token) <= MAX_QUOTE_CHARS else self.token[:MAX_QUOTE_CHARS] + "..."


class _DuplicateKeys(dict):
    """A JSON object that had a key twice (``json`` keeps the last value; we refuse it)."""

    __slots__ = ("duplicate",)

    def __init__(self, items: dict, duplicate: Any) -> None:
        super().__init__(items)
        self.duplicate = duplicate


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    name = part if len(part) <= MAX_QUOTE_CHARS else quote(part)
    return f"{path}.{name}" if path else name


def _find_marked(value: Any, path: str) -> tuple[str, Any] | None:
    """``(path, item)`` of the first refused item (a bad value or an object with a duplicate key)."""
    if isinstance(value, (_BadValue, _DuplicateKeys)):
        return path, value
    if isinstance(value, dict):
        for key, item in value.items():
            found = _find_marked(item, _join(path, key if isinstance(key, str) else str(key)))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_marked(item, _join(path, i))
            if found:
                return found
    return None


def _file_size(fh) -> int:
    st = os.fstat(fh.fileno())
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _too_big(source: str, size: int | None) -> InputError:
    got = f"{size:,} bytes" if size is not None else "larger than that"
    return InputError(f"{source}: the file is {got}; Poseidon reads documents of at most "
                      f"{MAX_DOCUMENT_BYTES >> 20} MiB (is this the right file?)")
