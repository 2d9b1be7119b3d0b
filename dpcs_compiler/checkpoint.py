"""Checkpoints a killed run resumes from by itself: sharded through `torch.distributed.checkpoint` (DCP),
committed atomically, checked before they are loaded.

    step = checkpoint.resume("ckpt", model=model, optimizer=optimizer, runtime=runtime, extra=position) or 0
    while step < steps:
        ...  # one training step
        step += 1
        if step % 100 == 0:
            checkpoint.save("ckpt", step, model=model, optimizer=optimizer, runtime=runtime, extra=position)

Layout: one directory per checkpoint, `DIR/step_000000123/`, holding DCP's files (one per rank that holds
data, and `.metadata`), `dpcs.json` (the step, the dpcs `Runtime`'s state and `extra`) and `MANIFEST.json`
(every other file's size and sha256). A checkpoint is written under `DIR/.step_000000123.partial`; once every
rank wrote its part, rank 0 writes the manifest and renames the directory: a directory named `step_*` is a
complete checkpoint, and a save killed before the rename leaves only a `.partial` one, which resume ignores
and the next save removes. `resume` loads the newest complete checkpoint whose files match its manifest; one
that does not (a file missing, truncated or changed) is skipped with a warning naming it, never loaded.
The newest `keep` complete checkpoints are kept.

Model and optimizer states go through `torch.distributed.checkpoint.state_dict` (`get_state_dict` /
`set_state_dict`): a plain module, DDP or FSDP2, and a `CompressedOptimizer`'s compressed state; a checkpoint
written by N ranks loads on any number (DCP reshards). In a distributed job every rank calls `save` and
`resume` at the same point of its loop: rank 0 alone commits, prunes and chooses what to load, and the others
follow it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import torch

from dpcs_compiler.distributed import rank_agreement
from dpcs_compiler.diagnostics import DpcsWarning

log = logging.getLogger("dpcs.checkpoint")

FORMAT = 1  # of dpcs.json and MANIFEST.json
MANIFEST = "MANIFEST.json"
STATE = "dpcs.json"
_NAME = re.compile(r"^step_(\d{9,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded as asked."""


def checkpoint_dir(directory: str | os.PathLike, step: int) -> Path:
    """Where the complete checkpoint of `step` lives."""
    return Path(directory) / f"step_{step:09d}"


class PendingSave:
    """An asynchronous save under way (`save(..., asynchronous=True)`): its tensors were copied out and its
    files are written in the background. `result()` waits for them and commits the checkpoint; every rank calls
    it at the same point (the next `save` and `checkpoint.wait()` do). Not committed, it is not a checkpoint:
    a job that ends or dies first leaves it partial."""

    def __init__(self, future: Any, finish: Any) -> None:
        self._future, self._finish, self._path = future, finish, None

    def done(self) -> bool:
        """Whether its files are written (it may still need `result()` to commit)."""
        return self._path is not None or self._future.done()

    def result(self) -> Path:
        """Wait for its files, commit it and return its directory."""
        if self._path is None:
            self._future.result()
            if _PENDING and _PENDING[0] is self:
                _PENDING.clear()
            self._path = self._finish()
        return self._path


_PENDING: list[PendingSave] = []  # the asynchronous save under way, at most one
_ASYNC_GROUP: list[Any] = []  # the gloo group DCP's background saves use (not the training's collectives')


def _on_cuda(layout: Any) -> bool:
    """Whether a state dict of this layout (`_layout`) holds CUDA tensors."""
    return any(isinstance(leaf, tuple) and leaf[-1] == "cuda" for leaf in layout[1])


