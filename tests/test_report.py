"""A step plan's record (`report.StepRecord`): its predicted peak split into what the refusal names."""

from __future__ import annotations

from dpcs_compiler.debug.render import format_bytes
from dpcs_compiler.report import StepRecord, describe_step
from dpcs_compiler.step.records import _split


def record(**changes) -> StepRecord:
    fields = dict(step="step_x", calls=["a", "b"], budget_bytes=900, predicted_peak_bytes=1000, peak_graph="a",
                  peak_node="mul", peak_phase="backward", feasible=False, replanned=True)
    return StepRecord(**(fields | changes))


def test_the_peak_splits_into_parts_that_add_up_to_it():
    # Parameters 100, state 50 and buckets 120 and 30 other bytes outside the graphs, FSDP2's gathers 200,
    # gradients 150: activations are the rest.
    parts = record(parameter_bytes=100, outside_bytes=200, bucket_bytes=120, optimizer_state={"bytes": 50},
                   gathered_bytes=200, gradient_bytes=150).split()
    assert parts == {"parameters": 100, "optimizer_state": 50, "buckets": 120, "outside_graphs": 30, "gathered": 200,
                     "gradients": 150, "activations": 350, "optimizer_step": 0}
    assert sum(parts.values()) == 1000
    # Never more gathered or gradient bytes than the peak has left for them.
    tight = record(parameter_bytes=900, gathered_bytes=80, gradient_bytes=80).split()
    assert (tight["gathered"], tight["gradients"], tight["activations"]) == (80, 20, 0)


def test_the_refusal_names_fsdp2s_gathered_parameters_and_ddps_buckets_only_where_there_are_some():
    fsdp = _split(record(parameter_bytes=100, gathered_bytes=200, gradient_bytes=150))
    assert "parameters 100 B (FSDP2: this rank's shards)" in fsdp
    assert f"FSDP2's gathered parameters (the running block's and those in flight beside it) {format_bytes(200)}" in fsdp
    assert "buckets" not in fsdp
    ddp = _split(record(parameter_bytes=100, outside_bytes=120, bucket_bytes=120, gradient_bytes=150))
    assert "DistributedDataParallel's gradient buckets 120 B" in ddp and "FSDP2" not in ddp


def test_the_step_line_says_what_its_compiled_graphs_predict_where_that_differs():
    planned = describe_step(record())
    assert planned == ("step (2 graph calls: a, b): predicted peak 1000 B in a backward at mul; budget 900 B, over budget; "
                       "graphs re-planned for the step")
    assert describe_step(record(compiled_peak_bytes=1000)) == planned
    assert "predicted peak 1000 B in a backward at mul (950 B as its graphs compiled); budget 900 B" in describe_step(
        record(compiled_peak_bytes=950))
