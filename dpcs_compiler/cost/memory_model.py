"""The memory and time of one training step under a plan: the one peak formula solvers and reports share.

The foundation's timeline simulator gives, for the joint graph scheduled as it will run, the bytes alive at
every step. `MemoryProblem` is that timeline split in two: `base_bytes`, everything the plan cannot change
(parameters, inputs, temporaries, gradients), and the candidates, the forward buffers the backward reads,
whose lifetimes the plan decides:

- SAVE: alive from its producer to its last backward use (what autograd does by default).
- RECOMPUTE: freed after its last forward use; made again in backward just before its first backward use,
  or earlier when a recomputed candidate needs it as an input, and then alive to its last use. It is
  made before the step that first reads it allocates anything: while it is recomputed, the memory is what
  was alive before that step (`base_before_bytes`), the candidates alive at that step, and the most its
  re-run holds beyond the candidate itself (`recompute_transient`). Candidates made again at one step are counted
  together, their transients one at a time (each is freed before the next is made).
- OFFLOAD: copied to host memory on a side stream after it is made; its device memory is freed once both
  the copy has finished and its last forward use has run. The reload starts early enough (the prefetch
  distance) for the copy to finish by its first backward use, and it is alive from then on.

Everything here is a pure function of plain data: no graphs, no torch. Positions are schedule steps
(indices into the joint schedule); `step_seconds` are the cost model's estimates of each step's run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

SAVE = "save"
RECOMPUTE = "recompute"
OFFLOAD = "offload"
DECISIONS = (SAVE, RECOMPUTE, OFFLOAD)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A forward buffer the backward reads, with what each decision would cost.

    produced: step that makes it; last_forward_use: last forward step that reads it (>= produced);
    first_backward_use / last_use: first and last backward steps that read it.
    recompute_inputs: indices of other candidates that must be in memory to recompute it.
    transfer_seconds: one copy's time (out, or back), hidden behind compute where the schedule leaves room;
    offload_ops_seconds: the host time of the ops that move it, never hidden (`cost.op_time.offload_ops_seconds`).
    """

    name: str
    nbytes: int
    produced: int
    last_forward_use: int
    first_backward_use: int
    last_use: int
    recompute_seconds: float = 0.0
    recompute_transient: int = 0
    recompute_inputs: tuple[int, ...] = ()
    transfer_seconds: float = 0.0
    offload_ops_seconds: float = 0.0
    can_recompute: bool = True
    can_offload: bool = False

    def __post_init__(self) -> None:
        for name in ("transfer_seconds", "offload_ops_seconds"):
            if not 0.0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"candidate {self.name!r}: {name} must be finite and >= 0, got {getattr(self, name)!r}")
        if not self.produced <= self.last_forward_use < self.first_backward_use <= self.last_use:
            raise ValueError(
                f"candidate {self.name!r}: need produced <= last_forward_use < first_backward_use <= last_use, got "
                f"{self.produced}, {self.last_forward_use}, {self.first_backward_use}, {self.last_use}"
            )


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryProblem:
    """One step's memory without its candidates, the candidates, and each step's estimated run time.

    Candidates are listed in the order they are produced; a candidate's recompute inputs come before it.
    """

    base_bytes: np.ndarray  # int64 [steps]: bytes alive during each step, candidates excluded
    step_seconds: np.ndarray  # float64 [steps]
    backward_start: int
    candidates: tuple[Candidate, ...]
    base_before_bytes: np.ndarray | None = None  # int64 [steps]: alive just before each step; default base_bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_bytes", np.asarray(self.base_bytes, dtype=np.int64))
        object.__setattr__(self, "step_seconds", np.asarray(self.step_seconds, dtype=np.float64))
        before = self.base_bytes if self.base_before_bytes is None else self.base_before_bytes
        object.__setattr__(self, "base_before_bytes", np.asarray(before, dtype=np.int64))
        if not self.base_bytes.shape == self.step_seconds.shape == self.base_before_bytes.shape:
            raise ValueError("base_bytes, base_before_bytes and step_seconds must have one entry per step")
        for i, c in enumerate(self.candidates):
            if any(not 0 <= j < i for j in c.recompute_inputs):
                raise ValueError(f"candidate {c.name!r}: recompute inputs must be earlier candidates")
            if c.last_use >= self.steps:
                raise ValueError(f"candidate {c.name!r}: last use {c.last_use} is past the last step")
        # Where each step starts, in seconds (for copy timing), computed once.
        object.__setattr__(self, "_starts", np.concatenate(([0.0], np.cumsum(self.step_seconds))))

    @property
    def steps(self) -> int:
        return len(self.base_bytes)

    def with_schedule_excess(self, forward_bytes: int, backward_bytes: int, boundary_bytes: int | None = None
                             ) -> MemoryProblem:
        """The problem with bytes added to every forward / backward step: what the compiled graphs hold
        beyond the modelled order (Inductor's fused kernels), as read on a compiled plan. Negative amounts
        (a schedule that holds less) are taken as given: the prediction of that plan; callers that plan
        with it pass only positive ones, so a plan is never loosened by what another plan's schedule did.

        `boundary_bytes`: of those, what is alive between the phases, before the backward's first step (what
        the forward leaves beyond the model; `cost.step_model.boundary_level` reads it there). None: the
        backward's bytes, as if its excess were held from its start. A backward's excess is mostly a peak
        inside it (a fused kernel's outputs made at once): on the graph-break net, a 512 KiB excess of one
        backward counted at the boundary broke the step's cap on it, and its compile re-planned to recompute
        1.5 MiB more than the step needed (the step measured 20% under its budget)."""
        if forward_bytes == 0 and backward_bytes == 0 and not boundary_bytes:
            return self
        extra = self._per_phase(forward_bytes, backward_bytes)
        before = self.base_before_bytes + extra
        if boundary_bytes is not None and self.backward_start < self.steps:
            before[self.backward_start] += boundary_bytes - backward_bytes
        return dataclasses.replace(self, base_bytes=self.base_bytes + extra, base_before_bytes=before)

    def with_excess(self, excess: Mapping[str, int], *, planning: bool = False) -> MemoryProblem:
        """`with_schedule_excess` of an excess as the compile reads it: {"forward", "backward"} and, where known,
        "boundary" (bytes). `planning`: only what is above zero (a plan is planned with what another plan's
        schedule held beyond the model, never with what it held below)."""
        def get(key: str) -> int | None:
            value = excess.get(key)
            return None if value is None else max(0, value) if planning else value

        return self.with_schedule_excess(get("forward") or 0, get("backward") or 0, get("boundary"))

    def with_schedule_credit(self, forward_bytes: int, backward_bytes: int) -> MemoryProblem:
        """The problem with bytes (<= 0) taken off the bytes during every forward / backward step, not those
        before a step (so not the boundary level, `cost.step_model.boundary_level`): a compiled schedule that
        holds less than the modelled order inside a phase (Inductor's reordering) holds as much between the
        phases. Only for predicting a compiled plan (`GraphJob.step_graph`'s `credit`), never for planning."""
        if forward_bytes > 0 or backward_bytes > 0:
            raise ValueError(f"a schedule credit takes bytes <= 0, not ({forward_bytes}, {backward_bytes})")
        if forward_bytes == 0 and backward_bytes == 0:
            return self
        return dataclasses.replace(self, base_bytes=self.base_bytes + self._per_phase(forward_bytes, backward_bytes))

    def _per_phase(self, forward_bytes: int, backward_bytes: int) -> np.ndarray:
        """`forward_bytes` at each forward step, `backward_bytes` at each backward step."""
        return np.where(np.arange(self.steps) < self.backward_start, forward_bytes, backward_bytes)

    def all_saved(self) -> tuple[str, ...]:
        return (SAVE,) * len(self.candidates)

    def offload_free_step(self, index: int) -> int:
        """The forward step after which an offloaded candidate's device memory is freed."""
        c = self.candidates[index]
        done = int(np.searchsorted(self._starts, self._starts[c.produced + 1] + c.transfer_seconds, side="left"))
        # The forward graph waits for its copies by its last node at the latest.
        return min(max(c.last_forward_use, done - 1), self.backward_start - 1)

    def reload_step(self, index: int) -> int:
        """The step at which a reload starts: the latest one that still hides the copy behind compute
        (the prefetch distance is the first backward use minus this), never before backward starts."""
        c = self.candidates[index]
        latest_start = self._starts[c.first_backward_use] - c.transfer_seconds
        step = int(np.searchsorted(self._starts, latest_start, side="right")) - 1
        return max(min(step, c.first_backward_use), self.backward_start, self.offload_free_step(index) + 1)

    def exposed_transfer_seconds(self, index: int) -> float:
        """Copy time not hidden behind compute (offload and reload each), under the prefetch chosen."""
        c = self.candidates[index]
        reload_window = self._starts[c.first_backward_use] - self._starts[self.reload_step(index)]
        offload_window = self._starts[self.backward_start] - self._starts[c.produced + 1]  # forward waits at its end
        return max(0.0, c.transfer_seconds - reload_window) + max(0.0, c.transfer_seconds - offload_window)

    def offload_seconds(self, index: int) -> float:
        """Seconds offloading the candidate adds to the step: its copies' exposed time and its ops' host time,
        which nothing hides."""
        return self.exposed_transfer_seconds(index) + self.candidates[index].offload_ops_seconds


