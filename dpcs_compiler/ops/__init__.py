"""In-graph ops that dpcs's rewrites insert: offload/reload with side streams (`offload_ops`), the fp8
linear (`fp8`), the overflow flag the backward raises (`overflow`). The between-step runtime is not here."""
