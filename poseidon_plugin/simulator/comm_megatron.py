"""Communication model ``"megatron"``: the point-to-point semantics of megatron-core's pipeline schedules.

The paper's ``"dag"`` model puts a fixed transfer delay on each inter-stage edge: a stage sends and moves
on. Megatron's runtime does not. Its non-overlapped schedules exchange activations and gradients in
*blocking calls*: each call posts its sends and receives together (``batch_isend_irecv``) and waits for
all of them, and a send completes only once the peer has posted the matching receive (a rendezvous: gloo
and NCCL alike do not buffer a tensor the receiver has not asked for). So a stage that finished its
forward cannot start its next one until the *next* stage has reached the call that receives; neighbours
are coupled both ways. The DAG here encodes exactly that, and stays a DAG evaluated by longest path:

* every rank runs a *program* derived from megatron-core's schedule code: compute ops (the same per-rank
  order as :mod:`.schedules`) and, between them, ``post`` and ``wait`` of point-to-point operations;
* every call first costs its rank ``p2p_call_ms`` of CPU time (allocating receive buffers, issuing the
  ops: tens of microseconds behind NCCL, a fraction of a millisecond on gloo/CPU), then posts its ops;
* the j-th send on a channel (source rank -> destination rank) pairs with the j-th receive the
  destination posts from that source (gloo and NCCL match in posting order). Each pair becomes one
  transfer node ``X`` whose predecessors are the two posting points and whose weight is the link's
  ``send_ms``: ``finish(X) = max(post_sender, post_receiver) + send_ms``;
* a ``wait`` joins the rank's previous node and the ``X`` nodes it waits for; the next compute op hangs
  off the join. A blocking call is a post followed by a wait of all its ops.

Programs (per pipeline rank ``r``):

* ``1f1b`` — ``forward_backward_pipelining_without_interleaving``: warm-up ``recv_forward; F; send_forward``,
  one ``recv_forward`` before the steady state, then ``F; send_forward_recv_backward; B;
  send_backward_recv_forward`` (the last one only ``send_backward``), cool-down ``recv_backward; B;
  send_backward``.
* ``interleaved-1f1b`` — ``forward_backward_pipelining_with_interleaving`` without ``overlap_p2p_comm``:
  one blocking call after every warm-up forward (``send_forward_recv_forward``, the last one also receiving
  the first gradient), one four-way call after every steady (F, B) pair, ``send_backward_recv_backward``
  after every cool-down backward; which receives are posted follows megatron's
  ``recv_tensor_from_previous_stage`` rule.
* :func:`build_overlap` (comm model ``megatron-overlap`` once registered; see docs/FIDELITY.md) — the
  same schedule with ``overlap_p2p_comm=True``: warm-up and cool-down calls
  stay blocking, steady-state sends and receives are posted without waiting; a receive is waited for right
  before the op that consumes it, a send only when the next send in the same direction is posted.
* ``gpipe`` / ``eager-1f1b`` — not megatron schedules; modelled as a runtime on the same p2p layer that
  does a blocking receive right before each compute op and posts its send right after it, waiting for a
  send only when posting the next one in the same direction (blocking sends would deadlock eager-1f1b).

``"dag"`` is unchanged (in :mod:`.graph`). With free transfers and calls both models give the same
iteration time for ``1f1b``, ``gpipe`` and ``eager-1f1b`` (the extra edges only order events already
ordered by data flow), but not for interleaved: its blocking four-way exchanges couple neighbours even
then. ``megatron`` is never faster than ``dag``: every ``dag`` edge is implied by a chain of program
edges carrying at least the same delay (tests/unit/test_comm_megatron.py checks all of these, and the
DAG against an event-driven execution of the programs).
"""

from __future__ import annotations

from poseidon_plugin.simulator.graph import ALLREDUCE, GraphBuilder, Shape
from poseidon_plugin.simulator.schedules import BACKWARD, FORWARD, interleaved_table

P2P_CALL = "p2p_call_ms"

EXTRA_PARAMS = (
    (P2P_CALL, 0.0,
     "CPU time of one megatron p2p call on the calling rank before its transfers are posted (receive "
     "buffer allocation, posting); send_ms then counts from the later of the two posts to completion"),
)

