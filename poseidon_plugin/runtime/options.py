"""``--poseidon-*`` options of ``poseidon-run``: one table, parsed from the command line and ``POSEIDON_*`` env.

Torch-free on purpose: the launcher validates options before it starts any process, the per-rank bootstrap
reads the same options back from the environment the launcher exported, and unit tests exercise both
without torch.

Every option ``--poseidon-NAME`` is also settable as the environment variable ``POSEIDON_NAME`` (upper
case, ``-`` -> ``_``); a command-line value wins over the environment. ``--poseidon-*`` tokens may stand
anywhere on the command line (before or after the training script): Megatron never defines flags with that
prefix, so taking them out of the script's arguments cannot steal one of its flags.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from poseidon_plugin.argv import scan
from poseidon_plugin.errors import PoseidonError

PREFIX = "--poseidon-"
ENV_PREFIX = "POSEIDON_"
# Set by the launcher for the ranks: the user launched a module (torchrun -m), not a file.
ENV_SCRIPT_IS_MODULE = "POSEIDON_SCRIPT_IS_MODULE"
# Test-only fault injection, "PHASE:RANK[:exit]" (see docs/RUNTIME.md); never set by users.
ENV_INJECT_FAULT = "POSEIDON_INJECT_FAULT"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
FLAG_STYLES = ("auto", "megatron", "mindspeed-layout", "mindspeed", "patch")


def default_profile_cache() -> str:
    """``$XDG_CACHE_HOME/poseidon/profiles`` (``~/.cache/poseidon/profiles`` when XDG is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "poseidon", "profiles")


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeOptions:
    """Everything ``poseidon-run`` adds on top of torchrun. Field ``x_y`` is ``--poseidon-x-y`` / ``POSEIDON_X_Y``."""

    disable: bool = False
    """Run exactly torchrun (the ``--poseidon-*`` options are dropped, nothing else happens)."""
    dry_run: bool = False
    """Plan, print the plan table and the rewritten command on rank 0, then exit 0 before training."""
    plan: str | None = None
    """A saved plan (JSON) to apply instead of searching; validated against the real world."""
    save_plan: str | None = None
    """Rank 0 writes the plan it applies to this JSON file (atomically)."""
    cluster: str | None = None
    """Cluster spec file declaring device types, nodes and links, for when detection cannot tell."""
    profile_cache: str = ""
    """Directory of cached layer profiles; empty means :func:`default_profile_cache`."""
    schedules: tuple[str, ...] = ()
    """Pipeline schedules the search may choose from (comma list); empty means the search's default."""
    keep: bool = False
    """Keep the user's TP, PP and micro-batch size: plan only placement and the layer split."""
    search_mode: str = "exact"
    """``exact``: the proven optimum of the cost model (``poseidon plan --exact``); ``default``: the faster
    search whose space rests on the paper's ridge rule (docs/SEARCH.md). Either stops at
    ``search_time_limit`` with the best plan found."""
    search_time_limit: float = 30.0
    """Seconds rank 0 may search while every device of the job waits (default 30; at most half of
    ``timeout``). Past it the best plan so far is applied and the plan table says it is not proven optimal,
    with its gap to the proven lower bound; raise it to prove more."""
    search_workers: int = 0
    """Processes rank 0's search may walk a large tree with (``poseidon plan --workers``); 0 (default): the
    cores rank 0 may run on, at most 8. The plan is the same with any number."""
    emulate: str | None = None
    """Emulated heterogeneous cluster on CPU, e.g. ``A2-2:2,A2-4:2`` (see ``emulation/harness.py``)."""
    emulate_model: str | None = None
    """With ``emulate``: deterministic emulation of a real model, ``PRESET[:SCALE[:LINKS]]`` (e.g. ``llama3-8b``,
    ``llama3-8b:0.5:npu-wan``): layers, embedding, head and links take the preset's analytic times on the
    emulated devices x SCALE (default ``auto``: iterations of about 1-3 s); see ``emulation/harness.py``."""
    micro_batch_sizes: tuple[int, ...] = ()
    """Candidate micro-batch sizes to profile and search (comma list); empty means 1, 2, 4 up to the batch."""
    timeout: float = 600.0
    """Seconds any rank waits for the others at a Poseidon step before all ranks fail together (as NCCL's
    default). It also bounds the wait of the fastest device type for the slowest one's profiling."""
    profile_iters: int = 5
    """Timed forward/backward repetitions per profiled configuration (the median is kept)."""
    profile_warmup: int = 2
    """Untimed repetitions before the timed ones."""
    watch_iterations: int = 3
    """Training iterations timed to compare with the prediction (0 disables the watch)."""
    flag_style: str = "auto"
    """How the layer split reaches Megatron: ``megatron`` (layout flag), ``mindspeed-layout`` (MindSpeed-LLM
    with MindSpeed's layout backport), ``mindspeed`` (MindSpeed-LLM, ``--num-layer-list`` + layer patches),
    ``patch`` (layer patches only) or ``auto`` (see ``runtime/apply.py``)."""

    @property
    def search_budget_s(self) -> float:
        """The search's time limit at launch: ``search_time_limit``, and never more than half of ``timeout``
        (the other ranks' wait for the plan must not run out first)."""
        return min(self.search_time_limit, self.timeout / 2)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Spec:
    """How one option is read: its kind decides the parser and whether it takes a value."""

    field: str
    kind: str  # "bool" | "str" | "path" (must exist) | "out_path" | "float" | "int" | "str_list" | "int_list"
    minimum: float | None = None
    choices: tuple[str, ...] = ()
    example: str = ""  # a typical value for messages (else one by kind)

    @property
    def flag(self) -> str:
        return PREFIX + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.field.upper()


