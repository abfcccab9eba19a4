"""Watching the training the plan started: which layers each rank built, how long iterations take.

Two rows: ``TransformerLayer.__init__`` records the global layer number of every layer this process
builds (``layer.layer_number`` is 1-based and global in megatron-core), and ``get_forward_backward_func``
returns the schedule wrapped so that every training call (``forward_only=False``) reports its start and
stop marks to a callback (``runtime/watch.py`` times an iteration from one call's start to the next's, the
span the prediction covers: schedule, gradient sync, optimizer step). The by-name copy in ``megatron.core.pipeline_parallel`` is swept, and scripts that import it
later read the patched attribute. The wrappers never change arguments or results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .table import Patch, PatchTable

# Global layer numbers built in this process since the table was applied.
built_layers: list[int] = []
# Called as on_iteration(call_index, start_mark, stop_mark) after each training schedule call.
_callbacks: dict[str, Any] = {"on_iteration": None, "mark": None}


def configure(*, on_iteration: Callable[[int, Any, Any], None], mark: Callable[[], Any]) -> None:
    """Where iteration timings go, and how to take a (device) time mark."""
    _callbacks["on_iteration"] = on_iteration
    _callbacks["mark"] = mark


def _record_layer(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built_layers.append(int(self.layer_number))

    return __init__


def _timed_schedule(original):
    calls = {"n": 0}

    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        schedule = original(*args, **kwargs)

        @functools.wraps(schedule)
        def timed(*s_args, **s_kwargs):
            report, mark = _callbacks["on_iteration"], _callbacks["mark"]
            if s_kwargs.get("forward_only", False) or report is None:
                return schedule(*s_args, **s_kwargs)
            start = mark()
            result = schedule(*s_args, **s_kwargs)
            calls["n"] += 1
            report(calls["n"], start, mark())
            return result

        return timed

    return get_forward_backward_func


TABLE = PatchTable(
    "watch",
    (
        Patch(target="megatron.core.transformer.transformer_layer.TransformerLayer.__init__", make=_record_layer),
        Patch(
            target="megatron.core.pipeline_parallel.schedules.get_forward_backward_func",
            make=_timed_schedule,
            sweep=True,
        ),
    ),
)
