"""ParameterOffload: parameters of chosen blocks live in host buffers between uses, come back before the block's
forward and backward (the next block prefetched), their gradients go out as soon as they are final, and the
optimizer steps them on the host: training equals plain AdamW bit for bit on CPU, eager and compiled."""

from __future__ import annotations

import copy

import pytest
import torch

from dpcs_compiler.model_states.compressed_optimizer import CompressedOptimizer
from dpcs_compiler.model_states.param_offload import ParameterOffload
from dpcs_compiler.model_states.state_codec import Encoded
from dpcs_testing import dpcs_compile


class Block(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.linear(self.norm(x)))


class Stack(torch.nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack() -> Stack:
    torch.manual_seed(0)
    return Stack()


def train(model, optimizer, steps: int, *, micro_batches: int = 1, seed: int = 1) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        for _ in range(micro_batches):
            loss = model(torch.randn(8, 16, generator=generator)).square().mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def offloaded(net: Stack, blocks=(1, 2), **options):
    offload = ParameterOffload([net.blocks[i] for i in blocks])
    return offload, CompressedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), offload=offload, **options)


@pytest.mark.parametrize("compiled", [None, {}, {"memory_budget": 10_000_000}], ids=["eager", "dpcs", "dpcs-budget"])
def test_offloaded_training_is_plain_adamw_bit_for_bit(compiled):
    """50 steps; through dpcs the step's loop over blocks runs eagerly around one graph per block, and with a
    budget the step planner plans those graphs (and counts the optimizer's state) as one step."""
    plain_net, net = stack(), stack()
    plain = torch.optim.AdamW(plain_net.parameters(), lr=1e-2)
    offload, optimizer = offloaded(net, states="fp32")
    run = (lambda m: dpcs_compile(m, **compiled)) if compiled is not None else (lambda m: m)
    assert train(run(plain_net), plain, 50) == train(run(net), optimizer, 50)
    expected, got = plain_net.state_dict(), net.state_dict()
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert all(p.untyped_storage().nbytes() == 0 for block in net.blocks[1:3] for p in block.parameters())
    state_bytes = optimizer.state_bytes()
    block_state = sum(p.numel() * 4 * 2 for block in net.blocks[1:3] for p in block.parameters())
    assert state_bytes["host"] >= block_state  # the offloaded blocks' moments live with them on the host
    if compiled is not None:
        from dpcs_compiler import compile_records
        from dpcs_compiler.report import step_records

        assert compile_records(), "the blocks ran through dpcs"
        if compiled:
            assert step_records() and all(r.feasible for r in step_records())
            assert step_records()[-1].split()["optimizer_state"] > 0


def test_end_warmup_stores_the_state_now():
    model = stack()
    optimizer = CompressedOptimizer(torch.optim.AdamW(model.parameters()), states="int8", warmup_steps=10,
                                    min_elements=0)
    train(model, optimizer, 2)
    assert not any(isinstance(v, Encoded) for state in optimizer.state.values() for v in state.values())
    optimizer.end_warmup()
    assert all(isinstance(state["exp_avg"], Encoded) for state in optimizer.state.values())


def test_gradients_accumulate_over_micro_batches_as_on_the_device():
    plain_net, net = stack(), stack()
    plain = torch.optim.AdamW(plain_net.parameters(), lr=1e-2)
    _, optimizer = offloaded(net, states="fp32")
    assert train(plain_net, plain, 5, micro_batches=3) == train(net, optimizer, 5, micro_batches=3)
    for a, b in zip(plain_net.parameters(), net.state_dict().values()):
        assert torch.equal(a.detach(), b)


