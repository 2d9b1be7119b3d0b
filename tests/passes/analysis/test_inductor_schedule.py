"""The peak memory of a graph as Inductor schedules it, checked against the measured peak of its run."""

from __future__ import annotations

import types

import pytest
import torch

from dpcs_compiler.measure import measure_peak_memory
from dpcs_compiler.passes.analysis.inductor_schedule import (
    ScheduledPeak,
    ScheduledPeakProbe,
    kernel_groups,
    probe_available,
    probe_scheduled_peak,
    recording_buffer_reuses,
    with_reuses,
)

N = 256  # one float32 [N, N] buffer: 256 KiB


def compiled_and_probed(fn, *inputs):
    """Compile `fn` with Inductor (no autograd), run it once; its probe result and its measured peak."""
    compiled = torch.compile(fn, backend="inductor", dynamic=False)
    # A cached graph skips the scheduler the probe hooks into: compile afresh.
    with probe_scheduled_peak() as probe, recording_buffer_reuses() as reuses, torch.no_grad(), \
            torch._inductor.config.patch(force_disable_caches=True):
        compiled(*inputs)  # compiles here, inside the probe
    assert len(probe.peaks) == 1
    with torch.no_grad():
        _, measured = measure_peak_memory(compiled, *inputs)
    return with_reuses(probe.peaks[0], reuses), measured.peak_increase_bytes


def kernel_group_then_matmul(x, w):
    # relu writes over the matmul's dying output in place; cos is computed inside the last kernel.
    a, b = x.sin(), x.cos()
    return (torch.mm(a, w).relu() + b).sum(dim=0)


def sibling_outputs_and_reduction(x, w):
    y = torch.mm(x, w)
    return y.softmax(dim=-1), (y * 2).mean(dim=0)


def reduction_then_independent_kernel(x, w):
    t = torch.mm(x, w)  # an extern kernel's output, last read by the sum
    return t.sum(dim=1), x.cos()  # two C++ kernels of one group: cos's output exists while t does


def freed_buffers_taken_by_later_matmuls(x, w):
    # The wrapper gives b's output the freed buffer of a, and the last matmul's that of b.
    a = torch.mm(x, w)
    b = torch.mm(a, w)
    c = torch.mm(x.sin(), w)
    return torch.mm(b, c).sum(dim=0)


def halves_computed_into_their_concatenation(x, w):
    # Inductor computes each half into a slice of the concatenation (`NonOwningLayout`): one buffer, not three.
    # Counted as three, the peak read 262,144 B (one [N, N] buffer) over the measured one.
    a = torch.mm(x, w)
    both = torch.cat([a.sin(), a.cos()], dim=0)
    return torch.mm(both, w).sum(dim=0)


@pytest.mark.inductor
@pytest.mark.parametrize("fn", [kernel_group_then_matmul, sibling_outputs_and_reduction, reduction_then_independent_kernel,
                                freed_buffers_taken_by_later_matmuls, halves_computed_into_their_concatenation])
def test_scheduled_peak_is_the_measured_peak(fn):
    assert probe_available()
    x, w = torch.randn(N, N), torch.randn(N, N)
    scheduled, measured = compiled_and_probed(fn, x, w)
    assert scheduled.start_bytes == 0  # every input is resident
    assert abs(scheduled.peak_bytes - measured) <= 64, (scheduled, measured)


@pytest.mark.inductor
def test_a_kernel_group_allocates_all_its_outputs_before_it_runs():
    x, w = torch.randn(N, N), torch.randn(N, N)
    scheduled, measured = compiled_and_probed(reduction_then_independent_kernel, x, w)
    buffer = N * N * 4
    # Kernel by kernel, t would be freed before cos's output is made (one buffer at a time); the C++
    # backend runs the sum and the cos as one function, allocating before and freeing after it.
    assert measured == pytest.approx(2 * buffer, abs=4096)
    assert scheduled.peak_bytes == pytest.approx(measured, abs=64)


@pytest.mark.inductor
def test_present_inputs_count_from_the_start_and_are_freed_at_their_last_use():
    def fn(x, w):
        return torch.mm(x.sin(), w)

    x, w = torch.randn(N, N), torch.randn(N, N)
    peaks = {}
    for name, resident in (("resident", None), ("present", frozenset())):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="inductor", dynamic=False)
        with probe_scheduled_peak(resident=resident) as probe, torch.no_grad(), torch._inductor.config.patch(
            force_disable_caches=True
        ):
            compiled(x, w)
        (peaks[name],) = probe.peaks
    buffer = N * N * 4
    # Resident inputs are not counted: sin's output, then the matmul's.
    assert (peaks["resident"].start_bytes, peaks["resident"].peak_bytes) == (0, 2 * buffer)
    # Present inputs start counted; x is freed after sin reads it, so the matmul adds w, sin, its output.
    assert (peaks["present"].start_bytes, peaks["present"].peak_bytes) == (2 * buffer, 3 * buffer)
    assert peaks["present"].increase_bytes == buffer


