"""Hugging Face Trainer and accelerate through dpcs (`dpcs_compiler.integrations.hf`): randomly initialised
small GPT-2 and Llama built from their configs (no downloads), trained by an unchanged `Trainer` with a
memory budget (measured peak of a whole step against it), the Runtime stepping from the callback, a resumed
run restoring it; a plain accelerate loop against eager; and what `torch_compile_backend="dpcs"` does."""

from __future__ import annotations

import inspect
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from dpcs_compiler.integrations.hf import RUNTIME_STATE_FILE, DpcsCallback, _LossTap, compile_model  # noqa: E402
from dpcs_compiler.measure import CpuMemoryProfile, optimizer_state_bytes, resident_bytes  # noqa: E402
from dpcs_compiler.report import compile_records, step_records  # noqa: E402

SEQ, VOCAB, BATCH = 32, 128, 8
OPTIONS = {"compiler": "eager", "strict": True}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process-wide state (its dynamo plugin included) across Accelerators: each test
    starts from none, as a new training process does."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        # No dropout: a compiled run is compared with eager's, whose random draws differ.
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(config)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=SEQ,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def dataset(n: int = 96) -> list[dict[str, torch.Tensor]]:
    """Counting sequences from a random start: learnable, so the loss falls within a few steps."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = (torch.randint(0, VOCAB, (1,), generator=generator) + torch.arange(SEQ)) % VOCAB
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def arguments(tmp_path, steps: int, **changes) -> TrainingArguments:
    """Trainer's defaults but for the run's length, its folder and no outside reporting or progress bars."""
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=steps,
                    learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                    disable_tqdm=True)
    return TrainingArguments(**{**settings, **changes})


class StepPeak(TrainerCallback):
    """The absolute peak of one whole Trainer step (forward and backward of its batch, gradient clipping,
    the optimizer's step), measured with the CPU allocator's profile: parameters, buffers, the optimizer's
    state and the batch alive at its start are counted in."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.peak: int | None = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.at:
            batch_bytes = 2 * BATCH * SEQ * 8  # input_ids and labels, int64
            self.resident = (resident_bytes([*model.parameters(), *model.buffers()])
                             + optimizer_state_bytes(optimizer) + batch_bytes)
            self.profile = CpuMemoryProfile().start()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            self.profile.stop()
            self.peak = self.resident + self.profile.peak_increase_bytes()


def train(tmp_path, kind: str, budget: int | None, steps: int = 12):
    model = compile_model(tiny(kind), {**OPTIONS, **({"memory_budget": budget} if budget else {})})
    meter, dpcs = StepPeak(at=steps - 3), DpcsCallback(signal_every=1)
    trainer = Trainer(model=model, args=arguments(tmp_path, steps), train_dataset=dataset(), callbacks=[meter, dpcs])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, dpcs.runtime, meter.peak, losses


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainer_trains_within_the_budget_with_the_runtime_at_every_step(tmp_path, kind):
    _, _, free_peak, _ = train(tmp_path, kind, budget=None)
    torch._dynamo.reset()
    budget = int(0.85 * free_peak)
    trainer, runtime, peak, losses = train(tmp_path, kind, budget=budget)

    record = step_records()[-1]
    recomputed = max(r.recomputed_values for r in compile_records() if r.budget_bytes == budget)
    print(f"{kind}: unbudgeted step peak {free_peak} B; budget {budget} B: measured {peak} B, predicted "
          f"{record.predicted_peak_bytes} B; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert record.budget_bytes == budget and record.feasible and recomputed > 0
    assert peak <= budget
    assert losses[-1] < losses[0] - 0.5
    # The Runtime stepped at every optimizer step, and the loss it read is the one the Trainer logged.
    assert runtime.step_count == trainer.state.global_step == 12
    assert runtime.last_signals is not None
    assert runtime.last_signals.loss == pytest.approx(losses[-1], rel=1e-5)
    assert runtime._closed  # the callback built it, and closed it when training ended


def test_a_resumed_trainer_restores_the_runtime(tmp_path):
    """Checkpoints at steps 3 and 6; the run is resumed from step 3 as if killed after it: the Runtime
    continues from its saved state and ends where the uninterrupted run's did."""
    model = compile_model(tiny("llama"), OPTIONS)
    whole = DpcsCallback(signal_every=2)
    args = arguments(tmp_path, 6, save_strategy="steps", save_steps=3)
    Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[whole]).train()
    saved = tmp_path / "out" / "checkpoint-3" / RUNTIME_STATE_FILE
    assert saved.exists() and (tmp_path / "out" / "checkpoint-6" / RUNTIME_STATE_FILE).exists()
    shutil.rmtree(tmp_path / "out" / "checkpoint-6")

    torch._dynamo.reset()
    resumed = DpcsCallback(signal_every=2)
    model = compile_model(tiny("llama"), OPTIONS)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[resumed])
    trainer.train(resume_from_checkpoint=True)
    assert resumed.runtime.step_count == trainer.state.global_step == 6
    mine, theirs = resumed.runtime.state_dict(), whole.runtime.state_dict()
    assert mine["policies"] == theirs["policies"] and mine["decisions"] == theirs["decisions"]
    assert mine["signals"].keys() == theirs["signals"].keys()


