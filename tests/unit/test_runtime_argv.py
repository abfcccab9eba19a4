"""The one argv scanner (``poseidon_plugin.argv``): ``--flag value``, ``--flag=value``, switches, positionals."""

from __future__ import annotations

import pytest

from poseidon_plugin.argv import flag_values, remove_flags, scan


@pytest.mark.parametrize(
    "argv, switches, expected",
    [
        (["--a", "1", "--b=2", "--c"], (), [("--a", "1", 0, 2), ("--b", "2", 2, 3), ("--c", None, 3, 4)]),
        (["--bf16", "x.py"], ("--bf16",), [("--bf16", None, 0, 1)]),
        (["--bf16", "x.py"], (), [("--bf16", "x.py", 0, 2)]),
        (["--lr", "-1", "--lr", "--x"], (), [("--lr", "-1", 0, 2), ("--lr", None, 2, 3), ("--x", None, 3, 4)]),
        (["pos", "--", "--e=", "-m"], (), [("--e", "", 2, 3)]),
        (["--s=1"], ("--s",), [("--s", "1", 0, 1)]),  # an inline value is a value even on a switch
    ],
)
def test_scan_rules(argv, switches, expected):
    assert [(t.flag, t.value, t.start, t.stop) for t in scan(argv, switches)] == expected


def test_flag_values_last_wins_and_missing_values():
    argv = ["--a", "1", "--a=2", "--sw", "--b"]
    assert flag_values(argv, ("--sw",)) == {"--a": "2", "--sw": "", "--b": ""}
    assert flag_values(argv, ("--sw",), missing=None) == {"--a": "2"}


def test_remove_flags_keeps_everything_else_in_order():
    argv = ["x.py", "--keep", "1", "--drop", "2", "pos", "--drop=3", "--sw", "--drop", "--tail", "t"]
    assert remove_flags(argv, {"--drop"}) == ["x.py", "--keep", "1", "pos", "--sw", "--tail", "t"]
    assert remove_flags(argv, {"--sw"}, ("--sw",)) == ["x.py", "--keep", "1", "--drop", "2", "pos", "--drop=3",
                                                       "--drop", "--tail", "t"]