def node(device: str | None, extern: bool = False):
    return types.SimpleNamespace(
        get_device=lambda: torch.device(device) if device else None,
        is_extern=lambda: extern,
        is_template=lambda: False,
    )


def test_a_reused_buffer_lives_until_the_allocation_that_takes_it():
    """Kernels k0-k3: A (100 B) made at k0, last read at k1; B (50 B) made at k2; C (100 B, an output) at k3.
    The wrapper gives C the freed A: A is alive across k2, where B is made too, and C makes nothing."""
    delta = (100, 0, -100 + 50, -50 + 100, 0)
    buffers = {"A": (0, 2, 100), "B": (2, 3, 50), "C": (3, None, 100)}
    levels = ScheduledPeak(4, 0, 100, 100, "k0", (delta, ["k0", "k1", "k2", "k3"], buffers, 7))
    assert with_reuses(levels, {}) is levels and with_reuses(levels, {8: [("A", "C")]}) is levels  # another graph's
    reused = with_reuses(levels, {7: [("A", "C")]})
    assert (reused.peak_bytes, reused.peak_kernel, reused.end_bytes) == (150, "k2", 100)


def test_kernel_groups_follow_the_cpp_backends_flushes():
    order = [node("cpu"), node("cpu"), node("cpu", extern=True), node("cpu"), node(None), node("cpu")]
    first, last = kernel_groups(order)
    # [0, 1] one C++ function; the matmul alone; [3, 4, 5] one function (a node without a device,
    # a no-op, does not flush).
    assert first == [0, 0, 2, 3, 3, 3]
    assert last == [1, 1, 2, 5, 5, 5]


def test_kernel_groups_on_cuda_are_single_kernels():
    order = [node("cuda"), node("cuda"), node("cuda", extern=True)]
    assert kernel_groups(order) == ([0, 1, 2], [0, 1, 2])


def test_probe_pickles_and_copies_as_an_inert_handle():
    import copy
    import pickle

    probe = ScheduledPeakProbe(resident=frozenset({"a"}), present=frozenset({"b"}), chained=lambda nodes: nodes)
    probe.peaks.append("x")
    assert copy.deepcopy(probe) is probe
    clone = pickle.loads(pickle.dumps(probe))
    assert clone.resident == {"a"} and clone.present == {"b"} and clone.peaks == [] and clone.chained is None


@pytest.mark.inductor
def test_a_failed_reading_is_kept_not_raised(monkeypatch):
    import dpcs_compiler.passes.analysis.inductor_schedule as module

    def broken(*args, **kwargs):
        raise KeyError("an Inductor internal that moved")

    monkeypatch.setattr(module, "scheduled_peak", broken)
    compiled = torch.compile(lambda x: x.sin() * 2, backend="inductor", dynamic=False)
    with probe_scheduled_peak() as probe, torch._inductor.config.patch(force_disable_caches=True):
        torch.testing.assert_close(compiled(torch.ones(4)), torch.ones(4).sin() * 2)
    assert probe.peaks == [] and probe.errors == ["KeyError: 'an Inductor internal that moved'"]


