"""Packaging: one namespace in site-packages, one version string, extras without unused dependencies."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re

import pytest
from setuptools import find_packages

import poseidon_plugin

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERIC = {"cython_core", "patches"}  # repository folders that must not become top-level packages


def _installed():
    try:
        return importlib.metadata.distribution("poseidon-plugin")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("poseidon-plugin is not installed (pip install -e .)")


def test_packages_live_under_the_project_namespace():
    found = find_packages(where=REPO, include=["poseidon_plugin", "poseidon_plugin.*"])
    assert {"poseidon_plugin._core", "poseidon_plugin.patches"} <= set(found)
    assert os.path.realpath(os.path.join(REPO, "poseidon_plugin", "_core")) == os.path.join(REPO, "cython_core")
    assert os.path.realpath(os.path.join(REPO, "poseidon_plugin", "patches")) == os.path.join(REPO, "patches")


def test_installed_top_level_is_only_poseidon_plugin():
    top = (_installed().read_text("top_level.txt") or "").split()
    assert top == ["poseidon_plugin"], top


def test_one_version_string():
    assert _installed().version == poseidon_plugin.__version__
    setup_py = open(os.path.join(REPO, "setup.py"), encoding="utf-8").read()
    assert not re.search(r"version\s*=\s*['\"]", setup_py), "setup.py must read poseidon_plugin.__version__"


def test_extras_build_on_each_other_without_unused_dependencies():
    extras: dict[str, set[str]] = {}
    for req in _installed().requires or []:
        m = re.match(r"([^;]+?)\s*;\s*extra\s*==\s*['\"](\w+)['\"]", req)
        if m:
            extras.setdefault(m.group(2), set()).add(m.group(1).replace(" ", ""))
    assert extras["cpu"] and extras["cpu"] <= extras["test"], extras
    names = {re.split(r"[<>=\[]", r)[0].lower() for reqs in extras.values() for r in reqs}
    assert not names & {"numpy", "packaging"}, names


def test_no_code_imports_the_generic_top_level_names():
    offenders = []
    for folder in ("poseidon_plugin", "cython_core", "patches", "scripts", "tests"):
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(root, name)
                tree = ast.parse(open(path, encoding="utf-8").read(), path)
                for node in ast.walk(tree):
                    mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                            else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                            else [])
                    offenders += [f"{path}:{node.lineno}: {m}" for m in mods if m.split(".")[0] in GENERIC]
    assert not offenders, offenders


def test_an_editable_install_leaves_the_bytecode_beside_the_sources():
    """``setup.py``'s build_ext byte-compiles the package where an editable install runs it, so a process
    started under ``PYTHONDONTWRITEBYTECODE`` does not compile it from source on every start."""
    import importlib.util

    _installed()
    import poseidon_plugin.search.engine as engine
    import poseidon_plugin.patches.table as table

    for module in (poseidon_plugin, engine, table):
        if not module.__file__.startswith(REPO):
            pytest.skip("installed from a wheel, not in editable mode (pip byte-compiles the wheel's files)")
        assert os.path.exists(importlib.util.cache_from_source(module.__file__)), module.__name__


def test_a_compiled_search_imports_no_pure_python_twin():
    """The uncompiled sources of the compiled search (``splits``, ``structure_bounds``, ``bounds``...) load
    only under ``POSEIDON_PURE_PYTHON``: a fresh ``poseidon plan`` process would pay their import."""
    import subprocess
    import sys

    from poseidon_plugin.backend import PURE_ENV, compiled

    if compiled("_search") is None:
        pytest.fail("the compiled core is not built: run `pip install -e .` first")
    twins = ["poseidon_plugin.search.splits", "poseidon_plugin.search.structure_bounds",
             "poseidon_plugin.search.relaxation_bound", "poseidon_plugin.search.bounds"]
    code = ("import sys; from poseidon_plugin.cli import main; "
            "main(['plan', '--cluster', 'paper-setting-1', '--model', 'llama2-13b', '--exact', '--json', "
            "'--no-progress']); "
            f"print('loaded:', *[m for m in {twins!r} if m in sys.modules])")
    env = {k: v for k, v in os.environ.items() if k != PURE_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "loaded:"
