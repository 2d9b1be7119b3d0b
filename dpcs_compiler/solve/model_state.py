"""Choosing how to keep optimizer state jointly with the activation plan: a pure function of the levers'
costs and of what the step's activation planner can do with the memory each leaves."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from dpcs_compiler.cost.model_state import StateLever


@dataclasses.dataclass(frozen=True)
class StepWithState:
    """The step's best activation plan with a given amount of optimizer state alive through it."""

    feasible: bool
    activation_seconds: float  # added by recomputing and offloading activations
    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class LeverChoice:
    lever: StateLever
    state_bytes: int
    state_seconds: float
    step: StepWithState

    @property
    def seconds(self) -> float:
        return self.state_seconds + self.step.activation_seconds


def choose_state_lever(options: Sequence[tuple[StateLever, int, float]],
                       plan_with: Callable[[int], StepWithState]) -> LeverChoice:
    """Of `options` (lever, its state bytes on the device, the seconds it adds), the one whose step fits with the
    least added time in all (the lever's and the activation plan's, `plan_with(state bytes)`); if none fits,
    the one with the fewest bytes (its step reaches the lowest peak).

    A step that does not fit with some state bytes fits with no more (what is alive through the step only
    adds): the fewest bytes are tried first, and no option with as many bytes as one that did not fit is
    tried. Then levers go cheapest first, until one alone costs more than the best total found (activation
    plans only add time)."""
    if not options:
        raise ValueError("no state lever to choose from")
    fewest = min(options, key=lambda o: (o[1], o[2]))
    best = LeverChoice(fewest[0], fewest[1], fewest[2], plan_with(fewest[1]))
    if not best.step.feasible:
        return best
    does_not_fit = None
    for lever, nbytes, seconds in sorted(options, key=lambda o: (o[2], o[1])):
        if seconds >= best.seconds:
            break
        if lever == fewest[0] or (does_not_fit is not None and nbytes >= does_not_fit):
            continue
        choice = LeverChoice(lever, nbytes, seconds, plan_with(nbytes))
        if not choice.step.feasible:
            does_not_fit = nbytes if does_not_fit is None else min(does_not_fit, nbytes)
        elif choice.seconds < best.seconds:
            best = choice
    return best
