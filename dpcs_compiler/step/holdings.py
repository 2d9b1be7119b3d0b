"""What a step holds beside its graphs' activations, read from the live objects: FSDP2's shards and DDP's
gradient buckets, parameters a graph takes without seeing them, the optimizers of the step's parameters and
their state, ParameterOffload blocks, and what a CUDA process holds beyond the step's own tensors."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterable, Sequence
from gc import get_objects
from typing import Any

import torch

from dpcs_compiler.measure import optimizer_state_bytes
from dpcs_compiler.report import compile_count
from dpcs_compiler.cost.optimizer_state import anticipated_state_bytes, state_now_bytes
from dpcs_compiler.cost.model_state import (
    step_transient_bytes,
)
from dpcs_compiler.model_states.compressed_optimizer import INSTANCES, CompressedOptimizer
from dpcs_compiler.model_states.param_offload import INSTANCES as OFFLOADS
from dpcs_compiler.model_states.param_offload import ParameterOffload

log = logging.getLogger("dpcs.step")


@dataclasses.dataclass
class _Block:
    """A module of a ParameterOffload, as the step sees it; named (id of the offload, id of the module)."""

    offload: weakref.ref[ParameterOffload]
    module: weakref.ref[torch.nn.Module]
    parameter_bytes: int
    parameter_elements: int
    gradient_bytes: int  # of its parameters that take a gradient
    held_gradient_bytes: int  # gradients it has from earlier micro-batches (on the device, or on the host)
    chosen: bool  # the planner chooses whether it is offloaded (`ParameterOffload(auto=True)`)


@dataclasses.dataclass(frozen=True)
class _Fsdp:
    """FSDP2's parameters as the step sees them: the gathered (unsharded) parameters by id, with the bytes of
    their shard (what their gradient leaves after its reduce-scatter) and the model they belong to (its root's
    state context, by id); per model, its shards' bytes (kept all step) and the sharded gradients already there
    (earlier micro-batches). Another FSDP2 model alive in the process (an earlier one not yet collected) is in
    torch's registry too: a step counts the models whose parameters its graphs take (`of`). Per model too, how
    many collectives' buffers its process groups may release after the collectives end (`late_collectives`)."""

    gathered: dict[int, int]
    model_of: dict[int, int]
    models: dict[int, tuple[int, int]]
    late: dict[int, int] = dataclasses.field(default_factory=dict)

    def of(self, taken: Iterable[int]) -> tuple[int, int]:
        """(shard bytes, sharded gradient bytes) of the models of the gathered parameters `taken` (ids)."""
        used = self._used(taken)
        return sum(self.models[m][0] for m in used), sum(self.models[m][1] for m in used)

    def late_collectives(self, taken: Iterable[int]) -> int:
        """The most collectives whose buffers the process groups of the models of `taken` (ids) hold after
        they end (`late_collectives`), at least one."""
        return max((self.late.get(m, 1) for m in self._used(taken)), default=1)

    def _used(self, taken: Iterable[int]) -> set[int]:
        return {self.model_of[p] for p in taken if p in self.model_of}


def late_collectives(group: Any, device_type: str) -> int:
    """How many collectives of `group` may still hold their buffers after they end. Gloo runs collectives on its
    worker threads, and each drops the collective it ran (its inputs, outputs and copies) only when it takes the
    queue's lock again (`ProcessGroupGloo::runLoop`): one per thread, its `threads` option (2 by default), by
    the ranks' timing. Other backends: one (NCCL's release on the GPU waits to be measured: issue 57)."""
    try:
        backend = group._get_backend(torch.device(device_type))
    except (RuntimeError, AttributeError, ValueError):
        return 1
    threads = getattr(getattr(backend, "options", None), "_threads", None)
    if type(backend).__name__ == "ProcessGroupGloo" and isinstance(threads, int) and threads > 0:
        return threads
    return 1


def _fsdp_groups(group: Any) -> list[Any]:
    """The process groups an FSDP2 parameter group's collectives run on: its shard group (gathers, and
    reduce-scatters unless a separate group is set), the separate reduce-scatter group, HSDP's replicate group."""
    info = group.mesh_info
    found = [getattr(info, name, None) for name in
             ("shard_process_group", "reduce_scatter_process_group", "replicate_process_group")]
    return list({id(g): g for g in found if g is not None}.values())