def test_a_block_is_in_memory_only_while_it_or_its_neighbour_runs():
    net = stack()
    offload, optimizer = offloaded(net, blocks=(0, 1, 2, 3))
    seen: list[tuple[str, int, list[int]]] = []

    def resident() -> list[int]:
        return [i for i, block in enumerate(net.blocks) if block.linear.weight.untyped_storage().nbytes()]

    for i, block in enumerate(net.blocks):
        block.linear.register_forward_hook(lambda *_, i=i: seen.append(("forward", i, resident())))
        block.linear.weight.register_hook(lambda grad, i=i: seen.append(("backward", i, resident())))
    train(net, optimizer, 1)  # learns the order
    seen.clear()
    train(net, optimizer, 1)
    assert seen == [
        ("forward", 0, [0, 1]), ("forward", 1, [1, 2]), ("forward", 2, [2, 3]), ("forward", 3, [3]),
        ("backward", 3, [2, 3]), ("backward", 2, [1, 2]), ("backward", 1, [0, 1]), ("backward", 0, [0]),
    ]
    assert resident() == [] and all(p.grad is None for p in net.parameters() if offload.owns(p))


def test_frozen_parameters_come_back_for_backward_and_go_after_it():
    plain_net, net = stack(), stack()
    for model in (plain_net, net):
        model.blocks[1].linear.weight.requires_grad_(False)
    plain = torch.optim.AdamW([p for p in plain_net.parameters() if p.requires_grad], lr=1e-2)
    offload = ParameterOffload([net.blocks[1], net.blocks[2]])
    optimizer = CompressedOptimizer(torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2),
                                    states="fp32", offload=offload)
    assert train(plain_net, plain, 5) == train(net, optimizer, 5)
    assert net.blocks[1].linear.weight.untyped_storage().nbytes() == 0


def test_compressed_state_of_offloaded_parameters_stays_on_the_host_and_round_trips():
    net = stack()
    _, optimizer = offloaded(net, states="int8", min_elements=0)
    train(net, optimizer, 3)
    stored = optimizer.state[net.blocks[1].linear.weight]["exp_avg"]
    assert isinstance(stored, Encoded) and stored.codes.device.type == "cpu"
    saved = copy.deepcopy(optimizer.state_dict())
    model_saved = copy.deepcopy(net.state_dict())

    twin = stack()
    twin_offload, twin_optimizer = offloaded(twin, states="int8", min_elements=0)
    twin.load_state_dict(model_saved)
    twin_optimizer.load_state_dict(saved)
    assert all(p.untyped_storage().nbytes() == 0 for p in twin.blocks[1].parameters())
    assert train(net, optimizer, 3, seed=5) == train(twin, twin_optimizer, 3, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), twin.state_dict().values()))


@pytest.mark.parametrize("states", ["fp32", "int8"])
def test_blocks_switched_between_host_and_device_train_as_without_switching(states):
    """`use()` between steps and between micro-batches (a gradient half accumulated on each side): parameters,
    gradients and optimizer state follow the block, and training is what it is with no switch (fp32 state:
    plain AdamW bit for bit)."""
    reference_net, net = stack(), stack()
    options = {"states": states, "min_elements": 0}
    reference = (torch.optim.AdamW(reference_net.parameters(), lr=1e-2) if states == "fp32" else
                 CompressedOptimizer(torch.optim.AdamW(reference_net.parameters(), lr=1e-2), **options))
    offload = ParameterOffload(list(net.blocks), auto=True)
    optimizer = CompressedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), offload=offload, **options)
    choices = [[0, 1, 2, 3], [], [1, 3], [0, 2], [2], [0, 1, 2, 3], [3]]
    generator = torch.Generator().manual_seed(3)
    expected, got = [], []
    for chosen in choices:
        for micro_batch in range(2):
            if micro_batch == 1:  # half the gradient accumulated as the blocks were, half as they are now
                offload.use([net.blocks[i] for i in chosen])
            x = torch.randn(8, 16, generator=generator)
            for model, losses in ((reference_net, expected), (net, got)):
                loss = model(x).square().mean()
                loss.backward()
                losses.append(loss.item())
        reference.step(), optimizer.step()
        reference.zero_grad(), optimizer.zero_grad()
        assert offload.offloaded_modules() == [net.blocks[i] for i in chosen]
        resident = [i for i, b in enumerate(net.blocks) if b.linear.weight.untyped_storage().nbytes()]
        assert resident == [i for i in range(4) if i not in chosen]
    assert expected == got
    assert all(torch.equal(a, b) for a, b in zip(reference_net.state_dict().values(), net.state_dict().values()))
    # The last choice offloads block 3 only: its state alone is in host memory.
    def nbytes(value):
        return value.nbytes if isinstance(value, Encoded) else value.untyped_storage().nbytes()

    block3 = sum(nbytes(v) for p in net.blocks[3].parameters() for v in optimizer.state[p].values())
    assert optimizer.state_bytes()["host"] == block3 > 0


