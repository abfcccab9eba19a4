"""Counters of the structure search: one index per name, shared by the pure loop (:mod:`.splits`,
:mod:`.structure_bounds`) and the compiled one (``poseidon_plugin._core._search`` exports the same ``COUNTER_NAMES``;
a unit test compares them)."""

COUNTER_NAMES = ("nodes", "bound_evals", "sim_calls", "pruned_bound", "pruned_path", "pruned_memory",
                 "pruned_ridge", "pruned_order", "improved")
NODES, BOUND_EVALS, SIM_CALLS, PRUNED_BOUND, PRUNED_PATH, PRUNED_MEMORY, PRUNED_RIDGE, \
    PRUNED_ORDER, IMPROVED = range(len(COUNTER_NAMES))
N_COUNTERS = len(COUNTER_NAMES)