_SPECS: tuple[_Spec, ...] = (
    _Spec(field="disable", kind="bool"),
    _Spec(field="dry_run", kind="bool"),
    _Spec(field="plan", kind="path"),
    _Spec(field="save_plan", kind="out_path"),
    _Spec(field="cluster", kind="path"),
    _Spec(field="profile_cache", kind="out_path"),
    _Spec(field="schedules", kind="str_list"),
    _Spec(field="keep", kind="bool"),
    _Spec(field="search_mode", kind="str", choices=("exact", "default")),
    _Spec(field="search_time_limit", kind="float", minimum=0.1, example="30"),
    _Spec(field="search_workers", kind="int", minimum=0, example="8"),
    _Spec(field="emulate", kind="str", example="A2-2:2,A2-4:2"),
    _Spec(field="emulate_model", kind="str", example="llama3-8b"),
    _Spec(field="micro_batch_sizes", kind="int_list", minimum=1),
    _Spec(field="timeout", kind="float", minimum=1.0),
    _Spec(field="profile_iters", kind="int", minimum=1),
    _Spec(field="profile_warmup", kind="int", minimum=0),
    _Spec(field="watch_iterations", kind="int", minimum=0),
    _Spec(field="flag_style", kind="str", choices=FLAG_STYLES),
)
_BY_FLAG = {spec.flag: spec for spec in _SPECS}
_SWITCHES = frozenset(spec.flag for spec in _SPECS if spec.kind == "bool")
assert {spec.field for spec in _SPECS} == {f.name for f in fields(RuntimeOptions)}


def known_flags() -> tuple[str, ...]:
    """Every ``--poseidon-*`` flag, in table order."""
    return tuple(spec.flag for spec in _SPECS)


