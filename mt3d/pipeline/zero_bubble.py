"""Zero-bubble pipeline orders (Qi et al., ICLR 2024, arXiv 2401.10241): ZB-H1 and ZB-V.

A backward is split into B, the gradient of a stage's input (on the critical path: the previous
stage waits for it), and W, the gradients of its weights (nothing waits for it but the optimizer
step), so W can fill the time a rank would otherwise sit idle. Each rank runs its passes in a fixed
order; this module makes those orders and replays them.

* ``placement``: the stage each (rank, chunk) holds. "1f1b" and "zb-h1": one stage per rank. "zbv":
  2p stages of half the layers in a V, rank r holding stage r and stage 2p - 1 - r, so the first
  and the last stage are both on rank 0 and the loss's gradient turns around there.
* ``orders``: every rank's order of passes, made by running the ranks in time (a list scheduler):
  a rank that is free takes whatever can start soonest; among passes that can start now, a B whose
  gradient has arrived (the latest stage first), then a W if more than ``lag`` are pending, then a
  forward (the latest stage first), then the oldest pending W. A forward needs room: at most
  1F1B's p - r forwards of rank r ahead of its B's with one stage per rank (so B's flow upstream at
  1F1B's pace; the V has only the memory bound), and the activations a rank holds, counted from a
  forward to its W (a B frees some of them; counting them to the W is the safe side), at most
  1F1B's peak: p micro-batches (2p half-stage units for the V).
  The lag is searched (none, 0 .. 2p) for the shortest step at unit pass times. "1f1b" runs B and W
  as one pass (the plain backward) with p - r micro-batches on rank r: 1F1B's order and its
  bubble, (p - 1) / (m + p - 1) of the step.
* ``replay``: runs the orders as fixed programs (as an engine would) with the pass times given,
  checks them (each pass once, a forward after its input, a B after its gradient and its forward,
  a W after its B, the memory never over the limit, no deadlock) and returns the makespan, each
  rank's idle fraction of it and its activation peak.

With F = B = W and free transfers (mean idle fraction of the step): 1F1B 0.200 / ZB-H1 0.077 /
ZB-V 0.040 at p 2, m 4 (ZB-H1's (p - 1) F, the paper's third of 1F1B's (p - 1)(F + B + W));
0.273 / 0.143 / 0.059 at p 4, m 8 (ZB-H1 one pass over the paper's 0.111: its theory frees part of
the activations at B); 0.304 / 0.158 / 0.068 at p 8, m 16 (``replay``; tests/test_zero_bubble.py
holds the first two).

* ``rank_programs``: the orders as the instruction steps mt3d's pipeline engine runs (sends,
  receives, commits; WGT for W, LOCAL hand-overs at the V's turn), and ``simulate`` runs them through
  ``pipeline.schedule``'s simulator, which checks every message against what its receiver expects.
  At unit pass times they take exactly the orders' makespan; with other pass times or transfers up
  to 0.5 F they stay within 16% of the replay's (whose passes adapt, where the programs are fixed).

``mt3d.ds.interleaved`` runs both (with ``parallel.deferred``'s split backward, and ``stages``'s placement
of chunks in ``mt3d.ds.pipe``); ``chart`` draws a schedule.
"""

from __future__ import annotations

import bisect
import functools
from collections import defaultdict
from dataclasses import dataclass

from .schedule import (
    BWD,
    COMMIT,
    FWD,
    LOAD,
    LOCAL_ACT,
    LOCAL_GRAD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    WGT,
    Op,
    simulate_programs,
)

F, B, W = "F", "B", "W"
SCHEDULES = {"1f1b": 1, "zb-h1": 1, "zbv": 2}
"""Each schedule's chunks per rank."""


@dataclass(frozen=True)
class Pass:
    """One pass of rank's work: ``kind`` (F, B or W) of ``stage`` on micro-batch ``mb``."""

    kind: str
    stage: int
    mb: int


def check(schedule: str, p: int, m: int) -> None:
    """Raise ValueError (one line) when ``schedule`` cannot run p stages of m micro-batches."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if p < 2:
        raise ValueError(f"the {schedule} schedule needs pipeline >= 2, got {p}")
    if m < 1:
        raise ValueError(f"the {schedule} schedule needs at least one micro-batch, got {m}")


def placement(schedule: str, p: int) -> list[int]:
    """The rank of each stage (stage s of ``len(...)``)."""
    if SCHEDULES[schedule] == 1:
        return list(range(p))
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


def memory_limit(schedule: str, p: int, rank: int) -> int:
    """The activations rank ``rank`` may hold, in one stage's activations of one micro-batch (half a
    rank's layers for "zbv"): 1F1B's on that rank for "1f1b" (p - rank), 1F1B's peak (its first
    rank's, p micro-batches) on every rank for the zero-bubble schedules."""
    if schedule == "1f1b":
        return p - rank
    return p * SCHEDULES[schedule]


