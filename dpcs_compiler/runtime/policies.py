"""Policies: explicit state machines with hysteresis that turn signal snapshots into runtime decisions.

    policy.update(signals)                 # one snapshot (`Signals`), read every N steps by the runtime
    decisions = policy.propose(decisions)  # the policy's part of the next decisions

Pure Python, no torch: each policy is unit-tested on synthetic traces. The runtime runs its policies in
order on every snapshot, each proposing on top of the previous one's decisions. Subclass `Policy` (or one
of these) to change a rule; a policy's configuration is a frozen dataclass validated on construction,
whose errors name the field.

Precision (`PrecisionPolicy`), after DPCS: demote one rung of the ladder (fp32 -> bf16 -> fp8) after
`patience` stable steps, promote at once on an overflow or an instability (a gradient-norm, loss or
curvature spike), then wait `cooldown` steps before demoting again; never below `floor`. An overflow whose
gradients were non-finite in some regions only keeps those regions in fp32 instead of promoting the model.

Memory (`MemoryPolicy`): tighten the budget one level (x`factor`) at once when headroom drops below
`low_headroom` or an out-of-memory error is caught, relax one level after `patience` steps above
`high_headroom`, and not within `cooldown` steps of a tightening.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dpcs_compiler.options import config_from
from dpcs_compiler.runtime.decisions import MODE_RANK, Decisions, check_mode


@dataclasses.dataclass(frozen=True)
class Signals:
    """What the run showed over the last `steps` steps, reduced across ranks (one snapshot).

    overflow: some gradient or the loss was inf/NaN (the dpcs overflow flag, a non-finite gradient norm or
        loss) in a step GradScaler did not handle. overflow_regions: the regions whose gradients were non-finite, when known.
    grad_norm: the latest global gradient norm; grad_norm_z: the largest deviation of the global norm from its
        running mean over the snapshot, in running standard deviations (a spike when large).
    loss, loss_z: the same for the loss. curvature_ratio: the latest top Hessian eigenvalue estimate over its
        running mean (the optional curvature probe).
    headroom: free memory as a fraction of the device's (the smallest over ranks); peak_bytes: the measured peak.
    oom: an out-of-memory error was caught in the step (`Runtime.run_step`).
    scaler_backoffs: steps GradScaler skipped and backed off from (its inf gradients are not an `overflow`);
    scale: its scale after the last step.
    """

    step: int
    steps: int = 1
    overflow: bool = False
    overflow_regions: tuple[str, ...] = ()
    grad_norm: float | None = None
    grad_norm_z: float | None = None
    loss: float | None = None
    loss_z: float | None = None
    curvature: float | None = None
    curvature_ratio: float | None = None
    headroom: float | None = None
    peak_bytes: int | None = None
    oom: bool = False
    scaler_backoffs: int = 0
    scale: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in dataclasses.asdict(self).items()
        }


def _field_error(config: object, field: str, valid: str) -> ValueError:
    return ValueError(f"{type(config).__name__}.{field}={getattr(config, field)!r} is not valid; valid choices: {valid}")


def _check_int(config: object, field: str, minimum: int) -> None:
    value = getattr(config, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field_error(config, field, f"an int >= {minimum}")


def _check_number(config: object, field: str, low: float, high: float, *, open_low: bool = True) -> None:
    value = getattr(config, field)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and value <= high
    ok = ok and (value > low if open_low else value >= low)
    if not ok:
        raise _field_error(config, field, f"a number in {'(' if open_low else '['}{low:g}, {high:g}]")


class Policy:
    """A state machine over signal snapshots. Subclasses implement `update` and `propose`, and keep every
    piece of state they need to resume in `state_dict` (plain JSON values)."""

    name = "policy"

    def __init__(self) -> None:
        self.reason: str | None = None  # why the last update changed the proposal, for logs and telemetry

    def update(self, signals: Signals) -> None:
        raise NotImplementedError

    def propose(self, decisions: Decisions) -> Decisions:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicyConfig:
    """modes: the ladder, highest precision first (e.g. ("fp32", "bf16", "fp8")); each mode strictly less
    precise than the one before. floor: the lowest mode the policy may demote to (default: the ladder's
    last). start: the mode of the first steps (default: the one the model was compiled with, or the ladder's
    top if that is not on the ladder). patience: stable steps before demoting one rung. cooldown: steps after
    a promotion before the policy demotes again. grad_z_limit / loss_z_limit: a gradient-norm or loss
    deviation of more running standard deviations than this is an instability; curvature_limit: a curvature
    estimate this many times its running mean is one. per_region: an overflow confined to some regions keeps
    those regions in fp32 rather than promoting the model. min_scale: GradScaler backing off is loss scaling
    at work (it probes a larger scale every growth_interval steps and backs off), not an overflow, unless it
    backs off below this scale (DeepSpeed and Megatron stop at 1): then the dtype's range is too small."""

    modes: tuple[str, ...] = ("fp32", "bf16")
    floor: str | None = None
    start: str | None = None
    patience: int = 200
    cooldown: int = 500
    grad_z_limit: float = 8.0
    loss_z_limit: float = 8.0
    curvature_limit: float = 4.0
    per_region: bool = True
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.modes, str) or not isinstance(self.modes, (tuple, list)) or not self.modes:
            raise _field_error(self, "modes", "a non-empty tuple of precision modes, highest precision first")
        object.__setattr__(self, "modes", tuple(self.modes))
        for mode in self.modes:
            check_mode(f"{type(self).__name__}.modes element", mode)
        if any(MODE_RANK[a] <= MODE_RANK[b] for a, b in zip(self.modes, self.modes[1:])):
            raise _field_error(
                self, "modes", "modes in strictly decreasing precision, e.g. ('fp32', 'bf16', 'fp8'), not both bf16 and fp16"
            )
        for field in ("floor", "start"):
            if getattr(self, field) is not None and getattr(self, field) not in self.modes:
                raise _field_error(self, field, f"None or one of the ladder's modes {self.modes}")
        _check_int(self, "patience", 1)
        _check_int(self, "cooldown", 0)
        for field in ("grad_z_limit", "loss_z_limit", "curvature_limit", "min_scale"):
            _check_number(self, field, 0.0, math.inf)
        if not isinstance(self.per_region, bool):
            raise _field_error(self, "per_region", "True, False")

    @property
    def floor_index(self) -> int:
        return self.modes.index(self.floor) if self.floor is not None else len(self.modes) - 1