def split_argv(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Take the ``--poseidon-*`` options out of ``argv``; return ``({flag: raw value}, remaining argv)``.

    Read with ``poseidon_plugin.argv``'s rules: boolean options take no value (``--poseidon-dry-run``) or
    an inline one (``--poseidon-dry-run=0``); the others take the next token or an inline ``=value``. Raises PoseidonError on an unknown
    ``--poseidon-*`` flag (with a suggestion), a missing value, or a repeated flag.
    """
    found: dict[str, str] = {}
    rest: list[str] = []
    position = 0
    for token in scan(argv, switches=_SWITCHES):
        if not token.flag.startswith(PREFIX):
            continue
        rest.extend(argv[position:token.start])
        position = token.stop
        flag = token.flag
        spec = _BY_FLAG.get(flag)
        if spec is None:
            # Compare the part after the shared prefix, or every typo would look close to every flag.
            names = [known[len(PREFIX):] for known in known_flags()]
            close = difflib.get_close_matches(flag[len(PREFIX):], names, n=1)
            hint = f"did you mean {PREFIX}{close[0]}?" if close else f"known: {', '.join(known_flags())}"
            raise PoseidonError(f"unknown option {flag}; {hint}")
        if flag in found:
            raise PoseidonError(f"{flag} is given twice ({found[flag]!r} and the next); give it once")
        if token.value is not None:
            found[flag] = token.value
        elif spec.kind == "bool":
            found[flag] = "1"
        else:
            raise PoseidonError(f"{flag} needs a value, e.g. {flag}={_example(spec)}")
    rest.extend(argv[position:])
    return found, rest


def resolve(cli: Mapping[str, str], environ: Mapping[str, str]) -> RuntimeOptions:
    """Build validated options from ``split_argv``'s flags and the environment (the command line wins).

    Raises PoseidonError naming the flag or environment variable, the bad value and what is allowed.
    """
    values: dict[str, Any] = {}
    for spec in _SPECS:
        if spec.flag in cli:
            raw, source = cli[spec.flag], spec.flag
        elif spec.env in environ:
            raw, source = environ[spec.env], spec.env
        else:
            continue
        values[spec.field] = _convert(spec, raw, source)
    options = RuntimeOptions(**values)
    _check_conflicts(options)
    return options


def parse(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> tuple[RuntimeOptions, list[str]]:
    """``split_argv`` + ``resolve``: the options and the argv left for torchrun and the script."""
    cli, rest = split_argv(argv)
    return resolve(cli, os.environ if environ is None else environ), rest


def as_given(message: str, argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """``message`` with each ``--poseidon-*`` flag the user set through its ``POSEIDON_*`` variable instead
    named by that variable (what the user typed is what the error must name)."""
    try:
        cli, _ = split_argv(argv)
    except PoseidonError:
        return message
    for spec in _SPECS:
        value = environ.get(spec.env)
        if spec.flag in message and spec.flag not in cli and value:
            # "--poseidon-x VALUE" and "e.g. --poseidon-x EXAMPLE" become assignments; a bare flag, the name
            message = message.replace(f"{spec.flag} {value}", f"{spec.env}={value}")
            message = message.replace(f"e.g. {spec.flag} ", f"e.g. {spec.env}=").replace(spec.flag, spec.env)
    return message


def to_env(options: RuntimeOptions) -> dict[str, str]:
    """The ``POSEIDON_*`` variables that make :func:`resolve` give back ``options`` (the launcher -> rank channel).

    Paths are made absolute so that a rank with another working directory reads the same files.
    """
    env: dict[str, str] = {}
    for spec in _SPECS:
        value = getattr(options, spec.field)
        if spec.kind == "bool":
            env[spec.env] = "1" if value else "0"
        elif value is None:
            env[spec.env] = ""
        elif spec.kind in ("str_list", "int_list"):
            env[spec.env] = ",".join(str(v) for v in value)
        elif spec.kind in ("path", "out_path"):
            env[spec.env] = os.path.abspath(value) if value else ""
        else:
            env[spec.env] = str(value)
    return env


def profile_cache_dir(options: RuntimeOptions) -> str:
    """The profile cache directory these options select."""
    return options.profile_cache or default_profile_cache()


def _convert(spec: _Spec, raw: str, source: str) -> Any:
    text = raw.strip()
    if spec.kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise PoseidonError(f"{source}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off")
    if spec.kind in ("str", "path", "out_path"):
        if spec.choices and text not in spec.choices:
            raise PoseidonError(f"{source}={raw!r} is not allowed; choose one of {', '.join(spec.choices)}")
        if not text:
            if source.startswith(PREFIX):  # the launcher passes unset options to the ranks as empty variables
                raise PoseidonError(f"{source} {raw!r} is empty; give a value, e.g. {source}={_example(spec)}, "
                                    f"or leave the option out")
            return RuntimeOptions.__dataclass_fields__[spec.field].default
        if spec.kind == "path" and not os.path.isfile(text):
            raise PoseidonError(f"{source}={raw!r}: no such file; give the path of an existing JSON or YAML file")
        return text
    if spec.kind in ("int", "float"):
        number = _number(spec.kind, text, source, raw)
        if spec.minimum is not None and number < spec.minimum:
            raise PoseidonError(f"{source}={raw!r} is too small; it must be >= {spec.minimum:g}")
        return number
    items = [item.strip() for item in text.split(",") if item.strip()]
    if spec.kind == "int_list":
        numbers = tuple(_number("int", item, source, raw) for item in items)
        if any(n < (spec.minimum or 0) for n in numbers):
            raise PoseidonError(f"{source}={raw!r}: every value must be >= {spec.minimum:g}, e.g. {_example(spec)}")
        return tuple(sorted(set(numbers)))
    return tuple(dict.fromkeys(items))


def _number(kind: str, text: str, source: str, raw: str) -> float:
    try:
        number = int(text) if kind == "int" else float(text)
    except ValueError:
        raise PoseidonError(f"{source}={raw!r} is not {'an integer' if kind == 'int' else 'a number'}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise PoseidonError(f"{source}={raw!r} is not a finite number")
    return number


def _example(spec: _Spec) -> str:
    return spec.example or {
        "bool": "1",
        "path": "FILE.json",
        "out_path": "PATH",
        "str_list": "1f1b,interleaved-1f1b",
        "int_list": "1,2,4",
        "int": "3",
        "float": "300",
    }.get(spec.kind, spec.choices[0] if spec.choices else "VALUE")


def _check_conflicts(options: RuntimeOptions) -> None:
    """Options that cannot be honoured together: say which pair, and which one to drop."""
    if options.plan:
        for field, given in (
            ("keep", options.keep),
            ("schedules", bool(options.schedules)),
            ("micro_batch_sizes", bool(options.micro_batch_sizes)),
        ):
            if given:
                flag = PREFIX + field.replace("_", "-")
                raise PoseidonError(
                    f"--poseidon-plan {options.plan} conflicts with {flag}: a saved plan already fixes "
                    f"the parallelism; drop {flag} or drop --poseidon-plan to search again"
                )
    if options.emulate_model and not options.emulate:
        raise PoseidonError(f"--poseidon-emulate-model {options.emulate_model} needs --poseidon-emulate TYPE:COUNT,... "
                            "(the emulated devices); add it or drop --poseidon-emulate-model")
    if options.save_plan and options.plan and os.path.abspath(options.save_plan) == os.path.abspath(options.plan):
        raise PoseidonError("--poseidon-save-plan names the same file as --poseidon-plan; give another path")
