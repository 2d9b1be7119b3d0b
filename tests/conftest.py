"""Every test starts from a fresh Dynamo and compile-record state with fixed seeds."""

import os

import torch

from dpcs_testing import fresh_compile_state  # noqa: F401  (autouse fixture)

# Under pytest-xdist each worker gets one core's worth of intra-op threads, so two workers on two cores do
# not oversubscribe them (processes a test starts keep their own default).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
