"""One pipeline rank's times and memory from per-layer costs: the one place the formula lives.

The cost model (:meth:`CostModel.stage_times`, :meth:`CostModel.memory_per_stage`, ``GroupCosts``), the
search's complete plans (``search/evaluate.py``) and its DAG bound (``search/splits.py``) all call these
functions, so every route to a plan's time does the same operations in the same order and gives the
same number, bit for bit. The split search's typed loops repeat two of them on flat buffers
(``StructureBounds._fill`` in ``search/structure_bounds.py`` and ``SplitSearch._memory_need`` in
``search/splits.py``, compiled as ``poseidon_plugin._core``): ``tests/unit/test_search_backends.py``
checks their memory caps against :func:`memory_need` and their plans' times against the exhaustive search.

One set of names, from the profile to the compiled search (``GroupCosts`` fields, ``TypeTable``
columns, ``StructureBounds`` attributes, the arguments below):

================================  ================================================================
``forward_ms``, ``backward_ms``   one layer, one micro-batch
``embedding_forward_ms`` ...      extra on the first virtual stage (``embedding_backward_ms``)
``head_forward_ms`` ...           extra on the last virtual stage: output layer + loss
``allreduce_ms``                  DP gradient sync of one layer per iteration (0 when ``dp = 1``)
``embedding_allreduce_ms``        ... of the embedding; ``head_allreduce_ms``: of the output layer
``layer_state_bytes``             weights + grads + optimizer states of one layer, per device
``layer_activation_bytes``        activations one layer keeps per live micro-batch
``embedding_*_bytes``,            the same for the embedding / the output layer
``head_*_bytes``
``usable_bytes``                  device memory minus reserves
``step_forward_ms`` ...           framework cost of one forward (``step_backward_ms``: backward)
                                  micro-batch step of any chunk, outside the model (schedule, loss)
``optimizer_ms``                  optimizer step, one layer's share, per iteration (after the sync)
``optimizer_fixed_ms``            the rest of a stage's optimizer step, per iteration
================================  ================================================================

The framework terms are constants per (group, chunk) or per (group, stage): a lower bound that leaves them
out (an undecided stage, ``fallback``) stays a lower bound, because the simulator is monotone in every time.

The parameter vector is the simulator's (:class:`~poseidon_plugin.simulator.graph.ParamLayout`):
index 0 unused, then forward ms of ``(rank, chunk)`` at ``1 + rank V + chunk``, backward ms after all
forwards, one send ms per rank, one all-reduce ms per rank, then the comm model's extras.
"""

from __future__ import annotations


def forward_index(pp: int, v: int, rank: int, chunk: int) -> int:
    """Index of a virtual stage's forward ms in the parameter vector (``ParamLayout.forward``)."""
    return 1 + rank * v + chunk


def backward_index(pp: int, v: int, rank: int, chunk: int) -> int:
    """Index of its backward ms (``ParamLayout.backward``)."""
    return 1 + pp * v + rank * v + chunk


def send_index(pp: int, v: int, rank: int) -> int:
    """Index of the send ms of link ``rank -> rank + 1`` (``ParamLayout.send``)."""
    return 1 + 2 * pp * v + rank


def allreduce_index(pp: int, v: int, rank: int) -> int:
    """Index of a rank's DP all-reduce ms (``ParamLayout.allreduce``)."""
    return 1 + 2 * pp * v + pp + rank


def base_params(pp: int, v: int) -> int:
    """Length of the parameter vector without comm-model extras."""
    return 1 + 2 * pp * v + 2 * pp


def link_carries_data(rank: int, pp: int, v: int) -> bool:
    """Whether link ``rank -> rank + 1`` carries activations: none with one rank, and the wrap link
    (last rank -> rank 0) only with virtual stages."""
    return not (pp == 1 or (v == 1 and rank == pp - 1))


