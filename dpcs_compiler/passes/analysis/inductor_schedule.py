"""The peak memory of a graph as Inductor will run it: its fused kernels, in its final order.

dpcs plans on FX graphs in FX order, with a structural model of Inductor's pointwise fusion
(`fusion.inductor_fusion`). Inductor goes further: it fuses kernels that share inputs even when they sit
apart in the order (a recomputation in backward with a later pointwise backward op reading the same saved
value), and a fused kernel allocates all its outputs when it runs. A buffer can so be made long before the
FX order makes it, and be alive across a peak the plan was made for (measured: +17% on a Llama-style
model on CPU). This module reads the schedule Inductor generates code for, through the scheduler hook that
runs right after fusion, and simulates its live bytes the way the generated code allocates and frees:

- the order Inductor's peak-memory reordering will pick (`memory.reorder_for_peak_memory`, called on the
  same nodes: deterministic);
- Inductor's buffer sizes and last uses (`memory.compute_memory_timeline`);
- the C++ backend's kernel groups: consecutive C++ kernels are one function, all of whose outputs are
  allocated before it runs and whose dead buffers are freed after (`kernel_groups`);
- buffers made and last read inside one fused kernel, which are never allocated (`kernel_local_buffers`);
- in-place reuse of dying buffers (`in_place_reuses`, Inductor's own rules);
- the wrapper's reuse of a freed buffer for a later allocation of the same size: the freed one is not
  deleted but kept until that allocation takes it (`buf13 = buf3; del buf3  # reuse`), so it stays alive
  across the kernels in between. Inductor decides these while it generates code (`AllocateLine.plan`, with
  its own peak estimate), after the schedule is read: they are recorded then (`recording_buffer_reuses`)
  and applied to the reading (`with_reuses`). Left out, MiniGPT at 64 tokens measured one 256 KiB buffer
  (2%) above the prediction: a freed gradient kept across the MLP's backward for the next matmul's output;
- graph inputs: resident ones (parameters and user inputs) are never freed, others (a backward's saved
  values and tangents) are freed after their last read;
- the workspace an extern kernel or fallback (an ATen kernel: a convolution, its backward) allocates inside
  itself while it runs, given by the caller for the FX nodes it comes from (`op_workspace.WorkspaceTable`).

Inductor's own estimate has none of the last five; with them the simulated peak equals the measured one on
the test graphs and the benchmark models (`tests/passes/analysis/test_inductor_schedule.py`). The figure
used is the increase above the graph's start, `peak_bytes - start_bytes`, the start counting the inputs
alive before the graph is called (the saved activations of a backward).

The hook is a private Inductor interface (`config._post_fusion_custom_pass`, "prototype stage" in torch's
words); a torch without it makes `probe_available()` False and callers say so.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch._prims_common import _is_non_overlapping_and_dense_or_false as dense


@dataclasses.dataclass(frozen=True)
class ScheduledPeak:
    """Live bytes of one Inductor graph over its kernels, in the order it runs them."""

    kernels: int
    start_bytes: int  # non-resident inputs alive when the graph starts
    peak_bytes: int  # the most bytes alive while a kernel runs (its outputs made, its last-read inputs not yet freed)
    end_bytes: int  # alive after the last kernel: the graph's outputs (and inputs never read)
    peak_kernel: str | None  # the scheduler node at the peak (Inductor's buffer names)
    # What `with_reuses` needs: the live-bytes deltas per kernel, each buffer's (alloc index, free index, bytes)
    # into them (free index None: alive to the end), the kernels' names, and the graph read (its `id`).
    timeline: tuple | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def increase_bytes(self) -> int:
        """The peak above the graph's start."""
        return self.peak_bytes - self.start_bytes

    @property
    def leaves_bytes(self) -> int:
        """What the graph leaves alive above its start (a forward's saved values and outputs)."""
        return self.end_bytes - self.start_bytes


def probe_available() -> bool:
    """True if this torch's Inductor has the post-fusion scheduler hook the probe needs."""
    return hasattr(torch._inductor.config, "_post_fusion_custom_pass")


