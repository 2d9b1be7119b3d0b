"""Checkpoints a killed run resumes from: committed atomically, checked against their manifest before they are
loaded, the newest kept, and a run resumed from one continuing bit for bit (single process and 2 gloo ranks
under FSDP2, resumed on 2 ranks and on 1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from dpcs_compiler import Runtime, checkpoint
from dpcs_compiler.model_states import CompressedOptimizer
from dpcs_testing import dpcs_compile, run_rank_processes


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def data(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=generator) for _ in range(steps)]


def train(model, optimizer, batches, runtime=None) -> list[float]:
    losses = []
    for x in batches:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        if runtime is not None:
            runtime.step(loss=loss, optimizer=optimizer)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("compressed", [False, True], ids=["adamw", "compressed-int8"])
def test_a_resumed_run_continues_as_the_uninterrupted_one_bit_for_bit(tmp_path, compressed):
    def optimizer_of(model):
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return CompressedOptimizer(inner, states="int8", min_elements=0) if compressed else inner

    batches = data(6)
    model = net()
    optimizer = optimizer_of(model)
    train(model, optimizer, batches[:3])
    path = checkpoint.save(tmp_path, 3, model=model, optimizer=optimizer, extra={"batch": 3, "seed": 1})
    assert path == tmp_path / "step_000000003" and checkpoint.verify(path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000003"], "no partial directory left"
    uninterrupted = train(model, optimizer, batches[3:])

    fresh = net()
    fresh_optimizer = optimizer_of(fresh)
    extra: dict = {}
    step = checkpoint.resume(tmp_path, model=fresh, optimizer=fresh_optimizer, extra=extra)
    assert step == 3 and extra == {"batch": 3, "seed": 1}
    assert train(fresh, fresh_optimizer, batches[step:]) == uninterrupted
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_the_runtime_comes_back_with_its_state(tmp_path):
    model = net()
    compiled = dpcs_compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runtime = Runtime(model, signal_every=1)
    train(compiled, optimizer, data(3), runtime)
    checkpoint.save(tmp_path, 3, model=model, optimizer=optimizer, runtime=runtime)
    again = Runtime(net(), signal_every=1)
    assert checkpoint.resume(tmp_path, model=net(), runtime=again) == 3
    assert again.state_dict() == runtime.state_dict() and again.step_count == 3
    runtime.close()
    again.close()
    with pytest.raises(checkpoint.CheckpointError, match="no Runtime state"):
        checkpoint.save(tmp_path, 4, model=model)
        checkpoint.resume(tmp_path, runtime=Runtime(net()))


def test_a_resumed_run_compiles_only_the_variant_it_was_running(tmp_path):
    """Through a checkpoint, as a restarted job does: the runtime had switched to bf16; the resumed job's first
    compile is that variant, and nothing else is compiled."""
    model = net()
    compiled = dpcs_compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runtime = Runtime(model, signal_every=1)
    runtime.force_precision("bf16")
    train(compiled, optimizer, data(3), runtime)
    assert [e.decisions for e in runtime.compile_events] == ["bf16"]  # the first compile is already bf16
    checkpoint.save(tmp_path, 3, model=model, optimizer=optimizer, runtime=runtime)
    runtime.close()

    torch._dynamo.reset()  # a new process: nothing compiled yet
    fresh = net()
    fresh_compiled = dpcs_compile(fresh)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    again = Runtime(fresh, signal_every=1)
    assert checkpoint.resume(tmp_path, model=fresh, optimizer=fresh_optimizer, runtime=again) == 3
    train(fresh_compiled, fresh_optimizer, data(2), again)
    assert [e.decisions for e in again.compile_events] == ["bf16"]
    assert [g.compiles for g in again.graphs] == [1] and again.decisions.precision == "bf16"
    again.close()


def test_the_newest_checkpoints_are_kept_and_a_first_run_finds_none(tmp_path):
    assert checkpoint.resume(tmp_path / "none") is None and checkpoint.latest(tmp_path) is None
    model = net()
    for step in range(1, 6):
        checkpoint.save(tmp_path, step, model=model, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004", "step_000000005"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000000005"
    checkpoint.save(tmp_path, 5, model=model, keep=2)  # the same step again replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004", "step_000000005"]


def break_truncate(path: Path) -> None:
    file = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def break_flip(path: Path) -> None:
    file = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def break_remove(path: Path) -> None:
    (path / ".metadata").unlink()


def break_manifest(path: Path) -> None:
    (path / checkpoint.MANIFEST).write_text("{")


@pytest.mark.parametrize("damage", [break_truncate, break_flip, break_remove, break_manifest],
                         ids=["truncated", "changed", "file-missing", "manifest-broken"])
def test_a_damaged_checkpoint_is_skipped_with_a_warning_naming_it_never_loaded(tmp_path, damage):
    batches = data(4)
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, batches[:2])
    checkpoint.save(tmp_path, 2, model=model, optimizer=optimizer)
    expected = [p.detach().clone() for p in model.parameters()]
    train(model, optimizer, batches[2:])
    newest = checkpoint.save(tmp_path, 4, model=model, optimizer=optimizer)
    damage(newest)
    assert checkpoint.verify(newest) is not None
    fresh = net()
    with pytest.warns(UserWarning, match=f"checkpoint {newest} is skipped, not loaded"):
        step = checkpoint.resume(tmp_path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert step == 2
    for a, b in zip(expected, fresh.parameters()):
        assert torch.equal(a, b)


def test_a_save_killed_before_its_commit_leaves_nothing_resume_would_load(tmp_path):
    """What a save killed midway leaves: a `.partial` directory (resume ignores it, the next save removes
    it); the checkpoint before it is the one resumed."""
    model = net()
    checkpoint.save(tmp_path, 1, model=model)
    (tmp_path / ".step_000000002.partial").mkdir()
    (tmp_path / ".step_000000002.partial" / "__0_0.distcp").write_bytes(b"half")
    assert checkpoint.resume(tmp_path, model=net()) == 1
    checkpoint.save(tmp_path, 3, model=model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000001", "step_000000003"]


def test_bad_input_names_the_value_and_the_choices(tmp_path):
    with pytest.raises(ValueError, match="keep=0 is not valid; valid choices: an int >= 1"):
        checkpoint.save(tmp_path, 1, model=net(), keep=0)
    with pytest.raises(ValueError, match="step=-1 is not valid"):
        checkpoint.save(tmp_path, -1, model=net())
    with pytest.raises(ValueError, match="pass model= too"):
        checkpoint.save(tmp_path, 1, optimizer=torch.optim.SGD(net().parameters(), lr=1))
    with pytest.raises(ValueError, match="a dict of JSON values"):
        checkpoint.save(tmp_path, 1, model=net(), extra={"tensor": torch.ones(1)})
    assert not list(tmp_path.iterdir()), "nothing written for a refused save"


WORKER = Path(__file__).resolve().parent / "checkpoint_rank_worker.py"


def run_ranks(tmp_path: Path, name: str, mode: str, directory: Path) -> list[dict]:
    results = [tmp_path / f"{name}{rank}.pt" for rank in range(2)]
    commands = [[sys.executable, str(WORKER), str(rank), "2", str(tmp_path / f"{name}.store"), str(directory),
                 str(results[rank]), mode] for rank in range(2)]
    run_rank_processes(commands, [os.environ | {"OMP_NUM_THREADS": "1"}] * 2)
    return [torch.load(r) for r in results]


@pytest.mark.parametrize("mode", ["save", "save-async"], ids=["sync", "async"])
def test_a_checkpoint_of_two_fsdp2_ranks_resumes_on_two_and_on_one(tmp_path, mode):
    directory = tmp_path / "checkpoints"
    uninterrupted = run_ranks(tmp_path, "save", mode, directory)
    manifest = json.loads((directory / "step_000000003" / checkpoint.MANIFEST).read_text())
    assert len([f for f in manifest["files"] if f.endswith(".distcp")]) == 2, "each rank wrote its shards"
    resumed = run_ranks(tmp_path, "resume", "resume", directory)
    for run in resumed:
        assert run["start"] == 3 and run["extra"] == {"batch": 3}
        for a, b in zip(uninterrupted[0]["parameters"], run["parameters"]):
            assert torch.equal(a, b)
    # One process, no sharding: the two ranks' shards loaded whole (DCP reshards), and its steps on both
    # ranks' batches at once (FSDP2 averages the ranks' gradients of equal batches) give the same model.
    sys.path.insert(0, str(WORKER.parent))
    from checkpoint_rank_worker import STEPS, batches

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 40))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    extra: dict = {}
    assert checkpoint.resume(directory, model=model, optimizer=optimizer, extra=extra) == 3
    assert extra == {"batch": 3}
    both = [torch.cat(pair) for pair in zip(batches(0), batches(1))]
    for x in both[3:STEPS]:
        # each rank's loss is the mean over its own 8 rows: their average is the mean over all 16
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for a, b in zip(uninterrupted[0]["parameters"], model.parameters()):
        torch.testing.assert_close(b.detach(), a, rtol=1e-5, atol=1e-6)


def test_an_asynchronous_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path):
    """The tensors are copied out when `save` returns: steps taken while the files are written change nothing
    in the checkpoint, which is committed at the next save (or `wait`); until then it is only partial."""
    batches = data(6)
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, batches[:3])
    pending = checkpoint.save(tmp_path, 3, model=model, optimizer=optimizer, extra={"batch": 3}, asynchronous=True)
    assert isinstance(pending, checkpoint.PendingSave)
    at_save = [p.detach().clone() for p in model.parameters()]
    uninterrupted = train(model, optimizer, batches[3:])  # in place, while the files may still be written
    path = checkpoint.wait()
    assert path == tmp_path / "step_000000003" and pending.result() == path and checkpoint.verify(path) is None
    assert checkpoint.wait() is None, "nothing under way any more"
    fresh = net()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert checkpoint.resume(tmp_path, model=fresh, optimizer=fresh_optimizer) == 3
    for a, b in zip(at_save, fresh.parameters()):
        assert torch.equal(a, b)
    assert train(fresh, fresh_optimizer, batches[3:]) == uninterrupted
    # the next save commits the one under way first
    first = checkpoint.save(tmp_path, 7, model=model, asynchronous=True)
    checkpoint.save(tmp_path, 8, model=model)
    assert first.done() and first.result() == tmp_path / "step_000000007"
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000000008"


def test_asynchronous_saves_copy_into_host_buffers_kept_from_save_to_save(tmp_path):
    """The host copies are made once and reused while the state keeps its layout: each checkpoint still holds
    its own step's tensors (training goes on while the first is written) and values that are not tensors (a
    learning rate changed between saves) as they were at its save. Another layout makes new copies;
    `release_staging` frees them."""
    checkpoint.release_staging()
    staging = checkpoint._STAGING
    batches = data(4)
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, batches[:1])
    made = staging.allocations
    checkpoint.save(tmp_path / "first", 1, model=model, optimizer=optimizer, asynchronous=True)
    buffers = [t.data_ptr() for t in staging._buffers["model"].values()]
    first = [p.detach().clone() for p in model.parameters()]
    train(model, optimizer, batches[1:3])  # in place, while the first is written
    for group in optimizer.param_groups:
        group["lr"] = 5e-3
    checkpoint.save(tmp_path / "second", 3, model=model, optimizer=optimizer, asynchronous=True)
    assert staging.allocations == made + 1, "the second save reused the first one's host copies"
    assert [t.data_ptr() for t in staging._buffers["model"].values()] == buffers
    second = [p.detach().clone() for p in model.parameters()]
    train(model, optimizer, batches[3:])
    checkpoint.wait()
    for directory, step, expected, lr in (("first", 1, first, 1e-2), ("second", 3, second, 5e-3)):
        restored = net()
        restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1.0)
        assert checkpoint.resume(tmp_path / directory, model=restored, optimizer=restored_optimizer) == step
        for a, b in zip(expected, restored.parameters()):
            assert torch.equal(a, b)
        assert restored_optimizer.param_groups[0]["lr"] == lr
    # Another model: its own copies; released: made again at the next save.
    checkpoint.save(tmp_path, 5, model=torch.nn.Linear(3, 2), asynchronous=True)
    checkpoint.wait()
    assert staging.allocations == made + 2
    checkpoint.release_staging()
    assert staging._buffers is None
    checkpoint.save(tmp_path, 6, model=torch.nn.Linear(3, 2), asynchronous=True)
    checkpoint.wait()
    assert staging.allocations == made + 3
    checkpoint.release_staging()


def test_cuda_tensors_stage_into_pinned_copies_waited_for_before_the_save_returns(monkeypatch):
    """The choice only (no GPU here): CUDA tensors are copied into pinned host buffers, non-blocking, and the
    copies are waited for before `stage` returns; host tensors into plain buffers, blocking, with no wait."""
    import torch.distributed._state_dict_utils as utils

    calls = []
    create, copy = utils._create_cpu_state_dict, utils._copy_state_dict
    monkeypatch.setattr(utils, "_create_cpu_state_dict",
                        lambda sd, pin_memory=False, share_memory=False: calls.append(("pin", pin_memory)) or create(sd))
    monkeypatch.setattr(utils, "_copy_state_dict",
                        lambda sd, to, non_blocking=False, type_check=True: calls.append(("non_blocking", non_blocking))
                        or copy(sd, to))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(("synchronize", True)))
    for cuda in (False, True):
        monkeypatch.setattr(checkpoint, "_on_cuda", lambda layout, cuda=cuda: cuda)
        calls.clear()
        staging = checkpoint._Staging()
        staged = staging.stage({"w": torch.arange(3.0)})
        assert torch.equal(staged["w"], torch.arange(3.0)) and not staging.should_synchronize_after_execute
        assert calls == ([("pin", True), ("non_blocking", True), ("synchronize", True)] if cuda
                         else [("pin", False), ("non_blocking", False)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_asynchronous_saves_from_cuda_reuse_pinned_copies_and_hold_their_step(tmp_path):
    """On a GPU (`benchmarks/gpu_session.sh`, tests step): the host copies are pinned and kept from save to
    save, and each checkpoint holds the parameters of its step although training goes on at once."""
    checkpoint.release_staging()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = []
    for step in (1, 2):
        model(torch.randn(8, 64, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        checkpoint.save(tmp_path / str(step), step, model=model, optimizer=optimizer, asynchronous=True)
        expected.append([p.detach().cpu().clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # at once: the save's copies were made before it returned
        copies = checkpoint._STAGING._buffers["model"]
        assert all(t.is_pinned() for t in copies.values())
        if step == 1:
            pointers = [t.data_ptr() for t in copies.values()]
    assert [t.data_ptr() for t in checkpoint._STAGING._buffers["model"].values()] == pointers
    checkpoint.wait()
    for step, want in zip((1, 2), expected):
        restored = torch.nn.Linear(64, 64).cuda()
        assert checkpoint.resume(tmp_path / str(step), model=restored) == step
        for a, b in zip(want, restored.parameters()):
            assert torch.equal(a, b.detach().cpu())
    checkpoint.release_staging()


def test_a_closed_dcp_stager_cannot_stage_again():
    """Why asynchronous saves stage through dpcs's own stager, not a kept DCP one: once closed (torch 2.11's
    DefaultStager closes its copier after every stage), a DCP stager fails the next staging of a state dict like
    ours. The exception is the one an H200 with torch 2.11 raised from the second asynchronous save of a kept
    stager."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                             use_non_blocking_copy=False)
    state = {"model": {"w": torch.arange(6.0)}, "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}}
    stager = DefaultStager(options)
    staged = stager.stage(state)
    assert torch.equal(staged["model"]["w"], state["model"]["w"]) and staged["optimizer"] == state["optimizer"]
    stager.close()
    with pytest.raises(KeyError, match="type"):
        stager.stage(state)


