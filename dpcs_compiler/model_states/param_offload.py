"""Parameters (and their gradients) of chosen modules kept in host memory between uses.

    offload = ParameterOffload([model.blocks[0], model.blocks[1]])
    optimizer = CompressedOptimizer(torch.optim.AdamW(model.parameters()), states="fp32", offload=offload)

Each chosen module's parameters have their master copy in host memory (pinned on CUDA). The parameter
itself stays a device tensor of its shape, so compiled graphs and their guards see what they were traced
with, but its storage is empty (`resize_(0)`) except while the module runs:

- forward: a pre-hook brings the module's parameters in (and `prefetch` modules after it, in the order of
  the last forward) and a post-hook lets them go; the post-hook also hooks the module's outputs, so the
  parameters come back before the module's backward (with the module before it prefetched);
- backward: as each parameter's gradient is final (a post-accumulate-grad hook) the gradient is copied out to
  the host (added to what is there, for accumulation), the device gradient dropped and the parameter let go;
  whatever is still in at the end of the backward (frozen parameters) is let go then;
- the optimizer step for these parameters runs on the host copies with the host gradients (the
  `CompressedOptimizer` given `offload=`), so their optimizer state lives on the host as well. With
  `overlap=True` that step runs on a background thread while the next forward starts, the modules in the
  order of the forward: a parameter whose step is still running is waited for before anything here brings it
  in, reads or writes its host copy or its host gradient (`begin_step`, `end_step`).

On CUDA every copy runs on dpcs's side stream, with events the compute stream waits on right before use. On
CPU the copies are synchronous and happen at the same points, so the same code path is tested everywhere
(host and device being the same memory there, nothing is saved).

The hooks run outside compiled code (`torch.compiler.disable`): compile each block, or the model, whose
loop over blocks then runs eagerly around one graph per block, as with FSDP2. Dynamo does not guard on module
hooks by default: installing turns those guards on for the process (`skip_nnmodule_hook_guards = False`) and
resets Dynamo's caches, as code compiled without the hooks would read the emptied parameters. `state_dict()` of the model gives the host copies; `load_state_dict()`
writes them. Between steps read (or write) the parameters themselves only inside `with offload.gathered():`:
outside it their storage is empty, and torch does not check such reads (on CPU, a segfault).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from dpcs_compiler.ops.offload_ops import _side_stream, copy_to_host_async

# Every ParameterOffload installed and not closed: the step planner counts their parameters as a block's own,
# alive for its call (and its neighbours' prefetch), not as the step's (`step/`).
INSTANCES: weakref.WeakSet[ParameterOffload] = weakref.WeakSet()


def _weakly(method: Any) -> Any:
    """`method` called through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


