"""The dpcs compile pipeline for one Dynamo graph, stage by stage.

    Dynamo graph
      -> precision plan -> pre-autograd rewrites  (fp8 regions, precision casts: AOTAutograd traces their backward)
      -> AOTAutograd joint graph
      -> joint analyses -> plan -> partition -> step analyses
         (no memory_budget: torch's min-cut partition; with one: candidates -> cost model -> solver ->
          partition by the plan's decisions -> offload/reload ops)
      -> forward / backward rewrites      (offload and prefetch; the backward's overflow check)
      -> final compiler                   (Inductor, or "eager": the same graphs run uncompiled)

With Inductor, dpcs runs inside Inductor's own `compile_fx`: the partition stage is Inductor's
`custom_partitioner_fn` (after Inductor's joint-graph passes) and the forward/backward stage wraps
`compile_fx_inner`. With "eager", AOTAutograd is called with the same decompositions and partitioner
and the graphs run as FX code. Every compile derives its plan anew: Inductor's FX-graph and AOTAutograd
caches are bypassed for dpcs graphs (the C++ code cache still applies), and the partitioner's uuid,
which carries the plan's compile key, keeps cache entries of different plans apart if they are enabled.

`compile_graph` below is the whole sequence; each stage's body is a module of `stages/` (`job`: what one
graph's compilation shares; `precision`; `partition` with `memory_plan`; `compile_parts`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from dpcs_compiler.cost.step_model import decisions_code, merged_excess
from dpcs_compiler.options import DpcsOptions
from dpcs_compiler.passes.analysis.tensor_bytes import size_hints
from dpcs_compiler.report import note_compile_raised
from dpcs_compiler.stages.compile_parts import PartCompiler, aot_compile
from torch._inductor.exc import InductorError

from dpcs_compiler.stages.job import BudgetInfeasibleError, GraphJob, ScheduleOverBudget
from dpcs_compiler.stages.partition import JointPartitioner
from dpcs_compiler.stages.precision import PRE_AUTOGRAD_REWRITES, plan_precision_stage

log = logging.getLogger("dpcs.pipeline")


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], options: DpcsOptions) -> Callable:
    """Run the whole dpcs pipeline on one Dynamo graph and return the compiled callable (sizes planned for:
    the traced ones, or `options.size_hints`)."""
    with size_hints(options.size_hints):
        return _compile_graph(gm, example_inputs, options)


def _compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], options: DpcsOptions) -> Callable:
    job = GraphJob.start(gm, example_inputs, options)
    job.dump_graph("dynamo", gm)
    plan_precision_stage(job, gm)  # per-op dtypes and fp8 linears -> the plan
    gm = job.rewrite("pre_autograd", gm, PRE_AUTOGRAD_REWRITES)
    job.dump_graph("pre_autograd.final", gm)
    partitioner = JointPartitioner(job)  # joint analyses -> plan -> partition -> step analyses
    part_compiler = PartCompiler(job)  # forward / backward rewrites -> final compiler
    while True:
        job.replanning = True  # a ScheduleOverBudget is caught here, not at a lazily compiled backward's call
        try:
            compiled = aot_compile(gm, example_inputs, partitioner, part_compiler, options)
            job.check_ranks_agree()
            return compiled
        except InductorError as error:
            # Raised from inside Inductor's scheduler (`ScheduledPeakProbe.check`): dpcs's own answer. Read
            # from the error, not kept in a local: the error's traceback holds this frame (a reference cycle).
            note_compile_raised()
            if not isinstance(error.inner_exception, ScheduleOverBudget):
                if isinstance(error.inner_exception, BudgetInfeasibleError):
                    raise error.inner_exception from None
                raise
            _count_replan(job, error.inner_exception)
        except ScheduleOverBudget as over:
            note_compile_raised()
            _count_replan(job, over)
        finally:
            job.replanning = False


def _count_replan(job: GraphJob, over: ScheduleOverBudget) -> None:
    """The compiled graphs of the plan hold more than the model counted: plan again with that much less room
    in each phase (never less than measured before: no oscillation)."""
    job.record.replans += 1
    if job.plan.torch_plan:  # torch's partition, tried, went over: dpcs plans from now on
        job.torch_plan_refused = True
    job.read_excess[decisions_code(job.plan.decisions)] = dict(over.excess)
    job.schedule_excess = merged_excess(job.schedule_excess, over.excess)
    log.info("%s: re-planning, the compiled graphs hold more than planned: %s", job.record.graph, over.excess)
