"""Per-device work at scale: the cost model's arithmetic slot and link kinds (used by the search's
tables instead of a loop over each slot's devices) agree with the slot-by-slot definition."""

import random

import pytest

from poseidon_plugin.costmodel import CostModel
from poseidon_plugin.specs import LINK_INTER_NODE, LINK_INTRA_NODE, load_model
from poseidon_plugin.specs.cluster import parse_cluster


@pytest.mark.parametrize("seed", range(12))
def test_arithmetic_slots_and_links_match_the_device_loop(seed):
    rng = random.Random(seed)
    per_node, count = rng.choice([2, 4, 8, 16]), rng.choice([1, 2, 3, 5])
    cluster = parse_cluster({"name": "x", "device_types": ["A2-2", "A2-3"], "links": "npu", "nodes": [
        {"device_type": "A2-2", "count": count, "devices_per_node": per_node},
        {"device_type": "A2-3", "count": 2, "devices_per_node": 8}]})
    cm = CostModel(cluster, load_model("llama3-8b"))
    checked = 0
    for tp in (t for t in (1, 2, 4, 8) if per_node % t == 0):
        for dp in range(1, count * per_node // tp + 1):
            n = cm.max_stages("A2-2", tp, dp)
            for a in range(n):
                nodes_a, spans = cm.slot("A2-2", tp, dp, a)
                assert cm.slot_spans("A2-2", tp, dp, a) == spans
                for b in range(n):
                    nodes_b, _ = cm.slot("A2-2", tp, dp, b)
                    want = LINK_INTER_NODE if nodes_a != nodes_b else LINK_INTRA_NODE
                    assert cm.link_between("A2-2", a, "A2-2", b, tp, dp) == want
                    checked += 1
    assert checked > 0
