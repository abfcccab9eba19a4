"""MindSpeed-LLM style: the start-up order and the flag rules, as pure functions (torch-free).

MindSpeed-LLM trains on megatron-core 0.12.1 patched at import time by its adaptor, so *when* things
happen matters more than on stock Megatron. Sources (Ascend/MindSpeed-LLM, Ascend/MindSpeed; branches
``26.1.0`` and ``26.1.0_core_r0.12.1``; details and line references in ``docs/MINDSPEED.md``):

1. ``transfer_to_npu`` first, on Ascend: core 0.12 allocates on ``torch.cuda.current_device()``, which
   reaches the NPU only through ``torch_npu.contrib.transfer_to_npu``.
2. The adaptor (``mindspeed_llm/tasks/megatron_adaptor_v2.py``) before any ``megatron`` import: MindSpeed's
   pre-patches replace modules ("Need replace modules before import megatron"). It chooses its patches
   from the raw ``sys.argv`` at import, so ``sys.argv`` is set to the user's command line first.
3. After planning, ``sys.argv`` becomes the planned command line and the adaptor re-chooses its patches
   with its own entry point ``repatch(config)`` (26.0.0 and later): it removes every MindSpeed patch,
   re-reads the arguments, applies ``config`` on top (``setattr(args, key, value)``) and re-applies.
4. Then Poseidon's tables (layer assignment, MindSpeed offset helper): MindSpeed's ``apply_patch`` rebinds
   every module attribute identical to the function it replaces, so anything applied before step 3 is
   overwritten silently (``--num-layer-list`` *replaces* ``get_num_layers_to_build``). Verified after.

:func:`start_up` runs these steps through a :class:`Host` (the process: argv, modules, imports, device),
so the order is tested here without torch_npu or MindSpeed.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from poseidon_plugin.errors import PoseidonError

ADAPTOR_PACKAGE = "mindspeed_llm"
ADAPTOR_MODULE = "mindspeed_llm.tasks.megatron_adaptor_v2"
"""Imported by ``from mindspeed_llm import megatron_adaptor`` (``mindspeed_llm/__init__.py``), which
MindSpeed-LLM's ``pretrain_gpt.py`` does first; it runs ``FeatureAdaptor.execute()`` at import."""
REPATCH = "repatch"
"""``megatron_adaptor_v2.repatch(config: dict)``; present from MindSpeed-LLM 26.0.0 (absent in 2.2.0, 2.3.0)."""
TRANSFER_TO_NPU = "torch_npu.contrib.transfer_to_npu"
LAYOUT_BACKPORT = "mindspeed.core.pipeline_parallel.pipeline_model_parallel_layout"
"""MindSpeed 26.1.0_core_r0.12.1 (commit 94e8ac1c): Megatron's ``--pipeline-model-parallel-layout`` on core
0.12.1, enabled by MindSpeed-LLM 26.1.0's ``PipelineModelParallelLayoutFeature``."""
MEGATRON_LAYOUT = "megatron.core.transformer.pipeline_parallel_layer_layout"
"""Megatron's own layout module (megatron-core 0.13 and later)."""
SUPPORTED_RELEASES = ("26.0.0", "26.1.0")
"""MindSpeed-LLM releases whose adaptor has ``repatch`` (master too); all pin megatron-core core_v0.12.1."""

NUM_LAYER_LIST = "--num-layer-list"
MIN_PIPELINE_FOR_LAYER_LIST = 2
"""MindSpeed-LLM refuses ``--num-layer-list`` unless PP > 1 ("Dynamic pipeline model should work with
pipeline parallel"); with PP = 1 there is nothing to split, so the flag is left out."""


class MindSpeedError(PoseidonError):
    """A MindSpeed-LLM job Poseidon cannot run as asked (a flag conflict, an unsupported release)."""


class StartupError(RuntimeError):
    """The start-up order was broken (megatron imported too early, a patch overwritten)."""


# --- start-up order -------------------------------------------------------------------------------


class Host(Protocol):
    """What the start-up steps touch in the process (the real one is :class:`ProcessHost`)."""

    argv: list[str]

    def on_ascend(self) -> bool:
        """Whether this rank drives an Ascend NPU (torch_npu importable and a device present)."""

    def modules(self) -> Mapping[str, Any]:
        """The imported modules (``sys.modules``)."""

    def import_module(self, name: str) -> Any:
        """Import ``name`` and return it."""


class Table(Protocol):
    """A Poseidon patch table (``patches.table.PatchTable``)."""

    name: str

    def apply(self) -> None: ...

    def verify(self) -> list[str]: ...


