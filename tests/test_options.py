"""Options are validated when torch.compile hands them over: bad keys and values name themselves."""

from __future__ import annotations

import pytest
import torch

from dpcs_compiler.options import DUMP_DIR_ENV, HARDWARE_PROFILE_ENV, OPTIONS_ENV, DpcsOptions


def test_defaults():
    options = DpcsOptions.from_dict(None)
    assert (options.compiler, options.strict, options.dump_dir) == ("inductor", False, None)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"compilr": "eager"}, r"unknown dpcs option 'compilr'; valid options: 'compiler', 'strict', 'dump_dir'"),
        ({"compiler": "tvm"}, r"'compiler'='tvm' is not valid; valid choices: 'inductor', 'eager'"),
        ({"strict": "yes"}, r"'strict'='yes' is not valid; valid choices: True, False"),
        ({"dump_dir": 3}, r"'dump_dir'=3 is not valid"),
        ({"dump_dir": ""}, r"'dump_dir'='' is not valid"),
    ],
)
def test_bad_options_raise_value_error_naming_them(bad, message):
    with pytest.raises(ValueError, match=message):
        DpcsOptions.from_dict(bad)


def test_bad_option_through_torch_compile_names_it():
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="dpcs", options={"compiler": "tvm"})
    with pytest.raises(Exception, match=r"'compiler'='tvm' is not valid; valid choices: 'inductor', 'eager'"):
        compiled(torch.randn(2, 4))


def test_bad_option_is_never_swallowed_by_the_fallback():
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="dpcs", options={"strict": False, "nope": 1})
    with pytest.raises(Exception, match="unknown dpcs option 'nope'"):
        compiled(torch.randn(2, 4))


def test_options_are_frozen():
    options = DpcsOptions(compiler="eager")
    with pytest.raises(AttributeError):
        options.compiler = "inductor"


def test_dump_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    assert DpcsOptions.from_dict({}).dump_dir == tmp_path
    assert DpcsOptions.from_dict({"dump_dir": tmp_path / "x"}).dump_dir == tmp_path / "x"


def test_fingerprint_ignores_dump_dir_but_not_compiler(tmp_path):
    base = DpcsOptions(compiler="eager")
    assert base.fingerprint() == DpcsOptions(compiler="eager", dump_dir=tmp_path).fingerprint()
    assert base.fingerprint() != DpcsOptions(compiler="inductor").fingerprint()


def test_a_stand_in_names_another_compiler_and_compiles_apart():
    """`stands_in_for` (set by dpcs): the compiler a graph running with `compiler` for now is planned for."""
    stand_in = DpcsOptions(compiler="eager", stands_in_for="inductor")
    assert stand_in.stands_in_for == "inductor"
    assert stand_in.fingerprint() != DpcsOptions(compiler="eager").fingerprint()
    for bad in ("eager", "tvm"):
        with pytest.raises(ValueError, match=rf"'stands_in_for'='{bad}' is not valid; valid choices: None, or a compiler "
                                             r"other than compiler='eager' \('inductor', 'eager'; set by dpcs\)"):
            DpcsOptions(compiler="eager", stands_in_for=bad)


@pytest.mark.parametrize(
    "value, parsed",
    [
        (None, None),
        (1000, 1000),
        ("6GiB", 6 * 2**30),
        ("800MB", 800 * 10**6),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("4096", 4096),
        (0.5, 0.5),
        (1.0, 1.0),
        ("auto", "auto"),
    ],
)
def test_memory_budget_forms(value, parsed):
    assert DpcsOptions.from_dict({"memory_budget": value}).memory_budget == parsed


@pytest.mark.parametrize("value", [0, -5, 1.5, 0.0, True, "6 parsecs", "0MB", [1]])
def test_bad_memory_budget_names_value_and_forms(value):
    with pytest.raises(ValueError, match=r"'memory_budget'=.* is not valid; valid choices: None .* 'auto'"):
        DpcsOptions.from_dict({"memory_budget": value})