@dataclass
class _Timing:
    fwd: float
    bwd: float
    wgt: float
    p2p: float

    def of(self, schedule: str, kind: str) -> float:
        """One pass's time: the times are a rank's layers' (1F1B's stage), a V's stage has half."""
        if kind == F:
            t = self.fwd
        elif kind == B:  # the plain backward does both halves at once
            t = self.bwd + (self.wgt if schedule == "1f1b" else 0.0)
        else:
            t = self.wgt
        return t / SCHEDULES[schedule]


def orders(schedule: str, p: int, m: int) -> list[list[Pass]]:
    """Each rank's order of passes (module docstring): F, B and W of every stage it holds and every
    micro-batch, once each ("1f1b": no W; its B is the whole backward). Unit pass times (the paper's
    F = B = W) decide the order."""
    check(schedule, p, m)
    unit = _Timing(1.0, 1.0, 1.0, 0.0)
    if schedule == "1f1b":
        return _Run(schedule, p, m, unit, None).run()["orders"]
    best = None
    for lag in [None, *([k] * p for k in range(2 * p + 1))]:
        try:
            run = _Run(schedule, p, m, unit, None, lag).run()
        except AssertionError:  # a rule that stalls these sizes: the others are tried
            continue
        key = (run["makespan"], max(run["peak"]))
        if best is None or key < best[0]:
            best = (key, run["orders"])
    assert best is not None, f"no {schedule} order found for p {p}, m {m}"
    return best[1]


def replay(schedule: str, p: int, m: int, programs: list[list[Pass]] | None = None, *, fwd: float = 1.0,
           bwd: float = 1.0, wgt: float = 1.0, p2p: float = 0.0) -> dict:  # fmt: skip
    """Run ``programs`` (default: ``orders``) in their fixed order with these pass times (``bwd`` the
    input-gradient half, ``wgt`` the weight half; seconds of one stage of one micro-batch; ``p2p``
    per transfer between ranks) and check them; returns "makespan", per-rank "idle" (fraction of the
    makespan) and "peak" (activations held, ``memory_limit``'s unit), and "orders". Raises
    AssertionError on a pass missing, repeated, before its inputs, over the memory limit, or a
    deadlock."""
    check(schedule, p, m)
    programs = orders(schedule, p, m) if programs is None else programs
    return _Run(schedule, p, m, _Timing(fwd, bwd, wgt, p2p), programs).run()


