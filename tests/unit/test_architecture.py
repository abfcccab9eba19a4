"""The import map of docs/ARCHITECTURE.md, enforced: the planning core imports one way and never torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile

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
    # the compiled core: the cython_core/*.py links to search/ and simulator/ modules, under their _core names
    # (search/bounds.py asks backend for the compiled assignment solver)
    "_core": {"search", "simulator", "backend"},
}
FACES = {"poseidon_plugin.cli": {"pkg", "errors", "search", "simulator"},
         "poseidon_plugin.search.cli": ALLOWED["search"] | {"target"}}
PLANNING = ("specs", "simulator", "plan", "costmodel", "search", "target", *sorted(LEAVES))


# the framework layer: torch and megatron-core may be imported here
FRAMEWORK = ("runtime", "patches", "emulation")
# the emulation harness and the patch tables sit below runtime/ (runtime/ uses them, never the reverse)
ALLOWED_FRAMEWORK = {
    "patches": set(PLANNING),
    "emulation": set(PLANNING) | {"patches"},
}
# who may import the emulation harness (poseidon_plugin/emulation/): the device interface is the bootstrap's
# one way in; the torch-free declaration parser (harness) is read before launch and by the profiler's cache
# key; the client step runs Megatron-LM's loop on CPU. Everything else (the bootstrap first) goes through
# runtime/devices.py.
EMULATION_USERS = {
    "poseidon_plugin.runtime.devices": None,  # any module of the harness
    "poseidon_plugin.runtime.launcher": {"poseidon_plugin.emulation.harness", "poseidon_plugin.emulation.links_patch"},
    "poseidon_plugin.runtime.precheck": {"poseidon_plugin.emulation.harness"},
    "poseidon_plugin.runtime.profiler": {"poseidon_plugin.emulation.harness"},
    "poseidon_plugin.runtime.client_step": {"poseidon_plugin.emulation.cpu_training",
                                            "poseidon_plugin.emulation.megatron_training_patch"},
}
# the before-launch part of runtime/: the launcher's checks and the job-to-spec mapping, torch-free
RUNTIME_TORCH_FREE = ("runtime.options", "runtime.job_flags", "runtime.job_spec", "runtime.world",
                      "runtime.mindspeed", "runtime.precheck", "runtime.launcher", "emulation.harness")


def _part(module: str) -> str:
    parts = module.split(".")
    return "pkg" if len(parts) == 1 else parts[1]


def _module_files() -> dict[str, str]:
    """{module: file} for every module under poseidon_plugin/, following the links ``poseidon_plugin/patches``
    and ``poseidon_plugin/_core`` (and the ``cython_core/*.py`` links inside) under the names they import as."""
    modules: dict[str, str] = {}
    for root, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                modules[module[: -len(".__init__")] if module.endswith(".__init__") else module] = path
    return modules


def _imports() -> dict[str, set[str]]:
    """{module: poseidon_plugin modules it imports, lazily or not} for every module of :func:`_module_files`;
    ``from package import module`` counts as an import of the module."""
    files = _module_files()
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = {f"{source}.{alias.name}" for alias in node.names} & files.keys()
                found |= subs or {source}
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        edges[module] = {m for m in found if m == "poseidon_plugin" or m.startswith("poseidon_plugin.")}
    return edges


def test_planning_core_imports_one_way():
    bad = []
    for module, targets in _imports().items():
        part = _part(module)
        allowed = FACES.get(module, ALLOWED.get(part, ALLOWED_FRAMEWORK.get(part)))
        if allowed is None:
            assert part == "runtime", module  # a new part must be placed in the map
            continue  # runtime/ may use everything
        bad += [f"{module} -> {t}" for t in targets if _part(t) not in allowed | {part}]
    assert not bad, bad


def test_framework_parts_are_the_documented_ones():
    parts = {_part(m) for m in _imports()}
    assert parts == set(ALLOWED) | set(FRAMEWORK) | {"cli"}, parts


def test_emulation_is_reached_through_the_device_interface():
    """The bootstrap imports nothing of poseidon_plugin/emulation/; only the modules of EMULATION_USERS do,
    each only the harness modules it is listed with."""
    bad = []
    for module, targets in _imports().items():
        if _part(module) == "emulation":
            continue
        used = {t for t in targets if _part(t) == "emulation"}
        allowed = EMULATION_USERS.get(module, set())
        if allowed is not None and used - allowed:
            bad.append(f"{module} -> {sorted(used - allowed)}")
    assert not bad, bad
    assert "poseidon_plugin.runtime.bootstrap" not in EMULATION_USERS


def test_no_module_name_twice_across_runtime_patches_and_emulation():
    names: dict[str, list[str]] = {}
    for module in _module_files():
        if _part(module) in FRAMEWORK and module.count(".") == 2:
            names.setdefault(module.rsplit(".", 1)[1], []).append(module)
    assert not {n: m for n, m in names.items() if len(m) > 1}, names


def test_no_import_circles():
    """No circle of poseidon_plugin modules, lazy (function-level) imports included: a circle closed by a
    lazy import is a circle all the same (planning <-> precheck was one)."""
    edges = _imports()
    graph = {m: {t for t in targets if t in edges and t != m} for m, targets in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, circles


def test_plan_is_a_leaf_of_the_cost_model():
    edges = _imports()
    assert not {t for t in edges["poseidon_plugin.plan"] if _part(t) in ("costmodel", "search", "target")}


def test_before_launch_runtime_never_imports_torch():
    """The launcher's checks and the job-to-spec mapping import neither torch nor Megatron: with both
    blocked, a saved plan is checked against a declared (emulated) cluster, refused for other device types."""
    code = f"""
import sys
sys.modules["torch"] = sys.modules["megatron"] = None  # any import of them raises ImportError
{"".join(f"import poseidon_plugin.{m}{chr(10)}" for m in RUNTIME_TORCH_FREE)}
from poseidon_plugin.costmodel import Candidate, CostModel
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime import options, precheck
from poseidon_plugin.runtime.job_flags import read_job
from poseidon_plugin.runtime.job_spec import job_name, model_spec
from poseidon_plugin.specs import parse_cluster
args = "--num-layers 8 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --vocab-size 128 --micro-batch-size 1 --global-batch-size 4".split()
job = read_job("pretrain_gpt.py", args)
assert job_name("scripts/pretrain_gpt.py", job) == "pretrain_gpt-8l-h32"
cluster = parse_cluster({{"name": "emulated", "device_types": ["A2-2", "A2-4"], "links": "npu",
                          "nodes": [{{"device_type": t, "count": 1, "devices_per_node": 2}} for t in ("A2-2", "A2-4")]}})
model = model_spec(job, global_batch_size=4, name="pretrain_gpt-8l-h32")
plan = sys.argv[1]
CostModel(cluster, model).make_plan(Candidate(tp=1, pp=2, dp=2, mbs=1, stage_types=("A2-2", "A2-4"), layers=(5, 3),
                                              schedule="1f1b", virtual_stages=1)).save(plan)
opts, _ = options.parse(["--poseidon-emulate", "A2-2:2,A2-4:2", "--poseidon-plan", plan])
precheck.check_launch(opts, job, 4, args)
opts, _ = options.parse(["--poseidon-emulate", "A2-4:2,A2-2:2", "--poseidon-plan", plan])
try:
    precheck.check_launch(opts, job, 4, args)
    raise AssertionError("a plan for other device types passed")
except PoseidonError as exc:
    assert "stage 0 runs on A2-2 but device (node 0, local 0) here is a A2-4" in str(exc), exc
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron') and sys.modules[m] is not None)
assert not bad, bad
print("checked")
"""
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([sys.executable, "-c", code, os.path.join(folder, "plan.json")], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "checked", done.stderr[-2000:]


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
