"""Policies on synthetic signal traces: pure Python, no graphs, no torch."""

from __future__ import annotations

import pytest

from dpcs_compiler.runtime.decisions import Decisions
from dpcs_compiler.runtime.policies import (
    MemoryPolicy,
    MemoryPolicyConfig,
    PrecisionPolicy,
    PrecisionPolicyConfig,
    Signals,
)


def run(policy, trace, start=Decisions()):
    """Feed `trace` (one Signals per read) and return the proposed decisions after each read."""
    out = []
    for signals in trace:
        policy.update(signals)
        out.append(policy.propose(start))
    return out


def stable(step, steps=10, **kw):
    return Signals(step=step, steps=steps, grad_norm=1.0, grad_norm_z=0.5, loss=2.0, loss_z=0.5, headroom=0.15, **kw)


def test_precision_demotes_after_patience_and_promotes_at_once_on_overflow():
    policy = PrecisionPolicy(modes=("fp32", "bf16", "fp8"), patience=30, cooldown=50)
    trace = [stable(10 * i) for i in range(1, 7)]  # 60 stable steps: demote at 30 and at 60
    trace.append(stable(70, overflow=True))
    modes = [d.precision for d in run(policy, trace)]
    assert modes == ["fp32", "fp32", "bf16", "bf16", "bf16", "fp8", "bf16"]
    assert "promoted to bf16" in policy.reason


def test_cooldown_delays_the_next_demotion_after_a_promotion():
    policy = PrecisionPolicy(modes=("fp32", "bf16"), patience=10, cooldown=40)
    trace = [stable(10), Signals(step=20, steps=10, overflow=True)] + [stable(20 + 10 * i) for i in range(1, 6)]
    modes = [d.precision for d in run(policy, trace)]
    # demoted after 10 stable steps, promoted on the overflow, then 40 steps of cooldown before demoting again
    assert modes == ["bf16", "fp32", "fp32", "fp32", "fp32", "bf16", "bf16"]


def test_hysteresis_keeps_an_alternating_trace_from_thrashing():
    policy = PrecisionPolicy(modes=("fp32", "bf16"), patience=20, cooldown=100)
    trace = [stable(i * 10, overflow=(i % 3 == 0)) for i in range(1, 61)]
    modes = [d.precision for d in run(policy, trace)]
    switches = sum(a != b for a, b in zip(modes, modes[1:]))
    assert switches <= 2, modes


def test_never_below_the_floor():
    policy = PrecisionPolicy(modes=("fp32", "bf16", "fp8"), floor="bf16", patience=10, cooldown=0)
    modes = [d.precision for d in run(policy, [stable(10 * i) for i in range(1, 20)])]
    assert set(modes) == {"bf16"} and "fp8" not in modes


@pytest.mark.parametrize(
    "spike, reason",
    [({"grad_norm_z": 12.0}, "gradient-norm spike"), ({"loss_z": 9.0}, "loss spike"), ({"curvature_ratio": 5.0}, "curvature spike")],
)
def test_instabilities_promote(spike, reason):
    policy = PrecisionPolicy(modes=("fp32", "bf16"), start="bf16")
    [decision] = run(policy, [Signals(step=10, steps=10, **spike)])
    assert decision.precision == "fp32" and reason in policy.reason


def test_an_overflow_confined_to_regions_keeps_them_in_fp32_and_a_second_promotes():
    policy = PrecisionPolicy(modes=("fp32", "bf16"), start="bf16")
    first, again, unknown = run(
        policy,
        [
            Signals(step=10, overflow=True, overflow_regions=("blocks.1",)),
            Signals(step=20, overflow=True, overflow_regions=("blocks.1",)),  # already kept: promote the model
            Signals(step=30, overflow=True),
        ],
    )
    assert (first.precision, first.fp32_regions) == ("bf16", ("blocks.1",))
    assert (again.precision, again.fp32_regions) == ("fp32", ("blocks.1",))
    assert unknown.precision == "fp32" and "nothing to promote" in policy.reason


def test_per_region_off_promotes_the_model():
    policy = PrecisionPolicy(modes=("fp32", "bf16"), start="bf16", per_region=False)
    [decision] = run(policy, [Signals(step=10, overflow=True, overflow_regions=("blocks.1",))])
    assert (decision.precision, decision.fp32_regions) == ("fp32", ())


def test_start_defaults_to_the_compiled_mode_on_the_ladder():
    policy = PrecisionPolicy(modes=("fp32", "bf16", "fp8"))
    assert policy.propose(Decisions(precision="bf16")).precision == "bf16"
    other = PrecisionPolicy(modes=("fp32", "bf16"))
    assert other.propose(Decisions(precision="fp16")).precision == "fp32"  # not on the ladder: its top


