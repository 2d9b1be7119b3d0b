"""Hugging Face `Trainer` and `accelerate` loops through dpcs.

    from dpcs_compiler.integrations.hf import DpcsCallback, compile_model

    model = compile_model(model, options={"memory_budget": "6GiB", "precision": "bf16"})
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=..., callbacks=[DpcsCallback()])
    trainer.train()

`compile_model` compiles the model in place, as `nn.Module.compile` does: the model stays itself, so
`Trainer` reads its forward signature (no `remove_unused_columns=False`), `save_pretrained` writes the same
keys, and accelerate's `prepare` (DDP included) wraps it as any model. `DpcsCallback` runs a `Runtime` for
it: `Runtime.step` after every optimizer step, with the step's loss (the compiled call records it, outside
the graph) and accelerate's GradScaler; the Runtime's state is saved in each checkpoint and restored when
the Trainer resumes from one.

Why not `TrainingArguments(torch_compile_backend="dpcs")`: Trainer hands the name to accelerate, whose
`TorchDynamoPlugin` accepts only the names of its own `DynamoBackend` list and refuses any other
(`'DPCS' is not a valid DynamoBackend`), and a backend given by name cannot carry options (a budget, a
precision) anyway. Leave `torch_compile` off and compile with `compile_model`; `DPCS_OPTIONS` still adds
options from the environment.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dpcs_compiler.checkpoint import _write_synced
from dpcs_compiler.diagnostics import DpcsWarning
from dpcs_compiler.options import DpcsOptions
from dpcs_compiler.options import config_from
from dpcs_compiler.runtime.policies import Policy
from dpcs_compiler.runtime.runtime import Runtime, RuntimeConfig
from dpcs_compiler.runtime.telemetry import Telemetry

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "dpcs_compiler.integrations.hf needs transformers (and accelerate for Trainer): pip install transformers accelerate"
    ) from error

log = logging.getLogger("dpcs.integrations")

RUNTIME_STATE_FILE = "dpcs_runtime.json"  # in each Trainer checkpoint folder


class _LossTap:
    """The losses of the training forwards since the last optimizer step, detached, on their device (no
    host sync), and whether the model normalised them over the whole accumulated batch."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.summed = False  # the forward got num_items_in_batch: each micro-batch's loss is a share of the step's

    def record(self, output: Any, kwargs: Mapping[str, Any]) -> None:
        loss = _loss_of(output)
        if loss is not None:
            self.losses.append(loss.detach())
            self.summed = kwargs.get("num_items_in_batch") is not None

    def take(self) -> torch.Tensor | None:
        """The step's loss (the sum of normalised shares, else the mean of micro-batch means); clears."""
        losses, self.losses = self.losses, []
        if not losses:
            return None
        stacked = torch.stack([loss.float().reshape(()) for loss in losses])
        return stacked.sum() if self.summed else stacked.mean()


def _loss_of(output: Any) -> torch.Tensor | None:
    """A model output's loss: `.loss` / `["loss"]` of a ModelOutput or dict, else a scalar tensor output."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
    else:
        loss = getattr(output, "loss", output)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


_TAPS: weakref.WeakKeyDictionary[torch.nn.Module, _LossTap] = weakref.WeakKeyDictionary()


def compile_model(
    model: torch.nn.Module,
    options: Mapping[str, Any] | None = None,
    *,
    dynamic: bool | None = None,
    fullgraph: bool = False,
) -> torch.nn.Module:
    """Compile `model` with dpcs in place and return it (the same object).

    Like `model.compile(backend="dpcs", options=options)`: the module's forward, signature, parameters and
    state dict are untouched; only its call runs compiled. The options are checked here (with
    `DPCS_OPTIONS`), so a bad one fails before training starts. The compiled call also records each
    training forward's loss for `DpcsCallback`, outside the graph: the graphs dpcs plans are the model's.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"compile_model needs a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError(
            "compile_model got torch.compile's wrapper (an OptimizedModule); pass the model itself "
            "(its `_orig_mod`), which compile_model compiles in place"
        )
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError(
            f"{type(model).__name__} is already compiled in place (model.compile() or compile_model); "
            "compile it once"
        )
    options = dict(options or {})
    DpcsOptions.from_dict(options)  # a bad key or value names itself now, not at the first step
    compiled = torch.compile(model._call_impl, backend="dpcs", options=options, dynamic=dynamic, fullgraph=fullgraph)
    tap = _LossTap()
    module_ref = weakref.ref(model)

    def call(*args: Any, **kwargs: Any) -> Any:
        output = compiled(*args, **kwargs)
        module = module_ref()
        if module is not None and module.training and torch.is_grad_enabled():
            tap.record(output, kwargs)
        return output

    # What nn.Module.compile sets; nn.Module.__call__ runs it instead of _call_impl.
    model._compiled_call_impl = call
    _TAPS[model] = tap
    return model