class _Run:
    """Ranks run in time: each takes its next pass (from its program, or chosen as ``orders`` says)
    once its inputs are there; events in time order, ties by rank."""

    def __init__(self, schedule: str, p: int, m: int, timing: _Timing, programs: list[list[Pass]] | None,
                 lag: list[int] | None = None, train: bool = True):  # fmt: skip
        self.schedule, self.p, self.m, self.t = schedule, p, m, timing
        self.train = train  # False: forwards only (evaluation's), which hold nothing
        self.lag = lag or [10**9] * p
        self.rank_of = placement(schedule, p)
        self.stages = len(self.rank_of)
        self.held = {r: [s for s in range(self.stages) if self.rank_of[s] == r] for r in range(p)}
        self.programs = programs
        self.pos = [0] * p
        self.done: dict[Pass, float] = {}  # pass -> when it ended
        self.free_at = [0.0] * p
        self.busy = [0.0] * p
        self.live = [0] * p  # activations held (a forward's until its W)
        self.open = [0] * p  # forwards whose B has not run
        self.peak = [0] * p
        self.next_f = [0] * self.stages  # the next micro-batch each stage forwards
        self.next_b = [0] * self.stages  # and runs B of
        self.pending_w: list[list[Pass]] = [[] for _ in range(p)]
        self.order: list[list[Pass]] = [[] for _ in range(p)]
        kinds = (F,) if not train else (F, B) if schedule == "1f1b" else (F, B, W)
        self.expected = {Pass(k, s, mb) for k in kinds for s in range(self.stages) for mb in range(m)}

    def window(self, r: int) -> int:
        """Forwards rank ``r`` may run ahead of its B's: 1F1B's p - r with one stage per rank (so B's
        reach the rank before as in 1F1B), all its memory for the V."""
        return memory_limit(self.schedule, self.p, r) if self.schedule == "zbv" else self.p - r

    def ready_at(self, x: Pass) -> float | None:
        """When pass ``x``'s inputs are all on its rank (None: not produced yet)."""
        here = self.rank_of[x.stage]
        needs: list[Pass] = []
        if x.kind == F:
            needs = [Pass(F, x.stage - 1, x.mb)] if x.stage else []
        elif x.kind == B:
            needs = [Pass(F, x.stage, x.mb)]
            if x.stage + 1 < self.stages:
                needs.append(Pass(B, x.stage + 1, x.mb))
        else:
            needs = [Pass(B, x.stage, x.mb)]
        t = 0.0
        for n in needs:
            if n not in self.done:
                return None
            moved = self.t.p2p if self.rank_of[n.stage] != here else 0.0
            t = max(t, self.done[n] + moved)
        return t

    def choose(self, r: int) -> tuple[Pass, float] | None:
        """Rank ``r``'s next pass and when it can start (None: nothing it can run yet)."""
        if self.programs is not None:
            if self.pos[r] == len(self.programs[r]):
                return None
            x = self.programs[r][self.pos[r]]
            t = self.ready_at(x)
            return None if t is None else (x, max(t, self.free_at[r]))
        now = self.free_at[r]
        candidates = []  # (priority, start, pass): a pass whose inputs are here now comes first
        for s in sorted(self.held[r], reverse=True):  # the latest stage first
            if (
                self.next_b[s] < self.next_f[s]
                and (t := self.ready_at(Pass(B, s, self.next_b[s]))) is not None
            ):
                candidates.append((0, t, Pass(B, s, self.next_b[s])))
        if self.live[r] < memory_limit(self.schedule, self.p, r) and self.open[r] < self.window(r):
            for s in sorted(self.held[r], reverse=True):
                if self.next_f[s] < self.m and (t := self.ready_at(Pass(F, s, self.next_f[s]))) is not None:
                    candidates.append((1, t, Pass(F, s, self.next_f[s])))
        if self.pending_w[r]:  # a W goes before forwards once more than ``lag`` are pending
            candidates.append((0.5 if len(self.pending_w[r]) > self.lag[r] else 2, now, self.pending_w[r][0]))
        if not candidates:
            return None
        # what can start soonest; among those that can start then: B, a W past the lag, F, any W
        start = min(max(t, now) for _, t, _ in candidates)
        _, t, x = min((c for c in candidates if max(c[1], now) == start), key=lambda c: c[0])
        return x, max(t, now)

    def execute(self, r: int, x: Pass, start: float) -> None:
        assert x in self.expected and x not in self.done, f"rank {r}: {x} not expected, or twice"
        assert self.rank_of[x.stage] == r, f"rank {r}: {x} is another rank's stage"
        if x.kind == F:
            assert x.mb == self.next_f[x.stage], f"rank {r}: {x} out of micro-batch order"
            self.next_f[x.stage] += 1
            self.live[r] += 1
            self.open[r] += 1
            limit = memory_limit(self.schedule, self.p, r)
            assert not self.train or self.live[r] <= limit, f"rank {r}: {self.live[r]} held, over {limit}"
            self.peak[r] = max(self.peak[r], self.live[r])
        elif x.kind == B:
            assert x.mb == self.next_b[x.stage], f"rank {r}: {x} out of micro-batch order"
            self.next_b[x.stage] += 1
            self.open[r] -= 1
            if self.schedule == "1f1b":
                self.live[r] -= 1
            else:
                self.pending_w[r].append(Pass(W, x.stage, x.mb))
        else:
            self.pending_w[r].remove(x)
            self.live[r] -= 1
        length = self.t.of(self.schedule, x.kind)
        self.done[x] = start + length
        self.free_at[r] = start + length
        self.busy[r] += length
        self.order[r].append(x)
        self.pos[r] += 1

    def run(self) -> dict:
        # a rank's choice changes only when it or a rank holding a stage next to its stages ran a pass
        choice = {r: self.choose(r) for r in range(self.p)}
        while len(self.done) < len(self.expected):
            picks = [(c[1], r, c[0]) for r, c in choice.items() if c is not None]
            assert picks, f"deadlock: ranks stopped at {[o[-1] if o else None for o in self.order]}"
            start, r, x = min(picks)
            self.execute(r, x, start)
            for q in {r, (r - 1) % self.p, (r + 1) % self.p}:
                choice[q] = self.choose(q)
        missing = [
            r for r in range(self.p) if self.programs is not None and self.pos[r] < len(self.programs[r])
        ]
        assert not missing, f"ranks {missing} have passes left"
        makespan = max(self.free_at)
        return {
            "makespan": makespan,
            "idle": [1 - b / makespan for b in self.busy],
            "peak": list(self.peak),
            "orders": self.order,
            "ends": dict(self.done),
        }


