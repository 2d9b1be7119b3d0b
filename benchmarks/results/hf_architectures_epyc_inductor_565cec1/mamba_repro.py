"""Mamba's gradients under Inductor with torch's `default_partition`: no dpcs in it.

    python benchmarks/results/hf_architectures_epyc_inductor_565cec1/mamba_repro.py

Prints, per way of compiling the tiny HF Mamba of benchmarks/hf_architectures.py, the largest gradient difference
against eager relative to that gradient's largest element. On torch 2.13.0+cpu (2-core AMD EPYC, transformers
5.25.0): plain Inductor 6.6e-07; Inductor with `default_partition` as its partitioner 4.3e-01 (layer 1's A_log);
AOTAutograd with Inductor's decompositions and `default_partition`, run eagerly, 6.2e-07. dpcs partitions every
plan with `default_partition`, so every Mamba plan under Inductor computes these gradients.
"""

import copy
import inspect
import sys
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch._inductor.decomposition import select_decomp_table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hf_architectures  # noqa: E402


class DefaultPartition(CustomPartitionerFn):
    def __call__(self, gm, joint_inputs, **kwargs):
        accepted = inspect.signature(default_partition).parameters
        return default_partition(gm, joint_inputs, **{k: v for k, v in kwargs.items() if k in accepted})

    def uuid(self):
        return "default_partition"


def gradients(model, fn, inputs):
    model.zero_grad(set_to_none=True)
    fn(**inputs).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    torch.manual_seed(0)
    model, inputs = hf_architectures.architectures()["mamba"]()
    model.eval()
    reference = copy.deepcopy(model)
    expected = gradients(reference, reference, inputs)
    boxed = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    ways = {
        "inductor": ("inductor", {}),
        "inductor, default_partition": ("inductor", {"custom_partitioner_fn": DefaultPartition(), "fx_graph_cache": False}),
        "aot eager, inductor decompositions, default_partition": (aot_autograd(
            fw_compiler=boxed, bw_compiler=boxed, partition_fn=default_partition, decompositions=select_decomp_table()), {}),
    }
    for name, (backend, patches) in ways.items():
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        with inductor_config.patch(patches):
            got = gradients(m, torch.compile(m, backend=backend), inputs)
        worst = max(((got[n] - expected[n]).abs().max().item() / expected[n].abs().max().item(), n) for n in expected)
        print(f"{name}: worst gradient difference {worst[0]:.1e} of its largest element ({worst[1]})")


if __name__ == "__main__":
    main()
