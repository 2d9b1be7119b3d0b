"""An optimizer whose state is stored compressed (and optionally on the host) between steps.

    opt = CompressedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), states={"exp_avg": "int8"})

Inside `step()` the parameters are taken in chunks of about `chunk_bytes` of full-precision state: a chunk's
state is decoded, the wrapped optimizer steps those parameters only, and the state is encoded again before
the next chunk is decoded, so at most one chunk's state is in full precision at a time. With every state
in `fp32` and `on_host=False` this is the wrapped optimizer, bit for bit (it steps the same parameters with
the same kernels, a chunk at a time).

With `offload=` and `overlap=True`, `step()` steps the parameters on the device at once and those of the
offloaded modules on one background thread, the modules in the order of the last forward, so the host's
step runs while the next forward starts (as ZeRO-Offload and torchao's `CPUOffloadOptimizer` do): each
offloaded module's forward waits for its own parameters' step only. The background step uses the
hyperparameters as they were at `step()` (a scheduler may change them right after); whatever reads or
writes the optimizer's state or the offloaded parameters (`state_dict`, the model's `state_dict`,
`gathered()`, the next `step()`) waits for it first, and an error in it is raised there.

State dict format (`format_version` 1): the wrapped optimizer's own, where each stored state is a dict
`{"format": "int8" | "fp16" | "bf16" | "fp32", "block_size": int, "signed": bool, "codes": Tensor,
"scales": Tensor}` (no `"scales"` for `bf16`/`fp32`): `codes` has the parameter's shape and the format's
dtype (uint8, fp16, bf16, fp32), `scales` is fp32 of shape (rows, blocks per row), see `state_codec`. With
`warmup_steps > 0` each parameter's entry has `"dpcs_steps"`, the steps it has taken under the wrapper.
Under FSDP2 `codes` and `scales` are DTensors placed like the parameter, so `torch.distributed.checkpoint`
saves them sharded. `decompress_state_dict` turns such a dict into one the plain optimizer loads.
"""

from __future__ import annotations

import copy
import functools
import math
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterable, Mapping, Set
from typing import Any

import torch
import torch.utils._pytree as pytree

from dpcs_compiler.cost.model_state import OptimizerStateShape, StateLever, StateRates
from dpcs_compiler.model_states.param_offload import ParameterOffload
from dpcs_compiler.model_states.state_codec import FORMATS, Encoded, blocks_shape, check_format, decode, encode, region

FORMAT_VERSION = 1

# The state tensors each supported optimizer keeps per parameter, and whether they take both signs.
# Exact types: a subclass may keep other state under the same names.
STATE_SIGNS: dict[type[torch.optim.Optimizer], dict[str, bool]] = {
    torch.optim.AdamW: {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False},
    torch.optim.Adam: {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False},
    torch.optim.SGD: {"momentum_buffer": True},
    torch.optim.RMSprop: {"square_avg": False, "momentum_buffer": True, "grad_avg": True},
    torch.optim.Adagrad: {"sum": False},
}
_STORED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.uint8}
STEPS_KEY = "dpcs_steps"
AUTO = "auto"
# Every CompressedOptimizer alive: the step planner counts their state in the step's budget, and chooses how
# the "auto" ones keep it (`step/`).
INSTANCES: weakref.WeakSet[CompressedOptimizer] = weakref.WeakSet()


def supported_optimizers() -> list[str]:
    return [cls.__name__ for cls in STATE_SIGNS]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _like_param(local: torch.Tensor, param: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """`local` as a DTensor placed like `param` (of global `shape`, the parameter's by default)."""
    if not _is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    shape = tuple(param.shape) if shape is None else shape
    stride = tuple(int(torch.Size(shape)[i + 1:].numel()) for i in range(len(shape)))
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=shape, stride=stride)