def bubble_share(schedule: str, p: int, m: int, v: int = 1) -> float:
    """A rank's idle time per second of its compute in one step, at the paper's equal pass times (the
    planner's model): 1F1B (p - 1) / (v m) (PTD-P; v chunks per rank); ZB-H1 the paper's (p - 1) F of
    bubble, (p - 1) / (3 m): ``orders`` reach it at p 2 and leave up to a third more at p >= 4 (4 F at
    p 4, 9 F at p 8, 20 F at p 16); ZB-V (p - 1) F / 2, (p - 1) / (6 m), which ``replay`` gives exactly
    at p 2 to 16 and m 4 to 64 (tests/test_zero_bubble.py holds both against it)."""
    if schedule == "1f1b":
        return (p - 1) / (v * m)
    return (p - 1) / (3 * m * SCHEDULES[schedule])


def chart(schedule: str, p: int, m: int) -> str:
    """Each rank's timeline at the paper's unit pass times (``replay``), a row per rank: two characters
    per slot (a V's pass takes half the slot of a one-stage pass), the pass's kind (F, B or W; lower
    case for the V's second chunk) and its micro-batch (mod 10), ``..`` idle."""
    run = replay(schedule, p, m)
    unit = 1.0 / SCHEDULES[schedule]
    slots = round(run["makespan"] / unit)
    rows = [["."] * (2 * slots) for _ in range(p)]
    place = stages(schedule, p)
    for r, passes in enumerate(run["orders"]):
        for x in passes:
            length = _Timing(1.0, 1.0, 1.0, 0.0).of(schedule, x.kind)
            kind = x.kind if place[x.stage][1] == 0 else x.kind.lower()
            first = round((run["ends"][x] - length) / unit)
            for k in range(first, round(run["ends"][x] / unit)):
                rows[r][2 * k : 2 * k + 2] = [kind, str(x.mb % 10)]
    return "\n".join(f"rank {r} |{''.join(row)}|" for r, row in enumerate(rows))


