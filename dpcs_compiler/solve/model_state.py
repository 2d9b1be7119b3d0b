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
    the one whose step reaches the lowest peak. Levers are tried cheapest first and the search stops once a
    lever alone costs more than the best total found (activation plans only add time)."""
    if not options:
        raise ValueError("no state lever to choose from")
    best: LeverChoice | None = None
    lowest: LeverChoice | None = None
    for lever, nbytes, seconds in sorted(options, key=lambda o: (o[2], o[1])):
        if best is not None and seconds >= best.seconds:
            break
        choice = LeverChoice(lever, nbytes, seconds, plan_with(nbytes))
        if choice.step.feasible and (best is None or choice.seconds < best.seconds):
            best = choice
        if lowest is None or choice.step.peak_bytes < lowest.step.peak_bytes:
            lowest = choice
    assert lowest is not None
    return best if best is not None else lowest