def test_resuming_without_a_saved_runtime_warns(tmp_path):
    model = compile_model(tiny("llama"), OPTIONS)
    args = arguments(tmp_path, 2, save_strategy="steps", save_steps=2)
    Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[DpcsCallback(save_state=False)]).train()
    torch._dynamo.reset()
    args = arguments(tmp_path, 3, save_strategy="no")
    model = compile_model(tiny("llama"), OPTIONS)
    with pytest.warns(UserWarning, match="without a saved Runtime state"):
        Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[DpcsCallback()]).train(resume_from_checkpoint=True)


def test_compile_model_keeps_the_model_itself():
    model = tiny("gpt2")
    signature, keys = inspect.signature(model.forward), list(model.state_dict())
    assert compile_model(model, OPTIONS) is model
    assert inspect.signature(model.forward) == signature and "labels" in signature.parameters
    assert list(model.state_dict()) == keys  # no "_orig_mod." prefix: save_pretrained writes the same keys
    batch = dataset(2)
    ids = torch.stack([row["input_ids"] for row in batch])
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, model.forward(input_ids=ids, labels=ids).loss)


def test_compile_model_refuses_what_it_cannot_compile(monkeypatch):
    with pytest.raises(ValueError, match="torch.nn.Module"):
        compile_model(lambda x: x)
    with pytest.raises(ValueError, match="OptimizedModule"):
        compile_model(torch.compile(torch.nn.Linear(2, 2)))
    twice = compile_model(torch.nn.Linear(2, 2), OPTIONS)
    with pytest.raises(ValueError, match="already compiled"):
        compile_model(twice, OPTIONS)
    with pytest.raises(ValueError, match="precision"):
        compile_model(torch.nn.Linear(2, 2), {"precision": "fp12"})
    monkeypatch.setenv("DPCS_OPTIONS", '{"memory_budget": "lots"}')
    with pytest.raises(ValueError, match="DPCS_OPTIONS"):
        compile_model(torch.nn.Linear(2, 2))


def test_the_loss_tap_sums_shares_of_a_normalised_batch_and_averages_means():
    tap = _LossTap()
    tap.record({"loss": torch.tensor(1.0)}, {})
    tap.record({"loss": torch.tensor(3.0)}, {})
    assert tap.take().item() == 2.0 and tap.take() is None
    tap.record({"loss": torch.tensor(1.0)}, {"num_items_in_batch": torch.tensor(10)})
    tap.record(torch.tensor(3.0), {"num_items_in_batch": torch.tensor(10)})
    assert tap.take().item() == 4.0
    tap.record({"logits": torch.ones(2, 3)}, {})  # no loss (no labels): nothing recorded
    assert tap.take() is None


def test_the_callback_checks_its_settings():
    with pytest.raises(ValueError, match="signal_every"):
        DpcsCallback(signal_evry=1)
    with pytest.raises(ValueError, match="save_state"):
        DpcsCallback(save_state="yes")
    from dpcs_compiler import Runtime

    runtime = Runtime(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not both"):
        DpcsCallback(runtime, signal_every=1)
    runtime.close()


def test_torch_compile_backend_dpcs_is_refused_by_accelerate_and_the_callback_says_what_to_do(tmp_path):
    """What a user who tries `torch_compile_backend="dpcs"` meets (README: Hugging Face): accelerate's plugin
    takes only its own backend names. If accelerate ever accepts other names this test fails: update the
    README and the integration's docstring then."""
    model = tiny("llama")
    with pytest.raises(ValueError, match="is not a valid DynamoBackend"):
        Trainer(model=model, args=arguments(tmp_path, 1, torch_compile_backend="dpcs"), train_dataset=dataset())
    compiled = compile_model(tiny("llama"), OPTIONS)
    with pytest.raises(ValueError, match="leave torch_compile off"):
        Trainer(model=compiled, args=arguments(tmp_path, 1, torch_compile=True), train_dataset=dataset(),
                callbacks=[DpcsCallback()])


def test_the_callback_refuses_an_accelerate_configured_to_compile_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")  # what `accelerate config` / launch flags set
    with pytest.raises(ValueError, match="'inductor'.*set its dynamo backend to 'no'"):
        Trainer(model=compile_model(tiny("llama"), OPTIONS), args=arguments(tmp_path, 1), train_dataset=dataset(),
                callbacks=[DpcsCallback()])


def test_an_accelerate_loop_trains_a_compiled_model_as_eager_does():
    """accelerate's own compile (`Accelerator(dynamo_plugin=...)`) cannot take dpcs (the test above); a model
    compiled by compile_model goes through `accelerator.prepare` like any model and trains as eager does."""
    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin

    with pytest.raises(ValueError, match="is not a valid DynamoBackend"):
        TorchDynamoPlugin(backend="dpcs")

    rows = dataset(3 * BATCH)
    batches = [{key: torch.stack([row[key] for row in rows[i:i + BATCH]]) for key in rows[0]}
               for i in range(0, len(rows), BATCH)]

    def run(compiled: bool) -> torch.nn.Module:
        model = tiny("gpt2")
        if compiled:
            # Between the lowest peak plans reach (about 3.1 MB) and the unbudgeted one (4.5 MB): values recomputed.
            compile_model(model, {**OPTIONS, "memory_budget": 3_800_000})
        accelerator = Accelerator(cpu=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(model(**batch).loss)
            optimizer.step()
        return accelerator.unwrap_model(model)

    eager = run(compiled=False)
    torch._dynamo.reset()
    compiled = run(compiled=True)
    assert max(r.recomputed_values for r in compile_records()) > 0
    for (name, mine), theirs in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5, msg=name)