def _fsdp_parameters() -> _Fsdp | None:
    """FSDP2's states (`fully_shard`) in this process, read from torch's composable-state registry; None
    without any."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # a torch without FSDP2
        return None
    states = {id(st): st for ref in list(_module_state_mapping.values()) if isinstance(st := ref(), FSDPState)}
    if not states:
        return None
    gathered: dict[int, int] = {}
    model_of: dict[int, int] = {}
    models: dict[int, tuple[int, int]] = {}
    late: dict[int, int] = {}
    for state in states.values():
        # One model's states share their root's context once it ran (its lazy init); before, each its own.
        model = id(getattr(state, "_state_ctx", state))
        shards, gradients = models.get(model, (0, 0))
        for group in state._fsdp_param_groups:
            device = getattr(group.mesh_info.mesh, "device_type", "cpu")
            late[model] = max(late.get(model, 1), sum(late_collectives(g, device) for g in _fsdp_groups(group)))
            for fsdp_param in group.fsdp_params:
                shard = fsdp_param.sharded_param
                local = shard._local_tensor if hasattr(shard, "_local_tensor") else shard
                nbytes = local.numel() * local.element_size()
                shards += nbytes
                if shard.grad is not None:
                    grad = shard.grad._local_tensor if hasattr(shard.grad, "_local_tensor") else shard.grad
                    gradients += grad.numel() * grad.element_size()
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    gathered[id(unsharded)] = nbytes
                    model_of[id(unsharded)] = model
        models[model] = (shards, gradients)
    return _Fsdp(gathered, model_of, models, late)


def _ddp_buckets() -> tuple[dict[int, int], bool]:
    """Inside a DistributedDataParallel forward: its gradient buckets ({id: bytes}; one flat copy of every
    gradient, allocated when DDP was made and alive throughout), and whether `.grad`s are views of them."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return {}, False
    nbytes = sum(p.numel() * p.element_size() for p in ddp.module.parameters() if p.requires_grad)
    return {id(ddp): nbytes}, bool(getattr(ddp, "gradient_as_bucket_view", False))


def _count_unseen_parameters(root: torch.nn.Module, args: Sequence[Any], parameters: Iterable[int],
                             offloads: Iterable[int], bucket_views: bool, outside: dict[int, int],
                             device: torch.device | None = None) -> None:
    """Add to `outside` (by storage) the parameters of the compiled module on the call's device that this call
    does not take, and their gradients: alive through the step whoever reads them. A graph break in a layer
    leaves the embedding to eager code (Hugging Face models), which no graph counted: the step went over its
    budget by the embedding's bytes. (A parameter a later call takes is counted once, with it: `_shape`.)"""
    if device is None:
        device = next((x.device for x in args if isinstance(x, torch.Tensor)), None)
    for p in root.parameters():
        if p.device != device or id(p) in offloads:
            continue
        storage = p.untyped_storage()
        if storage.data_ptr() in parameters or not storage.nbytes():
            continue
        gradient = p.grad.untyped_storage().nbytes() if p.grad is not None and not bucket_views else 0
        outside[storage.data_ptr()] = storage.nbytes() + gradient  # by the parameter, as `gradients` is


def unseen_in_first_step(root: torch.nn.Module | None, takes: Sequence[Any], follows: bool,
                         device: torch.device | None = None, taken: Iterable[int] = ()) -> tuple[int, int]:
    """For a graph compiled in the step's first run: (bytes alive through it, bytes more alive in its backward)
    of the compiled module's parameters on its device (`device`, else its inputs') whose storages neither its
    tensors `takes` nor an earlier call of the step (storages `taken`) hold, which no graph counts until the
    step has been seen once.

    Alive through it: those parameters, and the gradients they already have. More in its backward, where more
    graphs `follows` it: the gradients the others will have by then. Its backward runs after the backwards of
    every graph that follows it, so those parameters' gradients exist there, except where eager code before
    it reads them (an embedding left outside the graphs): found in its inputs' autograd history, their
    gradients come after (unless the parameter is tied, registered twice, as a causal LM's output layer
    shares its embedding's weight: a later graph may take it too). A graph that nothing follows (a step of
    one graph) counts none: a parameter it does not take gets no gradient before its backward.
    On the graph-break net the first graph was planned without the later graphs' parameters and gradients
    (2.1 MB each of a 14.5 MB budget): its backward, the step's last, measured 7% over the budget at the
    first step."""
    if root is None or _fsdp_parameters() is not None:  # FSDP2's shards: counted by their own path
        return 0, 0
    tensors = [x for x in takes if isinstance(x, torch.Tensor)]
    if device is None:
        device = next((x.device for x in tensors if x.device.type != "cpu"), None) or next(
            (x.device for x in tensors), None)
    offloaded = {id(p) for po in list(OFFLOADS) for m in po.modules for p in po.params[m]}
    _, bucket_views = _ddp_buckets()  # gradients that are views of DDP's buckets take no memory of their own
    unseen: dict[int, int] = {}  # as the step recorder counts them once the step runs
    _count_unseen_parameters(root, tensors, {*taken, *(x.untyped_storage().data_ptr() for x in tensors)},
                             offloaded, bucket_views, unseen, device)
    alive = sum(unseen.values())
    if not follows or bucket_views or not unseen:
        return alive, 0
    to_come = [p for p in root.parameters()
               if p.untyped_storage().data_ptr() in unseen and p.grad is None and p.requires_grad]
    before = _read_before(tensors) if to_come else set()
    registered: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        registered[id(p)] = registered.get(id(p), 0) + 1
    return alive, sum(p.numel() * p.element_size() for p in to_come if id(p) not in before or registered[id(p)] > 1)