def scheduled_peak(
    nodes: Sequence, *, resident: frozenset[str] | None, present: frozenset[str] | None,
    workspace: Callable[[Sequence[torch.fx.Node]], int] | None = None,
    storages: Mapping[str, tuple[str, int]] | None = None,
) -> ScheduledPeak:
    """Simulate Inductor's fused scheduler nodes (called inside its scheduler, after fusion).

    resident: graph input names never freed (not counted: they are alive before and after the graph), or
    None for every input; present: non-resident input names alive before the graph starts (the start
    level), or None for all of them. Other inputs (a backward's tangents, made for the call) are counted
    from the start too, but above the start level. workspace: the bytes an extern kernel allocates inside
    itself, from the FX nodes it comes from (None: none). storages: input name -> (the storage's key, its bytes):
    inputs of one storage (a backward's saved `view` and its `permute`) are one buffer, counted once and freed
    after the last read of any of them, and an input laid out as a view into its storage counts the storage's
    bytes (`_input_buffers`).
    """
    from torch._inductor import memory
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet

    nodes = list(nodes)
    if not nodes:
        return ScheduledPeak(0, 0, 0, 0, None)
    scheduler = nodes[0].scheduler
    graph_inputs = OrderedSet(V.graph.graph_inputs.keys())
    graph_outputs = OrderedSet(V.graph.get_output_names())
    if torch._inductor.config.reorder_for_peak_memory:
        # The order Inductor will pick: its reordering is a deterministic function of the fused nodes (and
        # sets their planning info, buffer sizes and users, which depends on the nodes, not their order).
        order = memory.reorder_for_peak_memory(
            list(nodes), scheduler.name_to_buf, scheduler.name_to_fused_node, graph_inputs, graph_outputs
        )
    else:
        order = nodes
        memory.prepare_planning_info(order, scheduler.name_to_buf, scheduler.name_to_fused_node, graph_inputs, graph_outputs)
    # Inductor chose the order with the traced sizes; the bytes are those of the sizes the plan is for (a
    # dynamic-shape graph's size bucket: on MiniGPT planned at 128 tokens, traced at 64, the schedule read at 64
    # came out 9.4 MB under the model, and what it held beyond the model at 128 went uncounted).
    with sizes_as_planned() as patched:
        if patched:
            memory.prepare_planning_info(order, scheduler.name_to_buf, scheduler.name_to_fused_node, graph_inputs,
                                         graph_outputs)
        freeable, members = _input_buffers(order, graph_inputs, resident, storages or {})
        infos, step_of, _ = memory.compute_memory_timeline(order, freeable, graph_outputs)
        first, last = kernel_groups(order)
        removed = kernel_local_buffers(order, graph_outputs)
        infos = storages_of_aliases([info for info in infos if info.buffer.get_name() not in removed])
        delta = [0] * (len(order) + 1)
        for info in infos:
            delta[first[info.start_step]] += info.size_alloc
            if info.end_step != -1:
                delta[last[info.end_step] + 1] -= info.size_free
        by_name = {info.buffer.get_name(): info for info in infos}
        for output, taken in in_place_reuses(order, step_of, graph_inputs, graph_outputs).items():
            if output in by_name and taken in by_name:
                # The output is written over the dying input: nothing is allocated, the input's bytes live on.
                out, old = by_name[output], by_name[taken]
                delta[first[out.start_step]] -= out.size_alloc
                delta[last[old.end_step] + 1] += old.size_free
                if out.end_step != -1:
                    delta[last[out.end_step] + 1] += out.size_free - old.size_free
        if workspace is not None:
            for i, node in enumerate(order):
                if node.is_extern() and (nbytes := workspace(extern_origins(node))):
                    delta[first[i]] += nbytes
                    delta[last[i] + 1] -= nbytes
        start = sum(buf.mpi_buffer.size_free for name, buf in freeable.items()
                    if present is None or not present.isdisjoint(members[name]))
        buffers = {name: (first[info.start_step], None if info.end_step == -1 else last[info.end_step] + 1,
                          info.size_alloc) for name, info in by_name.items()}
        peak = _peak_of(delta, start, [node.get_name() for node in order], buffers, id(V.graph))
    if patched:  # Inductor's own planning info back at its sizes
        memory.prepare_planning_info(order, scheduler.name_to_buf, scheduler.name_to_fused_node, graph_inputs,
                                     graph_outputs)
    return peak


def _peak_of(delta: list[int], start: int, names: list[str], buffers: dict, graph: int) -> ScheduledPeak:
    levels = list(itertools.accumulate(delta))
    at = max(range(len(names)), key=levels.__getitem__)
    return ScheduledPeak(len(names), start, levels[at], levels[-1], names[at], (tuple(delta), names, buffers, graph))


