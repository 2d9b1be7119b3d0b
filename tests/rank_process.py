"""How the rank worker scripts of the gloo tests start and end (imported by them, not collected by pytest)."""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import sys

import torch.distributed as dist

# faulthandler's stream: a duplicate of stderr made at start. dpcs's `quiet_profiler_logs` points descriptor 2
# at a temporary file around each profiler start and stop; a crash dump written there would die with the rank.
_fault_log = None


def sharded_stack(world: int):
    """Two linear layers (48 -> 96 -> 40), seeded, each and the whole sharded with FSDP2 over `world` CPU ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 40))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def join(store: str, rank: int, world: int) -> None:
    """Join the gloo group of `world` ranks through the file `store` (a collective waits 120 s at most)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def report_crashes(hang_seconds: int = 200) -> None:
    """A rank that crashes (SIGABRT, SIGSEGV, ...) prints every thread's Python stack; so does a rank the test
    harness is about to kill (SIGUSR1: hung, or its peer failed), and a rank hung for `hang_seconds` (then
    exits)."""
    global _fault_log
    _fault_log = os.fdopen(os.dup(2), "w")
    faulthandler.enable(file=_fault_log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_fault_log, all_threads=True)
    faulthandler.dump_traceback_later(hang_seconds, exit=True, file=_fault_log)


def leave() -> None:
    """End the rank once its result is saved: every rank past its last collective, then out without finalizing
    the interpreter.

    gloo's worker threads destroy each finished collective's Work, and with it C++ references to its tensors;
    releasing a tensor Python also holds takes the GIL. A thread that waits for the GIL while the interpreter
    finalizes is ended by Python (pthread_exit) inside that noexcept destructor, and std::terminate aborts the
    rank: "terminate called without an active exception", SIGABRT, no Python frame (reproduced: 6 of 25 pairs
    of ranks that ended right after three gloo all-gathers aborted; none with a barrier and
    destroy_process_group first). The FSDP2 step ends with `full_tensor()`'s all-gathers, and its device mesh
    keeps the default group and its threads alive past destroy_process_group: hence `os._exit`."""
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    for stream in (sys.stdout, sys.stderr, _fault_log):
        if stream is not None:
            stream.flush()
    os._exit(0)


def see_dpcs_warnings() -> None:
    """In a rank's process, what the suite does in its own (pyproject.toml): a dpcs warning raises, so the rank
    fails and the test with it, but the verdict a scenario asked for with on_infeasible="best". Call it inside
    `warnings.catch_warnings()`, or once for the process."""
    import warnings

    from dpcs_compiler.diagnostics import DpcsWarning

    warnings.filterwarnings("error", category=DpcsWarning)
    warnings.filterwarnings("ignore", message=r"memory_budget .* cannot be met .*on_infeasible='best'", category=DpcsWarning)