# Program instructions (per rank):
#   (COMPUTE, kind, chunk, mb)   run a forward/backward
#   (POST, (op_id, ...))         one p2p call posting these ops (indices into the rank's op list)
#   (WAIT, (op_id, ...))         block until those ops have completed
COMPUTE, POST, WAIT = 0, 1, 2

# Point-to-point ops: (is_send, peer_rank, payload); payload = (kind, chunk, mb) of the compute op whose
# output a send carries (None for receives). The peer is a pipeline rank (the ring wraps for interleaved).
SEND_NEXT, SEND_PREV, RECV_PREV, RECV_NEXT = "send_next", "send_prev", "recv_prev", "recv_next"

# Posting order inside one megatron call, which decides matching when both directions use the same
# channel (pp = 2): ``_batched_p2p_ops`` posts send_prev, recv_prev, send_next, recv_next.
_BATCHED_ORDER = (SEND_PREV, RECV_PREV, SEND_NEXT, RECV_NEXT)
# ``_p2p_ops`` (used with overlap_p2p_comm) orders by the parity of the rank.
_EVEN_ORDER = (SEND_NEXT, RECV_PREV, SEND_PREV, RECV_NEXT)
_ODD_ORDER = (RECV_PREV, SEND_NEXT, RECV_NEXT, SEND_PREV)


class RankProgram:
    """One rank's instruction list and point-to-point op table, built call by call."""

    __slots__ = ("rank", "pp", "order", "instructions", "ops", "last_output")

    def __init__(self, rank: int, pp: int, order: tuple[str, ...]):
        self.rank, self.pp, self.order = rank, pp, order
        self.instructions: list[tuple] = []
        self.ops: list[tuple[bool, int, tuple | None]] = []
        self.last_output: dict[str, tuple] = {}  # last forward / backward computed (payload of sends)

    def compute(self, kind: str, chunk: int, mb: int) -> None:
        self.instructions.append((COMPUTE, kind, chunk, mb))
        self.last_output[kind] = (kind, chunk, mb)

    def post(self, **which: bool) -> dict[str, int]:
        """Post the ops flagged True (keys: send_next, send_prev, recv_prev, recv_next) in call order."""
        ids = {}
        nxt, prv = (self.rank + 1) % self.pp, (self.rank - 1) % self.pp
        for name in self.order:
            if not which.get(name):
                continue
            if name == SEND_NEXT:
                op = (True, nxt, self.last_output[FORWARD])
            elif name == SEND_PREV:
                op = (True, prv, self.last_output[BACKWARD])
            else:
                op = (False, prv if name == RECV_PREV else nxt, None)
            ids[name] = len(self.ops)
            self.ops.append(op)
        if ids:  # megatron makes no call at all when there is nothing to send or receive
            self.instructions.append((POST, tuple(ids.values())))
        return ids

    def wait(self, *op_ids: int | None) -> None:
        ids = tuple(i for i in op_ids if i is not None)
        if ids:
            self.instructions.append((WAIT, ids))

    def call(self, **which: bool) -> None:
        """A blocking megatron p2p call: post every flagged op, then wait for all of them."""
        ids = self.post(**which)
        self.wait(*ids.values())


# --------------------------------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------------------------------

def program_1f1b(pp: int, micro_batches: int, rank: int) -> RankProgram:
    """Megatron's non-interleaved 1F1B (batched p2p), as calls and computes on ``rank``."""
    prog = RankProgram(rank, pp, _BATCHED_ORDER)
    first, last = rank == 0, rank == pp - 1
    warmup = min(pp - rank - 1, micro_batches)
    steady = micro_batches - warmup
    for i in range(warmup):
        prog.call(recv_prev=not first)
        prog.compute(FORWARD, 0, i)
        prog.call(send_next=not last)
    if steady:
        prog.call(recv_prev=not first)
    for i in range(steady):
        prog.compute(FORWARD, 0, warmup + i)
        prog.call(send_next=not last, recv_next=not last)
        prog.compute(BACKWARD, 0, i)
        prog.call(send_prev=not first, recv_prev=not first and i < steady - 1)
    for i in range(warmup):
        prog.call(recv_next=not last)
        prog.compute(BACKWARD, 0, steady + i)
        prog.call(send_prev=not first)
    return prog