def with_reuses(peak: ScheduledPeak, reuses: dict[int, list[tuple[str, str]]]) -> ScheduledPeak:
    """`peak` with the wrapper's reuses of its graph (`recording_buffer_reuses`: graph id -> (freed buffer, the
    allocation that took it)) applied: the freed buffer lives on until the allocation, which makes nothing."""
    if peak.timeline is None:
        return peak
    delta, names, buffers, graph = peak.timeline
    pairs = [(old, new) for old, new in reuses.get(graph, ()) if old in buffers and new in buffers]
    if not pairs:
        return peak
    delta = list(delta)
    for old, new in pairs:
        _, freed_at, size = buffers[old]
        allocated_at, _, new_size = buffers[new]
        if freed_at is not None:
            delta[freed_at] += size
        delta[allocated_at] -= new_size
    return _peak_of(delta, peak.start_bytes, names, buffers, graph)


@contextlib.contextmanager
def recording_buffer_reuses() -> Iterator[dict[int, list[tuple[str, str]]]]:
    """Within the block, each reuse Inductor's wrapper decides (a freed buffer taken by a later allocation of the
    same size, `AllocateLine.plan`), by graph: {id(graph): [(freed buffer, allocation), ...]}."""
    from torch._inductor.codegen import wrapper
    from torch._inductor.virtualized import V

    reuses: dict[int, list[tuple[str, str]]] = {}
    plan = wrapper.AllocateLine.plan

    def recorded(self, state):
        line = plan(self, state)
        if isinstance(line, wrapper.ReuseLine) and not line.comm_buffer:
            reuses.setdefault(id(V.graph), []).append((line.node.get_name(), line.reused_as.get_name()))
        return line

    wrapper.AllocateLine.plan = recorded
    try:
        yield reuses
    finally:
        wrapper.AllocateLine.plan = plan


@contextlib.contextmanager
def sizes_as_planned() -> Iterator[bool]:
    """Inside Inductor's compile of a graph with dynamic shapes planned for other sizes than the traced ones
    (`tensor_bytes.size_hints`): its shape environment's hints at those sizes, and its size-hint cache
    emptied, for the block (restored after). Yields whether anything was changed."""
    import sympy
    from torch._inductor.virtualized import V

    from dpcs_compiler.passes.analysis.tensor_bytes import planned_sizes_override

    overrides = planned_sizes_override()
    env = getattr(V.graph.sizevars, "shape_env", None) if overrides else None
    # torch 2.13 names the hints backed_var_to_val (var_to_val warns); 2.11 has only var_to_val.
    values = (env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val) if env is not None else {}
    kept = {symbol: value for symbol, value in values.items() if getattr(symbol, "name", None) in overrides}
    if not kept:
        yield False
        return
    cache = getattr(V.graph, "dep_size_hint_cache", None)
    try:
        for symbol in kept:
            values[symbol] = sympy.Integer(overrides[symbol.name])
        if cache is not None:
            V.graph.dep_size_hint_cache = {}
        yield True
    finally:
        values.update(kept)
        if cache is not None:
            V.graph.dep_size_hint_cache = cache


def extern_origins(node) -> list[torch.fx.Node]:
    """The FX nodes an extern scheduler node's kernel comes from (Inductor's `origins`), in graph order."""
    origins = getattr(getattr(node, "node", None), "origins", None) or ()
    return sorted((n for n in origins if isinstance(n, torch.fx.Node)), key=lambda n: n.name)


