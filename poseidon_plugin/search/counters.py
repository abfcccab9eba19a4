"""Counters of the structure search: one index per name, read by :mod:`.splits` and :mod:`.structure_bounds`
(compiled, they copy the indices into C globals when imported) and by the engine."""

COUNTER_NAMES = ("nodes", "bound_evals", "sim_calls", "pruned_bound", "pruned_path", "pruned_memory",
                 "pruned_ridge", "pruned_order", "improved")
NODES, BOUND_EVALS, SIM_CALLS, PRUNED_BOUND, PRUNED_PATH, PRUNED_MEMORY, PRUNED_RIDGE, \
    PRUNED_ORDER, IMPROVED = range(len(COUNTER_NAMES))
N_COUNTERS = len(COUNTER_NAMES)
