"""The stages of the compile pipeline (`pipeline.compile_graph` runs them in order), one module each:

    job            GraphJob: what one graph's compilation shares; holding compiled graphs to the budget
    precision      per-op dtypes and fp8 linears into the plan; the rewrites of each stage
    partition      joint analyses -> plan or min-cut -> partition -> offload ops -> step analyses
    memory_plan    candidates -> cost model (the graph's hardware profile) -> solver -> decisions
    compile_parts  forward / backward / inference rewrites -> final compiler, through AOTAutograd
"""