def _input_buffers(order: Sequence, graph_inputs, resident: frozenset[str] | None,
                   storages: Mapping[str, tuple[str, int]]) -> tuple[dict, dict[str, frozenset[str]]]:
    """The graph's inputs that are not resident, as buffers freed after their last read, and the input names
    each stands for.

    Inductor's own list (`memory.get_freeable_input_buf`) leaves out inputs named like primals, tangents or
    `arg*`, whatever they hold; here residency is what the caller says: a backward's tangents are made
    for the call and freed after their last read, like its saved values. Inputs that are views of one storage
    (`storages`) are one buffer of the storage's bytes, alive until the last read of any of them: freeing one
    view frees nothing while another is alive. Counted per input, T5's backward under Inductor started 0.49 MB
    above what its saved values held and freed views early, so its peak above its start came out 78 KB (2.6%
    of the step) under the measured one. An input alone in its storage counts the storage's bytes where it is
    laid out as a view (`_a_view`), else its own layout's (`_input_bytes`).
    """
    from torch._inductor.dependencies import WeakDep
    from torch._inductor.memory import FreeableInputBuffer, MemoryPlanningInfoForBuffer
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet

    if resident is None:
        return {}, {}
    readers: dict[str, OrderedSet] = {}
    ordering: dict[str, OrderedSet] = {}
    sizes: dict[str, int] = {}
    members: dict[str, set[str]] = {}
    group: dict[str, str] = {}  # a storage's key -> the first of its inputs read (the buffer's name)
    shared = collections.Counter(key for key, _ in storages.values())
    for node in order:
        for dep in node.read_writes.reads:
            if dep.name in graph_inputs and dep.name not in resident:
                storage = storages.get(dep.name)
                buffer = V.graph.graph_inputs.get(dep.name)
                if storage is not None and shared[storage[0]] == 1 and not _a_view(buffer):
                    storage = None  # alone in its storage, and all of it: its own layout's bytes
                name = group.setdefault(storage[0], dep.name) if storage is not None else dep.name
                members.setdefault(name, set()).add(dep.name)
                ordering.setdefault(name, OrderedSet()).add(node)
                readers.setdefault(name, OrderedSet())
                sizes[name] = storage[1] if storage is not None else _input_bytes(buffer, dep)
                if not (isinstance(dep, WeakDep) and dep.is_fake):
                    readers[name].add(node)
    freeable = {
        name: FreeableInputBuffer(
            name,
            MemoryPlanningInfoForBuffer(size_free=sizes[name], succ_nodes=readers[name], succ_nodes_for_ordering=ordering[name]),
        )
        for name in ordering
        if readers[name]  # read only through ordering-only deps: never alive as far as memory goes
    }
    return freeable, {name: frozenset(members[name]) for name in freeable}


def size_hint(expr) -> int:
    """An Inductor size expression's value in the graph compiled now (0 without a hint)."""
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    hint = getattr(sizevars, "optimization_hint", None)  # torch >= 2.12; size_hint before
    return int(hint(expr, fallback=0) if hint is not None else sizevars.size_hint(expr, fallback=0))


def _input_bytes(buffer, dep) -> int:
    """The bytes a graph input spans (its layout's extent, offset included), not those one read of it covers:
    a kernel that reads an input under a mask (the gradient of a fused projection, made from the tangents of
    its split outputs) has a dependency over the whole loop. Sized by its reads, Phi-3's backward counted each
    of four 16 KiB tangents as 64 KiB, 197 KB (15.6% of the step) over the measured peak. A dependency's bytes
    where the input has no fixed layout (a symbolic size without a hint)."""
    from torch._inductor.utils import get_dtype_size
    from torch._inductor.virtualized import V

    try:
        layout = buffer.get_layout()
        return size_hint(layout.storage_size()) * get_dtype_size(layout.dtype)
    except (AttributeError, NotImplementedError, TypeError):
        return V.graph.get_dep_size_hint(dep)


def _a_view(buffer) -> bool:
    """Whether a graph input is laid out as a view into a larger storage (an offset, or strides that skip
    elements): ViT's saved class token, `select` of the last norm's (2, 17, 64) output, spans 4,608 B of its
    8,704 B storage, all of it alive until its last read. Sized by its extent, the backward's start read
    4,096 B under its saved values and each peak after its last read 4,096 B over the measured one."""
    try:
        layout = buffer.get_layout()
        shape = [size_hint(s) for s in layout.size]
        stride = [size_hint(s) for s in layout.stride]
        offset = size_hint(layout.offset)
    except (AttributeError, NotImplementedError, TypeError):
        return False
    return offset != 0 or not dense(shape, stride)


def _aliased_storage(layout) -> str:
    """The buffer whose storage a `NonOwningLayout` writes into (through any views of it)."""
    from torch._inductor import ir

    target = layout.view
    while not isinstance(target, ir.Buffer):
        target = target.unwrap_view() if isinstance(target, ir.BaseView) else target.data
    return target.get_name()


