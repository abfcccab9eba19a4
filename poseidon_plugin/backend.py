"""Which implementation runs a hot path: the compiled core (``poseidon_plugin._core``) or its pure-Python twin.

The one place that reads ``POSEIDON_PURE_PYTHON``: ``1`` (any value but empty or ``0``) forces the
pure-Python reference of every compiled piece; without a built extension the twin is the fallback too.
"""

from __future__ import annotations

import importlib
import os
from importlib.machinery import EXTENSION_SUFFIXES
from types import ModuleType

PURE_ENV = "POSEIDON_PURE_PYTHON"


def pure_python_forced() -> bool:
    """Whether ``POSEIDON_PURE_PYTHON`` forces the pure-Python twins."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def compiled(name: str) -> ModuleType | None:
    """The compiled module ``poseidon_plugin._core.<name>``, or ``None`` when forced off or not built.

    Some of the core are links to pure-Python-mode sources (``cython_core/*.py``): without the built
    extension such a name imports the source itself, which is not the compiled module either."""
    if pure_python_forced():
        return None
    try:
        module = importlib.import_module(f"poseidon_plugin._core.{name}")
    except ImportError:
        return None
    path = getattr(module, "__file__", None) or ""
    return module if path.endswith(tuple(EXTENSION_SUFFIXES)) else None
