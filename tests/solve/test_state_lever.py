"""Choosing how to keep optimizer state with the activation plan: least added time in all, cheapest first."""

from __future__ import annotations

import pytest

from dpcs_compiler.cost.model_state import StateLever
from dpcs_compiler.solve.model_state import StepWithState, choose_state_lever

OPTIONS = [(StateLever(), 800, 0.0), (StateLever("fp16"), 410, 0.010), (StateLever("int8"), 210, 0.020),
           (StateLever("int8", True), 10, 0.050)]


def activation_plans(floor: int, budget: int, seconds_per_byte: float):
    """A step whose activations need `floor` bytes without recomputing, and recompute to fit down to half."""
    asked: list[int] = []

    def plan_with(state: int) -> StepWithState:
        asked.append(state)
        room = budget - state
        if room >= floor:
            return StepWithState(True, 0.0, floor + state)
        if room >= floor // 2:
            return StepWithState(True, (floor - room) * seconds_per_byte, budget)
        return StepWithState(False, 0.0, floor // 2 + state)

    return plan_with, asked


def choose(options, plan_with):
    """`choose_state_lever` with a step planned from the option's bytes alone."""
    nbytes = {option: n for option, n, _ in options}
    return choose_state_lever(options, lambda option: plan_with(nbytes[option]))


def test_plain_state_when_it_fits():
    plan_with, asked = activation_plans(floor=1000, budget=2000, seconds_per_byte=1e-4)
    choice = choose(OPTIONS, plan_with)
    assert choice.lever == StateLever() and choice.seconds == 0 and asked == [10, 800]


def test_compressing_state_beats_recomputing_when_it_costs_less():
    plan_with, asked = activation_plans(floor=1000, budget=1500, seconds_per_byte=1e-4)
    choice = choose(OPTIONS, plan_with)  # fp32: 300 B to recompute, 0.03 s; fp16 fits for 0.01 s
    assert choice.lever == StateLever("fp16") and choice.seconds == pytest.approx(0.010)
    assert asked == [10, 800, 410]  # the fewest bytes first; int8 alone costs more than fp16 in all: not tried


def test_recomputing_beats_compressing_when_it_costs_less():
    plan_with, _ = activation_plans(floor=1000, budget=1500, seconds_per_byte=1e-6)
    choice = choose(OPTIONS, plan_with)
    assert choice.lever == StateLever() and choice.step.activation_seconds == pytest.approx(300e-6)


def test_only_the_host_fits():
    plan_with, _ = activation_plans(floor=1000, budget=700, seconds_per_byte=1e-6)
    choice = choose(OPTIONS, plan_with)
    assert choice.lever == StateLever("int8", True) and choice.step.feasible


def test_nothing_fits_gives_the_lowest_peak():
    plan_with, asked = activation_plans(floor=1000, budget=400, seconds_per_byte=1e-6)
    choice = choose(OPTIONS, plan_with)
    assert not choice.step.feasible and choice.lever == StateLever("int8", True) and choice.step.peak_bytes == 510
    assert asked == [10], "nothing fits with the fewest bytes: nothing with more is tried"


def test_options_with_more_bytes_than_one_that_did_not_fit_are_not_tried():
    plan_with, asked = activation_plans(floor=1000, budget=1000, seconds_per_byte=1e-9)
    choice = choose(OPTIONS + [(StateLever("bf16"), 900, 0.005)], plan_with)
    # fp32 (800 B) does not fit, so neither would bf16 (900 B, cheaper than fp16): not tried; fp16 fits
    assert choice.lever == StateLever("fp16") and asked == [10, 800, 410]


def test_no_options_is_an_error():
    with pytest.raises(ValueError, match="no state lever"):
        choose_state_lever([], lambda option: StepWithState(True, 0.0, 0))


def test_options_are_planned_as_themselves_not_by_their_bytes():
    """Two options of equal bytes (a block offloaded, or state compressed by as much) are planned each its own
    way: the one the step fits with is chosen."""
    options = [(("fp32", 1), 500, 0.01), (("int8", 0), 500, 0.02), (("fp32", 0), 900, 0.0)]
    planned = []

    def plan_with(option):
        planned.append(option)
        return StepWithState(option == ("int8", 0), 0.0, 1000)

    choice = choose_state_lever(options, plan_with)
    assert choice.lever == ("int8", 0) and planned == [("fp32", 1), ("int8", 0), ("fp32", 0)]