def storages_of_aliases(infos: Sequence) -> list:
    """`infos` (`memory.compute_memory_timeline`'s) with buffers that write into another's storage counted
    as that storage.

    Inductor realizes a concatenation's inputs into slices of its output (`ConcatKernel.realize_into`: each
    input's layout a `NonOwningLayout` of the output): the wrapper allocates the output when it allocates the
    first of them and makes each a view of it (`codegen_allocation`), so they allocate nothing and the output
    is alive from the first of them made to the last of them read. Inductor's own estimate counts each input
    beside the output: on Mixtral's backward the two halves of the experts' gate-and-up gradient were counted
    twice, 262 KB (9.6% of the step) over the measured peak. An alias whose storage is not among `infos` (a
    graph input) keeps its own bytes: more, never less.
    """
    from torch._inductor import ir

    by_name = {info.buffer.get_name(): info for info in infos}
    storage_of = {}
    for name, info in by_name.items():
        layout = getattr(getattr(info.buffer, "node", None), "layout", None)  # (a freeable input has no node)
        if isinstance(layout, ir.NonOwningLayout):
            storage_of[name] = _aliased_storage(layout)
    if not storage_of:
        return list(infos)

    def root(name: str) -> str:
        while name in storage_of:
            name = storage_of[name]
        return name

    spans: dict[str, list] = {}
    for name in storage_of:
        if (storage := root(name)) in by_name:
            spans.setdefault(storage, [by_name[storage]]).append(by_name[name])
    changed = {}
    for storage, members in spans.items():
        ends = [m.end_step for m in members]
        changed[storage] = dataclasses.replace(by_name[storage], start_step=min(m.start_step for m in members),
                                      end_step=-1 if -1 in ends else max(ends))
        for alias in members[1:]:
            changed[alias.buffer.get_name()] = dataclasses.replace(alias, size_alloc=0, size_free=0)
    return [changed.get(info.buffer.get_name(), info) for info in infos]


def kernel_local_buffers(order: Sequence, graph_outputs) -> set[str]:
    """Buffers made and last read inside one fused kernel: Inductor keeps them in registers or a local
    buffer and never allocates them (`Kernel.remove_kernel_local_buffers`); its memory estimate counts them."""
    if not order:
        return set()
    scheduler = order[0].scheduler
    removable = getattr(scheduler, "can_buffer_be_removed_through_fusion", None)
    if removable is None:
        return set()
    removed = set()
    for node in order:
        if len(node.get_nodes()) < 2:
            continue
        names = node.get_operation_names()
        for sub in node.get_nodes():
            if sub.is_reduction():
                continue  # read by the kernel's later loops: the C++ backend stores it (counted: never less)
            for buf in sub.get_outputs():
                name = buf.get_name()
                if name not in graph_outputs and removable(name, names):
                    removed.add(name)
    return removed


def kernel_groups(order: Sequence) -> tuple[list[int], list[int]]:
    """For each node, the first and last step of the kernel that runs it.

    Inductor's C++ backend generates consecutive scheduler nodes into one C++ function, flushed before an
    extern kernel (a matmul, a fallback op) or a template, and before a change of device: every output
    of the group is allocated before the call and dead buffers are freed after it. Elsewhere (Triton)
    each node is its own kernel. (The C++ backend also flushes past 500 kernel arguments; that split is
    not followed, which only counts a longer group: more memory, never less.)
    """
    first, last = list(range(len(order))), list(range(len(order)))
    start, current = 0, None  # the open group's first step, and its device

    def close(end: int) -> None:
        for j in range(start, end):
            first[j], last[j] = start, end - 1

    for i, node in enumerate(order):
        device = node.get_device()
        if device is None:
            continue  # a no-op kernel: it neither flushes nor allocates
        alone = device.type != "cpu" or node.is_extern() or node.is_template()
        if alone or device != current:
            close(i)
            start, current = i, device
        if alone:
            close(i + 1)
            start, current = i + 1, None
    close(len(order))
    return first, last