@dataclasses.dataclass(frozen=True, eq=False)
class PlanMemory:
    bytes_during: np.ndarray  # int64 [steps]
    peak_bytes: int
    peak_step: int


def check_decisions(problem: MemoryProblem, decisions: Sequence[str]) -> None:
    if len(decisions) != len(problem.candidates):
        raise ValueError(f"{len(decisions)} decisions for {len(problem.candidates)} candidates")
    for c, d in zip(problem.candidates, decisions):
        if d not in DECISIONS:
            raise ValueError(f"decision {d!r} for {c.name!r} is not valid; valid choices: {', '.join(DECISIONS)}")
        if d == RECOMPUTE and not c.can_recompute:
            raise ValueError(f"candidate {c.name!r} cannot be recomputed (a random op, or nothing to recompute it from)")
        if d == OFFLOAD and not c.can_offload:
            raise ValueError(f"candidate {c.name!r} cannot be offloaded (no host copy on this device)")


def materialize_steps(problem: MemoryProblem, decisions: Sequence[str]) -> list[int]:
    """For each recomputed candidate, the backward step at which it is made again (else -1).

    A candidate is recomputed before its first backward use, or before a recomputed candidate that needs it
    is recomputed, whichever comes first. Consumers come after their inputs, so walk backwards.
    """
    made = [-1] * len(problem.candidates)
    for i in reversed(range(len(problem.candidates))):
        if decisions[i] == RECOMPUTE:
            made[i] = min(made[i], problem.candidates[i].first_backward_use) if made[i] >= 0 else (
                problem.candidates[i].first_backward_use
            )
            for j in problem.candidates[i].recompute_inputs:
                if decisions[j] == RECOMPUTE:
                    made[j] = made[i] if made[j] < 0 else min(made[j], made[i])
    return made