def _blocks_follow_placement(param: torch.Tensor) -> bool:
    """Whether the blocks of the local shards are those of the whole tensor: replicated, or split along the
    first dimension of a tensor of two or more dimensions (blocks never cross a row)."""
    if not _is_dtensor(param):
        return True
    from torch.distributed.tensor import Replicate, Shard

    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0 and param.dim() >= 2)
               for p in param.placements)


class CompressedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (one of `supported_optimizers()`) so its state is stored compressed between steps.

    states: a format for every state tensor of the optimizer (`"int8"`), or a mapping from state name to
        format (`{"exp_avg": "int8", "exp_avg_sq": "fp32"}`); names not in it stay as the optimizer keeps them.
        `"auto"`: dpcs's step planner chooses one format (and `on_host`) for all of them, with the activation
        plan, under the compiled model's `memory_budget`; until it has, they are stored int8.
    block_size: columns per scaled block (`int8`, `fp16`).
    warmup_steps: plain steps each parameter takes before its state is compressed.
    min_elements: state tensors with fewer elements stay as they are (biases, norms).
    on_host: keep the chosen states in host memory (pinned on CUDA) between steps.
    chunk_bytes: full-precision state bytes decoded at a time inside `step()`.
    offload: the `ParameterOffload` whose parameters this optimizer steps on the host, with their host
        gradients (consumed by the step, as if `zero_grad()` followed) and host optimizer state.
    overlap: with `offload`, step the offloaded parameters on a background thread, overlapped with the next
        forward (see the module docstring); `wait()` waits for it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, states: str | Mapping[str, str] = "int8",
                 block_size: int = 256, warmup_steps: int = 0, min_elements: int = 4096,
                 on_host: bool = False, chunk_bytes: int = 64 << 20,
                 offload: ParameterOffload | None = None, overlap: bool = False) -> None:
        signs = STATE_SIGNS.get(type(optimizer))
        if signs is None:
            raise TypeError(f"CompressedOptimizer wraps {', '.join(supported_optimizers())}; "
                            f"got {type(optimizer).__name__}")
        self.auto = states == AUTO
        if self.auto:
            policy = dict.fromkeys(signs, "int8")  # the most compact on the device, until the planner chooses
        elif isinstance(states, str):
            if states not in FORMATS:
                raise ValueError(f"states={states!r} is not a state format; valid: {', '.join(FORMATS)}, or 'auto'")
            policy = dict.fromkeys(signs, states)
        elif isinstance(states, Mapping):
            unknown = sorted(set(states) - set(signs))
            if unknown:
                raise ValueError(f"states names {unknown} are not state of {type(optimizer).__name__}; "
                                 f"its states: {', '.join(signs)}")
            policy = {name: check_format(fmt, f"states[{name!r}]") for name, fmt in states.items()}
        else:
            raise TypeError(f"states must be a format ({', '.join(FORMATS)}) or a mapping of state name to "
                            f"format; got {type(states).__name__}")
        for name, value, least in (("block_size", block_size, 1), ("warmup_steps", warmup_steps, 0),
                                   ("min_elements", min_elements, 0), ("chunk_bytes", chunk_bytes, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}; got {value!r}")
        if not isinstance(on_host, bool):
            raise ValueError(f"on_host must be True or False; got {on_host!r}")
        if offload is not None and not isinstance(offload, ParameterOffload):
            raise TypeError(f"offload must be a ParameterOffload; got {type(offload).__name__}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False; got {overlap!r}")
        if overlap and offload is None:
            raise ValueError("overlap=True overlaps the host step of offloaded parameters with the next forward; "
                             "it needs offload=ParameterOffload([...])")
        self.inner = optimizer
        self.policy = policy
        self.signs = signs
        self.block_size = block_size
        self.warmup_steps = warmup_steps
        self.min_elements = min_elements
        self.on_host = on_host
        self.chunk_bytes = chunk_bytes
        self.offload = offload
        self.overlap = overlap
        self._background: ThreadPoolExecutor | None = None
        self._stepping: Future[None] | None = None
        if offload is not None:
            offload.optimizers.add(self)  # told when parameters move (`ParameterOffload.use`)
        self._steps: dict[torch.Tensor, int] = {}
        # Stored buffers, reused step to step: (id of the parameter, state name) -> its stored state. (Ids, not
        # the tensors: a tuple key compares its items with == when hashes collide.)
        self._held: dict[tuple[int, str], Encoded] = {}
        self._pending_copies: list[Any] = []
        # Share the wrapped optimizer's groups and state: schedulers, zero_grad and hooks see one optimizer.
        super().__setstate__({"defaults": optimizer.defaults, "state": optimizer.state,
                              "param_groups": optimizer.param_groups})
        INSTANCES.add(self)

    def __repr__(self) -> str:
        return (f"CompressedOptimizer({type(self.inner).__name__}, states={self.policy}, on_host={self.on_host}"
                + (", overlap=True)" if self.overlap else ")"))

    # ---- the step

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("CompressedOptimizer.step takes no closure: a closure re-evaluates the loss between "
                             "the wrapped optimizer's reads of state that is decoded a chunk at a time. Compute the "
                             "loss and backward before step().")
        self.wait()
        if self.offload is not None:
            self.offload.settle()
        ready = [p for group in self.param_groups for p in group["params"] if self._live(p).grad is not None]
        later = {id(p) for p in ready if self.overlap and self.offload.owns(p)}
        self._step_pieces(self._pieces([p for p in ready if id(p) not in later]), None)
        if later:
            self._step_later([p for p in ready if id(p) in later])
        if self.offload is not None:
            self.offload.zero_grad()  # the host gradients are consumed (those stepped later, by that step)

    def _step_pieces(self, pieces: Iterable[tuple[list[torch.Tensor], slice | None, bool]],
                     groups: list[dict[str, Any]] | None) -> None:
        for chunk, part, last in pieces:
            if part is None:
                self._step_chunk(chunk, groups)
            else:
                self._step_rows(chunk[0], part, last, groups)
            if groups is not None and last:
                self.offload.end_step(chunk)

    def _step_later(self, params: list[torch.Tensor]) -> None:
        """Offloaded `params` stepped on the background thread, in the order the last forward used them, with
        the hyperparameters as they are now."""
        assert self.offload is not None
        order = {id(p): i for i, p in enumerate(p for m in self.offload.forward_order() for p in self.offload.params[m])}
        params = sorted(params, key=lambda p: order.get(id(p), len(order)))
        groups = [{**pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                                     {k: v for k, v in group.items() if k != "params"}),
                   "params": list(group["params"])} for group in self.param_groups]
        pieces = list(self._pieces(params))
        self.offload.begin_step(params)
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="dpcs-host-step")
        self._stepping = self._background.submit(self._run_later, pieces, groups)

    def _run_later(self, pieces: list[tuple[list[torch.Tensor], slice | None, bool]],
                   groups: list[dict[str, Any]]) -> None:
        assert self.offload is not None
        try:
            with torch.no_grad():  # grad mode is the thread's own
                self._step_pieces(pieces, groups)
        except BaseException as error:
            self.offload.end_step([], error)
            raise

    def wait(self) -> None:
        """The optimizer step running in the background (`overlap=True`), if any, finished; its error raised."""
        if self._stepping is None:
            return
        stepping, self._stepping = self._stepping, None
        try:
            stepping.result()
        except BaseException:
            pass  # raised below, with what it means
        if self.offload is not None:
            self.offload.wait_steps()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.offload is not None:
            self.offload.zero_grad()

    def _live(self, param: torch.Tensor) -> torch.Tensor:
        """Where the parameter lives for the step: its host copy if offloaded, else itself."""
        # (Not host_param(): that waits for this optimizer's own background step.)
        return self.offload.host[id(param)] if self.offload is not None and self.offload.owns(param) else param

    def _pieces(self, params: list[torch.Tensor]) -> Iterable[tuple[list[torch.Tensor], slice | None, bool]]:
        """(parameters, None, True): whole parameters of about `chunk_bytes` of full-precision state together;
        ([parameter], rows, last?): a parameter whose state alone is larger, a slice of rows at a time."""
        per_element = 4 * max(1, len(self.policy))
        chunk: list[torch.Tensor] = []
        size = 0
        for param in params:
            local = _local(param)
            nbytes = local.numel() * per_element
            # Sliced once its state exists: the first step makes it whole (the wrapped optimizer's own start).
            if (nbytes > self.chunk_bytes and self.state.get(param) and not _is_dtensor(param) and local.dim() >= 1
                    and local.shape[0] > 1):
                if chunk:
                    yield chunk, None, True
                    chunk, size = [], 0
                if local.dim() >= 2:
                    step = max(1, self.chunk_bytes // (math.prod(local.shape[1:]) * per_element))
                else:  # elements, a whole number of blocks
                    step = max(self.block_size, self.chunk_bytes // per_element // self.block_size * self.block_size)
                for start in range(0, local.shape[0], step):
                    yield [param], slice(start, min(start + step, local.shape[0])), start + step >= local.shape[0]
                continue
            if chunk and size + nbytes > self.chunk_bytes:
                yield chunk, None, True
                chunk, size = [], 0
            chunk.append(param)
            size += nbytes
        if chunk:
            yield chunk, None, True

    def _inner_step(self, params: dict[int, torch.Tensor], groups: list[dict[str, Any]] | None) -> None:
        """The wrapped optimizer's step on `params` only (id of a group parameter -> the tensor it steps), with
        the hyperparameters of `groups` (the optimizer's own if None). A view of the wrapped optimizer steps
        them, with its state and its own copy of the groups: the groups a scheduler (on this optimizer or the
        wrapped one) changes are never touched, not even for the step's time, which may run in the background."""
        view = object.__new__(type(self.inner))
        view.__dict__.update(self.inner.__dict__)
        view.param_groups = [{**group, "params": [params[id(p)] for p in group["params"] if id(p) in params]}
                             for group in (self.param_groups if groups is None else groups)]
        step = getattr(type(self.inner).step, "__wrapped__", None)  # without the hooks: they ran for us
        step(view) if step is not None else view.step()

    def _step_rows(self, param: torch.Tensor, part: slice, last: bool, groups: list[dict[str, Any]] | None) -> None:
        """The wrapped optimizer's step on rows `part` of `param`, with those rows of its state: every supported
        optimizer updates each element from its own state and the parameter's step count, so a slice at a
        time is the whole step, and only a slice of the state is decoded at a time."""
        live = self._live(param)
        full = self.state[param]
        rows = live.detach()[part]
        rows.grad = live.grad[part]
        state: dict[str, Any] = {}
        for name, value in full.items():
            if isinstance(value, Encoded):
                state[name] = decode(region(value, part), rows.device)
            elif isinstance(value, torch.Tensor) and value.shape == param.shape:
                state[name] = value[part]  # updated in place
            else:
                state[name] = value.clone() if isinstance(value, torch.Tensor) else value
        if state:
            self.state[rows] = state
        try:
            self._inner_step({id(param): rows}, groups)
        finally:
            state = self.state.pop(rows, {})
        for name, value in state.items():
            current = full.get(name)
            if not (isinstance(value, torch.Tensor) and value.shape == rows.shape and value.dim() >= 1):
                if last:  # the step count: the same for every slice, kept once all are done
                    full[name] = value
            elif isinstance(current, Encoded):
                self._write_encoded(param, name, value, current, part)
            elif isinstance(current, torch.Tensor):
                if current[part].data_ptr() != value.data_ptr():  # the optimizer made a new tensor
                    current[part].copy_(value)
            else:
                raise AssertionError(f"state {name!r} appeared after the first step of a sliced parameter")
        if last:
            self._steps[param] = self._steps.get(param, 0) + 1
            self._store(param)

    def _write_encoded(self, param: torch.Tensor, name: str, value: torch.Tensor, held: Encoded, part: slice) -> None:
        """Rows `part` of a stored state, written in place from their new full-precision values."""
        target = region(held, part)
        if target.codes.device == value.device:
            encode(value, held.format, block_size=held.block_size, signed=self.signs[name], out=target)
        else:
            self._to_host(encode(value, held.format, block_size=held.block_size, signed=self.signs[name]), target)

    def _step_chunk(self, chunk: list[torch.Tensor], groups: list[dict[str, Any]] | None) -> None:
        live = {id(p): self._live(p) for p in chunk}
        for param in chunk:  # an offloaded parameter's state is keyed by its host copy during the step
            if live[id(param)] is not param and param in self.state:
                self.state[live[id(param)]] = self.state.pop(param)
            self._materialize(live[id(param)])
        try:
            self._inner_step(live, groups)
        finally:
            for param in chunk:
                if live[id(param)] is not param and live[id(param)] in self.state:
                    self.state[param] = self.state.pop(live[id(param)])
        for param in chunk:
            self._steps[param] = self._steps.get(param, 0) + 1
            self._store(param)

    # ---- decoding and storing one parameter's state

    def _materialize(self, param: torch.Tensor) -> None:
        state = self.state.get(param)
        if not state:
            return
        device = _local(self._live(param)).device
        for name, value in state.items():
            if isinstance(value, Encoded):
                state[name] = _like_param(decode(value, device), param)

    def _compressible(self, param: torch.Tensor, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 1
                and value.shape == param.shape and value.device == _local(self._live(param)).device and value.numel() >= self.min_elements
                and _blocks_follow_placement(param))

    def _store(self, param: torch.Tensor) -> None:
        if self._steps.get(param, 0) < self.warmup_steps:
            return
        state = self.state.get(param)
        if not state:
            return
        for name, fmt in self.policy.items():
            value = state.get(name)
            if not self._compressible(param, value) or (fmt == "fp32" and not self.on_host):
                continue
            local = _local(value)
            held = self._held.get((id(param), name))
            if self.on_host and local.device.type != "cpu":
                encoded = self._to_host(encode(local, fmt, block_size=self.block_size, signed=self.signs[name]), held)
            else:  # stored where it is: in the buffers it had, so the state keeps its memory step to step
                encoded = encode(local, fmt, block_size=self.block_size, signed=self.signs[name], out=held)
            self._held[(id(param), name)] = state[name] = encoded

    def _to_host(self, encoded: Encoded, held: Encoded | None) -> Encoded:
        """`encoded` copied into pinned host buffers (`held`'s when they fit); the copy is waited for before the
        host reads them (`_wait_for_host`)."""
        if (held is None or held.format != encoded.format or held.codes.device.type != "cpu"
                or held.codes.shape != encoded.codes.shape
                or (None if held.scales is None else held.scales.shape)
                != (None if encoded.scales is None else encoded.scales.shape)):
            pin = encoded.codes.is_cuda
            held = Encoded(encoded.format, torch.empty_like(encoded.codes, device="cpu", pin_memory=pin),
                           None if encoded.scales is None
                           else torch.empty_like(encoded.scales, device="cpu", pin_memory=pin),
                           encoded.block_size, encoded.signed, encoded.dtype)
        held.codes.copy_(encoded.codes, non_blocking=True)
        if encoded.scales is not None:
            assert held.scales is not None
            held.scales.copy_(encoded.scales, non_blocking=True)
        held.signed, held.dtype = encoded.signed, encoded.dtype
        if encoded.codes.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self._pending_copies.append(event)
        return held

    def _wait_for_host(self) -> None:
        """Copies to the host finish before the host reads what they wrote."""
        for event in self._pending_copies:
            event.synchronize()
        self._pending_copies.clear()

    def end_warmup(self) -> None:
        """Store every state as the policy says now, warm-up or not (e.g. before taking a state dict template
        to load a checkpoint written after the warm-up)."""
        self.wait()
        for group in self.param_groups:
            for param in group["params"]:
                self._steps[param] = max(self._steps.get(param, 0), self.warmup_steps)
                self._store(param)

    # ---- levers (the step planner's, for states="auto")

    def lever(self) -> StateLever | None:
        """How the stored states are kept, when one format holds for all of them."""
        formats = set(self.policy.values())
        return StateLever(formats.pop(), self.on_host) if len(formats) == 1 else None

    def use(self, lever: StateLever) -> None:
        """Keep every storable state as `lever` says, from now on: states already there are stored again at
        once (between steps), one parameter at a time."""
        self.wait()
        if lever == self.lever():
            return
        self.policy = dict.fromkeys(self.policy, lever.format)
        self.on_host = lever.on_host
        for param in [p for group in self.param_groups for p in group["params"]]:
            if self.state.get(param):
                self._materialize(param)
                self._store(param)
        params = {id(p): p for group in self.param_groups for p in group["params"]}
        self._held = {key: held for key, held in self._held.items()
                      if key[0] in params and self.state.get(params[key[0]], {}).get(key[1]) is held}

    def relocate(self, params: Iterable[torch.Tensor]) -> None:
        """The state of `params` moved to where each now lives (`ParameterOffload.use` moved them between the
        device and the host); state the lever keeps in host memory stays there."""
        self.wait()
        for param in params:
            state = self.state.get(param)
            if not state:
                continue
            device = _local(self._live(param)).device
            for name, value in list(state.items()):
                if isinstance(value, Encoded):
                    if self.on_host or value.codes.device == device:
                        continue
                    moved = Encoded(value.format, value.codes.to(device),
                                    None if value.scales is None else value.scales.to(device),
                                    value.block_size, value.signed, value.dtype)
                    if self._held.get((id(param), name)) is value:
                        self._held[(id(param), name)] = moved
                    state[name] = moved
                elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.device != device:
                    state[name] = value.to(device)

    def _stored_names(self, group: Mapping[str, Any]) -> list[str]:
        """The storable states the wrapped optimizer keeps per parameter of `group`, as its options make them."""
        kind = type(self.inner)
        if kind in (torch.optim.Adam, torch.optim.AdamW):
            names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        elif kind is torch.optim.SGD:
            names = ["momentum_buffer"] if group.get("momentum", 0) else []
        elif kind is torch.optim.RMSprop:
            names = (["square_avg"] + (["momentum_buffer"] if group.get("momentum", 0) else [])
                     + (["grad_avg"] if group.get("centered") else []))
        else:
            names = ["sum"]
        return [n for n in names if n in self.policy]

    def state_shape(self, offloaded: Set[int] = frozenset()) -> OptimizerStateShape:
        """This optimizer's state in counts (`cost/model_state.py`), from its parameters and options: what a
        lever may store, and what stays as it is; the parameters whose ids are in `offloaded` left out (their
        state lives with them in host memory)."""
        stored = kept = blocks = 0
        counted = type(self.inner) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
        for group in self.param_groups:
            names = self._stored_names(group)
            for param in group["params"]:
                if id(param) in offloaded:
                    continue
                local = _local(param)
                kept += 4 if counted else 0  # the step count, a float32 scalar per parameter
                if local.numel() >= self.min_elements and param.dim() >= 1 and _blocks_follow_placement(param):
                    stored += local.numel() * len(names)
                    rows, per_row = blocks_shape(tuple(local.shape), self.block_size)
                    blocks += rows * per_row * len(names)
                else:
                    kept += local.numel() * param.element_size() * len(names)
        return OptimizerStateShape(stored, kept, self.block_size, max(1, self.chunk_bytes // 4), blocks)

    def device(self) -> torch.device:
        """Where the optimizer's parameters are used (the first parameter's device)."""
        first = next((p for group in self.param_groups for p in group["params"]), None)
        return _local(first).device if first is not None else torch.device("cpu")

    # ---- what the state takes

    def device_state_bytes(self, offloaded: Set[int]) -> int:
        """Bytes of state on the device if the parameters whose ids are in `offloaded` lived in host memory
        (their state with them) and the others on the device, as the state is stored now."""
        self.wait()
        device = 0
        for param, state in self.state.items():
            if id(param) in offloaded:
                continue
            for value in state.values():
                if isinstance(value, Encoded):
                    device += 0 if self.on_host and value.codes.device.type == "cpu" else value.nbytes
                elif isinstance(value, torch.Tensor):
                    device += _local(value).nbytes
        return device

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state on the parameters' devices and in host buffers."""
        self.wait()
        device = host = 0
        for param, state in self.state.items():
            offloaded = self._live(param) is not param
            for value in state.values():
                on_host = offloaded or (isinstance(value, Encoded) and self.on_host
                                        and value.codes.device.type == "cpu")
                nbytes = value.nbytes if isinstance(value, Encoded) else (
                    _local(value).nbytes if isinstance(value, torch.Tensor) else 0)
                host += nbytes if on_host else 0
                device += 0 if on_host else nbytes
        return {"device": device, "host": host}

    # ---- state dicts

    def state_dict(self) -> dict[str, Any]:
        self.wait()
        self._wait_for_host()
        packed = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        packed["state"] = {index: self._export(params[index], entry) for index, entry in packed["state"].items()}
        return packed

    def _export(self, param: torch.Tensor, entry: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in entry.items():
            if isinstance(value, Encoded):
                stored: dict[str, Any] = {"format": value.format, "block_size": value.block_size,
                                          "signed": value.signed, "codes": _like_param(value.codes, param)}
                if value.scales is not None:
                    rows, blocks = blocks_shape(tuple(param.shape), value.block_size)
                    stored["scales"] = _like_param(value.scales, param, (rows, blocks))
                out[name] = stored
            else:
                out[name] = value
        if self.warmup_steps:
            out[STEPS_KEY] = torch.tensor(self._steps.get(param, 0))
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads this wrapper's state dicts (stored states stay as stored) and plain ones of the wrapped
        optimizer (stored as the policy says after the next step)."""
        self.wait()
        saved_params = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        if len(saved_params) != len(params):
            raise ValueError(f"the state dict has {len(saved_params)} parameters, this optimizer {len(params)}")
        param_of = dict(zip(saved_params, params))
        plain: dict[Any, dict[str, Any]] = {}
        stored: list[tuple[torch.Tensor, str, Mapping[str, Any]]] = []
        steps: dict[torch.Tensor, int] = {}
        for key, entry in state_dict["state"].items():
            plain[key] = {}
            for name, value in entry.items():
                if name == STEPS_KEY:
                    steps[param_of[key]] = int(value)
                elif isinstance(value, Mapping) and "format" in value:
                    stored.append((param_of[key], name, value))
                else:
                    plain[key][name] = value
        self.inner.load_state_dict({**state_dict, "state": plain})
        self.state, self.param_groups = self.inner.state, self.inner.param_groups  # load_state_dict rebinds them
        self._held.clear()
        self._steps = {p: steps.get(p, self.warmup_steps if stored else 0) for p in params}
        for param, name, value in stored:
            encoded = _imported(param, name, value, "cpu" if self.on_host else _local(self._live(param)).device)
            if self.on_host and _local(param).is_cuda:
                encoded = self._to_host(encoded, None)  # pinned
            self._held[(id(param), name)] = self.state[param][name] = encoded

    def close(self) -> None:
        """Lets go of the host buffers (and their pinned memory) now, not at garbage collection."""
        self.wait()
        if self._background is not None:
            self._background.shutdown()
            self._background = None
        self._wait_for_host()
        for param in list(self.state):
            self._materialize(param)
        self._held.clear()


def _imported(param: torch.Tensor, name: str, stored: Mapping[str, Any], device: torch.device | str) -> Encoded:
    """A stored state from a state dict, checked against the parameter it belongs to, on `device`."""
    fmt = stored["format"]
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    check_format(fmt, f"state {name!r} format")
    block_size = int(stored["block_size"])
    codes = _local(stored["codes"]).to(device, copy=True)  # written in place by later steps
    where = f"state {name!r} of a parameter of shape {tuple(param.shape)}"
    if codes.shape != _local(param).shape or codes.dtype != _STORED_DTYPES[fmt]:
        raise ValueError(f"{where}: codes of shape {tuple(codes.shape)} and dtype {codes.dtype}, expected "
                         f"{tuple(_local(param).shape)} and {_STORED_DTYPES[fmt]} for {fmt}")
    scales = stored.get("scales")
    if fmt in ("int8", "fp16"):
        if scales is None:
            raise ValueError(f"{where}: format {fmt} needs scales")
        scales = _local(scales).to(codes.device, copy=True)
        expected = blocks_shape(tuple(codes.shape), block_size)
        if tuple(scales.shape) != expected:
            raise ValueError(f"{where}: scales of shape {tuple(scales.shape)}, expected {expected} for "
                             f"block_size {block_size}")
    return Encoded(fmt, codes, scales, block_size, bool(stored["signed"]), param.dtype)


def decompress_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A `CompressedOptimizer` state dict as the wrapped optimizer's own: stored states decoded to full
    precision (DTensors stay DTensors), the wrapper's step counts dropped."""
    out = copy.copy(dict(state_dict))
    state: dict[Any, dict[str, Any]] = {}
    for key, entry in state_dict["state"].items():
        state[key] = {}
        for name, value in entry.items():
            if name == STEPS_KEY:
                continue
            if isinstance(value, Mapping) and "format" in value:
                codes = value["codes"]
                fmt = value["format"].decode() if isinstance(value["format"], bytes) else value["format"]
                scales = value.get("scales")
                encoded = Encoded(fmt, _local(codes), None if scales is None else _local(scales),
                                  int(value["block_size"]), bool(value["signed"]))
                state[key][name] = _like_param(decode(encoded), codes)
            else:
                state[key][name] = value
    out["state"] = state
    return out


@functools.cache
def measured_state_rates(device: str) -> StateRates:
    """Seconds per element to encode and decode each format on `device`, its host link's bytes per second and
    what an AdamW step on the host adds over one on the device per element, and the one on the device (None,
    0 and 0 on CPU, where the host is the device's memory): timed once per process on 2**18 elements."""
    values = torch.randn(1 << 18, device=device)

    def seconds(fn) -> float:
        fn()  # warm
        times = []
        for _ in range(3):
            if values.is_cuda:
                torch.cuda.synchronize(values.device)
            start = time.perf_counter()
            fn()
            if values.is_cuda:
                torch.cuda.synchronize(values.device)
            times.append(time.perf_counter() - start)
        return sorted(times)[1] / values.numel()

    encode_seconds, decode_seconds = {}, {}
    for fmt in FORMATS:
        encoded = encode(values, fmt)
        encode_seconds[fmt] = seconds(lambda: encode(values, fmt, out=encoded))
        decode_seconds[fmt] = seconds(lambda: decode(encoded))
    link, host_step, device_step = None, 0.0, 0.0
    if values.is_cuda:
        host = torch.empty(values.numel(), pin_memory=True)
        link = values.nbytes / seconds(lambda: values.copy_(host, non_blocking=True)) / values.numel()
        # An offloaded block's optimizer step runs on the host: AdamW's step there less its step on the device.
        steps = []
        for where in (host, values):
            param = torch.nn.Parameter(where.clone())
            param.grad = torch.randn_like(param)
            adamw = torch.optim.AdamW([param])
            steps.append(seconds(adamw.step))
        host_step, device_step = max(0.0, steps[0] - steps[1]), steps[1]
    return StateRates(encode_seconds, decode_seconds, link, host_step, device_step)