def test_a_plain_optimizer_on_offloaded_parameters_is_refused():
    net = stack()
    offload = ParameterOffload([net.blocks[0]])
    plain = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.randn(2, 16)).sum().backward()
    with pytest.raises(RuntimeError, match="SGD steps parameters whose gradients ParameterOffload keeps on the host"):
        plain.step()
    offload.close()
    assert all(p.untyped_storage().nbytes() > 0 for p in net.parameters())


@pytest.mark.parametrize(
    "modules, kwargs, message",
    [
        (lambda net: [], {}, "non-empty list of nn.Module"),
        (lambda net: [net.blocks, net.blocks[0]], {}, "must not contain each other: ModuleList contains Block"),
        (lambda net: [net.blocks[0]], {"prefetch": -1}, "prefetch must be an int >= 0; got -1"),
        (lambda net: [net.blocks[0]], {"auto": "yes"}, "auto must be True or False; got 'yes'"),
    ],
)
def test_bad_input_is_named(modules, kwargs, message):
    net = stack()
    with pytest.raises(ValueError, match=message):
        ParameterOffload(modules(net), **kwargs)


def test_use_names_only_its_own_modules():
    net = stack()
    offload = ParameterOffload([net.blocks[0]], auto=True)
    with pytest.raises(ValueError, match="use\\(\\) names 1 modules this ParameterOffload was not given"):
        offload.use([net.blocks[1]])
    offload.close()


def test_gathered_parameters_can_be_read_and_written_between_steps():
    """Between steps an offloaded parameter's storage is empty; `gathered()` brings every one back for reads and
    writes (an EMA of the weights), keeps what was written, and lets them go again."""
    net = stack()
    twin = copy.deepcopy(net)
    offload, optimizer = offloaded(net)
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    train(net, optimizer, 2)
    train(twin, plain, 2)
    block = net.blocks[1].linear.weight
    assert block.untyped_storage().nbytes() == 0
    with offload.gathered():
        for mine, theirs in zip(net.parameters(), twin.parameters()):
            torch.testing.assert_close(mine.detach().clone(), theirs.detach(), rtol=0, atol=0)
        with torch.no_grad():
            block.mul_(0.5)
    assert block.untyped_storage().nbytes() == 0
    torch.testing.assert_close(offload.host_param(block), 0.5 * twin.blocks[1].linear.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(net.state_dict()["blocks.1.linear.weight"], offload.host_param(block), rtol=0, atol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlapped-step"])
def test_an_offload_nobody_closed_goes_with_its_model(overlap):
    """Its hooks hold it weakly where the garbage collector cannot see them (a parameter's, torch's global
    optimizer hook): once the model and optimizer go, so do the offload and its host memory."""
    import gc
    import time
    import weakref

    net = stack()
    offload = ParameterOffload([net.blocks[1], net.blocks[2]])
    optimizer = CompressedOptimizer(torch.optim.AdamW(net.parameters()), states="fp32", offload=offload,
                                    overlap=overlap)
    train(net, optimizer, 2)
    optimizer.wait()
    gone = weakref.ref(offload)
    del net, offload, optimizer
    for _ in range(100):  # the stepping thread lets go of its last task a moment after finishing it
        gc.collect()
        if gone() is None:
            break
        time.sleep(0.01)
    assert gone() is None