class ProcessHost:
    """The running process as a :class:`Host`."""

    @property
    def argv(self) -> list[str]:
        return sys.argv

    @argv.setter
    def argv(self, value: list[str]) -> None:
        sys.argv = list(value)

    def on_ascend(self) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        import torch_npu  # noqa: F401  (registers torch.npu)
        import torch

        return bool(torch.npu.is_available())

    def modules(self) -> Mapping[str, Any]:
        return sys.modules

    def import_module(self, name: str) -> Any:
        return importlib.import_module(name)


def megatron_imported(host: Host) -> list[str]:
    """Names of the ``megatron`` modules already imported (sorted)."""
    return sorted(name for name in list(host.modules()) if name == "megatron" or name.startswith("megatron."))


def transfer_to_npu(host: Host) -> bool:
    """Step 1: on Ascend, map ``torch.cuda`` to ``torch.npu`` before megatron-core is imported; True if done."""
    if not host.on_ascend():
        return False
    early = megatron_imported(host)
    if early:
        raise StartupError(f"{early[0]} was imported before {TRANSFER_TO_NPU}; megatron-core 0.12 would keep "
                           "CUDA device calls. Import Poseidon's runtime before megatron")
    host.import_module(TRANSFER_TO_NPU)
    return True


def adaptor_installed(find_spec: Callable[[str], Any] = importlib.util.find_spec) -> bool:
    """Whether MindSpeed-LLM is importable (looked up, not imported: its import patches Megatron)."""
    return _spec(find_spec, ADAPTOR_PACKAGE) is not None


def import_adaptor(host: Host, script: str, user_args: Sequence[str]) -> Any:
    """Step 2: import MindSpeed-LLM's adaptor with ``sys.argv`` = the user's command line; the adaptor module."""
    early = megatron_imported(host)
    if early:
        raise StartupError(f"{early[0]} was imported before MindSpeed-LLM's adaptor ({ADAPTOR_MODULE}); "
                           "MindSpeed must replace modules before megatron is imported")
    host.argv = [script, *user_args]
    host.import_module(ADAPTOR_PACKAGE)
    adaptor = host.modules().get(ADAPTOR_MODULE)
    if adaptor is None:
        adaptor = host.import_module(ADAPTOR_MODULE)
    return adaptor


def repatch_config(planned: Sequence[str]) -> dict[str, Any]:
    """The planned flags as the adaptor's argument names and types (``--micro-batch-size 2`` -> ``{"micro_batch_size": 2}``).

    Given to ``repatch`` so that the re-chosen patches see the plan even where the adaptor would not
    re-read ``sys.argv`` (the sources re-parse it on every call, but do not promise to).
    """
    config: dict[str, Any] = {}
    i = 0
    while i < len(planned):
        flag = planned[i]
        if not flag.startswith("--"):
            raise ValueError(f"planned flags must be --flag value pairs, got {flag!r} at position {i}")
        has_value = i + 1 < len(planned) and not planned[i + 1].startswith("--")
        value: Any = planned[i + 1] if has_value else True
        if isinstance(value, str) and value.lstrip("-").isdigit():
            value = int(value)
        config[flag[2:].replace("-", "_")] = value
        i += 2 if has_value else 1
    return config


def repatch(host: Host, adaptor: Any, script: str, new_args: Sequence[str], planned: Sequence[str]) -> None:
    """Step 3: ``sys.argv`` = the planned command line, then the adaptor's ``repatch`` for it."""
    entry: Callable[[dict], None] | None = getattr(adaptor, REPATCH, None)
    if entry is None:
        raise MindSpeedError(
            f"MindSpeed-LLM's {ADAPTOR_MODULE} has no {REPATCH}() (releases before 26.0.0): its patches would "
            f"stay chosen for the launch flags, not the plan's; use MindSpeed-LLM {' or '.join(SUPPORTED_RELEASES)} "
            "or later"
        )
    host.argv = [script, *new_args]
    entry(repatch_config(planned))


def apply_and_verify(tables: Sequence[Table]) -> None:
    """Step 4: Poseidon's tables after the adaptor's last patching, each verified (targets and copies)."""
    for table in tables:
        table.apply()
    for table in tables:
        problems = table.verify()
        if problems:
            raise StartupError(f"patch table {table.name!r} was overwritten after applying: {'; '.join(problems)}")


@dataclass(kw_only=True, slots=True)
class StartUp:
    """What :func:`start_up` did, in order (for the log and the tests)."""

    steps: list[str] = field(default_factory=list)
    adaptor: Any = None


def start_up(host: Host, *, script: str, user_args: Sequence[str], plan_flags: Callable[[], tuple[list[str], list[str]]],
             tables: Callable[[], Sequence[Table]]) -> StartUp:
    """The whole order: transfer_to_npu -> adaptor (user argv) -> plan -> argv + repatch -> our tables.

    ``plan_flags()`` runs between the adaptor import and the repatch (it may import megatron: profiling,
    search) and returns ``(new_args, planned)``: the rewritten command line and the planned flags in it.
    ``tables()`` builds Poseidon's patch tables once the plan is known.
    """
    done = StartUp()
    if transfer_to_npu(host):
        done.steps.append("transfer_to_npu")
    done.adaptor = import_adaptor(host, script, user_args)
    done.steps.append("adaptor")
    new_args, planned = plan_flags()
    done.steps.append("plan")
    repatch(host, done.adaptor, script, new_args, planned)
    done.steps.append("repatch")
    apply_and_verify(tables())
    done.steps.append("poseidon patches")
    return done


