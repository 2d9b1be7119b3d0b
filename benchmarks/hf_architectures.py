"""dpcs on Hugging Face architectures nobody in the project tuned for: gradients against eager, and the budget.

    python benchmarks/hf_architectures.py [--models bert,mistral,...] [--compiler eager] [--fraction 0.75]
                                          [--steps 6] [--train] [--out benchmarks/results]

Each model is tiny (2 layers or stages, d 64, batch 2 x 64 tokens, vocab 256; ViT, Swin, ConvNeXt and ResNet:
32 x 32 images), random weights, in eval mode (no dropout: gradients compare exactly; `--train`: dropout on,
the gradients checked finite only), and is called as users call it:
`model(input_ids=..., labels=...).loss.backward()` (the model returns its logits too; the loop keeps the loss).
Per model: the unbudgeted dpcs step's measured peak, then dpcs at `--fraction` of it (on_infeasible="best")
after `--steps` steps, measured with the CPU profiler on top of the parameters, buffers and batch alive before
it (the profiler keeps dpcs's own check of the planned step from running: `step/meter.py::_Meter`), its
gradients against eager's, its step plan's prediction (as its variants compiled, where it was predicted again from them;
the plan's own in `planned_bytes`), and whether the budget held. Writes
hf_architectures_<compiler>.json (hf_architectures_<compiler>_train.json with `--train`).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dpcs_compiler.measure import measure_peak_memory, resident_bytes  # noqa: E402
from dpcs_compiler.report import clear_compile_records, compile_records, step_records  # noqa: E402

BATCH, SEQ, VOCAB = 2, 64, 256


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def architectures() -> dict[str, Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]]:
    import transformers as T

    small = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=128)

    seq2seq = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128)

    def lm(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        return model, dict(input_ids=_ids(1), labels=_ids(2))

    def image(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        pixels = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        return model, dict(pixel_values=pixels, labels=torch.tensor([1, 2]))

    return {
        "bert": lambda: lm(T.BertForMaskedLM(T.BertConfig(**small))),
        "roberta": lambda: lm(T.RobertaForMaskedLM(T.RobertaConfig(**{**small, "max_position_embeddings": 130}))),
        "distilbert": lambda: lm(T.DistilBertForMaskedLM(T.DistilBertConfig(
            vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=128))),
        "opt": lambda: lm(T.OPTForCausalLM(T.OPTConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
            max_position_embeddings=128, word_embed_proj_dim=64))),
        "gpt_neox": lambda: lm(T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**small))),
        "mistral": lambda: lm(T.MistralForCausalLM(T.MistralConfig(**small, num_key_value_heads=2))),
        "qwen2": lambda: lm(T.Qwen2ForCausalLM(T.Qwen2Config(**small, num_key_value_heads=2))),
        "phi": lambda: lm(T.PhiForCausalLM(T.PhiConfig(**small))),
        "gemma": lambda: lm(T.GemmaForCausalLM(T.GemmaConfig(**small, num_key_value_heads=2, head_dim=16))),
        "bloom": lambda: lm(T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4))),
        "t5": lambda: lm(T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
            pad_token_id=0))),
        "bart": lambda: lm(T.BartForConditionalGeneration(T.BartConfig(**seq2seq))),
        "gpt2": lambda: lm(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128))),
        "llama": lambda: lm(T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=2))),
        "qwen3": lambda: lm(T.Qwen3ForCausalLM(T.Qwen3Config(**small, num_key_value_heads=2, head_dim=16))),
        "gptj": lambda: lm(T.GPTJForCausalLM(T.GPTJConfig(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, rotary_dim=8))),
        "gpt_neo": lambda: lm(T.GPTNeoForCausalLM(T.GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=128,
            attention_types=[[["global", "local"], 1]], window_size=32))),
        "falcon": lambda: lm(T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4))),
        "electra": lambda: lm(T.ElectraForMaskedLM(T.ElectraConfig(**small, embedding_size=32))),
        "deberta_v2": lambda: lm(T.DebertaV2ForMaskedLM(T.DebertaV2Config(**small))),
        "mixtral": lambda: lm(T.MixtralForCausalLM(T.MixtralConfig(
            **small, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))),
        "olmo": lambda: lm(T.OlmoForCausalLM(T.OlmoConfig(**small))),
        "mpt": lambda: lm(T.MptForCausalLM(T.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4,
                                                      max_seq_len=128))),
        "gemma2": lambda: lm(T.Gemma2ForCausalLM(T.Gemma2Config(
            **small, num_key_value_heads=2, head_dim=16, sliding_window=32))),
        "gemma3": lambda: lm(T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            **small, num_key_value_heads=2, head_dim=16, sliding_window=32))),
        "phi3": lambda: lm(T.Phi3ForCausalLM(T.Phi3Config(**small, num_key_value_heads=2, pad_token_id=0))),
        "starcoder2": lambda: lm(T.Starcoder2ForCausalLM(T.Starcoder2Config(**small, num_key_value_heads=2))),
        "cohere": lambda: lm(T.CohereForCausalLM(T.CohereConfig(**small, num_key_value_heads=2))),
        "granite": lambda: lm(T.GraniteForCausalLM(T.GraniteConfig(**small, num_key_value_heads=2))),
        "qwen2_moe": lambda: lm(T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **small, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64))),
        "olmo2": lambda: lm(T.Olmo2ForCausalLM(T.Olmo2Config(**small))),
        "mamba": lambda: lm(T.MambaForCausalLM(T.MambaConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8))),
        "xlnet": lambda: lm(T.XLNetLMHeadModel(T.XLNetConfig(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4,
                                                             d_inner=128))),
        "albert": lambda: lm(T.AlbertForMaskedLM(T.AlbertConfig(**small, embedding_size=32))),
        "mobilebert": lambda: lm(T.MobileBertForMaskedLM(T.MobileBertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=2))),
        "pegasus": lambda: lm(T.PegasusForConditionalGeneration(T.PegasusConfig(**seq2seq, decoder_start_token_id=0))),
        "mbart": lambda: lm(T.MBartForConditionalGeneration(T.MBartConfig(**seq2seq))),
        "vit": lambda: image(T.ViTForImageClassification(T.ViTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
            patch_size=8, num_labels=10))),
        "swin": lambda: image(T.SwinForImageClassification(T.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
            num_labels=10))),
        "convnext": lambda: image(T.ConvNextForImageClassification(T.ConvNextConfig(
            num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, image_size=32))),
        "resnet": lambda: image(T.ResNetForImageClassification(T.ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10))),
    }


def one(build: Callable, compiler: str, fraction: float, steps: int, train: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = build()
    model.train(train)
    # What is alive before a step, as dpcs counts it in its budget: parameters, buffers (GPT-Neo's causal masks,
    # 32 KiB, were left out, and its prediction read 1.7% over what it measured) and the batch.
    resident = resident_bytes([*model.parameters(), *model.buffers(), *inputs.values()])

    def step(m: torch.nn.Module, fn: Callable) -> torch.Tensor:
        loss = fn(**inputs).loss
        loss.backward()
        return loss

    def measured(m: torch.nn.Module, fn: Callable) -> tuple[torch.Tensor, int]:
        m.zero_grad(set_to_none=True)  # the last step's gradients freed before, not inside, the step measured
        loss, peak = measure_peak_memory(lambda: step(m, fn))
        return loss, resident + peak.peak_increase_bytes

    reference = copy.deepcopy(model)
    eager_loss, _ = measured(reference, reference)
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    def compiled(options: dict[str, Any]) -> tuple[torch.nn.Module, Callable]:
        torch._dynamo.reset()
        clear_compile_records()
        m = copy.deepcopy(model)
        return m, torch.compile(m, backend="dpcs", options={"compiler": compiler, "strict": True, **options})

    m0, f0 = compiled({})
    for _ in range(2):
        measured(m0, f0)
    _, unbudgeted = measured(m0, f0)
    budget = int(fraction * unbudgeted)
    m1, f1 = compiled({"memory_budget": budget, "on_infeasible": "best"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            measured(m1, f1)
        loss, peak = measured(m1, f1)
    if train:  # dropout draws other masks in the compiled graphs than in eager: nothing to compare exactly
        gradients = [p.grad for p in m1.parameters() if p.grad is not None]
        if not torch.isfinite(loss) or not gradients or not all(torch.isfinite(g).all() for g in gradients):
            raise AssertionError(f"train mode: loss {loss.item()} or a gradient is not finite, or none was made")
    else:
        torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
        for n, p in m1.named_parameters():
            if n in grads:
                torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-5)
    records = [r for r in compile_records() if r.mode == "training"]
    planned = step_records()
    return {
        "unbudgeted_bytes": unbudgeted, "budget_bytes": budget, "measured_bytes": peak, "held": peak <= budget,
        # The step as its variants compiled (what Inductor's schedules hold counted, `compiled_peak_bytes`) where
        # a step plan was predicted again from them; else the plan's prediction.
        "predicted_bytes": (planned[-1].compiled_peak_bytes or planned[-1].predicted_peak_bytes) if planned
        else records[-1].predicted_peak_bytes,
        "planned_bytes": planned[-1].predicted_peak_bytes if planned else records[-1].predicted_peak_bytes,
        "feasible": planned[-1].feasible if planned else records[-1].plan_feasible,
        "step_planned": bool(planned), "graphs": len({r.variant_of or r.graph for r in records}),
        "recomputed": [r.recomputed_values for r in records], "gradients_match_eager": None if train else True,
        "infeasible_warning": any("cannot be met" in str(w.message) for w in caught),
    }


def plot(path: Path) -> Path:
    """Each model's step prediction against its measured peak, in percent (held budgets, refused ones, errors
    marked), beside the JSON: prediction_error.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    payload = json.loads(path.read_text())
    rows = [(n, r) for n, r in payload["models"].items() if "error" not in r]
    errors = [100 * (r["predicted_bytes"] / r["measured_bytes"] - 1) for _, r in rows]
    colors = ["tab:blue" if r["feasible"] else "tab:gray" for _, r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.33 * len(rows)), 4.2))
    ax.bar(range(len(rows)), errors, color=colors)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [n for n, _ in rows], rotation=70, fontsize=8)
    ax.set_ylabel("predicted / measured - 1 (%)")
    ax.set_title(f"Step peak as compiled vs measured, {payload['fraction']}x budget, {payload['compiler']} "
                 f"({payload['device']}, torch {payload['torch']}); gray: budget refused, best plan", fontsize=9)
    fig.tight_layout()
    out = path.with_name("prediction_error.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    choices = architectures()
    parser.add_argument("--models", default=",".join(choices), help=f"comma-separated, of: {', '.join(choices)}")
    parser.add_argument("--compiler", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--fraction", type=float, default=0.75, help="budget, of the unbudgeted measured peak")
    parser.add_argument("--steps", type=int, default=6, help="steps before the measured one")
    parser.add_argument("--train", action="store_true",
                        help="train mode (dropout on): gradients are checked finite, not against eager's")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        parser.error(f"--models {args.models!r} is not valid; valid choices: {', '.join(choices)}")
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction {args.fraction} is not valid; valid choices: a float in (0, 1]")
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = one(choices[name], args.compiler, args.fraction, args.steps, args.train)
        except Exception as error:  # noqa: BLE001 - a failing model is a result
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:800]}"}
        r = results[name]
        print(name, "ERROR " + r["error"] if "error" in r else
              f"budget {r['budget_bytes']} B: measured {r['measured_bytes']} B (held {r['held']}), predicted "
              f"{r['predicted_bytes']} B, feasible {r['feasible']}, recomputed {r['recomputed']}", flush=True)
    import transformers

    payload = {"device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
               "torch": torch.__version__, "transformers": transformers.__version__, "compiler": args.compiler,
               "fraction": args.fraction, "steps": args.steps, "train": args.train, "models": results}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"hf_architectures_{args.compiler}{'_train' if args.train else ''}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")
    print(f"wrote {plot(path)}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