AUTOGRAD_WALK_LIMIT = 200_000  # autograd nodes visited looking for what eager code before a graph read


def _read_before(tensors: Sequence[torch.Tensor]) -> set[int]:
    """The ids of the leaf tensors in the autograd history of `tensors`: their gradients are made after the
    backward of a graph that takes `tensors`. Past `AUTOGRAD_WALK_LIMIT` nodes the walk stops with what it
    found (a parameter it did not reach is counted with its gradient in that backward: over, never under)."""
    stack = [x.grad_fn for x in tensors if x.grad_fn is not None]
    seen: dict[int, Any] = {}  # kept alive while walking, so that no id is reused
    leaves: set[int] = set()
    while stack and len(seen) < AUTOGRAD_WALK_LIMIT:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.add(id(variable))
        stack.extend(n for n, _ in node.next_functions if n is not None and id(n) not in seen)
    return leaves


def _optimizers_of(parameters: dict[int, int], offloaded: Sequence[torch.Tensor] = ()) -> list[torch.optim.Optimizer]:
    """The optimizers (CompressedOptimizers, torch optimizers seen stepping, and those that have not stepped yet,
    found once per compile among the live objects) that step some of these parameters (by storage), or of these
    ParameterOffload parameters (by identity)."""
    _watch_optimizers()
    _find_optimizers()
    found = []
    ids = {id(p) for p in offloaded}
    for optimizer in [*INSTANCES, *_STEPPED]:
        if any(id(p) in ids or (p.untyped_storage().nbytes() and p.untyped_storage().data_ptr() in parameters)
               for g in optimizer.param_groups for p in g["params"]):
            found.append(optimizer)
    return found


def _block(po: ParameterOffload, module: torch.nn.Module) -> _Block:
    params = po.params[module]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return _Block(
        weakref.ref(po), weakref.ref(module), nbytes, sum(p.numel() for p in params),
        sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        sum(p.numel() * p.element_size() for p in params if p.grad is not None or po.has_gradient(p)),
        po.auto,
    )


HELD_ELSEWHERE = -1  # the key in a call's `outside` of what a CUDA process holds beside the step's own tensors


def _held_elsewhere(device: torch.device, counted: dict[int, int], optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """What the process has allocated on the CUDA `device` beyond the storages `counted` and the optimizers'
    state there now: other models, cuBLAS's workspaces, a data loader's batches."""
    state = sum(state_now_bytes(o, "cuda") for o in optimizers if not isinstance(o, CompressedOptimizer))
    return max(0, int(torch.cuda.memory_allocated(device)) - sum(counted.values()) - state)


def _make_cuda_workspaces(device: torch.device) -> None:
    """Run a matrix product forward and backward on `device`, so that the cuBLAS (and cuBLASLt) workspaces of
    this thread and of the autograd engine's thread for the device exist: each thread's first product
    allocates them (about 33 MiB each on an H200, torch 2.11) and keeps them, and the first plan counts them."""
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            torch.nn.functional.linear(x, w, w[0]).sum().backward()
    torch.cuda.synchronize(device)


def _state_bytes(optimizers: Any) -> int:
    """Bytes of the optimizers' state on the device once each has stepped: as it is now, with what a torch
    optimizer's first step will make anticipated (`cost/optimizer_state.py`). A wrapper that shares another's
    state (accelerate's AcceleratedOptimizer, Lightning's) is counted once, through the optimizer it wraps."""
    return sum(_one_state_bytes(optimizer) for optimizer in _distinct(optimizers))


def _distinct(optimizers: Any) -> list[torch.optim.Optimizer]:
    """The optimizers with one per state: of a wrapper and the optimizer it wraps (sharing its state), the one
    it wraps."""
    by_state: dict[int, torch.optim.Optimizer] = {}
    for optimizer in list(optimizers):
        key = id(optimizer.state)
        if key not in by_state or _wraps(by_state[key]):
            by_state[key] = optimizer
    return list(by_state.values())


def _wraps(optimizer: Any) -> bool:
    """Whether `optimizer` wraps another optimizer (and shares its state): `optimizer.optimizer` is one."""
    return isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)


