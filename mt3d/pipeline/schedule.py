"""The interleaved 1F1B schedule (Narayanan et al. 2021, PTD-P) as steps of DeepSpeed instructions.

Each of the p pipeline ranks holds v chunks of layers; virtual stage j = c * p + r is chunk c of
rank r, so a micro-batch goes through ranks 0 .. p-1 once per chunk and wraps from rank p-1 back
to rank 0 between chunks. The order of work on rank r is PTD-P's (Megatron-LM's
``forward_backward_pipelining_with_interleaving``): m micro-batches in groups of p; the k-th
forward runs chunk (k mod pv) // p of micro-batch (k // pv) * p + k mod p, the k-th backward the
same micro-batch on chunk v - 1 - (k mod pv) // p; warm-up runs (p - r - 1) * 2 + (v - 1) * p
forwards (all of them when m = p) before forwards and backwards alternate, then a cool-down
drains the backwards. The bubble falls from (p - 1) / m to (p - 1) / (v m) of the ideal time.

Communication: every step ends with one ``CommitP2P`` that posts all of the step's sends and
receives together (``batch_isend_irecv``): with the wrap-around the pipeline is a ring, where
blocking sends in any fixed order can deadlock. Inside a commit activations are ordered before
gradients on both sides, so the k-th message on each (sender, receiver) pair is the k-th one the
receiver expects even with p = 2, where a rank's upstream and downstream peer are the same rank
(Megatron refuses p = 2 because its order would swap them). ``simulate`` checks a schedule
without processes: FIFO channels per pair, rendezvous commits, every input ready in time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# op kinds of a step, in the order they are issued inside it
LOAD, FWD, BWD, SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD, COMMIT = (
    "load", "fwd", "bwd", "send_act", "send_grad", "recv_act", "recv_grad", "commit",
)  # fmt: skip
# zero-bubble schedules (``zero_bubble``): the weight-gradient half of a split backward (BWD is then
# the input-gradient half), and a hand-over between two stages on the same rank (the V's turn)
WGT, LOCAL_ACT, LOCAL_GRAD = "wgt", "local_act", "local_grad"


@dataclass(frozen=True)
class Op:
    """One instruction of rank r: ``kind`` on chunk ``chunk`` of micro-batch ``mb``."""

    kind: str
    chunk: int = -1
    mb: int = -1


def forward_item(k: int, p: int, v: int) -> tuple[int, int]:
    """(chunk, micro-batch) of the k-th forward of a rank."""
    group, within = divmod(k, p * v)
    return within // p, group * p + within % p


def backward_item(k: int, p: int, v: int) -> tuple[int, int]:
    """(chunk, micro-batch) of the k-th backward of a rank (chunks in reverse)."""
    chunk, mb = forward_item(k, p, v)
    return v - 1 - chunk, mb


def warmup(p: int, v: int, m: int, rank: int) -> int:
    """Forwards a rank runs before its first backward."""
    total = m * v
    if m == p:  # PTD-P's special case: all forwards first
        return total
    return min((p - rank - 1) * 2 + (v - 1) * p, total)


def check(p: int, v: int, m: int) -> None:
    """Raise ValueError when the interleaved schedule cannot run these sizes."""
    if p < 2 or v < 1:
        raise ValueError(
            f"the interleaved schedule needs pipeline >= 2 and virtual_stages >= 1, got {p}, {v}"
        )
    if m % p:
        raise ValueError(f"micro-batches per step ({m}) must be a multiple of the pipeline stages ({p})")


def rank_steps(p: int, v: int, m: int, rank: int, train: bool = True, split: bool = False) -> list[list[Op]]:
    """The steps of ``rank``: each a list of ops, the last op of each a COMMIT of its p2p ops.

    Activations arrive from the previous virtual stage (rank - 1, or rank p - 1 one chunk earlier
    for rank 0) and gradients from the next one; rank 0 chunk 0 loads the inputs and rank p - 1
    chunk v - 1 loads the labels and computes the loss.

    ``split`` (for posted transfers, ``mt3d.train.overlap.p2p``): each forward-and-backward step
    commits twice, the forward's send and the next forward's receive right after the forward, the
    backward's after the backward, so an activation leaves while its rank computes a backward
    instead of after it. Each side posts its messages in the same order as unsplit (activations,
    then gradients, step by step), so they match as unsplit. Waited for at each commit it is slower
    than one commit per step (``simulate``: 68 transfer times exposed instead of 41 at p 4, v 2, m 16),
    so it is only for posted transfers.
    """
    check(p, v, m)
    total = m * v
    first = lambda c: rank == 0 and c == 0  # noqa: E731 - first virtual stage: loads inputs
    last = lambda c: rank == p - 1 and c == v - 1  # noqa: E731 - last virtual stage: the loss
    w = warmup(p, v, m, rank) if train else total
    steps: list[list[Op]] = []

    def forward(k: int) -> list[Op]:
        c, mb = forward_item(k, p, v)
        ops = [Op(LOAD, c, mb)] if first(c) or last(c) else []
        return ops + [Op(FWD, c, mb)]

    def recv_act(k: int) -> list[Op]:
        if k >= total:
            return []
        c, mb = forward_item(k, p, v)
        return [] if first(c) else [Op(RECV_ACT, c, mb)]

    def send_act(k: int) -> list[Op]:
        c, mb = forward_item(k, p, v)
        return [] if last(c) else [Op(SEND_ACT, c, mb)]

    def recv_grad(k: int) -> list[Op]:
        if k >= total or not train:
            return []
        c, mb = backward_item(k, p, v)
        return [] if last(c) else [Op(RECV_GRAD, c, mb)]

    def send_grad(k: int) -> list[Op]:
        c, mb = backward_item(k, p, v)
        return [] if first(c) else [Op(SEND_GRAD, c, mb)]

    def step(compute: list[Op], sends: list[Op], recvs: list[Op]) -> None:
        acts = [o for o in sends + recvs if o.kind in (SEND_ACT, RECV_ACT)]
        grads = [o for o in sends + recvs if o.kind in (SEND_GRAD, RECV_GRAD)]
        steps.append(compute + acts + grads + [Op(COMMIT)])

    step([], [], recv_act(0))
    for k in range(w):
        recvs = recv_act(k + 1) + (recv_grad(0) if k == w - 1 else [])
        step(forward(k), send_act(k), recvs)
    for k in range(total - w):
        fk = k + w
        if split:
            step(forward(fk), send_act(fk), recv_act(fk + 1))
            step([Op(BWD, *backward_item(k, p, v))], send_grad(k), recv_grad(k + 1))
            continue
        step(forward(fk) + [Op(BWD, *backward_item(k, p, v))], send_act(fk) + send_grad(k),
             recv_act(fk + 1) + recv_grad(k + 1))  # fmt: skip
    if train:
        for k in range(max(total - w, 0), total):
            step([Op(BWD, *backward_item(k, p, v))], send_grad(k), recv_grad(k + 1))
    return [s for s in steps if len(s) > 1]  # drop steps with nothing but a commit


def simulate(p: int, v: int, m: int, train: bool = True, fwd_s: float = 0.0, bwd_s: float = 0.0,
             p2p_s: float = 0.0, posted: bool = False, split: bool | None = None,
             in_order: bool = False) -> dict:  # fmt: skip
    """Run every rank's steps without processes and check them; returns counts (for tests).

    With ``fwd_s``/``bwd_s`` (seconds of one chunk's forward/backward) it also keeps each rank's
    clock and returns ``makespan`` and per-rank ``idle`` fractions: the schedule's own bubble, free of
    any machine's noise (PTD-P: (p - 1) / (v m + p - 1) when bwd_s = 2 fwd_s and p2p is free).
    ``p2p_s``: seconds one message takes once both sides have posted it (messages of a step move at
    once); ``posted``: ``mt3d.train.overlap.p2p``, where a rank goes on after posting its step's
    messages and waits for a received tensor only right before the pass that reads it (sends drain
    at the end), instead of waiting for every message of the step; ``split``: ``rank_steps``' (default:
    as mt3d runs it, split when posted); ``in_order`` (posted): a pass waits for the whole batch its
    input came in and every batch its rank posted before, sends included, as mt3d's engine waits
    (``ds.interleaved``; NCCL runs one rank's batches in order on one stream anyway), instead of for
    its input alone.

    Semantics of ``batch_isend_irecv`` under rendezvous (no buffering): a rank posts all the sends
    and receives of its step at once; on each (sender, receiver) pair posted sends and posted
    receives match in posting order, whatever their kind (NCCL has no tags); the step completes
    when all its messages matched, and only then does the rank post its next step (posted: goes on
    at once, and a pass waits for its own input's message only). Raises
    AssertionError on a deadlock, on a message that is not the one the receiver expects, and on a
    forward or backward whose input has not arrived.
    """
    split = posted if split is None else split
    programs = [rank_steps(p, v, m, r, train, split) for r in range(p)]
    stages = [(s % p, s // p) for s in range(p * v)]  # virtual stage c * p + r is chunk c of rank r
    return _Simulation(programs, stages, fwd_s, bwd_s, p2p_s, posted, in_order and posted).run()


def simulate_programs(programs: list[list[list[Op]]], stages: list[tuple[int, int]], *,
                      fwd_s: float | dict = 0.0, bwd_s: float | dict = 0.0, wgt_s: float | dict = 0.0,
                      p2p_s: float = 0.0, posted: bool = True, in_order: bool = True) -> dict:  # fmt: skip
    """``simulate`` for any placement: ``programs[r]`` rank r's steps, ``stages[s]`` the (rank, chunk)
    holding stage s (in the order a micro-batch goes through them). ``wgt_s``: one WGT op's seconds
    (``bwd_s`` is then a BWD's, the input-gradient half). A pass time is one number, or a dict of
    each (rank, chunk)'s (measured stages differ: the V's rank 0 holds the embedding and the loss).
    Also checks that a WGT follows its BWD."""
    return _Simulation(programs, stages, fwd_s, bwd_s, p2p_s, posted, in_order and posted, wgt_s).run()


class _Simulation:
    """The state of ``simulate``: each rank's program, position, posted messages and clock."""

    def __init__(self, programs: list[list[list[Op]]], stages: list[tuple[int, int]], fwd_s: float,
                 bwd_s: float, p2p_s: float, posted: bool, in_order: bool = False,
                 wgt_s: float = 0.0) -> None:  # fmt: skip
        self.p = len(programs)
        self.fwd_s, self.bwd_s, self.wgt_s, self.p2p_s, self.posted = fwd_s, bwd_s, wgt_s, p2p_s, posted
        self.stages = stages
        self.stage_of = {rc: s for s, rc in enumerate(stages)}
        self.in_order = in_order
        p = self.p
        # each rank's posted batches: [unmatched messages, when the last matched one arrived, received]
        self.batches: list[list[list]] = [[] for _ in range(p)]
        self.waited = [0] * p  # batches before this index have been waited for (in_order)
        self.programs = programs
        self.pos = [-1] * p  # the step each rank has posted (-1: none yet)
        self.pending = [0] * p  # unmatched messages of each rank's posted step
        self.sends: dict[tuple[int, int], list] = defaultdict(list)
        self.recvs: dict[tuple[int, int], list] = defaultdict(list)
        self.have: list[set] = [set() for _ in range(p)]
        self.arrival: dict[tuple[int, tuple], float] = {}  # (receiver, message) -> when it arrived
        self.counts: dict[str, int] = defaultdict(int)
        self.clock = [0.0] * p  # when each rank's current step's p2p was posted (after its compute)
        self.done = [0.0] * p  # when the last message of that step completed (blocking), or its compute
        self.drained = [0.0] * p  # when each rank's last send arrived
        self.busy = [0.0] * p

    def neighbour(self, r: int, chunk: int, step: int) -> tuple[int, int]:
        """(rank, chunk) of the stage ``step`` (+1 next, -1 previous) from rank r's ``chunk``."""
        return self.stages[self.stage_of[(r, chunk)] + step]

    def route(self, r: int, o: Op) -> tuple[int, int, tuple]:
        """(sender, receiver, message as the receiver names it) of a send or receive op."""
        kind = "act" if o.kind in (SEND_ACT, RECV_ACT) else "grad"
        if o.kind in (SEND_ACT, SEND_GRAD):  # to the next (previous) stage
            dst, chunk = self.neighbour(r, o.chunk, +1 if o.kind == SEND_ACT else -1)
            return r, dst, (kind, chunk, o.mb)
        src, _ = self.neighbour(r, o.chunk, -1 if o.kind == RECV_ACT else +1)
        return src, r, (kind, o.chunk, o.mb)

    def inputs(self, r: int, ops: list[Op]) -> list[tuple]:
        """The received messages the compute ops of a step read."""
        need, last = [], len(self.stages) - 1
        for o in ops:
            if o.kind == FWD and self.stage_of[(r, o.chunk)] != 0:
                need.append(("act", o.chunk, o.mb))
            elif o.kind == BWD and self.stage_of[(r, o.chunk)] != last:
                need.append(("grad", o.chunk, o.mb))
        return need

    def compute(self, r: int, ops: list[Op], t: float) -> float:
        """Check and time the compute ops of a step from ``t`` (they use what earlier steps received;
        each waits for its input's arrival); returns when the last one ends."""
        have = self.have[r]
        for o in ops:
            if o.kind == LOAD:
                have.add(("act", o.chunk, o.mb))
            elif o.kind == FWD:
                assert ("act", o.chunk, o.mb) in have, f"rank {r}: {o} before its input"
                have.add(("out", o.chunk, o.mb))
                self.counts["fwd"] += 1
            elif o.kind == BWD:
                assert ("out", o.chunk, o.mb) in have, f"rank {r}: {o} before its forward"
                assert all(msg in have for msg in self.inputs(r, [o])), f"rank {r}: {o} before its gradient"
                have.add(("bwd", o.chunk, o.mb))
                self.counts["bwd"] += 1
            elif o.kind == WGT:
                assert ("bwd", o.chunk, o.mb) in have, f"rank {r}: {o} before its input gradient"
                assert ("wgt", o.chunk, o.mb) not in have, f"rank {r}: {o} twice"
                have.add(("wgt", o.chunk, o.mb))
                self.counts["wgt"] += 1
            elif o.kind in (LOCAL_ACT, LOCAL_GRAD):  # hand-over to this rank's other stage
                kind, done = ("act", "out") if o.kind == LOCAL_ACT else ("grad", "bwd")
                assert (done, o.chunk, o.mb) in have, f"rank {r}: {o} before its pass"
                peer, chunk = self.neighbour(r, o.chunk, +1 if kind == "act" else -1)
                assert peer == r, f"rank {r}: {o} hands over to rank {peer}"
                have.add((kind, chunk, o.mb))
                self.arrival[(r, (kind, chunk, o.mb))] = t
            if o.kind in (FWD, BWD, WGT):
                needed = self.inputs(r, [o])
                t = max([t] + [self.arrival.get((r, msg), 0.0) for msg in needed])
                if self.in_order:  # and for every batch up to the one it came in
                    last = self._batch_of(r, needed)
                    t = max([t] + [b[1] for b in self.batches[r][self.waited[r] : last + 1]])
                    self.waited[r] = max(self.waited[r], last + 1)
                work = {FWD: self.fwd_s, BWD: self.bwd_s, WGT: self.wgt_s}[o.kind]
                work = work[(r, o.chunk)] if isinstance(work, dict) else work
                t += work
                self.busy[r] += work
        return t

    def post(self, r: int) -> None:
        """Run rank ``r``'s current step's compute and post its messages."""
        ops = self.programs[r][self.pos[r]]
        self.clock[r] = self.done[r] = self.compute(r, ops, self.clock[r])
        p2p = [o for o in ops if o.kind in (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD)]
        self.pending[r] = len(p2p)
        batch = [len(p2p), 0.0, set()]
        if p2p:
            self.batches[r].append(batch)
        for o in p2p:
            src, dst, msg = self.route(r, o)
            queue = self.sends if o.kind in (SEND_ACT, SEND_GRAD) else self.recvs
            queue[(src, dst)].append((msg, r, self.clock[r], batch))
            if queue is self.recvs:
                batch[2].add(msg)

    def _batch_of(self, r: int, msgs: list[tuple]) -> int:
        """Index of rank ``r``'s last posted batch that receives one of ``msgs`` (-1: none)."""
        return max((k for k, b in enumerate(self.batches[r]) if b[2].intersection(msgs)), default=-1)

    def match(self) -> bool:
        """Match posted sends with posted receives, pair by pair in posting order."""
        moved = False
        for pair in list(self.sends):
            while self.sends[pair] and self.recvs[pair]:
                sent, s_rank, s_t, s_b = self.sends[pair].pop(0)
                want, r_rank, r_t, r_b = self.recvs[pair].pop(0)
                assert sent == want, f"rank {r_rank} expected {want} from {pair[0]}, got {sent}"
                self.have[r_rank].add(want)
                arrived = max(s_t, r_t) + self.p2p_s  # a message moves once both sides have posted it
                self.arrival[(r_rank, want)] = arrived
                for b in (s_b, r_b):
                    b[0] -= 1
                    b[1] = max(b[1], arrived)
                self.drained[s_rank] = max(self.drained[s_rank], arrived)
                if not self.posted:  # the step's commit waits for every message of it
                    for x in (s_rank, r_rank):
                        self.done[x] = max(self.done[x], arrived)
                self.pending[s_rank] -= 1
                self.pending[r_rank] -= 1
                self.counts["messages"] += 1
                moved = True
        return moved

    def ready(self, r: int) -> bool:
        """Whether rank ``r`` can go on to its next step: its commit completed (blocking), or (posted)
        the messages the next step's compute reads have been matched."""
        nxt = self.pos[r] + 1
        if nxt > len(self.programs[r]) or (self.pending[r] and not self.posted):
            return False
        if nxt == len(self.programs[r]) or not self.posted:
            return True
        need = self.inputs(r, self.programs[r][nxt])
        if self.in_order:  # every batch up to the last one its inputs come in has completed
            return all(b[0] == 0 for b in self.batches[r][self.waited[r] : self._batch_of(r, need) + 1])
        return all(msg in self.have[r] for msg in need)

    def advance(self) -> bool:
        """Move every rank that can go on to its next step."""
        moved = False
        for r in range(self.p):
            if self.ready(r):
                self.pos[r] += 1
                self.clock[r] = self.done[r]
                moved = True
                if self.pos[r] < len(self.programs[r]):
                    self.post(r)
        return moved

    def run(self) -> dict:
        """Simulate to the end; the counts (and clock figures) of ``simulate``."""
        while self.match() | self.advance():
            pass
        stuck = [r for r in range(self.p) if self.pos[r] < len(self.programs[r])]
        assert not stuck, f"deadlock: ranks {stuck} wait at steps {[self.pos[r] for r in stuck]}"
        assert not any(self.sends.values()) and not any(self.recvs.values()), "unmatched messages"
        end = [max(c, d) for c, d in zip(self.clock, self.drained)]
        makespan = max(end)
        if makespan > 0:
            self.counts["makespan"] = makespan
            self.counts["idle"] = [1 - b / makespan for b in self.busy]
        return dict(self.counts)