def test_on_infeasible_choices():
    assert DpcsOptions.from_dict({"on_infeasible": "best"}).on_infeasible == "best"
    with pytest.raises(ValueError, match="'on_infeasible'='ignore' is not valid; valid choices: 'error', 'best'"):
        DpcsOptions.from_dict({"on_infeasible": "ignore"})


@pytest.mark.parametrize(
    "options, falls_back",
    [
        ({}, True),
        ({"strict": True}, False),
        ({"memory_budget": "6GiB"}, False),  # a fallback would drop the budget
        ({"memory_budget": "6GiB", "strict": False}, False),
        ({"memory_budget": "6GiB", "on_failure": "fallback"}, True),
        ({"on_failure": "error"}, False),
    ],
)
def test_on_failure_says_whether_a_graph_dpcs_cannot_compile_falls_back(options, falls_back):
    assert DpcsOptions.from_dict(options).falls_back is falls_back
    assert DpcsOptions.from_dict(options).fingerprint() == DpcsOptions.from_dict(
        {k: v for k, v in options.items() if k == "memory_budget"}).fingerprint()  # the same compiled code


def test_bad_on_failure_names_value_and_choices():
    with pytest.raises(ValueError, match="'on_failure'='ignore' is not valid; valid choices: None, 'error', 'fallback'"):
        DpcsOptions.from_dict({"on_failure": "ignore"})
    with pytest.raises(ValueError, match="'strict'=True and 'on_failure'='fallback' contradict each other"):
        DpcsOptions.from_dict({"strict": True, "on_failure": "fallback"})

def test_a_new_budget_changes_the_compile_key():
    from dpcs_compiler.plan import Plan

    keys = {
        Plan("g", DpcsOptions.from_dict({"memory_budget": b}).fingerprint()).compile_key() for b in (None, 10**9, 10**8)
    }
    assert len(keys) == 3


def test_precision_options_and_their_defaults():
    options = DpcsOptions.from_dict({"precision": "bf16", "keep_fp32": ["lm_head", "*.norm"], "fp8": {"min_size": 64}})
    assert options.keep_fp32 == ("lm_head", "*.norm") and options.fp8.min_size == 64
    assert (options.fp8.recipe, options.fp8.filter, options.fp8.matmul, options.fp8.grad_dtype) == (
        "tensorwise", ("*",), "auto", "e5m2")
    assert options.overflow_detected  # on for fp8 (and fp16) unless asked otherwise
    assert not DpcsOptions.from_dict({"precision": "bf16"}).overflow_detected
    assert DpcsOptions.from_dict({"precision": "fp16", "detect_overflow": False}).overflow_detected is False
    assert DpcsOptions.from_dict({"fp8": True}).fp8.min_size == 1024
    assert DpcsOptions.from_dict({"fp8": False}).fp8 is None
    fingerprints = {DpcsOptions.from_dict(o).fingerprint() for o in (
        {}, {"precision": "bf16"}, {"precision": "bf16", "fp8": True}, {"precision": "bf16", "keep_fp32": ["x"]})}
    assert len(fingerprints) == 4  # each compiles other code: each has its own compile key


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"precision": "fp64"}, r"'precision'='fp64' is not valid; valid choices: 'fp32', 'bf16', 'fp16'"),
        ({"keep_fp32": "lm_head"}, r"'keep_fp32'='lm_head' is not valid; valid choices: a list of module-name patterns"),
        ({"keep_fp32": ["ok", ""]}, r"'keep_fp32'=\['ok', ''\] is not valid"),
        ({"fp8": 3}, r"'fp8'=3 is not valid; valid choices: None, False, True, or a dict"),
        ({"fp8": {"recipe": "blockwise"}}, r"'fp8.recipe'='blockwise' is not valid; valid choices: 'tensorwise', 'rowwise'"),
        ({"fp8": {"min_size": 8}}, r"'fp8.min_size'=8 is not valid; valid choices: an int >= 16"),
        ({"fp8": {"margin": -1}}, r"'fp8.margin'=-1 is not valid; valid choices: a number in \[0, 16\]"),
        ({"fp8": {"matmul": "cublas"}}, r"'fp8.matmul'='cublas' is not valid; valid choices: 'auto', 'scaled_mm', 'emulated'"),
        ({"fp8": {"grad_dtype": "e3m4"}}, r"'fp8.grad_dtype'='e3m4' is not valid; valid choices: 'e5m2', 'e4m3'"),
        ({"fp8": {"filter": "mlp"}}, r"'fp8.filter'='mlp' is not valid"),
        ({"fp8": {"recipes": "rowwise"}}, r"unknown dpcs option 'fp8.recipes'; valid keys: 'recipe', 'filter'"),
        ({"detect_overflow": "yes"}, r"'detect_overflow'='yes' is not valid; valid choices: None, True, False"),
    ],
)
def test_bad_precision_options_name_themselves(bad, message):
    with pytest.raises(ValueError, match=message):
        DpcsOptions.from_dict(bad)