@pytest.mark.slow  # three Inductor compiles (12 s on 2 cores)
@pytest.mark.inductor
def test_a_dynamic_graph_planned_for_other_sizes_is_read_at_those_sizes():
    """A graph traced at 64 rows and compiled for a size bucket of 256 (`tensor_bytes.size_hints`, as a
    dynamic-shape variant is): its schedule's bytes are those of 256 rows, the peak measured there, not the
    traced size's (the order is Inductor's, chosen with the traced sizes)."""
    from torch._inductor.compile_fx import compile_fx

    from dpcs_compiler.passes.analysis.tensor_bytes import size_hints

    w = torch.randn(N, N)

    def at(rows: int | None, x: torch.Tensor):
        def backend(gm, example_inputs):
            # Dynamo passes the shape symbols as inputs of their own: the rows' is the one traced at 64.
            names = [t.node.expr.name for t in example_inputs if isinstance(t, torch.SymInt) and t.node.hint == 64]
            assert len(names) == (0 if rows is None else 1), names
            with size_hints((name, rows) for name in names):
                return compile_fx(gm, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(kernel_group_then_matmul, backend=backend, dynamic=rows is not None)
        with probe_scheduled_peak() as probe, torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
            compiled(x, w)
        (peak,) = probe.peaks
        return peak

    planned = at(4 * 64, torch.randn(64, N))  # traced at 64 rows, planned for 256
    static = at(None, torch.randn(4 * 64, N))
    assert planned.peak_bytes == static.peak_bytes and planned.end_bytes == static.end_bytes, (planned, static)
    assert at(64, torch.randn(64, N)).peak_bytes < planned.peak_bytes  # the traced size's is smaller


@pytest.mark.inductor
def test_inputs_that_are_views_of_one_storage_count_once_and_live_until_the_last_read():
    """A backward's saved `view` and `permute` of one buffer are two inputs and one storage: counted per input,
    the start held it twice and the first view's last read freed bytes that stay alive (T5's backward: 78 KB of
    the step under the measured peak)."""

    def fn(a, b, w):
        y = torch.mm(a.sin(), w)  # a's last read
        return torch.mm(b.cos(), y)  # b's last read

    s, w = torch.randn(N, N), torch.randn(N, N)
    buffer = N * N * 4
    peaks = {}
    for name, storages in (("per input", None), ("per storage", {"arg0_1": ("s", buffer), "arg1_1": ("s", buffer)})):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="inductor", dynamic=False)
        with probe_scheduled_peak(resident=frozenset({"arg2_1"}), storages=storages) as probe, torch.no_grad(), \
                torch._inductor.config.patch(force_disable_caches=True):
            compiled(s, s.t(), w)
        (peaks[name],) = probe.peaks
    # Per storage: s (start); sin's output, y, then cos's output beside s and y; s freed after cos; the last
    # matmul's output beside y and cos's: three buffers, two above the start.
    assert (peaks["per storage"].start_bytes, peaks["per storage"].peak_bytes) == (buffer, 3 * buffer)
    # Per input the start counts s twice, and a's last read frees a buffer: one above the start.
    assert (peaks["per input"].start_bytes, peaks["per input"].increase_bytes) == (2 * buffer, buffer)


@pytest.mark.inductor
def test_an_input_read_under_a_mask_counts_its_own_bytes():
    """A kernel that pads an input (a slice's gradient) reads it under a mask over the whole padded range: sized
    by that read, the input counted the padded bytes (Phi-3's backward: four 16 KiB tangents of its fused
    projection's split counted 64 KiB each, 15.6% of the step over the measured peak)."""

    def fn(a, w):
        return torch.mm(torch.nn.functional.pad(a, (0, 3 * N // 4)), w)

    a, w = torch.randn(N, N // 4), torch.randn(N, N)
    compiled = torch.compile(fn, backend="inductor", dynamic=False)
    with probe_scheduled_peak(resident=frozenset({"arg1_1"})) as probe, torch.no_grad(), \
            torch._inductor.config.patch(force_disable_caches=True):
        compiled(a, w)
    (peak,) = probe.peaks
    buffer = N * N * 4
    assert peak.start_bytes == buffer // 4  # a's own bytes, not the padded range's
    # The padded input beside a, then the product beside the padded input (a freed).
    assert peak.peak_bytes == 2 * buffer


@pytest.mark.inductor
def test_an_input_that_is_a_view_into_a_larger_storage_counts_the_storage_and_a_whole_one_its_own_bytes():
    """A saved view into a larger buffer (ViT's class token, a `select` of the last norm's output) keeps all of
    its storage alive until its last read; sized by its layout's extent, the start read 4,096 B under the saved
    values and the step's peak after that read 4,096 B over the measured one. An input laid out whole (no offset,
    nothing skipped) is its own bytes, whatever storage the model gives it: it may be the forward's compact copy."""

    def fn(a, w):
        return torch.mm(a.sin(), w)

    s, w = torch.randn(N, N), torch.randn(N // 2, N)
    buffer = N * N * 4
    starts = {}
    for name, a in (("view", s[:, : N // 2]), ("whole", torch.randn(N, N // 2))):  # both given s's storage
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="inductor", dynamic=False)
        with probe_scheduled_peak(resident=frozenset({"arg1_1"}), storages={"arg0_1": ("s", buffer)}) as probe, \
                torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
            compiled(a, w)
        (peak,) = probe.peaks
        starts[name] = peak.start_bytes
    assert starts == {"view": buffer, "whole": buffer // 2}
