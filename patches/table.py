"""Patch tables: named rows ``(dotted target, wrapper factory)``, applied explicitly, idempotent, reversible.

Why a table and not monkey-patching in place: the set of functions Poseidon changes in Megatron must be
visible in one place, each change must be undoable (tests, and a job that falls back to the user's own
configuration), and a half-applied patch must be caught at once rather than show up as a wrong layer split
hours later. So every row is applied, then *verified* (the target and every swept copy now hold the
wrapper), and ``revert()`` puts back exactly what was there.

``from megatron.core.x import f`` copies ``f`` into the importing module; patching ``megatron.core.x.f``
alone leaves those copies on the original. A row with ``sweep=True`` therefore also rebinds every copy
found in ``sys.modules`` (modules under ``SWEEP_PREFIXES``). Modules imported after ``apply()`` read the
patched attribute themselves.

A row with ``value=True`` replaces a module global that is state, not code (megatron-core's RNG tracker,
``parallel_state``'s TP group): the same apply / verify / revert, but the replacement is not tagged with
the owning table (``None`` or ``True`` cannot carry a tag) and it is checked by identity only.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

SWEEP_PREFIXES: tuple[str, ...] = ("megatron", "mindspeed", "mindspeed_llm", "pretrain_gpt")
_MARK = "__poseidon_patch__"


@dataclass(frozen=True, kw_only=True, slots=True)
class Patch:
    """One row: replace ``target`` by ``make(original)``."""

    target: str
    """Dotted path: ``package.module.function`` or ``package.module.Class.attribute``."""
    make: Callable[[Any], Any]
    """Wrapper factory: gets the original callable, returns the replacement (which may call the original)."""
    sweep: bool = False
    """Also rebind the by-name copies of the original in already-imported modules."""
    value: bool = False
    """The target is a value (module global), not a callable: ``make(original)`` returns the new value,
    which is neither tagged nor swept."""


@dataclass(kw_only=True, slots=True)
class _Applied:
    """What one applied row changed, so that revert() can undo exactly that."""

    owner: Any
    name: str
    raw_original: Any
    """The attribute as stored on the owner (a staticmethod object stays one)."""
    original: Any
    replacement: Any
    sweep: bool
    copies: list[tuple[Any, str]] = field(default_factory=list)


class PatchError(RuntimeError):
    """A patch target is missing or a patch did not take effect (a stack Poseidon does not know)."""


class PatchTable:
    """A named set of patches applied and reverted together."""

    def __init__(self, name: str, rows: Iterable[Patch]) -> None:
        self.name = name
        self.rows = tuple(rows)
        self._applied: list[_Applied] = []
        self._lock = threading.Lock()

    @property
    def applied(self) -> bool:
        """Whether ``apply()`` is in effect."""
        return bool(self._applied)

    def apply(self) -> None:
        """Apply every row (a no-op when already applied), then verify; on any failure nothing stays patched."""
        with self._lock:
            if self._applied:
                return
            try:
                for row in self.rows:
                    self._applied.append(_apply_row(row, self.name))
                problems = self._problems()
                if problems:
                    raise PatchError(f"patch table {self.name!r} did not take effect: {'; '.join(problems)}")
            except Exception:
                self._revert_locked()
                raise

    def revert(self) -> None:
        """Put back every original (targets and swept copies); a no-op when not applied."""
        with self._lock:
            self._revert_locked()

    def verify(self) -> list[str]:
        """Problems with the applied state (empty when every target and copy holds its replacement)."""
        with self._lock:
            return self._problems()

    def _problems(self) -> list[str]:
        problems = []
        for entry in self._applied:
            # a config object (torch._dynamo.config) holds its values behind attribute access, not in vars()
            held = vars(entry.owner)
            current = _unwrap(held[entry.name] if entry.name in held else getattr(entry.owner, entry.name, None))
            if current is not entry.replacement:
                problems.append(f"{_describe(entry.owner)}.{entry.name} is not patched")
            for module, attr in entry.copies:
                if getattr(module, attr, None) is not entry.replacement:
                    problems.append(f"copy {module.__name__}.{attr} is not patched")
            for module in _sweep_modules() if entry.sweep else ():
                for attr, value in list(vars(module).items()):
                    if value is entry.original and (module, attr) not in entry.copies:
                        problems.append(f"{module.__name__}.{attr} still holds the original")
        return problems

    def _revert_locked(self) -> None:
        while self._applied:
            entry = self._applied.pop()
            setattr(entry.owner, entry.name, entry.raw_original)
            for module, attr in entry.copies:
                if getattr(module, attr, None) is entry.replacement:
                    setattr(module, attr, entry.original)


class LazyPatchTable(PatchTable):
    """A table whose rows are built when it is first applied (by ``rows()``), so that importing the table
    imports nothing of what it patches: feature detection, or a package that is the script's business."""

    def __init__(self, name: str, rows: Callable[[], Iterable[Patch]]) -> None:
        super().__init__(name, ())
        self._build_rows = rows

    def apply(self) -> None:
        if not self.applied:
            self.rows = tuple(self._build_rows())
        super().apply()


def resolve(target: str) -> tuple[Any, str]:
    """``(owner, attribute name)`` for a dotted target: the longest importable module prefix, then attributes."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for attr in parts[split:-1]:
                owner = getattr(owner, attr)
        except AttributeError:
            break
        if not hasattr(owner, parts[-1]):
            break
        return owner, parts[-1]
    raise PatchError(f"patch target {target} does not exist in the installed stack")


def _apply_row(row: Patch, table: str) -> _Applied:
    owner, name = resolve(row.target)
    raw = owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)
    original = _unwrap(raw)
    if row.value:
        if row.sweep:
            raise PatchError(f"{row.target}: a value row cannot sweep copies (a copy of a value is not a reference)")
        replacement = row.make(original)
        setattr(owner, name, replacement)
        return _Applied(owner=owner, name=name, raw_original=raw, original=original, replacement=replacement,
                        sweep=False)
    if getattr(original, _MARK, None) is not None:
        raise PatchError(f"{row.target} is already patched by table {getattr(original, _MARK)!r}")
    replacement = row.make(original)
    setattr(replacement, _MARK, table)
    setattr(owner, name, staticmethod(replacement) if isinstance(raw, staticmethod) else replacement)
    entry = _Applied(
        owner=owner, name=name, raw_original=raw, original=original, replacement=replacement, sweep=row.sweep
    )
    if row.sweep:
        for module in _sweep_modules():
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, replacement)
                    entry.copies.append((module, attr))
    return entry


def _sweep_modules() -> list[Any]:
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None and name.split(".")[0] in SWEEP_PREFIXES
    ]


def _unwrap(raw: Any) -> Any:
    return raw.__func__ if isinstance(raw, staticmethod) else raw


def _describe(owner: Any) -> str:
    return getattr(owner, "__module__", "") + "." + owner.__qualname__ if isinstance(owner, type) else owner.__name__

