"""Error types shared by the planning core, the CLI and the launcher.

Every user-facing mistake raises a :class:`PoseidonError` (a ``ValueError``) whose message names the
flag or field, the bad value and what is allowed; the CLIs print it as one line and exit with code 2.
"""


class PoseidonError(ValueError):
    """A user mistake (bad input file, flag or value). The message is shown as is, without traceback."""


class InputError(PoseidonError):
    """A malformed or invalid input document (stage-level input, spec, profile, plan)."""


class NoFeasiblePlanError(PoseidonError):
    """The search found no plan that satisfies the constraints (memory, divisibility, ...)."""
