"""Learning a training step's graphs, and planning them for one budget (`cost/step_model.py`).

A graph compiled with a memory_budget (and budget_scope "step", the default) takes part: its dispatcher hands
its calls to the `StepRecorder` while the recorder watches. For each forward call that builds an autograd
graph, the recorder notes the graph, its parameters (by storage, counted once for the step), the
gradients already in `.grad` (earlier micro-batches) and weak references to the storages of its inputs and
outputs its backward does not read, and puts a pre-hook on the call's backward node that reads which of those
the step has freed (and what other calls left alive that no graph counts) and queues an end-of-backward
callback. When every such backward has ended, one step is complete: its shape is
the graphs in forward call order.

The first step runs first plans (`runtime.variants.GraphDispatcher`): a graph compiled in the middle of a step counts what the
graphs before it hold, and one whose compile ended at a graph break holds least between its phases. At the
first forward call after a step of a new shape, the recorder plans the step (`plan_step`) with each graph's
memory problem, kept by its dispatcher: if the graphs' own settled plans fit the step, nothing changes;
otherwise each graph gets a context
(what the others hold around it, and a cap on what it holds itself) and switches, at its next call, to the
variant compiled for it, between steps and without Dynamo, as runtime variants do. A step no plan fits raises
`BudgetInfeasibleError` naming the smallest step peak reached and the graph that holds the most (or warns,
under on_infeasible="best").

The step after a plan takes effect is measured (`_Meter`): what it holds beyond the plan at its turn (eager
code between the last forward and the first backward, such as a loss) or elsewhere is counted, and the step
planned again if that raises its predicted peak. In a distributed job every rank takes these decisions alike.

Watching stops after `STABLE_STEPS` steps of shapes already planned for; a newly compiled graph, a new size
bucket, a runtime decision that changes a graph's variant, or graphs called in an order not planned for
(`glance`: a list append per call while not watching) starts it again (the step it starts in can be
partly seen: planned together with the full ones, it never loosens their contexts). Shapes seen since the
process started are all planned for, so steps that alternate between branches hold the budget on each.

Modules, one idea each:
- `recorder.py`: `StepRecorder`, the calls it watches and the step shapes it learns; `STEPS`, the process's one.
- `planning.py`: planning a step for its budget (the `Planning` half of the recorder).
- `measuring.py`: holding a planned step against its measurement, and correcting it (the `Measuring` half).
- `meter.py`: the meters of a step's and an optimizer step's peak, on CUDA and on CPU.
- `calls.py`: what a step is made of: its calls, what they hold and free, shapes joined.
- `holdings.py`: what a step holds beside its graphs: FSDP2 shards, DDP buckets, optimizers and their state,
  ParameterOffload blocks, memory outside the step on CUDA.
- `records.py`: a step plan as written (the steps file) and said (refusals, verdicts never given).
- `participant.py`: what the recorder needs of a compiled graph (the runtime's `GraphDispatcher` is one).
"""

from dpcs_compiler.step.recorder import STEPS, StepRecorder

__all__ = ["STEPS", "StepRecorder"]