def candidate_intervals(problem: MemoryProblem, decisions: Sequence[str]) -> list[tuple[int, int, int]]:
    """(first step, last step, bytes) of every stretch a candidate is alive."""
    made = materialize_steps(problem, decisions)
    intervals = []
    for i, (c, d) in enumerate(zip(problem.candidates, decisions)):
        if d == SAVE:
            intervals.append((c.produced, c.last_use, c.nbytes))
        elif d == RECOMPUTE:
            intervals.append((c.produced, c.last_forward_use, c.nbytes))
            intervals.append((made[i], c.last_use, c.nbytes))
        else:
            intervals.append((c.produced, problem.offload_free_step(i), c.nbytes))
            intervals.append((problem.reload_step(i), c.last_use, c.nbytes))
    return intervals


def recompute_transients(problem: MemoryProblem, decisions: Sequence[str]) -> dict[int, int]:
    """Step -> the largest transient of the candidates made again before it runs."""
    made = materialize_steps(problem, decisions)
    largest: dict[int, int] = {}
    for i, c in enumerate(problem.candidates):
        if made[i] >= 0 and c.recompute_transient:
            largest[made[i]] = max(largest.get(made[i], 0), c.recompute_transient)
    return largest


def plan_memory(problem: MemoryProblem, decisions: Sequence[str]) -> PlanMemory:
    """The step's bytes alive at every step under `decisions`, and its peak: THE peak formula.

    At a step before which candidates are recomputed, the bytes are the larger of the step itself and the
    recomputation (what was alive before the step, the candidates alive at it, the largest transient).
    """
    check_decisions(problem, decisions)
    delta = np.zeros(problem.steps + 1, dtype=np.int64)
    for start, end, nbytes in candidate_intervals(problem, decisions):
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    candidates = np.cumsum(delta[:-1])
    during = problem.base_bytes + candidates
    for step, transient in recompute_transients(problem, decisions).items():
        during[step] = max(during[step], problem.base_before_bytes[step] + candidates[step] + transient)
    peak_step = int(np.argmax(during)) if len(during) else -1
    return PlanMemory(bytes_during=during, peak_bytes=int(during[peak_step]) if len(during) else 0, peak_step=peak_step)


def floor_bytes(problem: MemoryProblem) -> np.ndarray:
    """int64 [steps]: bytes no plan goes below at each step (a bound, not a plan): the base, plus each
    candidate where every decision keeps it alive. Recomputing or offloading a candidate still keeps it from
    its making to its last forward use and from its first backward use to its last (a recomputation is made
    at its first backward use or earlier, a reload lands by then, an offload frees it after its last forward
    use or later); one that can only be saved is alive throughout."""
    delta = np.zeros(problem.steps + 1, dtype=np.int64)
    for c in problem.candidates:
        if c.can_recompute or c.can_offload:
            stretches = ((c.produced, c.last_forward_use), (c.first_backward_use, c.last_use))
        else:
            stretches = ((c.produced, c.last_use),)
        for start, end in stretches:
            delta[start] += c.nbytes
            delta[end + 1] -= c.nbytes
    return problem.base_bytes + np.cumsum(delta[:-1])


def plan_seconds(problem: MemoryProblem, decisions: Sequence[str]) -> float:
    """Seconds the plan adds to the step: recomputation, and copies not hidden behind compute."""
    check_decisions(problem, decisions)
    added = 0.0
    for i, (c, d) in enumerate(zip(problem.candidates, decisions)):
        if d == RECOMPUTE:
            added += c.recompute_seconds
        elif d == OFFLOAD:
            added += problem.offload_seconds(i)
    return added
