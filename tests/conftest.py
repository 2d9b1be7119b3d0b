"""Every test starts from a fresh Dynamo and compile-record state with fixed seeds."""

from dpcs_testing import fresh_compile_state  # noqa: F401  (autouse fixture)
