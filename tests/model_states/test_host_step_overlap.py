"""CompressedOptimizer(offload=..., overlap=True): the host step of offloaded parameters runs on a background
thread while the next forward starts, module by module in the forward's order. It trains bit for bit as the
step in the foreground, with schedulers, accumulation and state dicts taken mid-flight; each module's forward
waits for its own step only; an error in the background reaches the training loop."""

from __future__ import annotations

import threading

import pytest
import torch

from dpcs_compiler.model_states.compressed_optimizer import CompressedOptimizer
from dpcs_testing import dpcs_compile
from tests.model_states.test_param_offload import offloaded, stack

# A block has 1088 elements; `chunk_bytes` counts 12 bytes of state an element for AdamW (its three possible
# moments): a chunk per block, its weight sliced in rows (once its state exists) with a third of that.
ONE_BLOCK = 1088 * 12


def optimizer_for(net, *, overlap: bool, blocks=(0, 1, 2, 3), **options) -> CompressedOptimizer:
    return offloaded(net, blocks, overlap=overlap, **options)[1]


def run(net, optimizer, steps: int, *, micro_batches: int = 2, snapshot_at: int | None = None):
    """Losses, and the optimizer's state dict right after step `snapshot_at` (a background step in flight)."""
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    generator = torch.Generator().manual_seed(1)
    losses, snapshot = [], None
    for step in range(steps):
        for _ in range(micro_batches):
            loss = net(torch.randn(8, 16, generator=generator)).square().mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        if step == snapshot_at:
            snapshot = optimizer.state_dict()
        schedule.step()  # changes the groups' lr while the background step may still run
        optimizer.zero_grad()
    if isinstance(optimizer, CompressedOptimizer):
        optimizer.wait()
    return losses, snapshot


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("options", [
    {"states": "fp32"},
    {"states": "int8", "min_elements": 0, "chunk_bytes": ONE_BLOCK // 3},
    {"states": {"exp_avg": "bf16"}, "blocks": (1, 3), "chunk_bytes": ONE_BLOCK},
], ids=["fp32", "int8-sliced", "bf16-some-blocks"])
def test_overlapped_step_trains_as_the_step_in_the_foreground(options):
    nets = [stack(), stack()]
    optimizers = [optimizer_for(net, overlap=overlap, **options) for net, overlap in zip(nets, (False, True))]
    (losses, snapshot), (overlapped, overlapped_snapshot) = (run(n, o, 6, snapshot_at=2)
                                                               for n, o in zip(nets, optimizers))
    assert losses == overlapped
    assert_same(snapshot, overlapped_snapshot)
    assert_same(optimizers[0].state_dict(), optimizers[1].state_dict())
    assert_same(nets[0].state_dict(), nets[1].state_dict())


def test_overlapped_step_through_dpcs_is_plain_adamw():
    plain_net, net = stack(), stack()
    plain = torch.optim.AdamW(plain_net.parameters(), lr=1e-2)
    optimizer = optimizer_for(net, overlap=True, states="fp32")
    assert run(dpcs_compile(plain_net), plain, 5)[0] == run(dpcs_compile(net), optimizer, 5)[0]
    assert_same(plain_net.state_dict(), net.state_dict())


def test_each_forward_waits_for_its_own_module_only():
    """The background step of the last block is held until the second block's forward has started: the forward
    runs ahead of it, and every block's step still ends before that block's forward."""
    net = stack()
    optimizer = optimizer_for(net, overlap=True, states="fp32", chunk_bytes=ONE_BLOCK)
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    second_started = threading.Event()
    block_of = {id(p): i for i, block in enumerate(net.blocks) for p in block.parameters()}
    step_chunk = optimizer._step_chunk

    def recorded_step(chunk, groups):
        blocks = {block_of[id(p)] for p in chunk if id(p) in block_of}
        if groups is not None and 3 in blocks:
            assert second_started.wait(timeout=60), "the forward did not start while the last block's step ran"
        step_chunk(chunk, groups)
        with lock:
            events.extend(("stepped", b) for b in sorted(blocks))

    def forward_started(index):
        def hook(module, args):
            with lock:
                events.append(("forward", index))
            if index == 1 and ("forward", 1) in events[:-1]:  # the second step's
                second_started.set()
        return hook

    optimizer._step_chunk = recorded_step
    for i, block in enumerate(net.blocks):
        block.register_forward_pre_hook(forward_started(i))
    run(net, optimizer, 2, micro_batches=1)
    assert events[:4] == [("forward", i) for i in range(4)]
    after = events[4:]  # the first background step, the second forward and what followed
    assert after.index(("forward", 1)) < after.index(("stepped", 3))  # ran ahead of the step
    for i in range(4):
        assert after.index(("stepped", i)) < after.index(("forward", i))  # and waited for its own


def test_a_failed_background_step_stops_training():
    net = stack()
    optimizer = optimizer_for(net, overlap=True, states="fp32")
    step_chunk = optimizer._step_chunk

    def failing(chunk, groups):
        if groups is not None:
            raise MemoryError("injected")
        step_chunk(chunk, groups)

    optimizer._step_chunk = failing
    net(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="background optimizer step of offloaded parameters failed") as info:
        net(torch.randn(8, 16))
    assert isinstance(info.value.__cause__, MemoryError)
    with pytest.raises(RuntimeError, match="background optimizer step"):
        optimizer.state_dict()


def test_scheduler_change_during_the_background_step_applies_to_the_next_step():
    """The background step is held until the scheduler has set the next step's lr: it still steps with the lr
    of the step that launched it."""
    nets = [stack(), stack()]
    optimizers = [optimizer_for(net, overlap=overlap, states="fp32") for net, overlap in zip(nets, (False, True))]
    gate = threading.Event()
    launched = optimizers[1]._run_later
    optimizers[1]._run_later = lambda pieces, groups: (gate.wait(timeout=60), launched(pieces, groups))
    x = torch.randn(8, 16)
    for net, optimizer in zip(nets, optimizers):
        net(x).square().mean().backward()
        optimizer.step()
        for group in optimizer.param_groups:
            group["lr"] = 123.0
    gate.set()
    optimizers[1].wait()
    assert_same(nets[0].state_dict(), nets[1].state_dict())


@pytest.mark.parametrize("kwargs, message", [
    ({"overlap": True}, "needs offload="),
    ({"overlap": "yes"}, "overlap must be True or False"),
])
def test_bad_overlap_options_are_named(kwargs, message):
    net = stack()
    with pytest.raises(ValueError, match=message):
        CompressedOptimizer(torch.optim.AdamW(net.parameters()), **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_overlapped_host_step_trains_as_the_step_in_the_foreground():
    """Pinned host copies, side-stream fetches and gradient copies out, the host step on its thread."""
    nets = [stack().cuda(), stack().cuda()]
    optimizers = [optimizer_for(net, overlap=overlap, states="fp32") for net, overlap in zip(nets, (False, True))]
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 16, generator=generator).cuda() for _ in range(4)]
    losses = [[], []]
    for batch in batches:
        for i, (net, optimizer) in enumerate(zip(nets, optimizers)):
            loss = net(batch).square().mean()
            loss.backward()
            losses[i].append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
    optimizers[1].wait()
    assert losses[0] == losses[1]
    assert_same(nets[0].state_dict(), nets[1].state_dict())