def stages(schedule: str, p: int, v: int = 1) -> list[tuple[int, int]]:
    """(rank, chunk) of each stage, a rank's chunks numbered in stage order: the V's (chunk 0 of rank
    r is stage r, chunk 1 is stage 2p - 1 - r), or else the ring of ``v`` chunks per rank (stage
    c p + r is chunk c of rank r: one stage per rank at v = 1, PTD-P's interleaving above)."""
    if schedule != "zbv":
        return [(s % p, s // p) for s in range(p * v)]
    seen = [0] * p
    out = []
    for r in placement(schedule, p):
        out.append((r, seen[r]))
        seen[r] += 1
    return out


@functools.lru_cache(maxsize=16)
def rank_programs(
    schedule: str, p: int, m: int, train: bool = True
) -> tuple[tuple[tuple[Op, ...], ...], ...]:
    """Every rank's ``orders`` as steps of instructions (``pipeline.schedule``'s ops, each step ending
    in a COMMIT), for posted transfers whose batches complete in posting order (NCCL runs a rank's
    batches in order on one stream; ``mt3d.ds.interleaved`` waits so): a step runs one pass, then
    posts its output (a send, or a LOCAL hand-over to the rank's other stage at the V's turn) and the
    receives due. A receive is posted at the commit the receiving rank reaches no later than the
    sender posts the send, in the orders' own timeline (``replay`` at unit times): posted later, the
    send would hold up the sender's later batches (its receives too) until then. Receives therefore
    follow the sender's order on each (sender, receiver) pair, as NCCL's matching by order alone
    needs. A rank loads a micro-batch once, at the forward of the first stage or the last one it
    holds (the V's rank 0 holds both: its engine keeps the labels for the last); "1f1b" has no WGT
    (its BWD is the whole backward). ``train`` False: evaluation's, the forwards alone in the same
    order. Cached: an engine asks for them every step."""
    check(schedule, p, m)
    place = stages(schedule, p)
    last = len(place) - 1
    rank_of = [r for r, _ in place]
    if train:
        timeline = replay(schedule, p, m)
    else:  # a subset of a schedule that runs, in the same order, runs (its dependencies are a subset)
        forwards = [[x for x in o if x.kind == F] for o in orders(schedule, p, m)]
        timeline = _Run(schedule, p, m, _Timing(1.0, 1.0, 1.0, 0.0), forwards, train=False).run()
    order, ends = timeline["orders"], timeline["ends"]

    def output(x: Pass) -> tuple[str, int, tuple] | None:
        """(op kind, receiving rank, message as the receiver names it) of what pass ``x`` hands on."""
        if x.kind == F and x.stage < last:
            to, kind = x.stage + 1, "act"
        elif x.kind == B and x.stage > 0:
            to, kind = x.stage - 1, "grad"
        else:
            return None
        local = rank_of[to] == rank_of[x.stage]
        op = {("act", True): LOCAL_ACT, ("act", False): SEND_ACT, ("grad", True): LOCAL_GRAD,
              ("grad", False): SEND_GRAD}[(kind, local)]  # fmt: skip
        return op, rank_of[to], (kind, place[to][1], x.mb)

    # receives: receiving rank -> the index of the pass whose step posts them (-1: a step before all)
    due: list[dict[int, list[tuple]]] = [defaultdict(list) for _ in range(p)]
    sends = sorted(
        ((ends[x], r, k, out) for r in range(p) for k, x in enumerate(order[r])
         if (out := output(x)) is not None and out[0] in (SEND_ACT, SEND_GRAD)),
    )  # fmt: skip  # in time order, each sender's in its own order
    finished = [[ends[x] for x in order[r]] for r in range(p)]  # each rank's passes' ends, ascending
    for sent_at, _, _, (_, to, msg) in sends:
        due[to][bisect.bisect_right(finished[to], sent_at) - 1].append(msg)

    def receives(r: int, k: int) -> list[Op]:
        return [Op(RECV_ACT if kind == "act" else RECV_GRAD, chunk, mb) for kind, chunk, mb in due[r][k]]

    programs = []
    for r in range(p):
        steps = [receives(r, -1) + [Op(COMMIT)]] if due[r][-1] else []
        for k, x in enumerate(order[r]):
            chunk = place[x.stage][1]
            loads = x.stage == 0 or (x.stage == last and rank_of[last] != rank_of[0])
            ops = [Op(LOAD, chunk, x.mb)] if x.kind == F and loads else []
            ops.append(Op({F: FWD, B: BWD, W: WGT}[x.kind], chunk, x.mb))
            out = output(x)
            if out is not None:
                ops.append(Op(out[0], chunk, x.mb))
            steps.append(ops + receives(r, k) + [Op(COMMIT)])
        programs.append(tuple(tuple(step) for step in steps))
    return tuple(programs)


def simulate(schedule: str, p: int, m: int, *, fwd: float = 1.0, bwd: float = 1.0, wgt: float = 1.0,
             p2p: float = 0.0, per_pass: dict | None = None) -> dict:  # fmt: skip
    """``rank_programs`` run by ``pipeline.schedule``'s simulator as the engine runs them (posted
    transfers, each rank's batches completing in posting order): the checks of ``simulate_programs``
    (every message the one its receiver expects, no deadlock, inputs before passes, W after B) and
    its counts, makespan and idle fractions. Pass times as ``replay``'s (a rank's layers, per
    micro-batch; "1f1b"'s backward takes ``bwd + wgt``), or ``per_pass``: {"fwd" | "bwd" | "wgt":
    {(rank, chunk): seconds of one pass}} as measured ("1f1b"'s "bwd" the whole backward)."""
    chunks = SCHEDULES[schedule]
    full = 0.0 if schedule != "1f1b" else wgt
    programs = rank_programs(schedule, p, m)
    times = per_pass or {"fwd": fwd / chunks, "bwd": (bwd + full) / chunks, "wgt": wgt / chunks}
    return simulate_programs(programs, stages(schedule, p), fwd_s=times["fwd"], bwd_s=times["bwd"],
                             wgt_s=times.get("wgt", 0.0), p2p_s=p2p)  # fmt: skip
