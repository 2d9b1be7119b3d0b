"""The package's layers, read from its source: what a lower layer never imports, and no import cycles.

cost/ and solve/ are pure (numbers and plain records in, plans out): they never import the graph passes,
the in-graph ops, the pipeline or its stages, or the debug tools; what they need of a graph arrives as
`dpcs_compiler.types` records. ops/ (in-graph ops) knows nothing of the passes that insert them.
model_states/ (the optimizer-state and parameter levers) and distributed/ (rank agreement, the cadence,
distributed signals) sit beside runtime/ and never reach up into planning or the graph passes; step/ (the
step planner) is called by the runtime's graphs and never imports runtime/. Every
import counts, at module level, inside functions and under TYPE_CHECKING alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "dpcs_compiler"

UPPER = ("passes", "ops", "pipeline", "stages", "debug", "backend", "cli")
RULES: dict[str, tuple[str, ...]] = {
    "cost": (*UPPER, "solve"),
    "solve": UPPER,
    "ops": ("passes", "pipeline", "stages", "debug", "backend", "cli", "solve"),
    "types": ("*",),  # plain records: nothing of the package
    # levers on the optimizer's and the parameters' tensors: they know the cost records and the in-graph
    # copy ops, never the planner, the runtime that drives them or the ranks
    "model_states": (*UPPER[:1], *UPPER[2:], "solve", "runtime", "step", "distributed"),
    # ranks: agreement, the cadence and the signals they share; no planning, no graph rewrites, no levers
    "distributed": (*UPPER, "solve", "model_states"),
    # the step planner: the runtime's graphs call it (`step/participant.py` says what it needs of them); it
    # never calls back into the runtime, the backend or the pipeline
    "step": ("runtime", "pipeline", "backend", "cli"),
}


def imports(root: Path) -> list[tuple[str, int, str, bool]]:
    """(importing module, line, imported module, at module level) for every package import under `root`."""
    modules = {_module_name(p, root) for p in root.rglob("*.py")}
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(n) for n in _module_level(tree.body)}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root.name:
                targets = [t if (t := f"{node.module}.{a.name}") in modules else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == root.name]
            found += [(_module_name(path, root), node.lineno, t, id(node) in top) for t in targets]
    return found


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements run on import: the body, and the branches of module-level ifs (TYPE_CHECKING included)."""
    statements = []
    for node in body:
        statements.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            statements += _module_level(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
    return statements


def layer_violations(root: Path) -> list[str]:
    """One line per import a layer rule forbids, naming the file, the line, the import and the rule."""
    lines = []
    for module, line, target, _ in imports(root):
        layer = module.split(".")[1] if "." in module else ""
        forbidden = RULES.get(layer, ())
        imported = target.split(".")[1] if "." in target else ""
        if ("*" in forbidden and imported != layer) or imported in forbidden:
            path = module.replace(".", "/") + ".py"
            rule = "imports nothing of the package" if "*" in forbidden else f"never imports {', '.join(f'{f}/' for f in forbidden)}"
            lines.append(f"{path}:{line} imports {target}: {layer}/ {rule} (layer rules: tests/test_layers.py)")
    return lines


def import_cycles(root: Path) -> list[list[str]]:
    """Module-level import cycles (imports inside functions are how a module reaches up lazily)."""
    graph = nx.DiGraph((module, target) for module, _, target, top in imports(root) if top and module != target)
    # Importing a.b.c from outside a.b runs the package a.b's __init__ first: an edge to each package on the way
    # (the root's own __init__ aside, which every module of the package runs first; a module inside a.b finds it
    # initializing already).
    packages = {_module_name(p, root) for p in root.rglob("__init__.py")}
    graph.add_edges_from((module, package) for module, target in list(graph.edges)
                         for i in range(2, target.count(".") + 1)
                         if (package := ".".join(target.split(".")[:i])) in packages and package != target
                         and not module.startswith(package + "."))
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def test_no_lower_layer_imports_an_upper_one():
    violations = layer_violations(PACKAGE)
    assert not violations, "\n".join(violations)


def test_no_import_cycles():
    cycles = import_cycles(PACKAGE)
    assert not cycles, "module-level import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_rules_see_every_package_module():
    modules = {m for m, *_ in imports(PACKAGE)}
    assert {"dpcs_compiler.cost.op_time", "dpcs_compiler.solve.precision", "dpcs_compiler.ops.fp8"} <= modules


def test_a_forbidden_import_fails_with_a_message_naming_it(tmp_path):
    """As if someone had written these imports into the package by hand."""
    root = tmp_path / "dpcs_compiler"
    for folder in ("solve", "cost", "passes/analysis"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "types.py").write_text("import dataclasses\n")
    (root / "passes" / "analysis" / "op_sites.py").write_text("from dpcs_compiler.types import OpSite\n")
    (root / "solve" / "precision.py").write_text(
        "from dpcs_compiler.types import OpSite\n\n\ndef plan():\n    from dpcs_compiler.passes.analysis.op_sites import x\n"
    )
    (root / "cost" / "op_time.py").write_text("from dpcs_compiler.cost import calibration\n")
    (root / "cost" / "calibration.py").write_text("from dpcs_compiler.cost.op_time import x\n")
    assert layer_violations(root) == [
        "dpcs_compiler/solve/precision.py:5 imports dpcs_compiler.passes.analysis.op_sites: solve/ never imports "
        "passes/, ops/, pipeline/, stages/, debug/, backend/, cli/ (layer rules: tests/test_layers.py)"
    ]
    assert import_cycles(root) == [["dpcs_compiler.cost.calibration", "dpcs_compiler.cost.op_time"]]


MAX_LINES = 800
REASON = "Longer than 800 lines because"


def test_no_module_is_longer_than_800_lines_without_its_reason_at_the_top():
    """Each file one idea: a module past MAX_LINES says why in its docstring ("Longer than 800 lines because
    ...", within its first 30 lines), or is split by concern."""
    long = [f"{path.relative_to(PACKAGE.parent)}: {n} lines"
            for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(text := path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
            and not any(REASON in line for line in text[:30])]
    assert not long, f"modules over {MAX_LINES} lines without '{REASON} ...' at their top: " + "; ".join(long)
