"""The partition stage's reading of a partitioned step for Inductor's schedule (`stages/partition.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes" / "analysis"))
from training_graphs import trace_training  # noqa: E402

from dpcs_compiler.passes.analysis.liveness import liveness  # noqa: E402
from dpcs_compiler.passes.analysis.schedule import Schedule  # noqa: E402
from dpcs_compiler.stages.partition import backward_input_storages, resident_backward_inputs  # noqa: E402


def test_outputs_of_one_multi_output_op_are_storages_apart():
    """A layer norm's output (saved as a view), mean and reciprocal deviation are three storages of one op: each
    alone in its storage, none is grouped. Keyed by the op alone, they were one storage of the last one's
    bytes (Gemma 3's attention output and its log-sum-exp: 2 KiB for 34 KiB, its backward's start read 1.1% of
    the step low)."""

    def fn(x, w):
        return torch.nn.functional.layer_norm(x, (64,), w).view(8, 2, 32).sin().sum()

    graphs = trace_training(fn, torch.randn(8, 64, requires_grad=True), torch.randn(64, requires_grad=True))
    step = Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1, parameter_indices=(1,))
    live = liveness(step)
    received = {p.name: [(b.producer.name, b.index) for b in live.references[src]] for p, src in step.receives.items()}
    norm = "native_layer_norm"
    assert (received["getitem_1"], received["getitem_2"], received["view"]) == ([(norm, 1)], [(norm, 2)], [(norm, 0)])
    storages = backward_input_storages(step, live, resident_backward_inputs(step, live))
    assert storages["getitem_1"][0] != storages["getitem_2"][0] != storages["view"][0] != storages["getitem_1"][0]


def test_views_of_one_output_are_one_storage_of_its_bytes():
    """A saved output and a view of it (its transpose): one storage, the output's bytes, for both names."""

    def fn(x, w):
        y = torch.nn.functional.layer_norm(x, (64,), w)
        return (y.sin() * y.t().cos().t()).sum()

    graphs = trace_training(fn, torch.randn(8, 64, requires_grad=True), torch.randn(64, requires_grad=True))
    step = Schedule.of_partition(graphs.forward, graphs.backward, num_user_outputs=1, parameter_indices=(1,))
    live = liveness(step)
    storages = backward_input_storages(step, live, resident_backward_inputs(step, live))
    shared = [name for name, storage in storages.items() if storage == ("native_layer_norm[0]", 8 * 64 * 4)]
    assert len(shared) >= 2
    assert all(storages[name][0] != "native_layer_norm[0]" for name in storages.keys() - shared)
