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