# --- flags ------------------------------------------------------------------------------------------


def layer_list_flags(*, tp: int, pp: int, layers: Sequence[int], micro_batch_size: int) -> list[str]:
    """The planned flags in this style; ``--num-layer-list`` only with PP >= 2 (one entry per stage)."""
    layers = [int(n) for n in layers]
    if len(layers) != pp:
        raise MindSpeedError(f"{NUM_LAYER_LIST} takes one layer count per pipeline stage; the plan has "
                             f"{len(layers)} stages for PP {pp} (virtual stages need the layout flag: "
                             "MindSpeed 26.1.0's --pipeline-model-parallel-layout)")
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if pp >= MIN_PIPELINE_FOR_LAYER_LIST:
        flags += [NUM_LAYER_LIST, ",".join(map(str, layers))]
    return flags + ["--micro-batch-size", str(micro_batch_size)]


DROPPED_FLAGS: dict[str, str] = {
    "--pipeline-num-transformer-layers": "MindSpeed refuses it next to --num-layer-list "
                                         "(unaligned_pineline_feature.py); the plan decides the split",
}
"""User flags the plan replaces in this style (on top of ``job_flags.PLANNED_FLAGS``), and why."""

REFUSED_FLAGS: dict[str, str] = {
    "--noop-layers": "MindSpeed-LLM silently sets --num-layer-list to None when --noop-layers is given "
                     "(features_manager/pipeline_parallel/num_layer_list.py), so the planned split would be "
                     "ignored; drop --noop-layers",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class FlagDecision:
    """How the user's flags change in this style."""

    drop: tuple[str, ...] = ()
    """User flags to remove (with their values)."""
    add: tuple[str, ...] = ()
    """Flags to add (after the planned ones)."""
    notes: tuple[str, ...] = ()
    """One line per change, for the log."""


def check_user_flags(user: Mapping[str, str], *, tp: int, pp: int, ep: int, num_experts: int) -> FlagDecision:
    """Refuse, drop or add flags around a planned ``--num-layer-list`` (``user``: ``job_flags.flag_values``)."""
    for flag, why in REFUSED_FLAGS.items():
        if flag in user:
            raise MindSpeedError(f"{flag} {_quote(user[flag])} conflicts with Poseidon's split: {why}")
    schedule = user.get("--schedules-method")
    if schedule == "dualpipev":
        raise MindSpeedError("--schedules-method dualpipev cannot run an uneven --num-layer-list split "
                             "(MindSpeed-LLM refuses the pair, and its dualpipev layer offsets assume an even "
                             "split); drop --schedules-method dualpipev")
    drop = tuple(flag for flag in DROPPED_FLAGS if flag in user)
    notes = [f"dropped {flag} {_quote(user[flag])}: {DROPPED_FLAGS[flag]}" for flag in drop]
    add: tuple[str, ...] = ()
    if needs_sequence_parallel(tp=tp, ep=ep, num_experts=num_experts) and "--sequence-parallel" not in user:
        add = ("--sequence-parallel",)
        notes.append(f"added --sequence-parallel: megatron-core 0.12 requires it for MoE with TP {tp} > 1 and "
                     f"EP {ep} > 1 (model_parallel_config.py)")
    return FlagDecision(drop=drop, add=add, notes=tuple(notes))


def needs_sequence_parallel(*, tp: int, ep: int, num_experts: int) -> bool:
    """Core 0.12 raises "When using expert parallelism and tensor parallelism, sequence parallelism must be
    used" for EP > 1 with TP > 1 (``ModelParallelConfig.__post_init__``); EP > 1 implies MoE."""
    return num_experts > 0 and tp > 1 and ep > 1


def model_parallel_world(tp: int, pp: int, cp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """The smallest world size these degrees fit in; every valid world size is a multiple of it.

    The rule of megatron-core 0.12's ``initialize_model_parallel`` (the same in 0.16): dense layers
    (attention, non-expert MLP) use ``tp x pp x cp`` ranks per replica, so ``DP = world / (tp x pp x cp)``;
    expert layers use ``etp x ep x pp`` (``etp`` defaults to ``tp``; CP folds into expert data
    parallelism), so ``expert DP = world / (etp x ep x pp)``. Both must divide the world, hence the lcm.
    """
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", tp if etp is None else etp)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    etp = tp if etp is None else etp
    return math.lcm(tp * pp * cp, etp * ep * pp)


def data_parallel_size(world: int, tp: int, pp: int, cp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """DP of the dense layers for ``world`` ranks (see :func:`model_parallel_world`); MindSpeedError if the
    world does not fit the degrees."""
    unit = model_parallel_world(tp, pp, cp, ep, etp)
    if world % unit:
        raise MindSpeedError(
            f"{world} ranks do not fit TP {tp} x PP {pp} x CP {cp} (dense) and expert TP "
            f"{tp if etp is None else etp} x EP {ep} x PP {pp} (experts): the world must be a multiple of {unit}; "
            "change --context-parallel-size / --expert-model-parallel-size or the number of ranks"
        )
    return world // (tp * pp * cp)


def dp_multiple(script_args: Sequence[str]) -> int:
    """What the plan's DP must be a multiple of for the job's CP (``TargetRuntime.dp_multiple``): the plan's
    ``tp x dp x pp`` ranks must be a multiple of ``tp x pp x cp``. Expert parallelism is the plan's own
    (searched with megatron-core's rules, ``costmodel.check_expert_layout``); the user's EP flags are
    replaced, so they set nothing here (their values are still checked)."""
    from poseidon_plugin.argv import flag_values

    cp, _ep, _etp = user_cp_ep(flag_values(script_args))
    return cp


def user_cp_ep(user: Mapping[str, str]) -> tuple[int, int, int | None]:
    """``(cp, ep, etp)`` from the user's flags (Megatron's names; defaults 1, 1, None = TP)."""
    def read(flag: str, default: int | None) -> int | None:
        if flag not in user:
            return default
        try:
            value = int(user[flag])
        except ValueError:
            value = 0
        if value < 1:
            raise MindSpeedError(f"{flag} {_quote(user[flag])} is invalid: must be an integer >= 1")
        return value

    return (read("--context-parallel-size", 1), read("--expert-model-parallel-size", 1),
            read("--expert-tensor-parallel-size", None))


# --- the layout backport ----------------------------------------------------------------------------


def layout_backport(find_spec: Callable[[str], Any] = importlib.util.find_spec,
                    exists: Callable[[str], bool] = os.path.exists) -> bool:
    """Whether the installed MindSpeed has Megatron's layout flag (26.1.0_core_r0.12.1 and later).

    Found without importing MindSpeed (its import patches): the package ``LAYOUT_BACKPORT`` names is looked
    up under the top-level ``mindspeed`` package's folders.
    """
    return _submodule_exists(find_spec, exists, LAYOUT_BACKPORT)


def choose_style(find_spec: Callable[[str], Any] = importlib.util.find_spec,
                 exists: Callable[[str], bool] = os.path.exists) -> str:
    """``auto`` flag style: megatron's layout module -> ``megatron``; MindSpeed-LLM on a MindSpeed with the
    layout backport -> ``mindspeed-layout`` (the layout flag, any split incl. virtual stages); MindSpeed-LLM
    -> ``mindspeed`` (``--num-layer-list``); else ``patch``. No module is imported."""
    if _submodule_exists(find_spec, exists, MEGATRON_LAYOUT):
        return "megatron"
    if _spec(find_spec, ADAPTOR_PACKAGE) is not None:
        return "mindspeed-layout" if layout_backport(find_spec, exists) else "mindspeed"
    return "patch"


def _spec(find_spec: Callable[[str], Any], name: str) -> Any:
    try:
        return find_spec(name)
    except (ImportError, ValueError):
        return None


def _submodule_exists(find_spec: Callable[[str], Any], exists: Callable[[str], bool], dotted: str) -> bool:
    """Whether ``dotted`` would be imported, looked up as the import system does but importing nothing.

    ``megatron`` is a namespace package: with two megatron-cores on the path (MindSpeed-LLM's 0.12 first,
    another further down) ``megatron.core`` is the *first* folder holding ``core/__init__.py``, so each level
    is resolved in path order and a module of the other copy does not count.
    """
    top, *rest = dotted.split(".")
    spec = _spec(find_spec, top)
    if spec is None or not spec.submodule_search_locations:
        return False
    locations = list(spec.submodule_search_locations)
    for depth, part in enumerate(rest):
        last = depth == len(rest) - 1
        found = next((os.path.join(root, part) for root in locations
                      if exists(os.path.join(root, part, "__init__.py"))
                      or (last and exists(os.path.join(root, part) + ".py"))), None)
        if found is not None:
            locations = [found]
            continue
        namespace = [os.path.join(root, part) for root in locations if exists(os.path.join(root, part))]
        if last or not namespace:
            return False
        locations = namespace  # a namespace sub-package: all its folders, in order
    return True


def _quote(value: str, limit: int = 80) -> str:
    return repr(value if len(value) <= limit else value[: limit - 3] + "...")
