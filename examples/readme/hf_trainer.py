"""docs/trainers.md twin: "Hugging Face Trainer and accelerate". A randomly initialised small GPT-2 (no download) and a
counting dataset, then the block word for word: an unchanged Trainer (3 epochs of 2 steps)."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dpcs_compiler import compile_records

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))
train_dataset = [{"input_ids": (torch.arange(16) + i) % 64, "labels": (torch.arange(16) + i) % 64} for i in range(16)]

from transformers import Trainer, TrainingArguments
from dpcs_compiler.integrations.hf import DpcsCallback, compile_model

model = compile_model(model, options={"memory_budget": "6GiB"})    # in place: the same model object
trainer = Trainer(model=model, args=TrainingArguments(output_dir="out"), train_dataset=train_dataset,
                  callbacks=[DpcsCallback()])                      # a Runtime stepping with the Trainer
trainer.train()

(callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, DpcsCallback)]
assert callback.runtime.step_count == trainer.state.global_step == 6
assert any(r.budget_bytes == 6 * 2**30 for r in compile_records())
print(f"Trainer ran {trainer.state.global_step} steps through dpcs; the Runtime saw {callback.runtime.step_count}")
