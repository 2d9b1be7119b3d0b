"""The optional curvature probe: the top Hessian eigenvalue of the loss by power iteration on
Hessian-vector products, every `every` steps (off unless a Runtime is given one).

    probe = CurvatureProbe(lambda: model(batch).loss, model.parameters(), every=100)
    rt = Runtime(compiled_model, curvature=probe)

`loss_fn` must compute the loss with the uncompiled model: the Hessian-vector product differentiates the
gradient again, which compiled graphs do not support (the loss runs with the math attention kernel, whose
backward is differentiable, where fused ones are not). A sharp rise of the eigenvalue over its running mean
(`Signals.curvature_ratio`) marks a region of the loss where low precision is risky, and the precision
policy promotes. Each probe costs about 1 + 2 x `iterations` forward-backward passes and one host sync; its
time is kept (`seconds`, `probes`) and written to the telemetry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch


class CurvatureProbe:
    def __init__(
        self,
        loss_fn: Callable[[], torch.Tensor],
        parameters: Iterable[torch.nn.Parameter],
        *,
        every: int = 100,
        iterations: int = 8,
        decay: float = 0.9,
        seed: int = 0,
    ) -> None:
        for name, value, minimum in (("every", every, 1), ("iterations", iterations, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"CurvatureProbe {name}={value!r} is not valid; valid choices: an int >= {minimum}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"CurvatureProbe decay={decay!r} is not valid; valid choices: a number in [0, 1)")
        self.loss_fn = loss_fn
        self.parameters = [p for p in parameters if p.requires_grad]
        if not self.parameters:
            raise ValueError("CurvatureProbe needs parameters that require grad")
        self.every, self.iterations, self.decay, self.seed = every, iterations, decay, seed
        self.mean: float | None = None
        self.last: float | None = None
        self.last_ratio: float | None = None
        self.seconds = 0.0
        self.probes = 0

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def top_eigenvalue(self, step: int) -> float:
        """Power iteration from a start vector seeded by (seed, step): the same on every rank."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no double backward
            loss = self.loss_fn()
        grads = torch.autograd.grad(loss, self.parameters, create_graph=True)
        vector = [torch.randn(p.shape, generator=generator).to(p.device, p.dtype) for p in self.parameters]
        eigenvalue = torch.zeros(())
        for _ in range(self.iterations):
            norm = torch.sqrt(sum((v.float() ** 2).sum() for v in vector)).clamp_min(1e-12)
            vector = [v / norm for v in vector]
            product = torch.autograd.grad(grads, self.parameters, grad_outputs=vector, retain_graph=True)
            eigenvalue = sum((h.float() * v.float()).sum() for h, v in zip(product, vector))
            vector = [h.detach() for h in product]
        return float(eigenvalue)

    def probe(self, step: int) -> tuple[float, float | None]:
        """Run the probe: (eigenvalue, its ratio to the running mean before it, None for the first)."""
        start = time.perf_counter()
        value = self.top_eigenvalue(step)
        self.seconds += time.perf_counter() - start
        self.probes += 1
        ratio = None if self.mean is None or self.mean <= 0 else abs(value) / self.mean
        self.mean = abs(value) if self.mean is None else self.decay * self.mean + (1 - self.decay) * abs(value)
        self.last, self.last_ratio = value, ratio
        return value, ratio

    def state_dict(self) -> dict:
        return {"mean": self.mean, "seconds": self.seconds, "probes": self.probes}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.seconds, self.probes = state["mean"], state["seconds"], state["probes"]