def test_the_hardware_profile_defaults_to_the_environment_else_measure(monkeypatch):
    assert DpcsOptions.from_dict({}).hardware_profile == "reference-cpu"  # the test suite's pin (conftest)
    monkeypatch.delenv(HARDWARE_PROFILE_ENV)
    assert DpcsOptions.from_dict({}).hardware_profile == "measure"
    assert DpcsOptions.from_dict({"hardware_profile": None}).hardware_profile == "measure"
    monkeypatch.setenv(HARDWARE_PROFILE_ENV, "h100")
    assert DpcsOptions.from_dict({}).hardware_profile == "h100"
    assert DpcsOptions.from_dict({"hardware_profile": "l4"}).hardware_profile == "l4"  # code wins


def test_a_bad_hardware_profile_names_the_option_or_the_variable(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"dpcs option 'hardware_profile'='h200' is not valid; valid choices: 'measure'"):
        DpcsOptions.from_dict({"hardware_profile": "h200"})
    missing = tmp_path / "gpu.json"
    with pytest.raises(ValueError, match=f"'hardware_profile' \\(or {HARDWARE_PROFILE_ENV}\\): no profile file at '{missing}'"):
        DpcsOptions.from_dict({"hardware_profile": str(missing)})
    monkeypatch.setenv(HARDWARE_PROFILE_ENV, "A100")
    with pytest.raises(ValueError, match=f"environment variable {HARDWARE_PROFILE_ENV}='A100' is not valid"):
        DpcsOptions.from_dict({})
    with pytest.raises(ValueError, match="'rank_agreement'='yes' is not valid; valid choices: True, False"):
        DpcsOptions.from_dict({"hardware_profile": "h100", "rank_agreement": "yes"})


def test_the_profile_is_not_in_the_options_fingerprint():
    """The plan carries the resolved profile itself (`Plan.hardware`): how it was named must not make two
    ranks' plans differ when rank 0's profile is used on both."""
    fingerprints = {DpcsOptions.from_dict({"hardware_profile": p}).fingerprint() for p in ("measure", "h100", "l4")}
    assert len(fingerprints) == 1


# ---- DPCS_OPTIONS: options without code ---------------------------------------------------------------------


def test_dpcs_options_give_options_and_the_code_wins_key_by_key(monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, '{"memory_budget": "6GiB", "precision": "bf16", "compiler": "eager"}')
    options = DpcsOptions.from_dict({"precision": "fp16"})
    assert (options.memory_budget, options.precision, options.compiler) == (6 * 2**30, "fp16", "eager")
    sources = dict(options.option_sources)
    assert sources["precision"] == "code"
    assert sources["memory_budget"] == sources["compiler"] == f"environment variable {OPTIONS_ENV}"
    assert "strict" not in sources  # a default is no source
    assert options.fingerprint() == DpcsOptions.from_dict(
        {"memory_budget": "6GiB", "precision": "fp16", "compiler": "eager"}).fingerprint()