def test_memory_tightens_at_once_and_relaxes_after_patience_and_cooldown():
    policy = MemoryPolicy(low_headroom=0.05, high_headroom=0.3, factor=0.5, patience=20, cooldown=30)
    trace = [
        Signals(step=10, steps=10, headroom=0.02),  # tighten: x0.5
        Signals(step=11, steps=1, oom=True),  # tighten again: x0.25
        *[Signals(step=11 + 10 * i, steps=10, headroom=0.5) for i in range(1, 6)],
    ]
    scales = [d.budget_scale for d in run(policy, trace)]
    # the cooldown holds until 30 steps after the OOM; then 20 steps above the watermark per level relaxed
    assert scales == [0.5, 0.25, 0.25, 0.25, 0.5, 0.5, None]
    assert policy.level == 0


def test_memory_relaxes_only_after_a_run_of_high_headroom():
    policy = MemoryPolicy(high_headroom=0.3, patience=30, cooldown=0, factor=0.5)
    policy.level = 2
    trace = [Signals(step=i * 10, steps=10, headroom=h) for i, h in enumerate([0.5, 0.5, 0.2, 0.5, 0.5, 0.5], 1)]
    levels = []
    for s in trace:
        policy.update(s)
        levels.append(policy.level)
    assert levels == [2, 2, 2, 2, 2, 1]  # the dip at 0.2 restarts the count


def test_memory_never_tighter_than_its_limit():
    policy = MemoryPolicy(max_level=2, factor=0.5)
    for i in range(5):
        policy.update(Signals(step=i, oom=True))
    assert policy.level == 2 and "nothing to tighten" in policy.reason
    policy.level = 1
    policy.no_tighter()
    policy.update(Signals(step=9, oom=True))
    assert policy.level == 1


@pytest.mark.parametrize(
    "cls, fields, named",
    [
        (PrecisionPolicyConfig, {"modes": ("bf16", "fp32")}, "PrecisionPolicyConfig.modes"),
        (PrecisionPolicyConfig, {"modes": ("fp32", "bf16", "fp16")}, "PrecisionPolicyConfig.modes"),
        (PrecisionPolicyConfig, {"modes": ("fp32", "int4")}, "modes element"),
        (PrecisionPolicyConfig, {"floor": "fp8"}, "PrecisionPolicyConfig.floor"),
        (PrecisionPolicyConfig, {"patience": 0}, "PrecisionPolicyConfig.patience"),
        (PrecisionPolicyConfig, {"grad_z_limit": -1}, "PrecisionPolicyConfig.grad_z_limit"),
        (MemoryPolicyConfig, {"low_headroom": 0.5, "high_headroom": 0.2}, "MemoryPolicyConfig.high_headroom"),
        (MemoryPolicyConfig, {"factor": 1.0}, "MemoryPolicyConfig.factor"),
        (MemoryPolicyConfig, {"max_level": True}, "MemoryPolicyConfig.max_level"),
    ],
)
def test_configs_name_the_bad_field(cls, fields, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        cls(**fields)


def test_policy_state_round_trips_and_takes_the_same_decisions():
    def trace():
        return [stable(10 * i, overflow=(i == 4)) for i in range(1, 12)]

    a = PrecisionPolicy(modes=("fp32", "bf16", "fp8"), patience=20, cooldown=30)
    first_half, second_half = trace()[:5], trace()[5:]
    run(a, first_half)
    b = PrecisionPolicy(modes=("fp32", "bf16", "fp8"), patience=20, cooldown=30)
    b.load_state_dict(a.state_dict())
    assert [d.precision for d in run(a, second_half)] == [d.precision for d in run(b, second_half)]
    with pytest.raises(ValueError, match="ladder"):
        PrecisionPolicy(modes=("fp32", "bf16")).load_state_dict(a.state_dict())


def test_decisions_validate_and_key_stably():
    assert Decisions(fp32_regions=("b", "a")).key() == Decisions(fp32_regions=("a", "b", "a")).key()
    assert Decisions(budget_scale=0.85**2).key() == Decisions(budget_scale=0.7225).key()
    assert Decisions.from_json(Decisions("fp8", ("x",), 0.5).to_json()) == Decisions("fp8", ("x",), 0.5)
    for bad in ({"precision": "int8"}, {"budget_scale": 1.5}, {"budget_bytes": 0}, {"fp32_regions": "blocks"}):
        with pytest.raises(ValueError, match="Decisions"):
            Decisions(**bad)


def test_scaler_back_offs_promote_only_below_min_scale():
    policy = PrecisionPolicy(modes=("fp32", "bf16"), start="bf16", min_scale=1.0, patience=10**6)
    routine = Signals(step=10, steps=10, scaler_backoffs=1, scale=32768.0)
    [kept] = run(policy, [routine])
    assert kept.precision == "bf16" and policy.reason is None
    [promoted] = run(policy, [Signals(step=20, steps=10, scaler_backoffs=3, scale=0.5)])
    assert promoted.precision == "fp32" and "loss scale backed off to 0.5 < min_scale 1" in policy.reason