class ParameterOffload:
    """Keeps the parameters of `modules` in host memory between uses; see the module docstring.

    prefetch: how many modules ahead (in forward; behind, in backward) are brought in when one starts.
    auto: the step planner of a model compiled with a `memory_budget` chooses which of `modules` are offloaded
        (the fewest that let the step fit at the least added time, with the optimizer state's lever and the
        activation plan; none where the host is the device's own memory) and switches them between steps
        (`use`). Until it has, all are offloaded.
    """

    def __init__(self, modules: Sequence[nn.Module], *, prefetch: int = 1, auto: bool = False) -> None:
        modules = list(modules)
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise ValueError("ParameterOffload needs a non-empty list of nn.Module to offload")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0; got {prefetch!r}")
        if not isinstance(auto, bool):
            raise ValueError(f"auto must be True or False; got {auto!r}")
        for outer in modules:
            for inner in modules:
                if outer is not inner and any(inner is m for m in outer.modules()):
                    raise ValueError(f"offloaded modules must not contain each other: {type(outer).__name__} "
                                     f"contains {type(inner).__name__}")
        self.modules = modules
        self.prefetch = prefetch
        self.auto = auto
        self._kept: set[int] = set()  # parameters kept on the device (`use`): resident, stepped there
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()  # CompressedOptimizers stepping with this
        self.params: dict[nn.Module, list[nn.Parameter]] = {m: list(m.parameters()) for m in modules}
        unique = {id(p): p for params in self.params.values() for p in params}
        self.host: dict[int, torch.Tensor] = {}
        self._param: dict[int, nn.Parameter] = unique
        self.host_grad: dict[int, torch.Tensor] = {}  # host gradients, accumulated until the optimizer takes them
        self._has_grad: set[int] = set()
        self._pending_grads: list[tuple[int, torch.Tensor, Any]] = []  # (param, staging, event) on CUDA
        self._ready: dict[int, Any] = {}  # param -> event of its H2D copy (CUDA)
        self._resident: set[int] = set()
        self._running: dict[int, int] = {}  # param -> modules running their forward with it
        self._order: list[nn.Module] = []  # modules in the order of the last whole forward
        self._this_forward: list[nn.Module] = []
        self._backward_queued = False
        # Parameters whose optimizer step runs in the background: set once it is done (or failed).
        self._stepping: dict[int, threading.Event] = {}
        self._step_error: BaseException | None = None
        self._handles: list[Any] = []
        for param in unique.values():
            storage = param.untyped_storage()
            if param.storage_offset() != 0 or storage.nbytes() != param.numel() * param.element_size():
                raise ValueError(f"a parameter of shape {tuple(param.shape)} is a view into a larger storage; "
                                 "ParameterOffload moves whole storages")
            host = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=param.is_cuda)
            host.copy_(param.detach())
            self.host[id(param)] = host
            if param.requires_grad:  # frozen ones have no gradient, and are let go at the end of the backward
                self.host_grad[id(param)] = torch.empty_like(host, pin_memory=param.is_cuda)
                # Held weakly: a tensor's hooks are outside the garbage collector's reach when C++ also holds the
                # tensor, so a strong one would keep this offload (and its host memory) alive for good.
                self._handles.append(param.register_post_accumulate_grad_hook(_weakly(self._gradient_ready)))
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._before_forward))
            self._handles.append(module.register_forward_hook(self._after_forward))
            self._handles.append(module._register_state_dict_hook(self._state_dict_from_host))
            self._handles.append(module._register_load_state_dict_pre_hook(self._load_into_host, with_module=True))
            self._handles.append(module.register_load_state_dict_post_hook(self._after_load))
        for param in unique.values():
            self._release(param)
        # By default Dynamo does not guard on module hooks (`skip_nnmodule_hook_guards`): code compiled for a
        # module without them (this one before, or another of its class) would run this one without them, on
        # parameters whose storage is empty. From now on it guards on them, and what it compiled goes.
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset()
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        # A global hook: it holds this offload weakly (an offload nobody closed still goes with its model), and
        # goes with it.
        handle = register_optimizer_step_pre_hook(_weakly(self._refuse_unaware_optimizers))
        self._handles.append(handle)
        weakref.finalize(self, handle.remove)
        INSTANCES.add(self)

    # ---- what the optimizer sees

    def offloaded(self) -> list[nn.Parameter]:
        """The parameters kept in host memory between uses (now)."""
        return [p for key, p in self._param.items() if key not in self._kept]

    def owns(self, param: torch.Tensor) -> bool:
        """Whether `param` is one of this offload's and lives in host memory between uses now."""
        return id(param) in self._param and id(param) not in self._kept

    def offloaded_modules(self) -> list[nn.Module]:
        return [m for m in self.modules if not any(id(p) in self._kept for p in self.params[m])]

    def use(self, offloaded: Iterable[nn.Module]) -> None:
        """Offload the parameters of the modules in `offloaded` and keep the others' on the device, from now on
        (between steps, or at the start of a forward: not while a backward runs). A parameter that comes back
        brings its gradients so far and its optimizer state with it; one that goes takes them to the host (and
        leaves the device when its module is not running)."""
        chosen = {id(m) for m in offloaded}
        unknown = chosen - {id(m) for m in self.modules}
        if unknown:
            raise ValueError(f"use() names {len(unknown)} modules this ParameterOffload was not given")
        self.wait_steps()
        self.settle()
        moved: list[nn.Parameter] = []
        for module in self.modules:
            for param in self.params[module]:
                key = id(param)
                if id(module) in chosen and key in self._kept:  # to the host
                    self._kept.discard(key)
                    self.host[key].copy_(param.detach())
                    if param.grad is not None:
                        self._accumulate(key, param.grad)
                        param.grad = None
                    if not self._running.get(key):
                        self._release(param)
                    moved.append(param)
                elif id(module) not in chosen and key not in self._kept:  # to the device, for good
                    self._fetch(param)
                    self._wait([param])
                    if key in self._has_grad:
                        grad = self.host_grad[key].to(param.device, copy=True)
                        param.grad = grad if param.grad is None else param.grad.add_(grad)
                        self._has_grad.discard(key)
                    self.host[key].grad = None
                    self._kept.add(key)
                    moved.append(param)
        for optimizer in list(self.optimizers):
            optimizer.relocate(moved)

    def has_gradient(self, param: torch.Tensor) -> bool:
        """Whether an offloaded parameter has a gradient waiting in host memory (earlier micro-batches)."""
        self._await(id(param))
        return id(param) in self._has_grad

    def host_param(self, param: torch.Tensor) -> torch.Tensor:
        """The host master copy of an offloaded parameter, its `.grad` the host gradient (after `settle`); its
        optimizer step, if one runs in the background, finished."""
        self._await(id(param))
        return self.host[id(param)]

    # ---- optimizer steps in the background (`CompressedOptimizer(overlap=True)`)

    def begin_step(self, params: Iterable[torch.Tensor]) -> None:
        """A background thread steps `params` now, with their host gradients (bound by `settle`): those are the
        step's until `end_step`, and whatever reads or writes these parameters here waits for it."""
        self.wait_steps()
        for param in params:
            key = id(param)
            if self.host[key].grad is None:
                raise RuntimeError("begin_step: a parameter has no host gradient bound; settle() first")
            self._stepping[key] = threading.Event()
            self._has_grad.discard(key)  # consumed by the step

    def end_step(self, params: Iterable[torch.Tensor], error: BaseException | None = None) -> None:
        """(On the stepping thread.) The step of `params` is done: their host gradients are let go. With
        `error`, it failed: every parameter still waited for is released, and each later wait raises."""
        if error is not None:
            self._step_error = error
            params = [self._param[key] for key in list(self._stepping)]
        for param in params:
            event = self._stepping.get(id(param))
            if event is not None:
                if error is None:
                    self.host[id(param)].grad = None
                event.set()

    def wait_steps(self) -> None:
        """Every background optimizer step of these parameters finished."""
        for key in list(self._stepping):
            self._await(key)
        self._raise_step_error()

    def _await(self, key: int) -> None:
        event = self._stepping.get(key)
        if event is not None:
            event.wait()
            self._stepping.pop(key, None)
        self._raise_step_error()

    def _raise_step_error(self) -> None:
        if self._step_error is not None:
            raise RuntimeError("the background optimizer step of offloaded parameters failed (their parameters "
                               "and optimizer state are partly stepped: load a checkpoint)") from self._step_error

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every offloaded parameter back on the device for the body, to read or write between steps (a weight
        EMA, an eager evaluation, a manual edit); written back to the host copies at the end, and let go.

        Outside a module's run an offloaded parameter's storage is empty, and torch does not check reads of it:
        `p.clone()` there reads freed memory (on CPU a segfault, not an error). Read through this, through
        `state_dict()`, or through `host_param(p)`."""
        self.wait_steps()
        params = [p for key, p in self._param.items() if key not in self._kept and key not in self._resident]
        for param in params:
            self._fetch(param)
        self._wait(params)
        try:
            yield
        finally:
            with torch.no_grad():
                for param in params:
                    self.host[id(param)].copy_(param.detach())
            for param in params:
                self._release(param)

    def settle(self) -> None:
        """Finish moving gradients out (CUDA) and hang each host gradient on its host parameter (those of a
        step running in the background are that step's)."""
        for key, staging, event in self._pending_grads:
            event.synchronize()
            self._accumulate(key, staging)
        self._pending_grads.clear()
        for key, host in self.host.items():
            if key not in self._stepping:
                host.grad = self.host_grad[key] if key in self._has_grad else None

    def zero_grad(self) -> None:
        self.settle()
        self._has_grad.clear()
        for key, host in self.host.items():
            if key not in self._stepping:
                host.grad = None

    def host_bytes(self) -> int:
        """Bytes of the host copies of the parameters and of their gradients (allocated once, at install)."""
        return sum(t.nbytes for t in self.host.values()) + sum(t.nbytes for t in self.host_grad.values())

    # ---- moving parameters

    def _fetch(self, param: nn.Parameter) -> None:
        key = id(param)
        self._await(key)  # its optimizer step, if it runs in the background
        if key in self._resident:
            return
        param.untyped_storage().resize_(param.numel() * param.element_size())
        host = self.host[key]
        if param.is_cuda:
            side = _side_stream(param.device)
            side.wait_stream(torch.cuda.current_stream(param.device))
            with torch.cuda.stream(side):
                param.data.copy_(host, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            self._ready[key] = done
        else:
            param.data.copy_(host)
        self._resident.add(key)

    def _wait(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            done = self._ready.pop(id(param), None)
            if done is not None:
                torch.cuda.current_stream(param.device).wait_event(done)

    def _release(self, param: nn.Parameter) -> None:
        key = id(param)
        self._wait([param])
        if key in self._kept:
            return
        param.untyped_storage().resize_(0)
        self._resident.discard(key)

    def forward_order(self) -> list[nn.Module]:
        """The offloaded modules in the order the last whole forward ran them (before one has: as given)."""
        return list(self._order or self.modules)

    def neighbours(self, module: nn.Module, direction: int) -> list[nn.Module]:
        """The `prefetch` modules after (direction +1) or before (-1) `module` in the last forward's order."""
        order = self._order or self._this_forward
        if module not in order:
            return []
        at = order.index(module)
        return [order[i] for i in range(at + direction, at + direction * (self.prefetch + 1), direction)
                if 0 <= i < len(order)]

    # ---- hooks (outside compiled code)

    @torch.compiler.disable
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self._this_forward and module is self._this_forward[0]:  # the first module again: a new forward
            self._order, self._this_forward = self._this_forward, []
        if module not in self._this_forward:
            self._this_forward.append(module)
        for param in self.params[module]:
            self._running[id(param)] = self._running.get(id(param), 0) + 1
            self._fetch(param)
        for ahead in self.neighbours(module, +1):
            for param in self.params[ahead]:
                self._fetch(param)
        self._wait(self.params[module])

    @torch.compiler.disable
    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for param in self.params[module]:
            self._running[id(param)] -= 1
            if not self._running[id(param)]:
                self._release(param)
        outputs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grads: self._before_backward(module), mode="any")

    def _before_backward(self, module: nn.Module) -> None:
        for param in self.params[module]:
            self._fetch(param)
        for behind in self.neighbours(module, -1):
            for param in self.params[behind]:
                self._fetch(param)
        self._wait(self.params[module])
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._backward_queued = False
        for key in list(self._resident):
            if not self._running.get(key):
                self._release(self._param[key])

    def _gradient_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        key = id(param)
        if grad is None or key in self._kept:
            return
        if grad.is_cuda:
            self._pending_grads.append((key, *copy_to_host_async(grad)))
        else:
            self._accumulate(key, grad)
        param.grad = None
        if not self._running.get(key):
            self._release(param)

    def _accumulate(self, key: int, grad: torch.Tensor) -> None:
        self._await(key)
        if key in self._has_grad:
            self.host_grad[key].add_(grad)
        else:
            self.host_grad[key].copy_(grad)
            self._has_grad.add(key)

    def _refuse_unaware_optimizers(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if getattr(optimizer, "offload", None) is self:
            return
        if any(self.owns(p) for group in optimizer.param_groups for p in group["params"]):
            raise RuntimeError(
                f"{type(optimizer).__name__} steps parameters whose gradients ParameterOffload keeps on the host; "
                "it would skip them. Step them with CompressedOptimizer(optimizer, offload=...)")

    # ---- the model's state dict reads and writes the host copies

    def _state_dict_from_host(self, module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
        self.wait_steps()
        for name, param in module.named_parameters():
            if prefix + name in state and self.owns(param):
                state[prefix + name] = self.host[id(param)]

    def _load_into_host(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, param in module.named_parameters():
            if self.owns(param) and prefix + name in state_dict:
                self._fetch(param)  # module.load_state_dict copies into the parameter itself
                self._wait([param])

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        for param in self.params[module]:
            if self.owns(param) and id(param) in self._resident and not self._running.get(id(param)):
                self.host[id(param)].copy_(param.detach())
                self._release(param)

    def close(self) -> None:
        """Bring every parameter back to the device for good and remove the hooks."""
        self.wait_steps()
        self.settle()
        for param in self._param.values():
            self._fetch(param)
            self._wait([param])
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        INSTANCES.discard(self)
        torch._dynamo.reset()  # code compiled with the hooks calls them

