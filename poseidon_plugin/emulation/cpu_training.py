"""Megatron-LM's own training loop (``megatron.training``: ``pretrain``, ``train_step``) on CPU ranks.

The megatron-core shim (``emulation/cpu_shim.py``) makes the model, the schedules and DDP run on gloo. A
training script built on ``megatron.training`` (Megatron-LM's ``pretrain_gpt.py``) needs two things more
on a CPU rank, both made here and nowhere else, each named in one log line:

* flags: the command a user writes for GPUs turns on features that exist only as CUDA kernels (Transformer
  Engine, Apex's persistent layer norm and gradient-accumulation fusion, the fused RoPE); on a CPU rank
  each is switched to Megatron-LM's own unfused path (:func:`flag_adjustments`, torch-free);
* the CUDA runtime calls ``megatron.training`` makes: the patch table ``emulation/megatron_training_patch.py``.

Nothing here runs on CUDA or Ascend ranks (``bootstrap.py`` calls :func:`prepare` only where the shim is
installed), and scripts that do not use ``megatron.training`` (``scripts/pretrain_gpt.py``) are left as
they are.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from poseidon_plugin import argv
from poseidon_plugin.errors import PoseidonError

_SWITCHES = ("--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
             "--no-masked-softmax-fusion", "--sequence-parallel")

IMPORT_NEEDS = "triton pydantic tqdm wrapt six regex einops"
"""What importing Megatron-LM's ``megatron.training`` needs besides torch and megatron-core (the ``test``
extra of setup.py installs it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Adjustment:
    """One CPU-only change to the training script's flags."""

    flag: str
    old: str | None
    """The user's value (None: not given, Megatron-LM's default applied)."""
    new: str | None
    """The value set on CPU ranks (None: a switch added; "": the flag dropped)."""
    why: str

    def line(self) -> str:
        if self.new == "":
            return f"CPU rank: {self.flag} dropped ({self.why})"
        was = "not given" if self.old is None else (f"was {self.old}" if self.old else "was given")
        now = self.flag if self.new is None else f"{self.flag} {self.new}"
        return f"CPU rank: {now} ({was}; {self.why})"


def flag_adjustments(args: Sequence[str]) -> list[Adjustment]:
    """The changes Megatron-LM's loop needs on a CPU rank, given the script's arguments (torch-free)."""
    values = argv.flag_values(args, _SWITCHES)
    out = []
    impl = values.get("--transformer-impl")
    if impl != "local":
        out.append(Adjustment(flag="--transformer-impl", old=impl, new="local",
                              why="Transformer Engine runs on CUDA only; Megatron-LM's default is "
                                  "transformer_engine"))
    if "--no-persist-layer-norm" not in values:
        out.append(Adjustment(flag="--no-persist-layer-norm", old=None, new=None,
                              why="the persistent layer norm is an Apex CUDA kernel"))
    if "--no-gradient-accumulation-fusion" not in values:
        out.append(Adjustment(flag="--no-gradient-accumulation-fusion", old=None, new=None,
                              why="the fused weight-gradient accumulation is a CUDA extension"))
    if ("--bf16" in values or "--fp16" in values) and "--no-masked-softmax-fusion" not in values:
        out.append(Adjustment(flag="--no-masked-softmax-fusion", old=None, new=None,
                              why="the fused bf16 / fp16 softmax is a CUDA extension"))
    if values.get("--position-embedding-type") in ("rope", "yarn", "mrope") and "--no-rope-fusion" not in values:
        out.append(Adjustment(flag="--no-rope-fusion", old=None, new=None,
                              why="the fused RoPE needs Transformer Engine"))
    if "--sequence-parallel" in values:
        out.append(Adjustment(flag="--sequence-parallel", old="", new="", why="the local layer spec's torch "
                              "norms have no sequence-parallel form (Transformer Engine's have); the plan is "
                              "priced with it"))
    if "--eval-interval" not in values:
        # Megatron-LM's loop divides by it (its default None stops the loop on any device); without the user's
        # own evaluation set-up the emulated run does not evaluate
        out.append(Adjustment(flag="--eval-interval", old=None, new=values.get("--train-iters") or "1000",
                              why="Megatron-LM's loop divides by it; the default None stops it"))
        if "--eval-iters" not in values:
            out.append(Adjustment(flag="--eval-iters", old=None, new="0",
                                  why="no evaluation set up by the user: the emulated run does not evaluate"))
    return out


def apply_adjustments(args: Sequence[str], adjustments: Sequence[Adjustment]) -> list[str]:
    """``args`` with each adjustment made: a changed flag replaced in place, added ones appended."""
    replace = {a.flag: a for a in adjustments if a.old is not None}
    out = argv.remove_flags(args, set(replace), _SWITCHES) if replace else list(args)
    for a in adjustments:
        if a.new != "":
            out += [a.flag] if a.new is None else [a.flag, a.new]
    return out


def prepare(script: str, args: Sequence[str], *, is_module: bool, log: Callable[[str], None]) -> list[str]:
    """On a CPU rank, right before a script whose stack has ``megatron.training`` runs
    (``job_flags.uses_megatron_training``, checked by ``Device.prepare_training``): the adjusted arguments, the
    training table applied, one log line per change."""
    from poseidon_plugin.emulation import cpu_shim_patch
    from poseidon_plugin.emulation import megatron_training_patch as megatron_training

    try:
        importlib.import_module("megatron.training.training")
    except ImportError as exc:
        raise PoseidonError(f"{script} runs on Megatron-LM's megatron.training, which does not import here "
                            f"({exc}); install what it needs: pip install {IMPORT_NEEDS} (the test extra: "
                            f"pip install -e '.[test]')") from None
    adjustments = flag_adjustments(args)
    megatron_training.TABLE.apply()
    for adjustment in adjustments:
        log(adjustment.line())
    for row in megatron_training.TABLE.rows:
        note = megatron_training.ROW_NOTES.get(row.target)
        if note:
            log(f"CPU rank: {note}")
    # the megatron-core shim's checks of CUDA type names this job's calls meet (applied with the shim)
    for note, flags in cpu_shim_patch.TYPE_NAME_CHECKS.values():
        if not flags or any(flag in args for flag in flags):
            log(f"CPU rank: {note}")
    return apply_adjustments(args, adjustments)