class _Staging:
    """How an asynchronous save copies its tensors out (DCP's `AsyncStager` protocol): into host buffers kept
    from save to save, pinned for CUDA tensors, whose non-blocking copies are waited for before `stage`
    returns (the loop stalls for the copy only). The buffers are made again only when the state's layout
    changes (its keys, or a tensor's shape, dtype, stride or device); values that are not tensors (a learning
    rate, a step count) are taken afresh at every save. A save starts after the one before it is written
    (`save` commits it first), so no buffer is overwritten while it is read. The host holds one copy of the
    saved tensors between asynchronous saves: `release_staging()` frees it.

    Not DCP's `DefaultStager` kept instead: once closed it fails its next staging, and torch 2.11's closes its
    copier after every stage (`tests/test_checkpoint.py::test_a_closed_dcp_stager_cannot_stage_again`); one
    stager per save allocated (and pinned) every copy again at every save."""

    _synchronize_after_execute = False  # `stage` returns the copies made

    def __init__(self) -> None:
        self._layout: Any = None
        self._buffers: dict[str, Any] | None = None
        self.allocations = 0  # how many times the buffers were made

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)
        cuda = _on_cuda(layout)
        if layout != self._layout or self._buffers is None:
            self._layout = self._buffers = None  # the old copies go before the new ones are made
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=cuda)
            self._layout = layout
            self.allocations += 1
        staged = _copy_state_dict(state_dict, self._buffers, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returned its copies made."""

    def close(self) -> None:
        """Kept for the next save (`release_staging` frees the buffers)."""

    def release(self) -> None:
        self._layout = self._buffers = None


def _layout(state_dict: dict[str, Any]) -> Any:
    """What a state dict's host copies depend on: its structure, and each tensor's type, shape, dtype, stride
    and device (a DTensor's local shard's too)."""
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten(state_dict)

    def of(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return type(leaf)
        local = leaf.to_local() if hasattr(leaf, "to_local") else leaf
        return (type(leaf), tuple(leaf.shape), leaf.dtype, tuple(local.shape), tuple(local.stride()),
                local.device.type)

    return spec, tuple(of(leaf) for leaf in leaves)


_STAGING = _Staging()


def release_staging() -> None:
    """Free the host copies asynchronous saves keep for the next one, after committing the save under way (so
    every rank calls it, as `wait`); the next asynchronous save makes them again."""
    wait()
    _STAGING.release()


def wait() -> Path | None:
    """Commit the asynchronous save under way, if any (every rank calls it): its directory, or None."""
    return _PENDING[0].result() if _PENDING else None


def save(directory: str | os.PathLike, step: int, *, model: torch.nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None, runtime: Any = None,
         extra: MutableMapping[str, Any] | None = None, keep: int = 3,
         asynchronous: bool = False) -> Path | PendingSave:
    """Write the checkpoint of `step` (every rank calls it) and return its directory once committed.

    model / optimizer: saved through DCP (an optimizer needs its model); runtime: a dpcs `Runtime`, its state
    saved; extra: JSON values of your own (the data position, the RNG seed), given back by `resume`;
    keep: complete checkpoints kept, the newest (this one among them), older ones removed.
    asynchronous: copy the tensors out and return a `PendingSave` at once, the files written in the
    background by DCP's `async_save` (on a gloo group of its own in a distributed job); the checkpoint is
    committed at its `result()`, the next `save` or `checkpoint.wait()`.
    """
    import torch.distributed.checkpoint as dcp

    wait()  # one save at a time: the one under way is committed first
    _check_step(step)
    if not isinstance(asynchronous, bool):
        raise ValueError(f"checkpoint.save: asynchronous={asynchronous!r} is not valid; valid choices: True, False")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"checkpoint.save: keep={keep!r} is not valid; valid choices: an int >= 1")
    if optimizer is not None and model is None:
        raise ValueError("checkpoint.save: an optimizer's state is saved with its model; pass model= too")
    try:
        payload = json.dumps({"format": FORMAT, "step": step,
                              "runtime": None if runtime is None else runtime.state_dict(),
                              "extra": None if extra is None else dict(extra)})
    except TypeError as error:
        raise ValueError(f"checkpoint.save: extra={extra!r} is not valid: {error}; valid choices: a dict of "
                         "JSON values (str, int, float, bool, None, lists and dicts of them)") from None
    root = Path(directory)
    final = checkpoint_dir(root, step)
    partial = root / f".{final.name}.partial"

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*.partial"):  # saves killed midway
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()

    digested: dict[str, list] = {}  # an asynchronous save's files, hashed in the background once written
    digesting = threading.Event()

    def digest() -> None:
        try:
            for p in sorted(partial.rglob("*")):
                if p.is_file():
                    digested[str(p.relative_to(partial))] = [p.stat().st_size, _sha256(p)]
        finally:
            digesting.set()

    def commit() -> str:
        (partial / STATE).write_text(payload)
        if asynchronous:
            digesting.wait(timeout=600)
        files = sorted(p for p in partial.rglob("*") if p.is_file())
        entries = {}
        for p in files:
            name, size = str(p.relative_to(partial)), p.stat().st_size
            known = digested.get(name)
            entries[name] = known if known is not None and known[0] == size else [size, _sha256(p)]
        manifest = {"format": FORMAT, "step": step, "files": entries}
        _write_synced(partial / MANIFEST, json.dumps(manifest, indent=1))
        _fsync_dir(partial)
        replaced = None
        if final.exists():  # the same step saved again: the old one out of the way first, removed after
            replaced = root / f".{final.name}.replaced"
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
        partial.rename(final)
        _fsync_dir(root)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        for old in _complete(root)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
        return str(final)

    def finish() -> Path:
        # Every rank's files are written (DCP's writer fsyncs them; its coordinator wrote `.metadata` after
        # gathering every rank's results): rank 0 commits.
        _barrier()
        committed = Path(_on_rank_zero(commit, "checkpoint commit"))
        log.info("dpcs: checkpoint of step %d written to %s", step, committed)
        return committed

    _on_rank_zero(prepare, "checkpoint directory")
    tensors = _state(model, optimizer)
    if asynchronous and tensors:
        with _single_process_quiet():
            response = dcp.async_save(tensors, checkpoint_id=str(partial), process_group=_async_group(),
                                      no_dist=rank_agreement.world() is None, async_stager=_STAGING)
        future = getattr(response, "upload_completion", response)
        if (rank_agreement.world() or (0, 1))[0] == 0:  # the files hashed as soon as written, off this thread
            future.add_done_callback(lambda _: digest())
        else:
            digesting.set()
        pending = PendingSave(future, finish)
        _PENDING.append(pending)
        return pending
    if tensors:
        with _single_process_quiet():
            dcp.save(tensors, checkpoint_id=str(partial))
    return finish()


def resume(directory: str | os.PathLike, *, model: torch.nn.Module | None = None,
           optimizer: torch.optim.Optimizer | None = None, runtime: Any = None,
           extra: MutableMapping[str, Any] | None = None) -> int | None:
    """Load the newest complete checkpoint under `directory` that matches its manifest into what is given
    (every rank calls it) and return its step; None when there is none (a first run). `extra` is updated
    with the values saved with it. Checkpoints that do not match their manifest are skipped with a warning."""
    import torch.distributed.checkpoint as dcp

    if optimizer is not None and model is None:
        raise ValueError("checkpoint.resume: an optimizer's state is loaded with its model; pass model= too")

    def choose() -> tuple[str | None, list[str]]:
        skipped = []
        for candidate in _complete(Path(directory)):
            problem = verify(candidate)
            if problem is None:
                return str(candidate), skipped
            skipped.append(f"dpcs: checkpoint {candidate} is skipped, not loaded: {problem}")
        return None, skipped

    chosen, skipped = _on_rank_zero(choose, "checkpoint to resume from")
    for message in skipped:
        warnings.warn(message, category=DpcsWarning, stacklevel=2)
    if chosen is None:
        return None
    path = Path(chosen)
    saved = json.loads((path / STATE).read_text())
    if saved.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {saved.get('format')!r}; this dpcs reads {FORMAT}")
    tensors = _state(model, optimizer)
    if tensors:
        with _single_process_quiet():
            dcp.load(tensors, checkpoint_id=str(path))
        _load_state(model, optimizer, tensors)
    if runtime is not None:
        if saved["runtime"] is None:
            raise CheckpointError(f"checkpoint {path} holds no Runtime state; resume without runtime=")
        runtime.load_state_dict(saved["runtime"])
    if extra is not None and saved["extra"] is not None:
        extra.update(saved["extra"])
    log.info("dpcs: resumed from %s (step %d)", path, saved["step"])
    return int(saved["step"])


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `directory` that matches its manifest (no warnings)."""
    return next((c for c in _complete(Path(directory)) if verify(c) is None), None)


def verify(path: str | os.PathLike) -> str | None:
    """What is wrong with the checkpoint at `path` against its manifest (None: every file is there, of its
    size and sha256, and nothing else is)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (ValueError, KeyError, TypeError) as error:
        return f"{MANIFEST} does not parse ({error})"
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    if present != set(files):
        missing, unknown = sorted(set(files) - present), sorted(present - set(files))
        return f"files missing {missing}" if missing else f"files not in its manifest {unknown}"
    for name, (size, digest) in sorted(files.items()):
        file = path / name
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, {size} were written (truncated or changed)"
        if _sha256(file) != digest:
            return f"{name} does not match its sha256 (changed after it was written)"
    return None


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint: step={step!r} is not valid; valid choices: an int >= 0")


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _state(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if model is None:
        return {}
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _load_state(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                tensors: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(model, tensors["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optimizer"])


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns at every save and load of a single process that it assumes one: that is what is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _async_group() -> Any:
    """A gloo group of every rank for DCP's background save (None in a single process): the training's own
    collectives go on meanwhile on theirs."""
    if rank_agreement.world() is None:
        return None
    if not _ASYNC_GROUP:
        import torch.distributed as dist

        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


def _on_rank_zero(compute, what: str):
    return compute() if rank_agreement.world() is None else rank_agreement.from_rank_zero(compute, what)


def _barrier() -> None:
    if rank_agreement.world() is not None:
        rank_agreement.every_rank(None)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