class _Interleaved:
    """Megatron's interleaved bookkeeping for one rank: chunk of each virtual micro-batch, who receives."""

    def __init__(self, pp: int, micro_batches: int, v: int, rank: int):
        self.pp, self.v, self.rank = pp, v, rank
        self.total = micro_batches * v
        self.table = interleaved_table(micro_batches, v, pp)
        self.warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, self.total)
        self.steady = self.total - self.warmup

    def chunk(self, k: int, forward: bool) -> int:
        c = self.table[k % self.total][1]
        return c if forward else self.v - 1 - c

    def mb(self, k: int) -> int:
        return self.table[k % self.total][0]

    def receives(self, k: int, forward: bool) -> bool:
        """Whether the call after virtual micro-batch ``k`` receives from the previous stage.

        The leading stage (rank 0 forward, rank pp-1 backward) is pp-1 steps ahead of the ending one:
        it receives nothing for its first pp-1 steps, and nothing destined to the chunk that would follow
        the last one.
        """
        leading = self.rank == 0 if forward else self.rank == self.pp - 1
        if not leading:
            return True
        if k < self.pp - 1:
            return False
        return self.chunk(k - (self.pp - 1), forward) != (self.v - 1 if forward else 0)

    def sends_activation(self, k: int) -> bool:
        return not (self.rank == self.pp - 1 and self.chunk(k, True) == self.v - 1)

    def sends_gradient(self, k: int) -> bool:
        return not (self.rank == 0 and self.chunk(k, False) == 0)


def program_interleaved(pp: int, micro_batches: int, v: int, rank: int) -> RankProgram:
    """Megatron's interleaved 1F1B without ``overlap_p2p_comm`` (batched, blocking calls)."""
    s = _Interleaved(pp, micro_batches, v, rank)
    prog = RankProgram(rank, pp, _BATCHED_ORDER)
    last_rank = rank == pp - 1
    prog.call(recv_prev=rank != 0)
    for k in range(s.warmup):
        prog.compute(FORWARD, s.chunk(k, True), s.mb(k))
        recv_prev = s.receives(k, True) and k != s.total - 1
        if k == s.warmup - 1 and s.steady:
            prog.call(send_next=s.sends_activation(k), recv_prev=recv_prev, recv_next=not last_rank)
        else:
            prog.call(send_next=s.sends_activation(k), recv_prev=recv_prev)
    for k in range(s.steady):
        fk = s.warmup + k
        prog.compute(FORWARD, s.chunk(fk, True), s.mb(fk))
        prog.compute(BACKWARD, s.chunk(k, False), s.mb(k))
        prog.call(send_next=s.sends_activation(fk), send_prev=s.sends_gradient(k),
                  recv_prev=s.receives(fk, True) and k != s.steady - 1, recv_next=s.receives(k, False))
    _interleaved_cooldown(prog, s, blocking_first_recv=not s.steady)
    return prog


def _interleaved_cooldown(prog: RankProgram, s: _Interleaved, blocking_first_recv: bool,
                          pending_recv_next: list | None = None) -> None:
    if blocking_first_recv:
        prog.call(recv_next=s.rank != s.pp - 1)
    for k in range(s.steady, s.total):
        c = s.chunk(k, False)
        if pending_recv_next and not (c == s.v - 1 and s.rank == s.pp - 1) and k != 0:
            prog.wait(pending_recv_next.pop(0))
        prog.compute(BACKWARD, c, s.mb(k))
        prog.call(send_prev=s.sends_gradient(k), recv_next=s.receives(k, False) and k != s.total - 1)


