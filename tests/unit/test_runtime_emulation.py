"""``--poseidon-emulate``: parsing, world-size check, the documented slow-down factors."""

from __future__ import annotations

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime.emulation import EmulatedNode, check_world, parse_emulate, slowdown_factors, types_by_rank
from poseidon_plugin.specs import device_presets

KNOWN = ("A2-2", "A2-3", "A2-4", "RTX-3090")


def test_parse_entries_in_order():
    nodes = parse_emulate(" A2-2:2, A2-4:2 ,", KNOWN)
    assert nodes == (EmulatedNode(device_type="A2-2", devices=2), EmulatedNode(device_type="A2-4", devices=2))
    assert types_by_rank(nodes) == ["A2-2", "A2-2", "A2-4", "A2-4"]


@pytest.mark.parametrize(
    "text, match",
    [
        ("A2-2", r"entry 'A2-2' is not TYPE:COUNT; e.g. --poseidon-emulate A2-2:2,A2-4:2"),
        ("A2-2:two", r"COUNT 'two' is not an integer"),
        ("A2-2:0", r"COUNT must be >= 1"),
        ("H100:2", r"unknown device type 'H100'; known: A2-2, A2-3, A2-4, RTX-3090"),
        (" , ", r"names no device"),
    ],
)
def test_parse_errors(text, match):
    with pytest.raises(PoseidonError, match=match):
        parse_emulate(text, KNOWN)


def test_world_size_must_match():
    nodes = parse_emulate("A2-2:2,A2-4:1", KNOWN)
    check_world(nodes, 3)
    with pytest.raises(PoseidonError, match=r"declares 3 devices but the job has 4 ranks.*--nproc-per-node 3"):
        check_world(nodes, 4)


def test_factors_are_peak_ratios():
    factors = slowdown_factors({"A2-2": 376.0, "A2-4": 280.0, "RTX-3090": 71.0})
    assert factors["A2-2"] == 1.0
    assert factors["A2-4"] == pytest.approx(376 / 280)
    assert factors["RTX-3090"] == pytest.approx(376 / 71)
    assert slowdown_factors({}) == {}


def test_paper_presets_are_emulatable():
    assert {"A2-2", "A2-3", "A2-4"} <= set(device_presets())
    parse_emulate("A2-2:1,A2-3:1,A2-4:1", device_presets())