def put_rank_times(params, pp: int, v: int, rank: int, layers, fallback,
                   forward_ms: float, backward_ms: float, allreduce_ms: float,
                   embedding_forward_ms: float, embedding_backward_ms: float,
                   embedding_allreduce_ms: float, head_forward_ms: float, head_backward_ms: float,
                   head_allreduce_ms: float, has_allreduce, step_forward_ms: float = 0.0,
                   step_backward_ms: float = 0.0, optimizer_ms: float = 0.0,
                   optimizer_fixed_ms: float = 0.0) -> None:
    """Write rank ``rank``'s forward and backward ms of every chunk and its all-reduce ms into
    ``params``. Chunk ``c`` holds ``layers[c * pp + rank]`` layers (where that is 0 and ``fallback`` is
    given: ``fallback[c * pp + rank]``, the search's lower bound of an undecided stage); the embedding
    extras go to virtual stage 0, the head extras to the last one; the all-reduce terms count only
    when ``has_allreduce``. Every chunk pays ``step_*_ms`` per micro-batch; the rank's optimizer step
    (``optimizer_ms`` per layer + ``optimizer_fixed_ms``) follows its gradient sync, with or without DP."""
    nv = pp * v
    total_ar = optimizer_fixed_ms
    for c in range(v):
        vs = c * pp + rank
        n = layers[vs]
        if not n and fallback is not None:
            n = fallback[vs]
        f = n * forward_ms + step_forward_ms
        b = n * backward_ms + step_backward_ms
        total_ar += n * optimizer_ms
        if has_allreduce:
            total_ar += n * allreduce_ms
        if c == 0 and rank == 0:
            f += embedding_forward_ms
            b += embedding_backward_ms
            if has_allreduce:
                total_ar += embedding_allreduce_ms
        if c == v - 1 and rank == pp - 1:
            f += head_forward_ms
            b += head_backward_ms
            if has_allreduce:
                total_ar += head_allreduce_ms
        params[1 + rank * v + c] = f
        params[1 + nv + rank * v + c] = b
    params[1 + 2 * nv + pp + rank] = total_ar


def rank_memory(chunk_layers, first: bool, last: bool, live: int, layer_state_bytes: float,
                layer_activation_bytes: float, embedding_state_bytes: float,
                embedding_activation_bytes: float, head_state_bytes: float,
                head_activation_bytes: float) -> float:
    """Peak bytes per device of a rank holding ``chunk_layers[c]`` layers in chunk ``c``: all states,
    plus ``live`` units of the largest chunk's activations (a live unit holds one chunk's; taking the
    largest is conservative). ``first``: the rank holds the embedding (in chunk 0); ``last``: the
    output layer (in its last chunk)."""
    v = len(chunk_layers)
    state = 0.0
    chunk_act = 0.0
    for c in range(v):
        n = chunk_layers[c]
        s = n * layer_state_bytes
        a = n * layer_activation_bytes
        if c == 0 and first:
            s += embedding_state_bytes
            a += embedding_activation_bytes
        if c == v - 1 and last:
            s += head_state_bytes
            a += head_activation_bytes
        state += s
        if a > chunk_act:
            chunk_act = a
    return state + live * chunk_act


def memory_need(t: int, r: int, chunk_layers, table, shape) -> float:
    """Peak bytes of rank ``r`` of a search shape (``shape.pp``, ``shape.live``) on device type ``t`` of a
    search cost table (:class:`~poseidon_plugin.search.tables.TypeTable`): :func:`rank_memory` with that
    type's columns, as :meth:`CostModel.memory_per_stage`."""
    return rank_memory(chunk_layers, r == 0, r == shape.pp - 1, shape.live[r],
                       table.layer_state_bytes[t], table.layer_activation_bytes[t],
                       table.embedding_state_bytes[t], table.embedding_activation_bytes[t],
                       table.head_state_bytes[t], table.head_activation_bytes[t])


__all__ = ["allreduce_index", "backward_index", "base_params", "forward_index", "link_carries_data",
           "memory_need", "put_rank_times", "rank_memory", "send_index"]
