"""One rank of the 2-process gloo step-budget tests in test_step_ranks.py (run as a script, not collected).

    python step_rank_worker.py RANK WORLD STORE_FILE SCENARIO BUDGET RESULT_FILE

ddp: `LayerNormStack` wrapped in DistributedDataParallel with 2 MB buckets (DDPOptimizer splits the graph into
    several), compiled with dpcs under BUDGET bytes; each rank takes its half of a global batch. After the
    step plan is in place, one step is measured with the profiler; its absolute peak counts the parameters,
    the input and DDP's gradient buckets (allocated when DDP was made, so invisible to the profiler).
ddp_unreachable:COMPILER: an MLP whose peak is parameters, gradients and 1 MB buckets, under a budget no
    activation plan meets, with dpcs's default options (only the compiler set).
fsdp: the same stack with `fully_shard` on each block, then on the root (FSDP2; Dynamo compiles one graph per
    block, the first apart, the rest one graph called five times). The absolute peak counts this rank's
    parameter shards and the input; each block's gathered parameters are allocated inside the step.
property:SHAPE:COMPILER (`tests/e2e/test_budget_property.py`): the ddp or fsdp step compiled afresh for each of
    the comma-separated BUDGET values in turn (0: no budget; 1: the lowest step peak, asked for with
    on_infeasible="best"), default options but the compiler: per budget, the step at which dpcs refused it and
    what it said, or the measured peak and the step's prediction.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import join, leave, report_crashes, see_dpcs_warnings  # noqa: E402
from dpcs_testing import allowing_best_plan, budget_refusal  # noqa: E402
from step_scenarios import LayerNormStack, global_batch  # noqa: E402

from dpcs_compiler import clear_compile_records, compile_records  # noqa: E402
from dpcs_compiler.measure import measure_peak_memory, resident_bytes  # noqa: E402
from dpcs_compiler.report import predicted_step_peak, step_records  # noqa: E402
from dpcs_compiler.step.holdings import late_collectives  # noqa: E402

WARMUP_STEPS = 4  # the first runs the graphs' own plans, the second plans the step; then steady
MEASURED_FSDP_STEPS = 4


def _ddp_step(rank: int, world: int, options: dict):
    """LayerNormStack in DistributedDataParallel with 2 MB buckets, compiled through dpcs with `options`: (model,
    one training step, the bytes alive before a step once DDP's buckets are made: parameters, input, buckets;
    those buckets' bytes)."""
    torch.manual_seed(0)
    model = LayerNormStack()
    wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2)
    compiled = torch.compile(wrapped, backend="dpcs", options=options)
    x = global_batch().chunk(world)[rank].contiguous()

    def step():
        model.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()

    def buckets() -> int:
        return sum(b.buffer().untyped_storage().nbytes() for b in wrapped.reducer._get_zeros_like_grad_buckets())

    return model, step, lambda: resident_bytes([*model.parameters(), *model.buffers(), x]) + buckets(), buckets


def ddp(rank: int, world: int, budget: int) -> dict:
    model, step, resident, buckets = _ddp_step(rank, world, {"compiler": "eager", "strict": True, "memory_budget": budget})
    for _ in range(WARMUP_STEPS):
        step()
    baseline, buckets = resident(), buckets()
    model.zero_grad(set_to_none=True)
    _, peak = measure_peak_memory(step)
    return {
        "measured_peak": peak.absolute(baseline),
        "buckets": buckets,
        "grads": [p.grad.detach().clone() for p in model.parameters()],
        "steps": [r.to_json() for r in step_records()],
        "plan_hashes": [r.plan_hash for r in compile_records() if r.mode == "training"],
        "graphs": len({r.graph for r in compile_records()}),
    }


def _fsdp_step(rank: int, world: int, options: dict):
    """LayerNormStack sharded per block with FSDP2, compiled through dpcs with `options`: (model, its input, one
    training step, the bytes alive before a step: this rank's shards and the input)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = LayerNormStack()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model, backend="dpcs", options=options)
    x = global_batch().chunk(world)[rank].contiguous()

    def step():
        model.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()

    shards = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    return model, step, shards + resident_bytes([x])


def fsdp(rank: int, world: int, budget: int) -> dict:
    model, step, resident = _fsdp_step(rank, world, {"compiler": "eager", "strict": True, "memory_budget": budget})
    for _ in range(WARMUP_STEPS):
        step()
    measured = []
    for _ in range(MEASURED_FSDP_STEPS):  # gloo's collectives leave a step-to-step spread (docs, limits)
        model.zero_grad(set_to_none=True)
        measured.append(measure_peak_memory(step)[1].absolute(resident))
    return {
        "measured_peak": max(measured),
        "measured_peaks": measured,
        "late_collectives": late_collectives(dist.group.WORLD, "cpu"),
        "grads": [p.grad.full_tensor().detach().clone() for p in model.parameters()],
        "steps": [r.to_json() for r in step_records()],
        "plan_hashes": [r.plan_hash for r in compile_records() if r.mode == "training"],
        "graphs": len({r.graph for r in compile_records()}),
    }


class ParameterMLP(torch.nn.Module):
    """Six 512-wide linear layers on 16 rows: the step's peak is parameters, gradients and DDP's buckets."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def ddp_unreachable(rank: int, world: int, budget: int, compiler: str) -> dict:
    """DDP with 1 MB buckets under `budget`, default options but the compiler: the step at which dpcs raised, and
    what it said (or the measured peak if it did not)."""
    torch.manual_seed(0)
    model = ParameterMLP()
    wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    options = {"compiler": compiler, **({"memory_budget": budget} if budget else {})}
    compiled = torch.compile(wrapped, backend="dpcs", options=options)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(rank))

    def step():
        model.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()

    raised = _refused_at(step)
    if raised is not None:
        return raised
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())  # one flat copy of every gradient
    model.zero_grad(set_to_none=True)
    _, peak = measure_peak_memory(step)
    return {"raised_at": None, "measured_peak": peak.absolute(resident_bytes([*model.parameters(), x]) + buckets)}


