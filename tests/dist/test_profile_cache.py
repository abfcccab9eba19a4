"""The layer-profile cache: any unreadable or squatted entry is re-measured, never fatal (issue 9, item 4)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch")

from poseidon_plugin.runtime.profiler import (ProfileRequest, cache_path, load_cached,  # noqa: E402
                                              store_cached)
from poseidon_plugin.specs import ProfileEntry  # noqa: E402

REQUEST = ProfileRequest(device_type="A2-2", tp=1, mbs=2)
KEY = {"device_type": "A2-2", "tp": "1", "mbs": "2", "seq": "32", "dtype": "fp32", "poseidon": "test"}
ENTRY = ProfileEntry(device_type="A2-2", tp=1, mbs=2, forward_ms=1.5, backward_ms=3.0, layer_params=100,
                     activation_bytes=4096, send_bytes=512)


class _Job:
    seq_length = 32
    dtype = "fp32"


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "profiles")


def test_round_trip(cache):
    os.makedirs(cache)
    assert store_cached(cache, KEY, ENTRY, _Job()) is None
    assert load_cached(cache, KEY, REQUEST) == ENTRY
    assert load_cached(cache, {**KEY, "poseidon": "other"}, REQUEST) is None  # another key: another file


@pytest.mark.parametrize("content", [
    b"\xff\xfe not utf-8 \x80",                        # UnicodeDecodeError
    b"{ truncated",                                     # not JSON
    b"[" * 100_000 + b"]" * 100_000,                   # nested too deep for the parser
    json.dumps({"model": "layer-cache"}).encode(),      # JSON, but not a profile
    b"",
], ids=["not-utf8", "not-json", "deep", "not-a-profile", "empty"])
def test_unreadable_entry_is_remeasured(cache, content):
    os.makedirs(cache)
    with open(cache_path(cache, KEY), "wb") as f:
        f.write(content)
    assert load_cached(cache, KEY, REQUEST) is None
    assert store_cached(cache, KEY, ENTRY, _Job()) is None  # the fresh measurement replaces it
    assert load_cached(cache, KEY, REQUEST) == ENTRY


def test_directory_squatting_an_entry_is_remeasured_and_reported(cache):
    os.makedirs(cache_path(cache, KEY))
    assert load_cached(cache, KEY, REQUEST) is None
    why = store_cached(cache, KEY, ENTRY, _Job())
    assert why is not None and why.startswith(cache_path(cache, KEY)), why
    assert os.path.isdir(cache_path(cache, KEY))  # not ours to delete
