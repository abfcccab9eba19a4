"""Patch tables: apply / verify / revert, by-name copies swept, idempotent, all-or-nothing (on fake modules)."""

from __future__ import annotations

import sys
import types

import pytest

from poseidon_plugin.patches import table as table_mod
from poseidon_plugin.patches.table import Patch, PatchError, PatchTable, resolve


@pytest.fixture
def fake(monkeypatch):
    """A fake package ``fakestack`` with a function, a by-name copy of it, and a class with a staticmethod."""
    core = types.ModuleType("fakestack.core")

    def layers(config):
        return "original"

    class Layer:
        @staticmethod
        def offset(config):
            return 0

        def forward(self, x):
            return x

    core.layers = layers
    core.Layer = Layer
    user = types.ModuleType("fakestack.user")
    user.layers = layers  # what `from fakestack.core import layers` leaves behind
    pkg = types.ModuleType("fakestack")
    pkg.core, pkg.user = core, user
    for name, module in (("fakestack", pkg), ("fakestack.core", core), ("fakestack.user", user)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(table_mod, "SWEEP_PREFIXES", ("fakestack",))
    return types.SimpleNamespace(core=core, user=user, layers=layers, Layer=Layer)


def _wrap(tag):
    def make(original):
        def wrapper(*args, **kwargs):
            return (tag, original(*args, **kwargs))

        return wrapper

    return make


def test_apply_sweeps_copies_and_revert_restores(fake):
    table = PatchTable("t", [Patch(target="fakestack.core.layers", make=_wrap("p"), sweep=True)])
    table.apply()
    assert fake.core.layers(None) == ("p", "original")
    assert fake.user.layers(None) == ("p", "original")
    assert table.applied and table.verify() == []
    table.revert()
    assert fake.core.layers is fake.layers and fake.user.layers is fake.layers
    assert not table.applied


def test_apply_is_idempotent(fake):
    table = PatchTable("t", [Patch(target="fakestack.core.layers", make=_wrap("p"), sweep=True)])
    table.apply()
    table.apply()
    assert fake.core.layers(None) == ("p", "original")  # wrapped once, not twice
    table.revert()
    table.revert()
    assert fake.core.layers is fake.layers


def test_staticmethods_and_methods(fake):
    table = PatchTable("t", [Patch(target="fakestack.core.Layer.offset", make=_wrap("s")),
                             Patch(target="fakestack.core.Layer.forward", make=_wrap("f"))])
    table.apply()
    assert isinstance(vars(fake.Layer)["offset"], staticmethod)
    assert fake.Layer.offset(None) == ("s", 0) and fake.Layer().offset(None) == ("s", 0)
    assert fake.Layer().forward(3) == ("f", 3)
    table.revert()
    assert fake.Layer.offset(None) == 0 and fake.Layer().forward(3) == 3


def test_missing_target_leaves_nothing_patched(fake):
    table = PatchTable("t", [Patch(target="fakestack.core.layers", make=_wrap("p"), sweep=True),
                             Patch(target="fakestack.core.no_such_function", make=_wrap("x"))])
    with pytest.raises(PatchError, match="fakestack.core.no_such_function does not exist"):
        table.apply()
    assert fake.core.layers is fake.layers and fake.user.layers is fake.layers
    assert not table.applied


def test_unswept_copy_fails_verification(fake):
    table = PatchTable("t", [Patch(target="fakestack.core.layers", make=_wrap("p"), sweep=True)])
    table.apply()
    assert table.verify() == []
    fake.user.layers = fake.layers  # a swept copy put back behind the table's back
    assert table.verify() == ["copy fakestack.user.layers is not patched"]
    fake.user.layers = fake.core.layers
    fake.user.late = fake.layers  # a by-name copy made after apply(), never swept
    assert table.verify() == ["fakestack.user.late still holds the original"]
    del fake.user.late
    fake.core.layers = fake.layers  # the target itself reverted behind the table's back
    assert "fakestack.core.layers is not patched" in table.verify()
    table.revert()
    assert fake.core.layers is fake.layers and fake.user.layers is fake.layers


def test_unswept_row_checks_only_its_target(fake):
    table = PatchTable("t", [Patch(target="fakestack.core.layers", make=_wrap("p"), sweep=False)])
    table.apply()  # without sweep the copies are left alone and not checked (a method has no module copies)
    assert fake.user.layers is fake.layers and table.verify() == []
    table.revert()


def test_two_tables_cannot_stack_on_one_target(fake):
    first = PatchTable("first", [Patch(target="fakestack.core.layers", make=_wrap("a"))])
    second = PatchTable("second", [Patch(target="fakestack.core.layers", make=_wrap("b"))])
    first.apply()
    with pytest.raises(PatchError, match="already patched by table 'first'"):
        second.apply()
    first.revert()


def test_resolve_reports_missing_modules():
    with pytest.raises(PatchError, match="no_such_package.x does not exist"):
        resolve("no_such_package.x")