def budgets_in_turn(rank: int, world: int, shape: str, compiler: str, budgets: list[int]) -> list[dict]:
    """The `shape` step ("ddp" or "fsdp") compiled afresh under each budget (0: none; 1: the lowest step peak,
    on_infeasible="best"), default options but the compiler: per budget, where dpcs refused it and what it said,
    or the measured peak, the step's prediction (as its variants compiled) and its last step record's."""
    make = {"ddp": lambda r, w, o: _ddp_step(r, w, o)[:3], "fsdp": lambda r, w, o: _fsdp_resident(*_fsdp_step(r, w, o))}[shape]
    out = []
    for budget in budgets:
        torch._dynamo.reset()
        clear_compile_records()
        options = {"compiler": compiler, **({"memory_budget": budget} if budget else {}),
                   **({"on_infeasible": "best"} if budget == 1 else {})}
        model, step, resident = make(rank, world, options)
        with allowing_best_plan() if budget == 1 else contextlib.nullcontext():
            raised = _refused_at(step)
        if raised is not None:
            out.append({"budget": budget, **raised})
            continue
        baseline = resident()
        model.zero_grad(set_to_none=True)
        _, peak = measure_peak_memory(step)
        record = predicted_step_peak()
        out.append({"budget": budget, "raised_at": None, "measured_peak": peak.absolute(baseline),
                    "predicted": None if record is None else record.compiled_peak_bytes or record.predicted_peak_bytes,
                    "planned": None if record is None else record.predicted_peak_bytes,
                    # (FSDP2: one block's parameters gathered, the bytes of its gradients' reduce-scatter copy;
                    # how many collectives gloo may release late)
                    "block_bytes": 4 * sum(p.numel() for p in model.blocks[0].parameters()),
                    "late_collectives": late_collectives(dist.group.WORLD, "cpu")})
    return out


def _fsdp_resident(model, step, resident: int):
    return model, step, lambda: resident


def fsdp_unreachable(rank: int, world: int, budget: int) -> dict:
    """FSDP2 per block under `budget`, default options but the eager compiler: the step at which dpcs raised,
    and what it said (or the measured peak if it did not)."""
    model, step, resident = _fsdp_step(rank, world, {"compiler": "eager", **({"memory_budget": budget} if budget else {})})
    raised = _refused_at(step)
    if raised is not None:
        return raised
    model.zero_grad(set_to_none=True)
    _, peak = measure_peak_memory(step)
    return {"raised_at": None, "measured_peak": peak.absolute(resident)}


def _refused_at(step) -> dict | None:
    """Run WARMUP_STEPS steps: the first that raised BudgetInfeasibleError (Dynamo wraps a backend's errors),
    with its message; None if none did."""
    for i in range(WARMUP_STEPS):
        try:
            step()
        except Exception as error:  # noqa: BLE001 - unwrapped below; anything else is raised again
            refusal = budget_refusal(error)
            if refusal is None:
                raise
            return {"raised_at": i, "message": str(refusal)}
    return None


def main() -> None:
    report_crashes()
    rank, world, store, scenario, budget, result = sys.argv[1:7]
    rank, world = int(rank), int(world)
    join(store, rank, world)
    with warnings.catch_warnings():
        see_dpcs_warnings()
        if scenario.startswith("ddp_unreachable:"):  # ddp_unreachable:COMPILER
            out = ddp_unreachable(rank, world, int(budget), scenario.partition(":")[2])
        elif scenario.startswith("property:"):  # property:SHAPE:COMPILER
            _, shape, compiler = scenario.split(":")
            out = budgets_in_turn(rank, world, shape, compiler, [int(b) for b in budget.split(",")])
        else:
            out = {"ddp": ddp, "fsdp": fsdp, "fsdp_unreachable": fsdp_unreachable}[scenario](rank, world, int(budget))
    torch.save(out, result)
    leave()


if __name__ == "__main__":
    main()
