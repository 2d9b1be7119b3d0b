"""Memory kernels allocate inside themselves while they run: measured per op signature on the CPU that compiles.

No FX graph shows it, yet it is part of a step's peak. On CPU it is large in conv nets: oneDNN reorders a
contiguous (NCHW) convolution's output, grad_output and input into its blocked layouts, so a convolution
allocates about its output's bytes again while it runs and its backward about its input's and grad_output's;
batch norm's backward copies its input; pooling and upsampling backwards copy their grads; a softmax or norm
given a non-contiguous input makes it contiguous first. Measured on a two-conv net (8 x 3 x 32 x 32, CPU,
torch 2.13): left out, the predicted peak was 30% under the measured one.

What a kernel allocates depends on the library version, the CPU's ISA (oneDNN's blocked layout), the
thread count and the layout the compiler gives its inputs, so it is measured, never guessed:

- `op_signature` names what decides it for one FX node: the op, its arguments' shapes, strides, dtypes and
  constant arguments, and the device. Nodes that allocate nothing beyond their outputs are not measured:
  views, pointwise ops (TensorIterator takes any strides), random ops (a probe would draw from the user's
  generator), ops that make tensors from nothing, and matrix products, whose only extra is a contiguous copy
  of an operand BLAS cannot read in place (`matmul_copies`, a rule, not a measurement). Under Inductor only
  the ops it runs as ATen kernels (extern kernels and fallbacks) are measured, and a convolution's tensors
  in the channels-last layout Inductor gives them on CPU (`torch._inductor.graph.GraphLowering.decide_layout_opt`).
- `measure_workspaces` runs each signature once on tensors of those shapes and strides (floating ones
  ones, integer ones zero, so indices are valid; nothing is drawn from the user's generator) under the
  legacy autograd profiler, which reports every CPU allocation of its thread in order and starts in
  milliseconds (kineto's first start takes over a second): the workspace is the most bytes alive during
  the call less the outputs' bytes. Results are kept per process and thread count (`_MEASURED`). On HF
  GPT-2 (12 layers, batch 2 x 128) its 22 signatures took 0.3 s, most of it the 50257 x 768 embedding's
  gradient.
- `WorkspaceTable` gives a schedule's nodes their bytes (`Schedule.workspace`); with rank agreement every
  rank takes, per signature of a training graph, the most any rank measured, so the ranks plan alike.

CUDA graphs are not measured yet (no GPU was at hand to validate it): their nodes count no workspace, and
the budget's `WORKSPACE_FRACTION` stays their only allowance. Probes run in a thread of their own, so a
profiler in the compiling thread (dpcs's step meter, the user's) does not see them; one that follows every
thread leaves them unmeasured, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._prims_common import _is_non_overlapping_and_dense_or_false as dense

from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.passes.analysis.tensor_bytes import hint_int

log = logging.getLogger("dpcs.passes")

aten = torch.ops.aten

# Matrix products: BLAS reads an operand in place when one of its last two dims is unit-strided.
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
# Ops Inductor lowers to an ATen call of its own (an extern kernel) rather than code it generates.
INDUCTOR_EXTERN = frozenset({aten.convolution.default, aten.convolution_backward.default}) | MATMULS
# Ops whose 4-D and 5-D tensors Inductor gives the channels-last layout on CPU when it optimizes layouts.
CHANNELS_LAST_OPS = frozenset({aten.convolution.default, aten.convolution_backward.default})


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What decides a tensor argument's part in a kernel's workspace."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def storage_elements(self) -> int:
        if any(s == 0 for s in self.shape):
            return 0
        return self.offset + 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """One kernel call as far as its workspace goes: the op, its arguments (tensors as `TensorSpec`, lists
    as tuples, constants as they are) and the device type."""

    op: str  # "namespace::name.overload"
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]
    device: str

    def overload(self) -> torch._ops.OpOverload:
        namespace, rest = self.op.split("::")
        name, overload = rest.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)

    def describe(self) -> str:
        shapes = [f"{tuple(a.shape)}" for a in pytree.tree_leaves(self.args) if isinstance(a, TensorSpec)]
        return f"{self.op}({', '.join(shapes)})"


class _NotProbed(Exception):
    """An argument the probe cannot rebuild (the node is not measured)."""


def _spec(value: Any, channels_last: bool) -> Any:
    if isinstance(value, torch.Tensor):
        shape = tuple(_hint(s) for s in value.shape)
        stride = tuple(_hint(s) for s in value.stride())
        # Inductor gives a dense tensor the channels-last layout; a view that is not dense (ViT's grad_output: the
        # patch tokens, a slice past the class token) reaches the kernel as that view of its buffer, and oneDNN
        # copies it first (8 KiB that a channels-last probe left out: the step measured 0.45% over the prediction).
        if channels_last and value.dim() in (4, 5) and all(s > 0 for s in shape) and dense(shape, stride):
            fmt = torch.channels_last if value.dim() == 4 else torch.channels_last_3d
            stride = tuple(torch.empty(shape, device="meta").to(memory_format=fmt).stride())
        return TensorSpec(shape, stride, value.dtype, _hint(value.storage_offset()))
    if isinstance(value, (list, tuple)):
        return tuple(_spec(v, channels_last) for v in value)
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return _hint(value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return value
    raise _NotProbed(type(value).__name__)


def _hint(value: Any) -> Any:
    """A size as planned for: its traced value, or the size bucket's (`tensor_bytes.size_hints`)."""
    if isinstance(value, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        if free_unbacked_symbols(value):
            raise _NotProbed("a data-dependent size")
        return hint_int(value.node.expr, value.node.shape_env)
    if isinstance(value, torch.SymFloat | torch.SymBool):
        raise _NotProbed("a symbolic scalar")
    return value


def _value(arg: Any) -> Any:
    """The traced value an FX argument stands for."""
    if isinstance(arg, fx.Node):
        if "val" not in arg.meta:
            raise _NotProbed(f"{arg.name} has no traced value")
        return arg.meta["val"]
    if isinstance(arg, (list, tuple)):
        return [_value(a) for a in arg]
    return arg


def allocates_only_outputs(op: torch._ops.OpOverload) -> bool:
    """Ops that allocate nothing beyond their outputs, or that a probe must not run (random ones)."""
    schema = op._schema
    tags = set(op.tags)
    name = schema.name.split("::")[-1]
    return bool(
        name.endswith("_like") or name.startswith(("new_", "empty"))  # made from another's sizes only
        or torch.Tag.pointwise in tags
        or torch.Tag.nondeterministic_seeded in tags
        or schema.is_mutable
        or any(r.alias_info is not None for r in schema.returns)
        or not any(isinstance(a.type, (torch.TensorType, torch.ListType, torch.OptionalType)) and "Tensor" in str(a.type)
                   for a in schema.arguments)
    )


def matmul_copies(node: fx.Node) -> int:
    """Bytes a CPU/CUDA matrix product copies: operands BLAS cannot read in place (neither of their last two
    dims unit-strided with the other at least its size), made contiguous first."""
    total = 0
    for arg in node.args:
        if not isinstance(arg, fx.Node) or not isinstance(value := arg.meta.get("val"), torch.Tensor) or value.dim() < 2:
            continue
        rows, cols = (_hint(s) for s in value.shape[-2:])
        row_stride, col_stride = (_hint(s) for s in value.stride()[-2:])
        if (col_stride == 1 and row_stride >= max(cols, 1)) or (row_stride == 1 and col_stride >= max(rows, 1)):
            continue
        if rows <= 1 or cols <= 1:
            continue
        total += math.prod(_hint(s) for s in value.shape) * value.element_size()
    return total


def runs_as_kernel_under_inductor(op: torch._ops.OpOverload) -> bool:
    """Whether Inductor calls this op's ATen kernel (an extern kernel or a fallback) instead of generating code."""
    from torch._inductor import lowering

    return op in INDUCTOR_EXTERN or op in lowering.fallbacks or op not in lowering.lowerings


def op_signature(node: fx.Node, *, inductor: bool = False, channels_last: bool = False) -> OpSignature | None:
    """What decides `node`'s workspace, or None where nothing is measured (see the module's docstring).
    `inductor`: the node runs under Inductor; `channels_last`: Inductor optimizes this graph's layouts."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op in MATMULS:
        return None
    if allocates_only_outputs(op) or (inductor and not runs_as_kernel_under_inductor(op)):
        return None
    try:
        values = [_value(a) for a in node.args], {k: _value(v) for k, v in node.kwargs.items()}
        tensors = [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]
        out = [t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
        if not tensors or not out or any(t.device.type != "cpu" for t in tensors):
            return None  # only CPU kernels are measured (see the module's docstring)
        for t in out:
            _spec(t, False)  # an output of data-dependent size is not measured
        layout = channels_last and op in CHANNELS_LAST_OPS
        args = _spec(values[0], layout)
        kwargs = tuple(sorted((k, _spec(v, layout)) for k, v in values[1].items()))
    except _NotProbed:
        return None
    return OpSignature(f"{op._schema.name}.{op._overloadname}", args, kwargs, "cpu")


def unmeasured_workspace(signature: OpSignature) -> int:
    """What a kernel the probe cannot run is counted to allocate inside itself: a copy of each tensor argument
    (the most the measured kernels allocate: oneDNN reorders a convolution's input and output into its
    layout, a norm's or a softmax's backward copies its input), so the budget keeps room for it instead of
    none."""
    return sum(a.storage_elements * a.dtype.itemsize for a in pytree.tree_leaves((signature.args, signature.kwargs))
               if isinstance(a, TensorSpec))


# Measured workspaces in this process, by (intra-op threads, signature): a kernel's scratch can be per thread.
_MEASURED: dict[tuple[int, OpSignature], int] = {}
_warned_busy = False


def _make(spec: Any) -> Any:
    if isinstance(spec, TensorSpec):
        # Ones (floating) and zeros (integers, so indices are valid): what a kernel allocates does not depend
        # on its values, and filling random numbers into a vocabulary-sized input took longer than its kernel.
        storage = torch.empty(spec.storage_elements, dtype=spec.dtype)
        storage.fill_(1 if spec.dtype.is_floating_point or spec.dtype.is_complex else 0)
        return storage.as_strided(spec.shape, spec.stride, spec.offset)
    if isinstance(spec, tuple):
        return [_make(s) for s in spec]
    return spec


def _peak_above_start(records: Iterable[Any]) -> int:
    """The most bytes allocated above the level at the start, over the legacy profiler's records (per
    thread, each in order; threads merged by time)."""
    threads = [thread for thread in records if thread]
    if not threads:
        return 0
    base = threads[0][0]  # `a.cpu_elapsed_us(b)` is b's time less a's
    events = []
    for t, thread in enumerate(threads):
        events.extend((base.cpu_elapsed_us(r), t, i, r.cpu_memory_usage()) for i, r in enumerate(thread)
                      if r.kind() == "memory_alloc")
    level = peak = 0
    for *_, nbytes in sorted(events):
        level += nbytes
        peak = max(peak, level)
    return peak


def _measure_one(signature: OpSignature) -> int:
    from torch.autograd.profiler_legacy import _disable_profiler_legacy, _enable_profiler_legacy, profile

    op = signature.overload()
    args = _make(signature.args)
    kwargs = {k: _make(v) for k, v in signature.kwargs}
    inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    _enable_profiler_legacy(profile(profile_memory=True).config())
    try:
        out = op(*args, **kwargs)
    finally:
        records = _disable_profiler_legacy()
    made = {}
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
            made[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return max(0, _peak_above_start(records) - sum(made.values()))


def measure_workspaces(signatures: Iterable[OpSignature]) -> dict[OpSignature, int]:
    """Each signature's workspace in bytes, measured on this CPU now (see the module's docstring); a
    signature whose probe fails (an op that checks its inputs' values) counts 0 and is logged.

    The probes run in a thread of their own: profiler state, dispatch modes (Dynamo's fake mode) and grad
    mode are per thread, so they run on real tensors, and a profiler running in the caller's thread (dpcs's
    step meter, the user's) neither blocks them nor sees their allocations."""
    signatures = list(dict.fromkeys(signatures))
    if not signatures:
        return {}
    found: dict[OpSignature, int] = {}
    failure: list[BaseException] = []

    def probe() -> None:
        try:
            found.update(_measure_in_this_thread(signatures))
        except BaseException as error:  # noqa: BLE001 - raised in the caller's thread below
            failure.append(error)

    worker = threading.Thread(target=probe, name="dpcs-workspace-probe")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return found


def _measure_in_this_thread(signatures: list[OpSignature]) -> dict[OpSignature, int]:
    global _warned_busy
    from torch.utils._python_dispatch import _disable_current_modes

    if torch._C._autograd._profiler_enabled():  # a profiler that follows every thread
        if not _warned_busy:
            warnings.warn("dpcs: a profiler is running, so kernels' own workspace is not measured: the plan's "
                          "predicted peak leaves it out (conv nets on CPU peak higher than predicted)",
                          category=DpcsWarning, stacklevel=3)
            _warned_busy = True
        return {s: 0 for s in signatures}
    found = {}
    with _disable_current_modes(), torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
        for signature in signatures:
            try:
                found[signature] = _measure_one(signature)
            except Exception as error:  # noqa: BLE001 - an op the probe cannot run: a bound, said in the log
                found[signature] = unmeasured_workspace(signature)
                log.warning("dpcs: workspace of %s not measured (%s: %s): counted as its inputs' bytes, %d B",
                            signature.describe(), type(error).__name__, error, found[signature])
    return found


@dataclasses.dataclass
class WorkspaceTable:
    """Workspace bytes for the nodes of one graph's schedules, measured as the compiler will run them.

    inductor: the graphs run under Inductor; channels_last: Inductor optimizes their layouts (on CPU, any
    graph with a convolution). `agree_on` makes the ranks agree on a training graph's signatures (the joint
    graph's, once): every rank takes the most any rank measured. A later signature (one only Inductor's
    graphs show) is this rank's own measurement.
    """

    inductor: bool = False
    channels_last: bool = False
    agreed: dict[OpSignature, int] = dataclasses.field(default_factory=dict)

    def signature(self, node: fx.Node) -> OpSignature | None:
        return op_signature(node, inductor=self.inductor, channels_last=self.channels_last)

    def agree_on(self, nodes: Iterable[fx.Node]) -> None:
        """One collective over every rank, whatever each has measured before (a rank that compiled a graph
        the others did not, an evaluation on rank 0, has more cached and must still take part)."""
        from dpcs_compiler.distributed import rank_agreement

        signatures = [s for s in dict.fromkeys(self.signature(n) for n in nodes) if s is not None]
        mine = self._measured(signatures)
        everyone = rank_agreement.every_rank(mine)
        self.agreed.update({s: max(r.get(s, 0) for r in everyone) for s in mine})

    def bytes_of(self, nodes: Iterable[fx.Node]) -> dict[fx.Node, int]:
        """Workspace bytes of the nodes that have any (measuring signatures not seen before)."""
        nodes = list(nodes)
        signatures = {n: self.signature(n) for n in nodes}
        measured = self._measured([s for s in dict.fromkeys(signatures.values()) if s is not None and s not in self.agreed])
        found = {}
        for node in nodes:
            signature = signatures[node]
            nbytes = 0 if signature is None else self.agreed.get(signature, measured.get(signature, 0))
            if node.op == "call_function" and node.target in MATMULS:
                nbytes = matmul_copies(node)
            if nbytes > 0:
                found[node] = nbytes
        return found

    @staticmethod
    def _measured(signatures: list[OpSignature]) -> dict[OpSignature, int]:
        threads = torch.get_num_threads()  # the probe thread runs with the process's setting too
        missing = [s for s in signatures if (threads, s) not in _MEASURED]
        if missing:
            _MEASURED.update({(threads, s): n for s, n in measure_workspaces(missing).items()})
        return {s: _MEASURED[threads, s] for s in signatures}


def layout_optimized(gm: fx.GraphModule) -> bool:
    """Whether Inductor gives this graph's convolutions channels-last tensors (its own decision, on CPU)."""
    from torch._inductor.graph import GraphLowering

    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except Exception:  # noqa: BLE001 - a graph Inductor's heuristic cannot read: as Inductor, no layout change
        return False

