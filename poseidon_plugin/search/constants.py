"""The structure search's constants, defined once.

A plain module: the compiled search (``poseidon_plugin._core._search`` and ``._core.structure_bounds``,
built from :mod:`.splits` and :mod:`.structure_bounds`) copies them into C globals when it is imported,
and the same sources read them from here uncompiled (``POSEIDON_PURE_PYTHON=1``).
"""

# relative slack on the path bounds (sums in a different order than the kernel's): they prune only
# when the bound exceeds tau by more than float noise; the DAG bound is compared exactly (monotone)
PATH_SLACK = 1e-9
# relative margin of the placement bounds' shortcut (StructureBounds._others_fit): a bound known to be
# at most another (in exact arithmetic) is taken to fit only when the other fits by this much more
FIT_SLACK = 1e-12
# rounds of the path bounds and the type-aware capacity at a root; a node that inherits its parent's
# bounds starts near a fixpoint, and one round on top of the parent's does nearly what two did from
# scratch, in less time (bench_search measures it)
PROPAGATION_ROUNDS = 3
INHERITED_ROUNDS = 2
# the relaxation bound (search/relaxation_bound.py): at most this many path rows per node ...
LP_MAX = 24
LP_KEEP = 12                # ... and this many kept for its children (its last duals' support), taken where violated
LP_MAX_OPTIONS = 600        # ... and (rank, type, layers) options: a node with more is left to the other bounds
LP_PIVOTS = 4000            # pivots per simplex run (Dantzig's rule, Bland's after half: no cycling; a cap anyway)
LP_DUAL_PIVOTS = 500        # ... and per dual simplex run (the rule can cycle on degenerate pivots)
LP_EPS = 1e-9               # the simplex's tolerance (the program's costs are scaled by tau: ~1)
LP_PRICE_SLACK = 1e-6      # the Lagrangian is priced where the program's value is within this share of a cut
LP_MIN_UNDECIDED = 3        # nodes with fewer undecided ranks are left to the children's DAG bounds
LP_TRIAL = 64               # each depth of a structure search keeps computing it after this many nodes only
LP_MIN_CUTS = 4             # ... while it cuts at least one of the depth's nodes in this many
LP_ONE_CHUNK_CUTS = 3       # ... and on one-chunk trees this many nodes in LP_MIN_CUTS (docs/SEARCH.md)
LP_SAMPLE = 16              # ... and below that at one node of the depth in this many (its cuts count too)
# the owner caps' placement by stage and type (StructureBounds._by_stage_fits): a structure search keeps
# computing it after this many calls only while it rejects at least one count in STAGE_MIN_CUTS
STAGE_TRIAL = 256
STAGE_MIN_CUTS = 64
# ranks decided from the end (one-chunk shapes) start with this many ranks from the front: rank 0's
# paths hold every other rank's layers twice and its own on every micro-batch (docs/SEARCH.md)
FRONT_FIRST = 1
CLOCK_EVERY = 1024          # nodes between two looks at the clock (time limit)
# a walk shared among processes (SplitSearch.share) publishes its threshold this much above its best plan,
# so that another process still finds a plan as fast (of equal plans, the walk alone keeps the first)
SHARE_TIE = 1e-12

# StructureBounds.mins: the smallest cost of each kind over the types an undecided rank may take
MIN_NAMES = ("forward_ms", "backward_ms", "embedding_forward_ms", "embedding_backward_ms",
             "head_forward_ms", "head_backward_ms", "allreduce_ms", "embedding_allreduce_ms",
             "head_allreduce_ms", "send_ms")
MIN_FORWARD, MIN_BACKWARD, MIN_EMBEDDING_FORWARD, MIN_EMBEDDING_BACKWARD, MIN_HEAD_FORWARD, \
    MIN_HEAD_BACKWARD, MIN_ALLREDUCE, MIN_EMBEDDING_ALLREDUCE, MIN_HEAD_ALLREDUCE, MIN_SEND = \
    range(len(MIN_NAMES))
N_MINS = len(MIN_NAMES)
N_TYPE_MINS = MIN_SEND      # the kinds a type has of its own (the transfers depend on the link)

__all__ = ["CLOCK_EVERY", "FIT_SLACK", "FRONT_FIRST", "INHERITED_ROUNDS", "LP_DUAL_PIVOTS", "LP_EPS", "LP_KEEP",
           "LP_MAX", "LP_MAX_OPTIONS", "LP_MIN_CUTS", "LP_MIN_UNDECIDED", "LP_ONE_CHUNK_CUTS", "LP_PIVOTS",
           "LP_PRICE_SLACK", "LP_SAMPLE", "LP_TRIAL",
           "MIN_ALLREDUCE", "MIN_BACKWARD", "MIN_EMBEDDING_ALLREDUCE", "MIN_EMBEDDING_BACKWARD",
           "MIN_EMBEDDING_FORWARD", "MIN_FORWARD", "MIN_HEAD_ALLREDUCE", "MIN_HEAD_BACKWARD", "MIN_HEAD_FORWARD",
           "MIN_NAMES", "MIN_SEND", "N_MINS", "N_TYPE_MINS", "PATH_SLACK", "PROPAGATION_ROUNDS", "SHARE_TIE",
           "STAGE_MIN_CUTS", "STAGE_TRIAL"]