def _one_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    if callable(getattr(optimizer, "state_bytes", None)):  # a CompressedOptimizer counts its own
        return optimizer_state_bytes(optimizer)
    anticipated, known = anticipated_state_bytes(optimizer)
    if not known and not optimizer.state and id(optimizer) not in _UNKNOWN_SAID:
        _UNKNOWN_SAID.add(id(optimizer))
        log.warning("dpcs: the state %s makes at its first step cannot be anticipated (not one of torch's "
                    "optimizers): the step is planned for it once it exists, and may run over its budget until "
                    "then", type(optimizer).__name__)
    return anticipated


_UNKNOWN_SAID: set[int] = set()


# torch optimizers seen stepping, or found before their first step (`_find_optimizers`); CompressedOptimizers
# register themselves when made.
_STEPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


_FOUND_AT: list[int] = [-1]  # the compile count when the live objects were last searched for optimizers


def _find_optimizers() -> None:
    """Add the live torch optimizers to `_STEPPED`, once per compile: an optimizer made before the first step
    has not stepped, and its state, made at its first step, is planned for from the first plan on."""
    count = compile_count()
    if _FOUND_AT[0] == count:
        return
    _FOUND_AT[0] = count
    for obj in get_objects():
        kind = type(obj)  # (isinstance would look through a dead weak proxy and raise)
        if (issubclass(kind, torch.optim.Optimizer) and not issubclass(kind, CompressedOptimizer) and not _inner(obj)
                and not _wraps(obj)):  # a wrapper's state is the optimizer's it wraps, found on its own
            _STEPPED.add(obj)


def _parameter_ids(blocks: dict[tuple[int, int], _Block], names) -> frozenset[int]:
    """The ids of the parameters of the named ParameterOffload blocks (those still alive)."""
    ids = set()
    for name in names:
        block = blocks.get(name)
        po, module = (block.offload(), block.module()) if block is not None else (None, None)
        if po is not None and module is not None:
            ids.update(id(p) for p in po.params[module])
    return frozenset(ids)


def _regime(optimizers: Any, offloaded: Any) -> tuple:
    """How the model state is kept, as an optimizer step's temporaries depend on it: the lever of the "auto"
    CompressedOptimizers (None without one; they share it) and the ParameterOffload blocks offloaded."""
    lever = next((o.lever() for o in list(optimizers) if isinstance(o, CompressedOptimizer) and o.auto), None)
    return lever, frozenset(offloaded)


def _decoded(optimizers: Any, blocks: dict[tuple[int, int], _Block]):
    """A regime's (`_regime`) full-precision chunk bytes, decoded at once by the "auto" CompressedOptimizers'
    steps (`cost.model_state.step_transient_bytes`)."""
    auto = [o for o in list(optimizers) if isinstance(o, CompressedOptimizer) and o.auto]

    def decoded(regime: tuple) -> int:
        lever, offloaded = regime
        if lever is None:
            return 0
        ids = _parameter_ids(blocks, offloaded)
        return sum(step_transient_bytes(o.state_shape(ids), lever) for o in auto)

    return decoded


def _inner(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is the one a CompressedOptimizer wraps (stepped by it, chunk by chunk)."""
    return any(optimizer is c.inner for c in INSTANCES)


def _offloaded_now() -> set[tuple[int, int]]:
    """The ParameterOffload blocks offloaded now, by name (id of the offload, id of the module)."""
    return {(id(po), id(m)) for po in list(OFFLOADS) for m in po.offloaded_modules()}


_WATCHING: list[Any] = []
# What hears each optimizer step start and end: the step recorder (`recorder.STEPS`).
OBSERVERS: list[Any] = []


def _watch_optimizers() -> None:
    if _WATCHING:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def starts(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        for observer in OBSERVERS:
            observer.optimizer_starts(optimizer)

    def stepped(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not isinstance(optimizer, CompressedOptimizer) and not _inner(optimizer):
            _STEPPED.add(optimizer)
        for observer in OBSERVERS:
            observer.optimizer_ends(optimizer)

    _WATCHING.append(register_optimizer_step_pre_hook(starts))
    _WATCHING.append(register_optimizer_step_post_hook(stepped))
