"""Choosing how to keep model state (the optimizer state's format and place, which blocks' parameters live in
host memory) jointly with the activation plan: a pure function of the options' costs and of what the step's
activation planner can do with the memory each leaves."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence


@dataclasses.dataclass(frozen=True)
class StepWithState:
    """The step's best activation plan with a given amount of optimizer state alive through it."""

    feasible: bool
    activation_seconds: float  # added by recomputing and offloading activations
    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class LeverChoice:
    lever: Hashable  # the option chosen (`step/`: a state lever and the blocks offloaded)
    state_bytes: int
    state_seconds: float
    step: StepWithState

    @property
    def seconds(self) -> float:
        return self.state_seconds + self.step.activation_seconds


def choose_state_lever(options: Sequence[tuple[Hashable, int, float]],
                       plan_with: Callable[[Hashable], StepWithState]) -> LeverChoice:
    """Of `options` (an option, the model-state bytes it leaves on the device through the step, the seconds it
    adds), the one whose step fits with the least added time in all (the option's and the activation plan's,
    `plan_with(option)`); if none fits, the one with the fewest bytes (its step reaches the lowest peak).

    A step that does not fit with some model-state bytes is taken not to fit with more (what is alive through
    the step only adds): the fewest bytes are tried first (every option with that many, cheapest first, until one
    fits), and no option with more bytes than one that did not fit is tried. (With offloaded blocks the bytes are where they are counted, not only how many; that
    rule can then pass over an option that fits, never choose one that does not: every choice is planned.)
    Then options go cheapest first, until one alone costs more than the best total found (activation plans
    only add time)."""
    if not options:
        raise ValueError("no state lever to choose from")
    fewest_bytes = min(o[1] for o in options)
    best = None
    for lever, nbytes, seconds in sorted((o for o in options if o[1] == fewest_bytes), key=lambda o: o[2]):
        choice = LeverChoice(lever, nbytes, seconds, plan_with(lever))
        if best is None or (choice.step.feasible and not best.step.feasible) or (
                not best.step.feasible and choice.step.peak_bytes < best.step.peak_bytes):
            best = choice
        if best.step.feasible:
            break
    assert best is not None
    if not best.step.feasible:
        return best
    does_not_fit = None
    for lever, nbytes, seconds in sorted(options, key=lambda o: (o[2], o[1])):
        if seconds >= best.seconds:
            break
        if nbytes == fewest_bytes or (does_not_fit is not None and nbytes > does_not_fit):
            continue
        choice = LeverChoice(lever, nbytes, seconds, plan_with(lever))
        if not choice.step.feasible:
            does_not_fit = nbytes if does_not_fit is None else min(does_not_fit, nbytes)
        elif choice.seconds < best.seconds:
            best = choice
    return best
