"""Random but training-shaped memory problems, for the solvers' tests and the solver-gap benchmark.

A forward phase makes the candidates, the backward reads them in roughly reverse order (LIFO, as autograd
does); base bytes rise through the forward and fall through the backward with temporaries on top. The same
seed always gives the same problem.
"""

from __future__ import annotations

import numpy as np

from dpcs_compiler.cost.memory_model import Candidate, MemoryProblem

MiB = 2**20
ALLOCATION_GRANULE = 512  # the CUDA caching allocator rounds every block to 512 bytes


def _granule(nbytes: float) -> int:
    return max(ALLOCATION_GRANULE, int(round(nbytes / ALLOCATION_GRANULE)) * ALLOCATION_GRANULE)


def random_problem(
    seed: int,
    steps: int = 300,
    candidates: int = 40,
    *,
    can_offload: bool = True,
    transient_fraction: float = 0.2,
    random_op_fraction: float = 0.1,
    bandwidth_bytes_per_s: float = 25e9,
    compute_bytes_per_s: float = 1e12,
    mean_step_seconds: float = 50e-6,
) -> MemoryProblem:
    """A `MemoryProblem` with `steps` schedule steps (about half forward) and `candidates` saved buffers.

    Candidates: log-normal sizes around 4 MiB with a few 8-32x larger ones; recompute time proportional to size
    (memory-bound ops at `compute_bytes_per_s`) with about a quarter 10-50x costlier (matmuls); 0-2 recompute
    inputs among the few previous candidates; `random_op_fraction` that cannot be recomputed; a
    `transient_fraction` that need temporaries to recompute. With `can_offload`, every candidate may be
    offloaded, its copy taking `nbytes / bandwidth_bytes_per_s` against steps of about `mean_step_seconds`.
    """
    if steps < 8 or candidates < 1:
        raise ValueError(f"need steps >= 8 and candidates >= 1, got steps={steps}, candidates={candidates}")
    rng = np.random.default_rng(seed)
    backward_start = int(steps * rng.uniform(0.42, 0.52))
    forward, backward = backward_start, steps - backward_start

    produced = np.sort(rng.integers(0, forward - 1, size=candidates))
    last_forward_use = np.minimum(produced + rng.integers(0, 4, size=candidates), forward - 1)
    # Mirror the forward position into the backward (LIFO), with jitter.
    mirrored = backward_start + (forward - 1 - produced) * (backward - 1) / max(forward - 1, 1)
    first_backward_use = np.clip(np.round(mirrored + rng.normal(0.0, 2.0, size=candidates)), backward_start, steps - 1)
    first_backward_use = first_backward_use.astype(np.int64)
    last_use = np.minimum(first_backward_use + rng.integers(0, 6, size=candidates), steps - 1)

    nbytes = rng.lognormal(np.log(4 * MiB), 0.8, size=candidates)
    big = rng.random(candidates) < 0.08
    nbytes[big] *= rng.uniform(8, 32, size=int(big.sum()))
    matmul = rng.random(candidates) < 0.25
    recompute_seconds = nbytes / compute_bytes_per_s * np.where(matmul, rng.uniform(10, 50, candidates), 1.0)
    recompute_seconds *= rng.uniform(0.8, 1.25, size=candidates)
    transient = rng.random(candidates) < transient_fraction
    random_op = rng.random(candidates) < random_op_fraction

    cands = []
    for i in range(candidates):
        inputs: tuple[int, ...] = ()
        if i > 0:
            count = int(rng.choice(3, p=(0.3, 0.5, 0.2)))
            pool = np.arange(max(0, i - 6), i)
            inputs = tuple(sorted(int(j) for j in rng.choice(pool, size=min(count, len(pool)), replace=False)))
        size = _granule(nbytes[i])
        cands.append(
            Candidate(
                name=f"c{i}",
                nbytes=size,
                produced=int(produced[i]),
                last_forward_use=int(last_forward_use[i]),
                first_backward_use=int(first_backward_use[i]),
                last_use=int(last_use[i]),
                recompute_seconds=float(recompute_seconds[i]),
                recompute_transient=_granule(size * rng.uniform(0.5, 2.0)) if transient[i] else 0,
                recompute_inputs=inputs,
                transfer_seconds=size / bandwidth_bytes_per_s if can_offload else 0.0,
                can_recompute=not random_op[i],
                can_offload=can_offload,
            )
        )

    # Base: parameters, activations that are not candidates (rising, then freed), gradients (rising in
    # backward), and each step's short-lived temporaries (not yet alive just before the step).
    t = np.arange(steps)
    total = float(sum(c.nbytes for c in cands))
    params = 0.6 * total
    activations = 0.25 * total * np.where(t < backward_start, t / forward, (steps - 1 - t) / max(backward - 1, 1))
    gradients = np.where(t < backward_start, 0.0, 0.3 * total * (t - backward_start) / max(backward - 1, 1))
    temporaries = rng.exponential(0.01 * total, size=steps) * (rng.random(steps) < 0.5)
    before = np.array([_granule(x) for x in params + activations + gradients], dtype=np.int64)
    base = before + np.array([_granule(x) if x > 0 else 0 for x in temporaries], dtype=np.int64)
    step_seconds = rng.gamma(2.0, mean_step_seconds / 2.0, size=steps)
    return MemoryProblem(
        base_bytes=base,
        step_seconds=step_seconds,
        backward_start=backward_start,
        candidates=tuple(cands),
        base_before_bytes=before,  # alive before each step: without the step's own temporaries
    )