class PrecisionPolicy(Policy):
    """Demote after patience, promote at once on overflow or instability, cooldown, floor; per-region pins."""

    name = "precision"

    def __init__(self, config: PrecisionPolicyConfig | None = None, **fields: Any) -> None:
        super().__init__()
        self.config = config_from(PrecisionPolicyConfig, config, fields, "PrecisionPolicy")
        self.index: int | None = None  # rung of the ladder; None until `start` (the runtime sets it)
        self.regions: tuple[str, ...] = ()  # regions kept in fp32
        self.stable_steps = 0
        self.cooldown_left = 0

    def start(self, compiled_mode: str) -> None:
        """Set the first rung: the config's start, else the compiled mode when it is on the ladder, else the top."""
        if self.index is not None:
            return
        mode = self.config.start or (compiled_mode if compiled_mode in self.config.modes else self.config.modes[0])
        self.index = min(self.config.modes.index(mode), self.config.floor_index)

    @property
    def mode(self) -> str:
        return self.config.modes[self.index or 0]

    def instability(self, s: Signals) -> str | None:
        """Why the snapshot counts as unstable (other than an overflow), or None."""
        c = self.config
        if s.grad_norm_z is not None and s.grad_norm_z > c.grad_z_limit:
            return f"gradient-norm spike ({s.grad_norm_z:.1f} sd > {c.grad_z_limit:g})"
        if s.loss_z is not None and s.loss_z > c.loss_z_limit:
            return f"loss spike ({s.loss_z:.1f} sd > {c.loss_z_limit:g})"
        if s.curvature_ratio is not None and s.curvature_ratio > c.curvature_limit:
            return f"curvature spike ({s.curvature_ratio:.1f}x its mean > {c.curvature_limit:g})"
        return None

    def update(self, signals: Signals) -> None:
        self.start(self.config.modes[0])
        self.reason = None
        c = self.config
        scale_floor = signals.scaler_backoffs and signals.scale is not None and signals.scale < c.min_scale
        unstable = (
            "overflow" if signals.overflow
            else f"loss scale backed off to {signals.scale:g} < min_scale {c.min_scale:g}" if scale_floor
            else self.instability(signals)
        )
        if unstable is not None:
            self.stable_steps = 0
            self.cooldown_left = self.config.cooldown
            new_regions = tuple(r for r in signals.overflow_regions if r not in self.regions)
            if signals.overflow and self.config.per_region and new_regions:
                self.regions = tuple(sorted(self.regions + new_regions))
                self.reason = f"overflow in {', '.join(new_regions)}: kept in fp32"
            elif self.index > 0:
                self.index -= 1
                self.reason = f"{unstable}: promoted to {self.mode}"
            else:
                self.reason = f"{unstable} at the top of the ladder ({self.mode}): nothing to promote"
            return
        self.stable_steps += signals.steps
        self.cooldown_left = max(0, self.cooldown_left - signals.steps)
        if self.stable_steps >= self.config.patience and self.cooldown_left == 0 and self.index < self.config.floor_index:
            self.index += 1
            self.stable_steps = 0
            self.reason = f"stable for {self.config.patience} steps: demoted to {self.mode}"

    def propose(self, decisions: Decisions) -> Decisions:
        self.start(decisions.precision)
        return dataclasses.replace(decisions, precision=self.mode, fp32_regions=self.regions)

    def state_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "regions": list(self.regions), "stable_steps": self.stable_steps,
            "cooldown_left": self.cooldown_left, "modes": list(self.config.modes),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["modes"]) != self.config.modes:
            raise ValueError(
                f"PrecisionPolicy state was saved with the ladder {tuple(state['modes'])}, this policy's is "
                f"{self.config.modes}"
            )
        self.index, self.regions = state["index"], tuple(state["regions"])
        self.stable_steps, self.cooldown_left = state["stable_steps"], state["cooldown_left"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPolicyConfig:
    """low_headroom / high_headroom: free memory fractions that tighten / (after patience) relax the budget.
    factor: each level multiplies the budget by it. max_level: the tightest level. patience: steps above
    high_headroom before relaxing one level. cooldown: steps after a tightening before relaxing."""

    low_headroom: float = 0.05
    high_headroom: float = 0.25
    factor: float = 0.85
    max_level: int = 8
    patience: int = 200
    cooldown: int = 500

    def __post_init__(self) -> None:
        _check_number(self, "low_headroom", 0.0, 1.0, open_low=False)
        _check_number(self, "high_headroom", 0.0, 1.0, open_low=False)
        if self.high_headroom <= self.low_headroom:
            raise _field_error(self, "high_headroom", f"a fraction above low_headroom={self.low_headroom!r}")
        _check_number(self, "factor", 0.0, 1.0)
        if self.factor == 1.0:
            raise _field_error(self, "factor", "a number in (0, 1)")
        _check_int(self, "max_level", 1)
        _check_int(self, "patience", 1)
        _check_int(self, "cooldown", 0)


class MemoryPolicy(Policy):
    """Tighten at once on low headroom or a caught OOM, relax after patience above the high watermark."""

    name = "memory"

    def __init__(self, config: MemoryPolicyConfig | None = None, **fields: Any) -> None:
        super().__init__()
        self.config = config_from(MemoryPolicyConfig, config, fields, "MemoryPolicy")
        self.level = 0  # 0: the budget as compiled
        self.limit = self.config.max_level  # lowered by `no_tighter` when a level's plans stop fitting
        self.high_steps = 0
        self.cooldown_left = 0

    def update(self, signals: Signals) -> None:
        self.reason = None
        c = self.config
        low = signals.headroom is not None and signals.headroom < c.low_headroom
        if signals.oom or low:
            self.high_steps = 0
            self.cooldown_left = c.cooldown
            why = "out-of-memory error" if signals.oom else f"headroom {signals.headroom:.1%} < {c.low_headroom:.0%}"
            if self.level < self.limit:
                self.level += 1
                self.reason = f"{why}: budget tightened to x{self.scale:g}"
            else:
                self.reason = f"{why} at the tightest level (x{self.scale:g}): nothing to tighten"
            return
        self.cooldown_left = max(0, self.cooldown_left - signals.steps)
        if signals.headroom is not None and signals.headroom > c.high_headroom:
            self.high_steps += signals.steps
        else:
            self.high_steps = 0
        if self.level > 0 and self.high_steps >= c.patience and self.cooldown_left == 0:
            self.level -= 1
            self.high_steps = 0
            self.reason = f"headroom above {c.high_headroom:.0%} for {c.patience} steps: budget relaxed to x{self.scale:g}"

    def no_tighter(self) -> None:
        """The plans of the current level no longer fit their budget: never go tighter than it."""
        self.limit = self.level

    @property
    def scale(self) -> float:
        return self.config.factor**self.level

    def propose(self, decisions: Decisions) -> Decisions:
        return dataclasses.replace(decisions, budget_scale=self.scale if self.level else None)

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "limit": self.limit, "high_steps": self.high_steps, "cooldown_left": self.cooldown_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level, self.limit = state["level"], state["limit"]
        self.high_steps, self.cooldown_left = state["high_steps"], state["cooldown_left"]
