"""The incremental timeline the fast solver edits: each candidate's decision and the bytes alive at every step,
kept equal to `cost.memory_model.plan_memory`'s under every single-candidate edit (tested), so every move a
solver weighs sees the true peak. Also what `solution.solved_solution` uses to save free offloads in one pass.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from dpcs_compiler.cost.memory_model import DECISIONS, MemoryProblem

SAVE_, RECOMPUTE_, OFFLOAD_ = 0, 1, 2  # indices into DECISIONS

Interval = tuple[int, int, int]  # (first step, last step, bytes)


class Move:
    """Setting candidate i to decision k: the candidates' intervals it adds (signed), the new remake steps
    (i's and its recomputed inputs'), and, once asked, its whole effect on the bytes alive at each step."""

    __slots__ = ("i", "k", "delta", "made", "_effect", "_remakes")

    def __init__(self, i: int, k: int, delta: list[Interval], made: dict[int, int]) -> None:
        self.i, self.k, self.delta, self.made = i, k, delta, made
        self._effect: tuple[int, np.ndarray] | None = None
        # With the effect: each transient step it touches, what it stops and starts making again there, and
        # the largest transient made there after it (`Timeline._transient_moves`), for `Timeline.apply`.
        self._remakes: list[tuple[int, list[int], dict[int, int], int]] = []


class Timeline:
    """A plan being edited: each candidate's decision and remake step, and the bytes alive at every step,
    kept equal to `plan_memory(problem, decisions).bytes_during`.

    `during` is the base bytes plus the candidates' intervals, plus `extra` at the steps where candidates with
    transients are made again: what lifts such a step to before + candidates + the largest of those
    transients, when that is more (plan_memory's rule)."""

    def __init__(self, problem: MemoryProblem) -> None:
        cands = problem.candidates
        n = self.n = len(cands)
        self.produced = [c.produced for c in cands]
        self.forward_end = [c.last_forward_use for c in cands]
        self.first_backward = [c.first_backward_use for c in cands]
        self.last = [c.last_use for c in cands]
        self.nbytes = [c.nbytes for c in cands]
        self.transient = [c.recompute_transient if c.can_recompute else 0 for c in cands]
        self.free = [problem.offload_free_step(i) if c.can_offload else -1 for i, c in enumerate(cands)]
        self.reload = [problem.reload_step(i) if c.can_offload else -1 for i, c in enumerate(cands)]
        self.inputs = [c.recompute_inputs for c in cands]
        self.consumers: list[list[int]] = [[] for _ in range(n)]
        for d, c in enumerate(cands):
            for j in c.recompute_inputs:
                self.consumers[j].append(d)
        # cost[i][k]: seconds decision k adds (inf: not allowed).
        self.cost = [
            [
                0.0,
                c.recompute_seconds if c.can_recompute else math.inf,
                problem.offload_seconds(i) if c.can_offload else math.inf,
            ]
            for i, c in enumerate(cands)
        ]
        # Each candidate's allowed decisions, cheapest first (ties: SAVE, RECOMPUTE, OFFLOAD).
        self.by_cost = [sorted((k for k in range(3) if cost[k] < math.inf), key=lambda k: cost[k]) for cost in self.cost]
        self.base = problem.base_bytes
        self.before = problem.base_before_bytes
        # The same as arrays, for screening every candidate at once.
        self.a_produced = np.array(self.produced, dtype=np.int64)
        self.a_forward_end = np.array(self.forward_end, dtype=np.int64)
        self.a_first_backward = np.array(self.first_backward, dtype=np.int64)
        self.a_last = np.array(self.last, dtype=np.int64)
        self.a_nbytes = np.array(self.nbytes, dtype=np.int64)
        self.a_transient = np.array(self.transient, dtype=np.int64)
        self.a_free = np.array(self.free, dtype=np.int64)
        self.a_reload = np.array(self.reload, dtype=np.int64)
        self.a_cost = np.array(self.cost, dtype=np.float64).reshape(n, 3)
        self.edge_input = np.array([j for c in cands for j in c.recompute_inputs], dtype=np.int64)
        self.edge_consumer = np.array([d for d, c in enumerate(cands) for _ in c.recompute_inputs], dtype=np.int64)
        self.work = 0  # moves evaluated so far: the unit the solver's effort is bounded in
        self.reset([SAVE_] * n)

    # -- whole-plan state -------------------------------------------------------------------------------------

    def reset(self, decision: list[int]) -> None:
        """Set every decision at once (materialize_steps and candidate_intervals in one pass)."""
        n = self.n
        made = [-1] * n
        for i in reversed(range(n)):
            if decision[i] == RECOMPUTE_:
                made[i] = self.first_backward[i] if made[i] < 0 else min(made[i], self.first_backward[i])
                for j in self.inputs[i]:
                    if decision[j] == RECOMPUTE_:
                        made[j] = made[i] if made[j] < 0 else min(made[j], made[i])
        starts, ends, sizes = [], [], []
        for i in range(n):
            for a, b, v in self.intervals(i, decision[i], made[i]):
                starts.append(a)
                ends.append(b + 1)
                sizes.append(v)
        delta = np.zeros(len(self.base) + 1, dtype=np.int64)
        np.add.at(delta, np.array(starts, dtype=np.int64), np.array(sizes, dtype=np.int64))
        np.add.at(delta, np.array(ends, dtype=np.int64), -np.array(sizes, dtype=np.int64))
        self.decision = list(decision)
        self.made = made
        self.a_decision = np.array(decision, dtype=np.int64)
        self.a_made = np.array(made, dtype=np.int64)
        self.seconds = math.fsum(self.cost[i][k] for i, k in enumerate(decision))
        self.remade: dict[int, dict[int, int]] = {}  # step -> {candidate: transient} made again there
        self._tops: dict[int, tuple[int, int, int]] = {}  # step -> `_top(step)`, until remade[step] changes
        for i in range(n):
            if made[i] >= 0 and self.transient[i]:
                self.remade.setdefault(made[i], {})[i] = self.transient[i]
        self.extra = np.zeros(len(self.base), dtype=np.int64)
        for step, made_there in self.remade.items():
            self.extra[step] = self._extra(step, max(made_there.values()))
        self.during = self.base + np.cumsum(delta[:-1]) + self.extra

    def _extra(self, step: int, transient: int) -> int:
        """How far recomputing with the largest transient `transient` at `step` lifts the step (0: none)."""
        if transient <= 0:
            return 0
        return max(0, int(self.before[step]) + transient - int(self.base[step]))

    def snapshot(self) -> tuple:
        remade = {s: dict(m) for s, m in self.remade.items()}
        return list(self.decision), list(self.made), self.seconds, self.during.copy(), self.extra.copy(), remade

    def restore(self, state: tuple) -> None:
        decision, made, self.seconds, during, extra, remade = state
        self.decision, self.made = list(decision), list(made)
        self.during, self.extra = during.copy(), extra.copy()
        self.remade = {s: dict(m) for s, m in remade.items()}
        self._tops = {}
        self.a_decision = np.array(decision, dtype=np.int64)
        self.a_made = np.array(made, dtype=np.int64)

    def decisions(self) -> tuple[str, ...]:
        return tuple(DECISIONS[k] for k in self.decision)

    def peak(self) -> int:
        return int(self.during.max())

    # -- one candidate at a time ------------------------------------------------------------------------------

    def intervals(self, i: int, k: int, made: int) -> list[Interval]:
        """Where candidate i is alive under decision k (remade at `made`): candidate_intervals' rule."""
        nb = self.nbytes[i]
        if k == SAVE_:
            return [(self.produced[i], self.last[i], nb)]
        if k == RECOMPUTE_:
            return [(self.produced[i], self.forward_end[i], nb), (made, self.last[i], nb)]
        return [(self.produced[i], self.free[i], nb), (self.reload[i], self.last[i], nb)]

    def change(self, i: int, k: int) -> Move:
        """Setting candidate i to decision k, not applied. Its recomputed inputs (recursively) may be pulled
        earlier or let go later: materialize_steps' rule, on the few candidates it can touch."""
        self.work += 1
        decision = self.decision
        old_k = decision[i]
        decision[i] = k  # temporarily, to walk the plan as it would be
        try:
            # Consumers before their inputs (inputs are earlier candidates): a max-heap on the index. The walk
            # goes on through an input only where a remake step moved (or from i itself): an input's remake
            # step is the earliest of its recomputed consumers', so one whose step stays moves none of its own.
            made: dict[int, int] = {}
            heap, queued = [-i], {i}
            while heap:
                x = -heapq.heappop(heap)
                if decision[x] != RECOMPUTE_:
                    m = -1
                else:
                    m = self.first_backward[x]
                    for d in self.consumers[x]:
                        if decision[d] == RECOMPUTE_:
                            m = min(m, made.get(d, self.made[d]))
                if x != i and m == self.made[x]:
                    continue
                made[x] = m
                for j in self.inputs[x]:
                    if decision[j] == RECOMPUTE_ and j not in queued:
                        queued.add(j)
                        heapq.heappush(heap, -j)
        finally:
            decision[i] = old_k
        delta = []
        for x, m in made.items():
            if x == i or m != self.made[x]:
                delta += [(a, b, -v) for a, b, v in self.intervals(x, decision[x], self.made[x])]
                delta += self.intervals(x, k if x == i else decision[x], m)
        return Move(i, k, delta, made)

    def _transient_moves(self, move: Move) -> dict[int, tuple[list[int], dict[int, int]]]:
        """The transient steps `move` touches, each with the candidates it stops making again there and those
        it starts to (with their transients). Not copies of the steps' sets: a step where the backward starts
        can remake hundreds of candidates, and every move evaluated would copy them."""
        after: dict[int, tuple[list[int], dict[int, int]]] = {}
        for x, m in move.made.items():
            if not self.transient[x]:
                continue
            old, new = self.made[x], m
            if old == new:
                continue
            if old >= 0 and x in self.remade.get(old, ()):
                after.setdefault(old, ([], {}))[0].append(x)
            if new >= 0:
                after.setdefault(new, ([], {}))[1][x] = self.transient[x]
        return after

    def _top(self, step: int) -> tuple[int, int, int]:
        """Of the transients made again at `step`: the largest, how many have it, the largest below it (0s)."""
        top = self._tops.get(step)
        if top is None:
            values = list(self.remade.get(step, {}).values())
            largest = max(values, default=0)
            top = (largest, values.count(largest), max((v for v in values if v < largest), default=0))
            self._tops[step] = top
        return top

    def _largest_after(self, step: int, gone: list[int], added: dict[int, int]) -> int:
        """The largest transient made again at `step` once `gone` stop being and `added` start (0: none)."""
        largest, count, below = self._top(step)
        made_there = self.remade.get(step, {})
        at_largest = sum(1 for x in gone if made_there[x] == largest)
        if at_largest < count:
            kept = largest
        elif len(gone) == 1:
            kept = below
        else:
            kept = max((v for y, v in made_there.items() if y not in gone), default=0)
        return max(kept, max(added.values(), default=0))

    def effect(self, move: Move) -> tuple[int, np.ndarray]:
        """(first step, what `move` adds to the bytes alive at each step from there)."""
        if move._effect is None:
            lo, local = _dense(move.delta)
            move._remakes = [(step, gone, added, self._largest_after(step, gone, added))
                             for step, (gone, added) in self._transient_moves(move).items()]
            for step, _, _, largest in move._remakes:
                local[step - lo] += self._extra(step, largest) - int(self.extra[step])
            move._effect = (lo, local)
        return move._effect

    def at(self, move: Move, t: int) -> int:
        """What `move` adds to the bytes alive at step t."""
        lo, local = self.effect(move)
        return int(local[t - lo]) if lo <= t < lo + len(local) else 0

    def raises_to(self, move: Move) -> int:
        """The highest value any step `move` raises would reach (min int64 when it raises none)."""
        lo, local = self.effect(move)
        raised = local > 0
        if not raised.any():
            return int(np.iinfo(np.int64).min)
        return int((self.during[lo : lo + len(local)][raised] + local[raised]).max())

    def apply(self, move: Move) -> None:
        """Commit `move`."""
        lo, local = self.effect(move)
        for step, gone, added, largest in move._remakes:
            self.extra[step] = self._extra(step, largest)
            made_there = self.remade.setdefault(step, {})
            for x in gone:
                del made_there[x]
            made_there.update(added)
            if not made_there:
                del self.remade[step]
            self._tops.pop(step, None)
        self.during[lo : lo + len(local)] += local
        for x, m in move.made.items():
            self.made[x] = m
            self.a_made[x] = m
        i, k = move.i, move.k
        self.seconds += self.cost[i][k] - self.cost[i][self.decision[i]]
        self.decision[i] = k
        self.a_decision[i] = k

    def set(self, i: int, k: int) -> None:
        self.apply(self.change(i, k))

    # -- every candidate at once ------------------------------------------------------------------------------

    def freed_at(self, t: int) -> np.ndarray:
        """int64 [n, 3]: about the bytes each candidate's switch to each decision frees at step t (a screen:
        recomputed inputs pulled earlier or let go are followed one level; `change` is exact)."""
        p, f, last, nb = self.a_produced, self.a_forward_end, self.a_last, self.a_nbytes
        decision, made = self.a_decision, self.a_made
        pull = self.a_first_backward.copy()  # where each candidate would be remade if recomputed now
        if len(self.edge_input):
            by = decision[self.edge_consumer] == RECOMPUTE_
            np.minimum.at(pull, self.edge_input[by], made[self.edge_consumer[by]])
        forward = (p <= t) & (t <= f)
        save = nb * ((p <= t) & (t <= last))
        recompute = nb * (forward + ((pull <= t) & (t <= last)))
        offload = nb * (((p <= t) & (t <= self.a_free)) + ((self.a_reload <= t) & (t <= last)))
        now_recompute = nb * (forward + ((made <= t) & (t <= last)))
        now = np.choose(decision, (save, now_recompute, offload))
        freed = now[:, None] - np.stack((save, recompute, offload), axis=1)
        # A transient made again at t lifts t to at least before + its transient.
        largest, count, below = self._top(t)
        largest_after = np.maximum(largest, self.a_transient)
        lifted = np.where(largest_after > 0, np.maximum(0, int(self.before[t]) - int(self.base[t]) + largest_after), 0)
        freed[:, RECOMPUTE_] -= np.where((pull == t) & (made != t), lifted - self.extra[t], 0)
        # One made again at t that stops being recomputed takes its transient away.
        for x, v in self.remade.get(t, {}).items():
            others = below if v == largest and count == 1 else largest
            freed[x, [SAVE_, OFFLOAD_]] += int(self.extra[t]) - self._extra(t, others)
        if len(self.edge_input):
            j, d = self.edge_input, self.edge_consumer
            alive_input = (decision[j] == RECOMPUTE_) & (t <= last[j])
            # A recomputed consumer that stops being recomputed lets go of the inputs it pulled earlier.
            released = alive_input & (decision[d] == RECOMPUTE_) & (made[j] == made[d]) & (made[d] <= t)
            released &= t < self.a_first_backward[j]
            let_go = np.zeros(self.n, dtype=np.int64)
            np.add.at(let_go, d[released], nb[j[released]])
            freed[:, SAVE_] += let_go
            freed[:, OFFLOAD_] += let_go
            # One that becomes recomputed pulls its recomputed inputs earlier.
            pulled = alive_input & (decision[d] != RECOMPUTE_) & (pull[d] <= t) & (t < made[j])
            held = np.zeros(self.n, dtype=np.int64)
            np.add.at(held, d[pulled], nb[j[pulled]])
            freed[:, RECOMPUTE_] -= held
        return freed


def _dense(delta: list[Interval]) -> tuple[int, np.ndarray]:
    """`delta` as (first step, bytes it adds at each step from there)."""
    lo = min(a for a, _, _ in delta)
    hi = max(b for _, b, _ in delta)
    local = np.zeros(hi - lo + 2, dtype=np.int64)
    for a, b, v in delta:
        local[a - lo] += v
        local[b + 1 - lo] -= v
    return lo, np.cumsum(local[:-1])
