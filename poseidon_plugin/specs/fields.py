"""Typed field readers for spec documents (YAML/JSON mappings), with errors that name the place.

Every reader takes the mapping, the key, and ``where`` (``"cluster.yaml: nodes[1]"``) and raises
:class:`~poseidon_plugin.errors.InputError` whose message names the file, the field, the bad value and
what is allowed. Spec files are data, read by :mod:`.documents` (JSON, or YAML without aliases); a
message shows at most ~80 characters of a value (:func:`~.documents.quote`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import InputError
from .documents import quote, read_document

__all__ = ["MAX_NAME_CHARS", "PRESET_DIR", "check_keys", "field_name", "get_bool", "get_float", "get_int",
           "get_list", "get_mapping", "get_str", "load_document_or_preset", "preset_names", "quote",
           "read_document", "write_json_atomic"]

_MISSING = object()

MAX_NAME_CHARS = 256
"""Longest name (cluster, model, device type): names end up in tables, plans and flags."""


def field_name(where: str, key: str) -> str:
    """``where`` + ``.key`` (``where`` ends in ``:`` for the document root)."""
    return f"{where}{key}" if where.endswith(": ") else f"{where}.{key}"


def _fail(where: str, key: str, value: Any, allowed: str, fix: str = "") -> InputError:
    tail = f"; {fix}" if fix else ""
    return InputError(f"{field_name(where, key)} = {quote(value)} is invalid: must be {allowed}{tail}")


def check_keys(doc: Mapping, where: str, allowed: Iterable[str], required: Iterable[str] = ()) -> None:
    """Reject unknown keys (typos) and missing required keys."""
    allowed = tuple(allowed)
    for key in doc:
        if key not in allowed:
            name = key if isinstance(key, str) and len(key) <= 80 else quote(key)
            raise InputError(f"{field_name(where, name)}: unknown field; allowed fields: "
                             f"{', '.join(allowed)}")
    for key in required:
        if key not in doc:
            raise InputError(f"{field_name(where, key)}: missing required field")


def get_mapping(doc: Any, where: str, what: str = "a mapping") -> Mapping:
    """``doc`` itself, checked to be a mapping."""
    if not isinstance(doc, Mapping):
        raise InputError(f"{where.rstrip(': ')}: must be {what}, got {type(doc).__name__}")
    return doc


def get_int(doc: Mapping, key: str, where: str, *, minimum: int = 1, maximum: int | None = None,
            default: Any = _MISSING) -> int:
    """An integer field in ``[minimum, maximum]`` (booleans are rejected: YAML ``yes`` is not a count)."""
    value = doc.get(key, default)
    allowed = f"an integer >= {minimum}" + (f" and <= {maximum:,}" if maximum is not None else "")
    if value is _MISSING:
        raise InputError(f"{field_name(where, key)}: missing required field ({allowed})")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(where, key, value, allowed)
    if maximum is not None and value > maximum:
        raise _fail(where, key, value, allowed, "the limits are in docs/SPECS.md (Limits)")
    return value


def get_float(doc: Mapping, key: str, where: str, *, minimum: float = 0.0, strict: bool = False,
              maximum: float | None = None, default: Any = _MISSING) -> float:
    """A finite number field; ``strict`` makes ``minimum`` exclusive."""
    value = doc.get(key, default)
    cmp = ">" if strict else ">="
    allowed = f"a finite number {cmp} {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    if value is _MISSING:
        raise InputError(f"{field_name(where, key)}: missing required field ({allowed})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise _fail(where, key, value, allowed)
    if value < minimum or (strict and value == minimum) or (maximum is not None and value > maximum):
        raise _fail(where, key, value, allowed)
    return float(value)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return False


def get_str(doc: Mapping, key: str, where: str, *, choices: Iterable[str] | None = None,
            default: Any = _MISSING) -> str:
    """A non-empty string field, optionally one of ``choices``."""
    value = doc.get(key, default)
    if value is _MISSING:
        raise InputError(f"{field_name(where, key)}: missing required field (a string)")
    if choices is not None:
        choices = tuple(choices)
        if value not in choices:
            raise _fail(where, key, value, "one of " + ", ".join(choices))
    elif not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise _fail(where, key, value, f"a non-empty string of at most {MAX_NAME_CHARS} characters")
    return value


def get_bool(doc: Mapping, key: str, where: str, *, default: Any = _MISSING) -> bool:
    """A boolean field (YAML ``true``/``false``)."""
    value = doc.get(key, default)
    if value is _MISSING:
        raise InputError(f"{field_name(where, key)}: missing required field (true or false)")
    if not isinstance(value, bool):
        raise _fail(where, key, value, "true or false")
    return value


def get_list(doc: Mapping, key: str, where: str, *, nonempty: bool = True,
             default: Any = _MISSING) -> list:
    """A list field."""
    value = doc.get(key, default)
    if value is _MISSING:
        raise InputError(f"{field_name(where, key)}: missing required field (a list)")
    if not isinstance(value, list) or (nonempty and not value):
        raise _fail(where, key, value, "a non-empty list" if nonempty else "a list")
    return value


PRESET_DIR = Path(__file__).resolve().parent / "presets"


def preset_names(kind: str) -> tuple[str, ...]:
    """Names of the built-in presets of ``kind`` (``cluster``, ``model``): files ``<name>.<kind>.yaml``."""
    suffix = f".{kind}.yaml"
    return tuple(sorted(p.name[:-len(suffix)] for p in PRESET_DIR.glob(f"*{suffix}")))


def load_document_or_preset(name_or_path: str | os.PathLike, kind: str, parse):
    """``parse(doc, source)`` of a YAML/JSON file, or of the built-in preset ``name_or_path``.

    The error for a name that is neither names the flag (``--cluster``, ``--model``) and lists presets.
    """
    p = Path(name_or_path)
    if _is_file(p):
        return parse(read_document(p, kind), str(p))
    name = str(name_or_path)
    preset = PRESET_DIR / f"{name}.{kind}.yaml"
    if os.sep not in name and _is_file(preset):
        return parse(read_document(preset, f"{kind} preset"), f"preset {name}")
    raise InputError(f"--{kind} {quote(name)} is neither a file nor a preset; presets: "
                     f"{', '.join(preset_names(kind))}")


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except (OSError, ValueError):  # a name too long for the OS, or with a NUL byte: not a file
        return False


def write_json_atomic(path: str | os.PathLike, doc: Any) -> None:
    """Write ``doc`` as JSON to ``path`` atomically (temp file in the same folder, then ``os.replace``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2, sort_keys=True, allow_nan=False)
            fh.write("\n")
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