def in_place_reuses(order: Sequence, step_of: dict, graph_inputs, graph_outputs) -> dict[str, str]:
    """Output buffer -> the dying input buffer Inductor writes it over, in the order given.

    Inductor decides this while generating code (`BaseSchedulerNode.decide_inplace_update`, with
    `config.inplace_buffers`): a pointwise node's output takes over an input it reads at the same index
    when that read is the input's last use, the input is an intermediate or a donated graph input (a
    backward's saved values), and the sizes match. This follows those rules; its own memory estimate
    (`torch._inductor.memory`) leaves the reuse out.
    """
    from torch._inductor import ir
    from torch._inductor.codegen.wrapper import can_match_buffer_size
    from torch._inductor.scheduler import SchedulerNode

    if not torch._inductor.config.inplace_buffers or not order:
        return {}
    scheduler = order[0].scheduler
    donated = getattr(scheduler, "name_to_donated_buffer", {})

    def step(user_node) -> int:
        fused = scheduler.name_to_fused_node.get(user_node.get_name())
        return step_of.get(fused, len(order))  # an output node, or one not scheduled: never done

    reuses: dict[str, str] = {}
    taken: set[str] = set()
    for i, node in enumerate(order):
        for sub in node.get_nodes():
            if not isinstance(sub, SchedulerNode):
                continue
            for out in sub.get_outputs():
                made = out.node
                if not made.should_allocate() or made.get_inputs_that_alias_output() or made.get_mutation_names():
                    continue
                for read in sub.read_writes.reads:
                    name = read.name
                    source = donated.get(name) or scheduler.name_to_buf.get(name)
                    if source is None or name in taken or name in graph_outputs or source.node is None:
                        continue
                    if name in graph_inputs and name not in donated:
                        continue
                    # (A NonOwningLayout's bytes are its storage's, `storages_of_aliases`: the output counted apart.)
                    if isinstance(source.node.get_output_spec(), (ir.NoneLayout, ir.MultiOutputLayout, ir.NonOwningLayout)):
                        continue
                    # Users in earlier kernels, and this node's own ancestors, are done.
                    remaining = [
                        u for u in source.users if step(u.node) >= i and u.node.get_name() not in sub.ancestors
                    ]
                    if (
                        len(remaining) == 1
                        and remaining[0].node is sub
                        and remaining[0].can_inplace
                        and can_match_buffer_size(source.node, made)
                    ):
                        reuses[out.get_name()] = name
                        taken.add(name)
                        break
    return reuses


class ScheduledPeakProbe:
    """A post-fusion scheduler pass that records `scheduled_peak` of each graph it sees, changing nothing.

    `check`, if given, is called with the first graph's reading (the graph compile_fx_inner was given: its
    scheduler runs before any subgraph's, which are scheduled while it generates code), before Inductor
    generates and compiles any code: an exception it raises (a plan over its budget) ends the compile
    there, wrapped in Inductor's `InductorError`, instead of after a C++ compile the caller would throw away.

    It pickles and deep-copies as an inert handle (Inductor copies and may pickle its config).
    """

    def __init__(
        self, *, resident: frozenset[str] | None = None, present: frozenset[str] | None = None, chained=None,
        check: Callable[[ScheduledPeak], None] | None = None,
        workspace: Callable[[Sequence[torch.fx.Node]], int] | None = None,
        storages: Mapping[str, tuple[str, int]] | None = None,
    ) -> None:
        self.resident, self.present, self.chained, self.check = resident, present, chained, check
        self.workspace, self.storages = workspace, storages
        self.peaks: list[ScheduledPeak] = []
        self.errors: list[str] = []  # readings that failed (an Inductor internal this module does not know)
        self.checked: ScheduledPeak | None = None  # the reading `check` was called with

    def __call__(self, nodes: list) -> list:
        if self.chained is not None:
            nodes = self.chained(nodes)
        try:
            self.peaks.append(scheduled_peak(nodes, resident=self.resident, present=self.present, workspace=self.workspace,
                                             storages=self.storages))
        except Exception as error:  # noqa: BLE001 - a failed reading is reported by the caller, not fatal here
            self.errors.append(f"{type(error).__name__}: {error}")
            return nodes
        if self.check is not None and len(self.peaks) == 1 and not self.errors:
            self.checked = self.peaks[0]
            self.check(self.checked)
        return nodes

    def __deepcopy__(self, memo: dict) -> ScheduledPeakProbe:
        return self

    def __reduce__(self):
        return (ScheduledPeakProbe, (), {"resident": self.resident, "present": self.present, "chained": None, "peaks": [],
                                         "errors": [], "check": None, "checked": None, "workspace": None,
                                         "storages": None})

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


@contextlib.contextmanager
def probe_scheduled_peak(
    *, resident: frozenset[str] | None = None, present: frozenset[str] | None = None,
    check: Callable[[ScheduledPeak], None] | None = None,
    workspace: Callable[[Sequence[torch.fx.Node]], int] | None = None,
    storages: Mapping[str, tuple[str, int]] | None = None,
) -> Iterator[ScheduledPeakProbe]:
    """Within the block, every graph Inductor schedules is measured; the probe holds the results (and calls
    `check` on the first, before code is generated: `ScheduledPeakProbe`)."""
    config = torch._inductor.config
    probe = ScheduledPeakProbe(resident=resident, present=present, chained=config._post_fusion_custom_pass, check=check,
                               workspace=workspace, storages=storages)
    with config.patch(_post_fusion_custom_pass=probe):
        yield probe
