"""The Hugging Face architecture sweep runs end to end on one model and writes its JSON."""

from __future__ import annotations

import json

import pytest

from dpcs_testing import load_benchmark

pytest.importorskip("transformers")


def test_bert_called_with_labels_holds_the_budget_and_is_planned_with_its_logits_freed(tmp_path, monkeypatch):
    """BERT returns its logits with the loss and the loop keeps the loss: the step is planned again with them
    freed, recomputing less than the graph's own plan, within the budget and with eager's gradients. Planned
    with the pinned reference CPU profile (the same decisions on every CPU)."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")
    assert load_benchmark("hf_architectures").main(["--models", "bert", "--steps", "4", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "hf_architectures_eager.json").read_text())
    assert result["torch"] and result["transformers"]
    bert = result["models"]["bert"]
    assert bert["held"] and bert["feasible"] and bert["step_planned"] and bert["gradients_match_eager"]
    own, *_, last = bert["recomputed"]
    assert last < own
    assert bert["measured_bytes"] <= bert["predicted_bytes"] <= 1.01 * bert["measured_bytes"]


def test_train_mode_with_dropout_holds_the_budget_and_writes_its_own_file(tmp_path, monkeypatch):
    """With dropout on, the compiled graphs draw other masks than eager: the gradients are checked finite, not
    compared (`gradients_match_eager` is None, not True), and the budget and prediction are held as in eval
    mode. The random values are never recomputed (they would not reproduce), so the plan saves them."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")
    run = load_benchmark("hf_architectures").main
    assert run(["--models", "distilbert", "--steps", "2", "--train", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "hf_architectures_eager.json").exists()
    result = json.loads((tmp_path / "hf_architectures_eager_train.json").read_text())
    assert result["train"] is True
    model = result["models"]["distilbert"]
    assert model["gradients_match_eager"] is None
    assert model["held"] and model["feasible"]
    assert model["measured_bytes"] <= model["predicted_bytes"] <= 1.01 * model["measured_bytes"]


def test_an_unknown_model_is_refused_with_the_choices(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("hf_architectures").main(["--models", "gpt5", "--out", str(tmp_path)])
    assert "valid choices: bert" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.inductor
def test_t5_under_inductor_holds_the_budget_its_first_step_plan_is_made_for(tmp_path, monkeypatch):
    """T5's backward under Inductor reads saved views of one storage (a `view` and its `permute`): counted per
    input, Inductor's schedule started 0.49 MB high and freed the first view's bytes early, and the step plan
    measured over its budget, predicted 2.6% under, with every step under the profiler (no correction from a
    measured step). Counted per storage it holds, predicted at or above what it measures. Planned with the pinned
    reference CPU profile."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")
    run = load_benchmark("hf_architectures").main
    assert run(["--models", "t5", "--compiler", "inductor", "--steps", "3", "--out", str(tmp_path)]) == 0
    t5 = json.loads((tmp_path / "hf_architectures_inductor.json").read_text())["models"]["t5"]
    assert t5["feasible"] and t5["step_planned"] and t5["gradients_match_eager"]
    assert t5["held"], t5
    assert t5["measured_bytes"] <= t5["predicted_bytes"] <= 1.02 * t5["measured_bytes"], t5


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("name", ["gptj", "mixtral"])
def test_a_refused_budgets_best_plan_under_inductor_is_predicted_as_its_graphs_compiled(tmp_path, monkeypatch, name):
    """Budgets no plan meets under Inductor: the best plan's step is predicted as its graphs compiled, within 1% of
    what it measures. Mixtral's experts' gradient is a concatenation Inductor computes in place, which its schedule
    was read as holding twice (predicted 9.6% over); GPT-J's backward schedule holds 97.5 KB less than the FX
    model, which its step's prediction left out (5.7% over). Planned with the pinned reference CPU profile."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")
    run = load_benchmark("hf_architectures").main
    assert run(["--models", name, "--compiler", "inductor", "--steps", "3", "--out", str(tmp_path)]) == 0
    model = json.loads((tmp_path / "hf_architectures_inductor.json").read_text())["models"][name]
    assert not model["feasible"] and model["infeasible_warning"] and model["gradients_match_eager"], model
    assert model["measured_bytes"] <= model["predicted_bytes"] <= 1.01 * model["measured_bytes"], model


@pytest.mark.slow
@pytest.mark.inductor
def test_mamba_under_inductor_with_a_budget_matches_eagers_gradients(tmp_path, monkeypatch):
    """Mamba's plans save several slices of one buffer; AOTAutograd donated each to the backward and Inductor wrote
    over one while another was still read: layer 1's `A_log` gradient 43% off (the sweep raises on any gradient
    not close to eager's). Not donated (`stages/compile_parts.saved_views_not_donated`), they match."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")
    run = load_benchmark("hf_architectures").main
    assert run(["--models", "mamba", "--compiler", "inductor", "--steps", "2", "--out", str(tmp_path)]) == 0
    mamba = json.loads((tmp_path / "hf_architectures_inductor.json").read_text())["models"]["mamba"]
    assert "error" not in mamba and mamba["gradients_match_eager"], mamba


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize(("name", "steps"), [("deberta_v2", 6), ("gemma3", 3)])
def test_first_plans_under_inductor_are_predicted_as_they_measure(tmp_path, monkeypatch, name, steps):
    """Every step under the profiler (no correction from a measured step): the step plan holds its budget and is
    predicted within 0.5% of what it measures. DeBERTa-v2's saved softmax was donated and written over in place
    (3.7% over); Gemma 3's saved attention output and log-sum-exp were one 2 KiB storage, and its backward was
    credited user outputs' bytes (1.1% under, over its budget). Planned with the pinned reference CPU profile.
    DeBERTa-v2's step is planned again twice when its compiled variants predict it well under its budget
    (`solve_knowing`): the step measured comes after those (a step that compiles a variant is predicted by its
    plan until it ends)."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")
    run = load_benchmark("hf_architectures").main
    assert run(["--models", name, "--compiler", "inductor", "--steps", str(steps), "--out", str(tmp_path)]) == 0
    model = json.loads((tmp_path / "hf_architectures_inductor.json").read_text())["models"][name]
    assert model["feasible"] and model["held"] and model["gradients_match_eager"], model
    assert abs(model["predicted_bytes"] - model["measured_bytes"]) <= 0.005 * model["measured_bytes"], model


@pytest.mark.slow
@pytest.mark.inductor
def test_phi3_under_inductor_holds_a_budget_it_was_refused(tmp_path, monkeypatch):
    """Phi-3's backward counted four 16 KiB tangents of its fused projection's split as 64 KiB each (an input read
    under a mask sized by that read): the budget was refused, its best plan predicted 15.6% over what it measured.
    Sized by their layouts, a plan fits and holds. Planned with the pinned reference CPU profile."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")
    run = load_benchmark("hf_architectures").main
    assert run(["--models", "phi3", "--compiler", "inductor", "--steps", "3", "--out", str(tmp_path)]) == 0
    model = json.loads((tmp_path / "hf_architectures_inductor.json").read_text())["models"]["phi3"]
    assert model["feasible"] and model["held"] and model["gradients_match_eager"], model
    assert not model["infeasible_warning"], model


@pytest.mark.slow
@pytest.mark.inductor
def test_vit_under_inductor_is_predicted_within_a_tenth_of_a_percent_not_under(tmp_path, monkeypatch):
    """ViT's patch embedding: its backward hands the convolution the patch tokens, a view past the class token that
    oneDNN copies first (8 KiB the channels-last workspace probe missed), and its saved class token is a view
    holding all of the norm's output (sized by its extent, 4 KiB short at the start and over after its last read).
    Predicted 0.45% under the measured step before; now over it by less than 0.1%. Planned with the pinned
    reference CPU profile."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")
    run = load_benchmark("hf_architectures").main
    assert run(["--models", "vit", "--compiler", "inductor", "--steps", "3", "--out", str(tmp_path)]) == 0
    model = json.loads((tmp_path / "hf_architectures_inductor.json").read_text())["models"]["vit"]
    assert model["gradients_match_eager"], model
    assert model["measured_bytes"] <= model["predicted_bytes"] <= 1.001 * model["measured_bytes"], model


@pytest.mark.slow
@pytest.mark.inductor
def test_deberta_v2_under_inductor_is_planned_within_two_percent_of_its_budget(tmp_path, monkeypatch):
    """DeBERTa-v2's compiled plans hold 63-162 KiB in their backward beyond the model, each its own: counting a
    plan's in full for every later plan, its step at 0.72 of its peak measured 2.1% under its budget (1,385,744 B
    of 1,415,401). Counted by the least eighth whose plan is not known over (`solve_knowing`), the step is
    planned again (twice at most) to 0.3% under it (1,411,344 B), and holds it. Planned with the pinned
    reference CPU profile."""
    monkeypatch.setenv("DPCS_HARDWARE_PROFILE", "reference-cpu")
    run = load_benchmark("hf_architectures").main
    assert run(["--models", "deberta_v2", "--compiler", "inductor", "--steps", "6", "--fraction", "0.72",
                "--out", str(tmp_path)]) == 0
    model = json.loads((tmp_path / "hf_architectures_inductor.json").read_text())["models"]["deberta_v2"]
    assert model["feasible"] and model["held"] and model["gradients_match_eager"], model
    assert model["measured_bytes"] >= 0.98 * model["budget_bytes"], model
