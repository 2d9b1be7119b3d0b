"""SignalCollector on plain parameters with hand-set gradients: what one read reports, and Moments."""

from __future__ import annotations

import math

import pytest
import torch

from dpcs_compiler.distributed.signals import combine
from dpcs_compiler.runtime.signals import Moments, SignalCollector, reduce_rule


def collector(every=3):
    a, b, loose = (torch.nn.Parameter(torch.zeros(4)) for _ in range(3))
    return SignalCollector({"a": [a], "b": [b]}, [a, b, loose], every=every, warmup=2), (a, b, loose)


def read(c, step):
    c.launch_read()
    return c.snapshot_from(c.take_read(), step)


def test_per_region_norms_and_a_confined_overflow():
    c, (a, b, loose) = collector()
    a.grad, b.grad, loose.grad = torch.full((4,), 3.0), torch.full((4,), 4.0), torch.zeros(4)
    c.collect(loss=torch.tensor(2.0), scaler=None)
    b.grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    c.collect(loss=torch.tensor(1.5), scaler=None)
    signals = read(c, 2)
    assert signals.steps == 2 and signals.overflow and signals.overflow_regions == ("b",)
    assert signals.grad_norm is None  # the last step's norm is not finite
    assert c.grad.count == 1 and c.grad.mean == pytest.approx(math.sqrt(4 * 9 + 4 * 16))
    assert signals.loss == 1.5


def test_an_overflow_everywhere_names_no_region_and_a_nan_loss_is_one():
    c, (a, b, loose) = collector()
    a.grad = b.grad = loose.grad = torch.full((4,), float("nan"))
    c.collect(loss=torch.tensor(1.0), scaler=None)
    signals = read(c, 1)
    assert signals.overflow and signals.overflow_regions == ()
    a.grad = b.grad = loose.grad = torch.ones(4)
    c.collect(loss=torch.tensor(float("inf")), scaler=None)
    assert read(c, 2).overflow


def test_a_scaler_backing_off_is_a_back_off_not_an_overflow_and_steps_without_gradients():
    class Scaler:
        def __init__(self):
            self._scale = torch.tensor(1024.0)

        def is_enabled(self):
            return True

    c, (a, b, loose) = collector(every=4)
    scaler = Scaler()
    c.collect(loss=None, scaler=scaler)  # no gradients, no loss
    c.collect(loss=None, scaler=scaler)
    a.grad = b.grad = loose.grad = torch.full((4,), float("inf"))  # the step GradScaler skips
    scaler._scale = torch.tensor(512.0)
    c.collect(loss=None, scaler=scaler)
    signals = read(c, 3)
    assert not signals.overflow and signals.overflow_regions == ()
    assert (signals.scaler_backoffs, signals.scale) == (1, 512.0)
    assert signals.grad_norm is None and signals.loss is None and signals.steps == 3
    c.collect(loss=None, scaler=scaler)  # the same inf gradients, and the scale stayed: not handled
    signals = read(c, 4)
    assert signals.overflow and signals.scaler_backoffs == 0


def test_moments_measure_spikes_in_running_deviations_after_the_warmup():
    m = Moments(decay=0.9, warmup=3)
    for value in (1.0, 1.01, 0.99, 1.0, 1.02):
        m.update(value)
    assert m.max_z < 1.0  # a spread under 5% of the mean counts as 5%
    m.update(2.0)
    assert m.max_z == pytest.approx(abs(2.0 - 1.0) / 0.05, rel=0.05)
    m.update(float("nan"))
    assert m.count == 6 and m.last != m.last  # skipped, remembered as the last value


def test_ranks_combine_any_overflow_mean_statistics_and_the_least_headroom():
    c, _ = collector()
    rules = reduce_rule(len(c.region_names))
    # regions a, b, loose; overflow, grad_norm, grad_z, loss, loss_z, steps, headroom, peak, oom, curvature, ratio,
    # scaler back-offs, scale
    zero = [0, 0, 0, 0.0, 2.0, 1.0, 3.0, 0.5, 10, 0.4, 100, 0, -1, -1, 1, 512.0]
    one = [0, 1, 0, 1.0, 4.0, 7.0, 5.0, 0.2, 10, -1, 300, 0, -1, -1, 0, 1024.0]
    combined = combine([zero, one], rules)
    assert combined == [0, 1, 0, 1.0, 3.0, 7.0, 4.0, 0.5, 10, 0.4, 300, 0, -1, -1, 1, 512.0]
    signals = c.snapshot_from(combined, 10)
    assert signals.overflow_regions == ("b",) and signals.headroom == 0.4 and signals.peak_bytes == 300
    assert (signals.scaler_backoffs, signals.scale) == (1, 512.0)


def test_a_state_saved_between_reads_keeps_the_unread_steps_and_a_launched_read():
    """A checkpoint between two reads (rows written, or a read launched and not yet taken, as on an
    accelerator) restores them: the resumed collector reads what the uninterrupted one reads."""
    import json

    def steps(c, params, losses, first=1):
        for i, loss in enumerate(losses, first):
            for p in params:
                p.grad = torch.full((4,), float(i))
            c.collect(loss=torch.tensor(loss), scaler=None)

    whole, params = collector(every=4)
    steps(whole, params, [3.0, float("inf"), 2.0])
    expected = whole.snapshot_from((whole.launch_read(), whole.take_read())[1], 3)

    half, params = collector(every=4)
    steps(half, params, [3.0, float("inf")])
    resumed, params = collector(every=4)
    resumed.load_state_dict(json.loads(json.dumps(half.state_dict())))
    steps(resumed, params, [2.0], first=3)
    got = resumed.snapshot_from((resumed.launch_read(), resumed.take_read())[1], 3)
    assert got.steps == 3 and got.overflow and got.loss == 2.0
    assert (got.grad_norm, got.loss_z, resumed.loss.state()) == (expected.grad_norm, expected.loss_z, whole.loss.state())

    launched, params = collector(every=4)
    steps(launched, params, [3.0, float("inf"), 2.0])
    launched.launch_read()
    resumed, _ = collector(every=4)
    resumed.load_state_dict(json.loads(json.dumps(launched.state_dict())))
    got = resumed.snapshot_from(resumed.take_read(), 3)
    assert (got.steps, got.overflow, got.loss, got.grad_norm) == (3, True, 2.0, expected.grad_norm)

    with pytest.raises(ValueError, match="signal_every"):
        collector(every=2)[0].load_state_dict(half.state_dict() | {"unread": {"values": [[0.0] * 6] * 3, "rows": []}})
    other = SignalCollector({}, [torch.nn.Parameter(torch.zeros(1))], every=4)
    with pytest.raises(ValueError, match="another model"):
        other.load_state_dict(half.state_dict())