def program_interleaved_overlap(pp: int, micro_batches: int, v: int, rank: int) -> RankProgram:
    """Megatron's interleaved 1F1B with ``overlap_p2p_comm=True`` (non-batched, deferred waits)."""
    s = _Interleaved(pp, micro_batches, v, rank)
    prog = RankProgram(rank, pp, _EVEN_ORDER if rank % 2 == 0 else _ODD_ORDER)
    last_rank = rank == pp - 1
    pending_recv_prev: list[int] = []
    pending_recv_next: list[int] = []
    prog.call(recv_prev=rank != 0)
    for k in range(s.warmup):
        prog.compute(FORWARD, s.chunk(k, True), s.mb(k))
        # Warm-up calls stay blocking (no overlap kwarg in megatron's warm-up path).
        prog.call(send_next=s.sends_activation(k), recv_prev=s.receives(k, True) and k != s.total - 1)
        if k == s.warmup - 1 and s.steady and not last_rank:
            pending_recv_next.append(prog.post(recv_next=True)["recv_next"])
    send_next_pending = send_prev_pending = None
    for k in range(s.steady):
        fk = s.warmup + k
        if not (s.chunk(fk, True) == 0 and rank == 0) and pending_recv_prev:
            prog.wait(pending_recv_prev.pop(0))
        prog.compute(FORWARD, s.chunk(fk, True), s.mb(fk))
        ids = prog.post(send_next=s.sends_activation(fk),
                        recv_prev=s.receives(fk, True) and k != s.steady - 1)
        prog.wait(send_next_pending)
        send_next_pending = ids.get(SEND_NEXT)
        if RECV_PREV in ids:
            pending_recv_prev.append(ids[RECV_PREV])
        if not (s.chunk(k, False) == s.v - 1 and last_rank) and pending_recv_next:
            prog.wait(pending_recv_next.pop(0))
        prog.compute(BACKWARD, s.chunk(k, False), s.mb(k))
        ids = prog.post(send_prev=s.sends_gradient(k), recv_next=s.receives(k, False))
        prog.wait(send_prev_pending)
        send_prev_pending = ids.get(SEND_PREV)
        if RECV_NEXT in ids:
            pending_recv_next.append(ids[RECV_NEXT])
    _interleaved_cooldown(prog, s, blocking_first_recv=not s.steady, pending_recv_next=pending_recv_next)
    prog.wait(send_prev_pending)
    # megatron never waits for its last steady-state forward send: the peer's receive completes it.
    return prog


def program_generic(shape: Shape, rank: int) -> RankProgram:
    """gpipe / eager-1f1b on megatron-style p2p: blocking receive right before the op that needs it,
    sends posted right after the op and waited for when the next send in that direction is posted.

    (Blocking sends would deadlock eager-1f1b: neighbours would both send and wait for the other.)
    """
    prog = RankProgram(rank, shape.pp, _BATCHED_ORDER)
    first, last = rank == 0, rank == shape.pp - 1
    pending = {SEND_NEXT: None, SEND_PREV: None}
    for kind, chunk, mb in shape.orders[rank]:
        fwd = kind == FORWARD
        prog.call(recv_prev=fwd and not first, recv_next=not fwd and not last)
        prog.compute(kind, chunk, mb)
        direction = SEND_NEXT if fwd else SEND_PREV
        if (fwd and not last) or (not fwd and not first):
            op = prog.post(**{direction: True})[direction]
            prog.wait(pending[direction])
            pending[direction] = op
    prog.wait(pending[SEND_NEXT], pending[SEND_PREV])
    return prog


def programs(shape: Shape, overlap: bool = False) -> list[RankProgram]:
    """Every rank's program for ``shape`` (``overlap``: interleaved with ``overlap_p2p_comm``)."""
    pp, m, v = shape.pp, shape.micro_batches, shape.virtual_stages
    if shape.schedule == "1f1b":
        return [program_1f1b(pp, m, r) for r in range(pp)]
    if shape.schedule == "interleaved-1f1b":
        make = program_interleaved_overlap if overlap else program_interleaved
        return [make(pp, m, v, r) for r in range(pp)]
    return [program_generic(shape, r) for r in range(pp)]


# --------------------------------------------------------------------------------------------------
# Graph
# --------------------------------------------------------------------------------------------------

def match_ops(progs: list[RankProgram]) -> list[tuple[int, int, int, int]]:
    """Pair sends with receives: per channel (src, dst), the j-th send with the j-th receive.

    Returns ``(src_rank, send_op, dst_rank, recv_op)`` per pair. Raises ``RuntimeError`` when a channel's
    counts differ (a program bug: the runtime would hang).
    """
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for prog in progs:
        for instr in prog.instructions:
            if instr[0] != POST:
                continue
            for op_id in instr[1]:
                is_send, peer, _payload = prog.ops[op_id]
                if is_send:
                    sends.setdefault((prog.rank, peer), []).append(op_id)
                else:
                    recvs.setdefault((peer, prog.rank), []).append(op_id)
    pairs = []
    for channel in sorted(set(sends) | set(recvs)):
        s, r = sends.get(channel, []), recvs.get(channel, [])
        if len(s) != len(r):
            raise RuntimeError(f"p2p channel {channel[0]}->{channel[1]}: {len(s)} sends but {len(r)} receives")
        pairs.extend((channel[0], a, channel[1], b) for a, b in zip(s, r))
    return pairs