class DpcsCallback(TrainerCallback):
    """Runs a dpcs `Runtime` under `Trainer`: one `Runtime.step` per optimizer step.

    `runtime`: a Runtime you built for the model (kept open at the end), or None: the callback builds one
    at the start of training from `policies`, `telemetry` and the `RuntimeConfig` fields given as keywords
    (checked here), and closes it when training ends. `save_state`: write the Runtime's state into each
    checkpoint folder (`dpcs_runtime.json`, by the main process) and restore it when the Trainer resumes
    from that checkpoint, so a resumed run compiles the same variant first and takes the same decisions.
    """

    def __init__(
        self,
        runtime: Runtime | None = None,
        *,
        policies: list[Policy] | None = None,
        telemetry: str | os.PathLike | Telemetry | None = None,
        save_state: bool = True,
        **runtime_config: Any,
    ) -> None:
        if runtime is not None and not isinstance(runtime, Runtime):
            raise ValueError(f"DpcsCallback runtime={runtime!r} is not valid; valid choices: None or a dpcs Runtime")
        if runtime is not None and (policies is not None or telemetry is not None or runtime_config):
            raise ValueError("DpcsCallback takes a Runtime or the settings to build one (policies, telemetry, "
                             "RuntimeConfig fields), not both")
        if not isinstance(save_state, bool):
            raise ValueError(f"DpcsCallback save_state={save_state!r} is not valid; valid choices: True, False")
        self._config = config_from(RuntimeConfig, None, runtime_config, "DpcsCallback")
        self._policies = policies
        self._telemetry = telemetry
        self._owned = runtime is None
        self.runtime = runtime
        self.save_state = save_state
        self._tap: _LossTap | None = None
        self._warned_no_loss = False

    # ---- Trainer events ------------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "torch_compile", False):
            raise ValueError(
                f"TrainingArguments(torch_compile=True, torch_compile_backend={args.torch_compile_backend!r}) would "
                "compile the model a second time around dpcs; leave torch_compile off: compile_model already "
                "compiled it with dpcs"
            )
        backend = _accelerate_dynamo_backend()
        if backend is not None:
            raise ValueError(
                f"accelerate is set to compile the model with {backend!r} (ACCELERATE_DYNAMO_BACKEND or "
                "`accelerate config`), a second time around dpcs; set its dynamo backend to 'no': compile_model "
                "already compiled the model with dpcs"
            )
        if getattr(args, "gradient_checkpointing", False):
            warnings.warn(
                "TrainingArguments(gradient_checkpointing=True) recomputes every block whatever dpcs plans; with a "
                "dpcs memory_budget leave it off and let the plan choose what to recompute",
                category=DpcsWarning, stacklevel=2,
            )

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if model is None:
            raise ValueError("DpcsCallback: the Trainer passed no model to on_train_begin")
        from accelerate.utils import extract_model_from_parallel

        model = extract_model_from_parallel(model, keep_torch_compile=False)  # behind DDP's, FSDP's, compile's
        self._tap = _TAPS.get(model)
        if self._tap is None:
            log.warning("DpcsCallback: %s was not compiled with dpcs_compiler.integrations.hf.compile_model; the "
                        "Runtime runs without the loss signal", type(model).__name__)
        if self.runtime is None or (self._owned and self.runtime._closed):
            self.runtime = Runtime(model, self._policies, self._telemetry, config=self._config)
            self._owned = True
        if self.save_state and state.global_step > 0:
            self._restore(args, state)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._tap is not None:
            self._tap.losses.clear()  # the step's micro-batches start here

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        # After the optimizer's step, before Trainer zeroes the gradients: the Runtime reads them.
        assert self.runtime is not None, "on_train_begin builds the Runtime"
        loss = self._tap.take() if self._tap is not None else None
        if loss is None and self._tap is not None and not self._warned_no_loss:
            self._warned_no_loss = True
            log.warning("DpcsCallback: the model's outputs carry no loss (pass labels); the Runtime runs without it")
        self.runtime.step(loss=loss, optimizer=optimizer, scaler=getattr(optimizer, "scaler", None))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.save_state or self.runtime is None or not state.is_world_process_zero:
            return
        folder = _checkpoint_folder(args, state.global_step)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"DpcsCallback: the Trainer's checkpoint folder {folder} does not exist")
        path = os.path.join(folder, RUNTIME_STATE_FILE)
        _write_synced(Path(path + ".partial"), json.dumps(self.runtime.state_dict()))  # as dpcs's checkpoints
        os.replace(path + ".partial", path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.runtime is not None and self._owned:
            self.runtime.close()

    # ---- resuming ------------------------------------------------------------------------------------------

    def _restore(self, args: Any, state: Any) -> None:
        assert self.runtime is not None
        path = os.path.join(_checkpoint_folder(args, state.global_step), RUNTIME_STATE_FILE)
        if not os.path.exists(path):
            warnings.warn(
                f"DpcsCallback: resuming at step {state.global_step} without a saved Runtime state ({path}); "
                "its policies start afresh",
                category=DpcsWarning, stacklevel=2,
            )
            return
        with open(path, encoding="utf-8") as saved:
            self.runtime.load_state_dict(json.load(saved))
        if self.runtime.step_count != state.global_step:
            raise ValueError(f"{path} holds the Runtime at step {self.runtime.step_count}, the Trainer resumes at "
                             f"step {state.global_step}")


def _accelerate_dynamo_backend() -> str | None:
    """The backend accelerate's state compiles prepared models with, None when it compiles none (or accelerate is
    not in use): the Trainer created its Accelerator before `on_init_end`."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return None
    plugin = getattr(AcceleratorState, "_shared_state", {}).get("dynamo_plugin")
    backend = getattr(getattr(plugin, "backend", None), "value", None)
    return None if backend in (None, "NO") else backend.lower()


def _checkpoint_folder(args: Any, step: int) -> str:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