@pytest.mark.parametrize("suffix, text", [
    (".json", '{"memory_budget": 1000000, "keep_fp32": ["lm_head"]}'),
    (".toml", 'memory_budget = 1000000\nkeep_fp32 = ["lm_head"]\n'),
])
def test_dpcs_options_may_name_a_json_or_toml_file(monkeypatch, tmp_path, suffix, text):
    path = tmp_path / f"dpcs{suffix}"
    path.write_text(text)
    monkeypatch.setenv(OPTIONS_ENV, str(path))
    options = DpcsOptions.from_dict(None)
    assert options.memory_budget == 1000000 and options.keep_fp32 == ("lm_head",)
    assert dict(options.option_sources)["memory_budget"] == f"{OPTIONS_ENV} file {str(path)!r}"


@pytest.mark.parametrize("value, message", [
    ('{"precision": "fp9"}', r"'precision'='fp9' is not valid.*\(key 'precision' of environment variable DPCS_OPTIONS\)"),
    ('{"budjet": 5}', r"unknown dpcs option 'budjet' in environment variable DPCS_OPTIONS; valid options: 'compiler'"),
    ('{"memory_budget": ', r"environment variable DPCS_OPTIONS is not valid JSON"),
    ("[1, 2]", r"DPCS_OPTIONS='\[1, 2\]' is not valid; valid choices: a JSON object"),
    ("/nowhere/dpcs.toml", r"DPCS_OPTIONS file '/nowhere/dpcs.toml' cannot be read"),
])
def test_a_bad_dpcs_options_names_the_variable_and_the_key(monkeypatch, value, message):
    monkeypatch.setenv(OPTIONS_ENV, value)
    with pytest.raises(ValueError, match=message):
        DpcsOptions.from_dict({"compiler": "eager"})


def test_a_bad_value_the_code_overrides_is_no_error(monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, '{"precision": "fp9"}')
    assert DpcsOptions.from_dict({"precision": "bf16"}).precision == "bf16"


def test_compile_records_and_the_dump_say_where_each_option_came_from(monkeypatch, tmp_path):
    import json

    from dpcs_compiler import compile_records
    from dpcs_testing import dpcs_compile

    monkeypatch.setenv(OPTIONS_ENV, '{"memory_budget": "64MiB", "dump_dir": "%s"}' % (tmp_path / "dump"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    dpcs_compile(model)(torch.randn(4, 8)).sum().backward()
    (record,) = compile_records()
    assert record.option_sources["memory_budget"] == record.option_sources["dump_dir"] == "environment variable DPCS_OPTIONS"
    assert record.option_sources["compiler"] == record.option_sources["strict"] == "code"
    assert record.option_sources["hardware_profile"] == "environment variable DPCS_HARDWARE_PROFILE"
    (summary,) = (tmp_path / "dump").rglob("summary.json")
    assert json.loads(summary.read_text())["option_sources"] == record.option_sources


@pytest.mark.parametrize("key, value", [("step_context", {"forward_bytes": 3}), ("size_hints", [["s0", 64]]),
                                        ("stands_in_for", "inductor")])
def test_fields_dpcs_sets_for_its_graphs_are_refused_from_users_in_code_and_in_the_environment(monkeypatch, key, value):
    import json

    with pytest.raises(ValueError, match=rf"unknown dpcs option '{key}' \(set by dpcs"):
        DpcsOptions.from_dict({key: value})
    monkeypatch.setenv("DPCS_OPTIONS", json.dumps({key: value}))
    with pytest.raises(ValueError, match=rf"'{key}'.*DPCS_OPTIONS"):
        DpcsOptions.from_dict({})
