"""One reading of ``--flag`` command lines, shared by every part of Poseidon that scans argv.

The rules are argparse's, for long options:

* ``--flag=value`` carries its value inline (even an empty one);
* a flag named in ``switches`` takes no value (``--bf16``, ``--poseidon-dry-run``);
* any other ``--flag`` takes the next token as its value when that token does not start with ``--``
  (so ``--lr -1`` is a value, ``--lr --bf16`` is not), and has no value otherwise;
* a bare ``--`` and every token that does not start with ``--`` is positional.

:func:`scan` reports where each flag and its value sit, so callers can take flags out and keep every other
token in order (``runtime/options.py`` takes out ``--poseidon-*``, ``runtime/job_flags.py`` drops the
planned flags), or read values (:func:`flag_values`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class FlagToken:
    """One ``--flag`` on a command line and the tokens it spans."""

    flag: str
    """The flag's name, ``--name`` (without an inline ``=value``)."""
    value: str | None
    """Its value (inline or the next token); None when it has none (a switch, or nothing followed)."""
    inline: bool
    """The value was given as ``--flag=value``."""
    start: int
    """Index in argv of the flag's token."""
    stop: int
    """Index in argv just after the flag's last token (``start + 2`` when the value is the next token)."""


def is_flag(token: str) -> bool:
    """Whether ``token`` is a long option (``--x``), not a value or the ``--`` separator."""
    return token.startswith("--") and token != "--"


def scan(argv: Sequence[str], switches: Collection[str] = ()) -> Iterator[FlagToken]:
    """Every ``--flag`` of ``argv`` in order, read with the module's rules (``switches`` take no value)."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if not is_flag(token):
            i += 1
            continue
        flag, has_inline, inline = token.partition("=")
        if has_inline:
            yield FlagToken(flag=flag, value=inline, inline=True, start=i, stop=i + 1)
            i += 1
        elif flag not in switches and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            yield FlagToken(flag=flag, value=argv[i + 1], inline=False, start=i, stop=i + 2)
            i += 2
        else:
            yield FlagToken(flag=flag, value=None, inline=False, start=i, stop=i + 1)
            i += 1


def flag_values(argv: Sequence[str], switches: Collection[str] = (), *, missing: str | None = "") -> dict[str, str]:
    """``{flag: value}`` for every flag of ``argv`` (the last occurrence wins).

    A flag without a value maps to ``missing`` (``""``), or is left out when ``missing`` is None.
    """
    values: dict[str, str] = {}
    for token in scan(argv, switches):
        if token.value is not None:
            values[token.flag] = token.value
        elif missing is not None:
            values[token.flag] = missing
    return values


def remove_flags(argv: Sequence[str], drop: Collection[str], switches: Collection[str] = ()) -> list[str]:
    """``argv`` without the flags in ``drop`` (and their values); every other token kept, in order."""
    kept: list[str] = []
    position = 0
    for token in scan(argv, switches):
        if token.flag in drop:
            kept.extend(argv[position:token.start])
            position = token.stop
    kept.extend(argv[position:])
    return kept
