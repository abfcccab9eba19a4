"""The import map of docs/ARCHITECTURE.md, enforced: the planning core imports one way and never torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "poseidon_plugin")

LEAVES = {"errors", "argv", "backend", "fingerprint", "stagecost"}
# part -> parts of poseidon_plugin it may import (docs/ARCHITECTURE.md, "Who may import whom")
ALLOWED = {
    **{leaf: {"errors"} for leaf in LEAVES},
    "pkg": set(),
    "specs": {"errors", "pkg"},
    "simulator": {"specs", "backend", "errors", "_core"},
    "plan": {"simulator", "specs", "argv", "errors"},
    "costmodel": {"plan", "specs", "simulator", "stagecost", "fingerprint", "errors"},
    "search": {"costmodel", "plan", "simulator", "specs", "stagecost", "backend", "errors", "_core"},
    "target": {"search", "costmodel", "simulator", "errors"},
}
FACES = {"poseidon_plugin.cli": {"pkg", "errors", "search", "simulator"},
         "poseidon_plugin.search.cli": ALLOWED["search"] | {"target"}}
PLANNING = ("specs", "simulator", "plan", "costmodel", "search", "target", *sorted(LEAVES))


def _part(module: str) -> str:
    parts = module.split(".")
    return "pkg" if len(parts) == 1 else parts[1]


def _imports() -> dict[str, set[str]]:
    """{module: poseidon_plugin modules it imports} for every module under poseidon_plugin/ (links skipped)."""
    edges: dict[str, set[str]] = {}
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d)) and d != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
            package = module.rsplit(".", 1)[0]
            if module.endswith(".__init__"):
                module = package = module[: -len(".__init__")]
            found = set()
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = package.split(".")[: len(package.split(".")) - node.level + 1]
                        found.add(".".join(base + ([node.module] if node.module else [])))
                    else:
                        found.add(node.module or "")
                elif isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
            edges[module] = {m for m in found if m == "poseidon_plugin" or m.startswith("poseidon_plugin.")}
    return edges


def test_planning_core_imports_one_way():
    bad = []
    for module, targets in _imports().items():
        part = _part(module)
        allowed = FACES.get(module, ALLOWED.get(part))
        if allowed is None:
            continue  # runtime, patches: the framework layer may use the whole planning core
        bad += [f"{module} -> {t}" for t in targets if _part(t) not in allowed | {part}]
    assert not bad, bad


def test_plan_is_a_leaf_of_the_cost_model():
    edges = _imports()
    assert not {t for t in edges["poseidon_plugin.plan"] if _part(t) in ("costmodel", "search", "target")}


def test_planning_core_never_imports_torch():
    code = ("import sys\n" + "".join(f"import poseidon_plugin.{m}\n" for m in PLANNING)
            + "import poseidon_plugin.search.cli, poseidon_plugin.simulator.cli, poseidon_plugin.cli\n"
            + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
            + "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_core_pure_mode_sources_are_links_to_one_source():
    """Each ``cython_core/*.py`` (but ``__init__.py``) is a link to a module of ``poseidon_plugin/`` that
    runs as it is (``POSEIDON_PURE_PYTHON=1``) and is compiled from the same file, typed by the ``.pxd``
    beside the link: no second copy of its logic. Such a module imports nothing the planning core may
    not (it is followed through the link here)."""
    core = os.path.join(REPO, "cython_core")
    linked = sorted(n for n in os.listdir(core) if n.endswith(".py") and n != "__init__.py")
    assert "assignment.py" in linked
    edges = _imports()
    for name in linked:
        path = os.path.join(core, name)
        assert os.path.islink(path), f"cython_core/{name} must be a link to its one source"
        target = os.path.realpath(path)
        assert target.startswith(PACKAGE + os.sep), target
        assert os.path.isfile(os.path.join(core, name[:-3] + ".pxd")), f"cython_core/{name[:-3]}.pxd"
        module = os.path.relpath(target, REPO)[:-3].replace(os.sep, ".")
        part = _part(module)
        assert {_part(t) for t in edges[module]} <= ALLOWED[part] | {part}, (module, edges[module])