def link_of(src: int, kind: str, pp: int) -> int:
    """The ``send_ms`` index of the link a transfer from ``src`` uses: activations (``kind`` F) go to the
    next rank over link ``src``, gradients (B) to the previous rank over link ``src - 1`` (ring: with
    pp = 2 both neighbours are the same rank, so the direction, not the peer, decides)."""
    return src if kind == FORWARD else (src - 1) % pp


def _start_node(starts: dict, add_node, pred: int, w: int) -> int:
    """``pred``, or for a call posted at time 0 (``pred`` -1) with a cost ``w``, the zero-weight source
    node to hang the cost on (one per ``w``, in ``starts``). Module-level, not nested in
    :func:`build_programs`: compiled, a function's closure variables live in one scope object, so a
    nested function that another nested one calls made a reference cycle through it, which kept the
    whole build's state alive until the cyclic collector walked it (~850,000 objects, 0.4 s, after a 1F1B
    build with 1,024 micro-batches)."""
    if pred >= 0:
        return pred
    if w not in starts:
        starts[w] = add_node(("S", -1, w, -1), 0, -1)
    return starts[w]


def build_programs(builder: GraphBuilder, shape: Shape, progs: list[RankProgram]) -> None:
    """Turn rank programs into the DAG (compute, call, transfer and join nodes) and register the sinks.

    Ranks are advanced like an event-driven execution (a rank stops at a wait whose peer op has not
    been posted yet), so every node is added after its predecessors; a program set that would deadlock
    raises ``RuntimeError``. Node economy, which keeps the graph small for the search's hot path:

    * a *blocking* call (a post immediately followed by a wait for all its ops) gets no node of its own:
      its CPU cost ``p2p_call_ms`` sits on the edges from the posting point to its transfer nodes,
      which the rank waits for anyway (``X >= post + call``);
    * a non-blocking post (overlap) is a node of weight ``p2p_call_ms`` on the rank's chain;
    * transfers with the same two posting points and the same link (1F1B's two-way steady exchange)
      share one node; a wait for a single transfer node needs no join node.

    Per-op state lives in per-rank lists indexed by op id (a shape of frontier size has ~10^5 ops): the
    peer of each op, its *anchor* (the posting node, ``-1`` for "time 0", and the weight index of the
    edge from it to the transfer; ``None`` until posted) and, for sends, its transfer node.
    """
    lay, pp = shape.layout, shape.pp
    call_cost = lay.extra(P2P_CALL)
    add_node, add_edge = builder.add_node, builder.add_edge
    n = len(progs)
    peer_rank = [[-1] * len(p.ops) for p in progs]
    peer_op = [[-1] * len(p.ops) for p in progs]
    for src, sop, dst, rop in match_ops(progs):
        peer_rank[src][sop], peer_op[src][sop] = dst, rop
        peer_rank[dst][rop], peer_op[dst][rop] = src, sop
    anchor: list[list] = [[None] * len(p.ops) for p in progs]
    xnode = [[-1] * len(p.ops) for p in progs]  # sender's op -> transfer node
    shared: dict[tuple, int] = {}              # (sender anchor, receiver anchor, link) -> transfer node
    pc, cursor = [0] * n, [-1] * n
    calls, joins = [0] * n, [0] * n            # per rank, for unique labels
    starts: dict[int, int] = {}

    def transfer(r: int, op_id: int) -> int:
        if progs[r].ops[op_id][0]:
            src, sop = r, op_id
        else:
            src, sop = peer_rank[r][op_id], peer_op[r][op_id]
        node = xnode[src][sop]
        if node >= 0:
            return node
        kind, chunk, mb = progs[src].ops[sop][2]
        weight = lay.send(link_of(src, kind, pp))
        a_send, a_recv = anchor[src][sop], anchor[peer_rank[src][sop]][peer_op[src][sop]]
        key = (a_send, a_recv, weight)
        node = shared.get(key, -1)
        if node < 0:
            # Named after what the sender sends: XF(rank=0,chunk=0,mb=3) carries F(rank 0, chunk 0, mb 3).
            node = add_node(("X" + kind, src, chunk, mb), weight, -1)
            for pred, w in (a_send, a_recv):
                add_edge(_start_node(starts, add_node, pred, w), node, w)
            shared[key] = node
        xnode[src][sop] = node
        return node

    progress = True
    while progress:
        progress = False
        for prog in progs:
            r, ins = prog.rank, prog.instructions
            n_ins, at = len(ins), pc[r]
            anchor_r, peer_rank_r, peer_op_r = anchor[r], peer_rank[r], peer_op[r]
            while at < n_ins:
                instr = ins[at]
                op = instr[0]
                if op == COMPUTE:
                    _, kind, chunk, mb = instr
                    w = lay.forward(r, chunk) if kind == FORWARD else lay.backward(r, chunk)
                    node = add_node((kind, r, chunk, mb), w, r)
                    if cursor[r] >= 0:
                        add_edge(cursor[r], node)
                    cursor[r] = node
                elif op == POST:
                    nxt = ins[at + 1] if at + 1 < n_ins else None
                    blocking = nxt is not None and nxt[0] == WAIT and (
                        nxt[1] == instr[1] or set(nxt[1]) == set(instr[1]))
                    if blocking:
                        here = (cursor[r], call_cost)
                    else:
                        node = add_node(("P", r, calls[r], -1), call_cost, -1)
                        calls[r] += 1
                        if cursor[r] >= 0:
                            add_edge(cursor[r], node)
                        cursor[r] = node
                        here = (node, 0)
                    for op_id in instr[1]:
                        anchor_r[op_id] = here
                else:
                    ids = instr[1]
                    posted = True
                    for o in ids:
                        if anchor[peer_rank_r[o]][peer_op_r[o]] is None:
                            posted = False
                            break
                    if not posted:
                        break  # the peer has not posted yet: run the other ranks first
                    if len(ids) == 1:
                        xs = [transfer(r, ids[0])]
                        blocking_here = anchor_r[ids[0]] == (cursor[r], call_cost)
                    else:
                        xs = sorted({transfer(r, o) for o in ids})
                        blocking_here = {anchor_r[o] for o in ids} == {(cursor[r], call_cost)}
                    if len(xs) == 1 and (blocking_here or xs[0] == cursor[r]):
                        cursor[r] = xs[0]
                    else:
                        node = add_node(("J", r, joins[r], -1), 0, -1)
                        joins[r] += 1
                        if cursor[r] >= 0 and not blocking_here:
                            add_edge(cursor[r], node)
                        for x in xs:
                            add_edge(x, node)
                        cursor[r] = node
                at += 1
                progress = True
            pc[r] = at
    stuck = [p.rank for p in progs if pc[p.rank] < len(p.instructions)]
    if stuck:
        raise RuntimeError(f"schedule {shape.schedule!r} (pp={pp}, M={shape.micro_batches}, "
                           f"V={shape.virtual_stages}): p2p programs deadlock on ranks {stuck}")
    for r in range(n):
        ar = add_node((ALLREDUCE, r, -1, -1), lay.allreduce(r), r)
        if cursor[r] >= 0:
            add_edge(cursor[r], ar)
        builder.sinks.append(ar)


OVERLAP_NAME = "megatron-overlap"


def build(builder: GraphBuilder, shape: Shape) -> None:
    """Comm model ``megatron``: blocking, rendezvous point-to-point calls (non-overlapped schedules);
    ``megatron-overlap`` (when the graph module routes that name here): ``overlap_p2p_comm=True``."""
    build_programs(builder, shape, programs(shape, overlap=shape.comm_model == OVERLAP_NAME))


def build_overlap(builder: GraphBuilder, shape: Shape) -> None:
    """Interleaved 1F1B with ``overlap_p2p_comm=True`` (other schedules: as :func:`build`)."""
    build_programs(builder, shape, programs(shape, overlap=True))


