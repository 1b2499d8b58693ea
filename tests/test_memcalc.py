"""Memory calculator: parameter formulas vs real models, activation coefficients vs a re-count,
estimates vs measured peaks, CLI and the no-torch import rule."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from crowdtrain.memcalc import estimate, get_architecture
from crowdtrain.memcalc.architectures import ACTIVATION_COEFFS, PRESETS_JSON


def test_memcalc_imports_without_torch():
    code = "import sys, crowdtrain.memcalc as m, crowdtrain.memcalc.web; m.estimate('crowdtrain-paper'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["gpt2", "gpt2-large", "gpt2-xl", "bert-base", "bert-large", "t5-3b", "t5-11b",
                                  "gpt-j-6b", "gpt3-2.7b", "gpt3-175b"])
def test_param_formula_matches_hf_model_on_meta(name):
    torch = pytest.importorskip("torch")
    import transformers as tf

    arch = get_architecture(name)
    h, L = arch.width, arch.stacks[0].layers
    if arch.family == "gpt2":
        model_fn = lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=L, n_embd=h, n_head=arch.heads,
                                                            n_positions=arch.seq_len, vocab_size=arch.vocab_size))
    elif arch.family == "bert":
        model_fn = lambda: tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=L, hidden_size=h, num_attention_heads=arch.heads,
                                                            intermediate_size=arch.ff, vocab_size=arch.vocab_size))
    elif arch.family == "t5":
        model_fn = lambda: tf.T5ForConditionalGeneration(tf.T5Config(num_layers=L, d_model=h, d_kv=arch.d_head,
                                                                     num_heads=arch.heads, d_ff=arch.ff, vocab_size=arch.vocab_size))
    else:
        model_fn = lambda: tf.GPTJForCausalLM(tf.GPTJConfig(n_layer=L, n_embd=h, n_head=arch.heads, n_inner=arch.ff,
                                                            vocab_size=arch.vocab_size, rotary_dim=64))
    with torch.device("meta"):
        model = model_fn()
    assert arch.params().numel == sum(p.numel() for p in model.parameters())


def test_known_counts():
    assert get_architecture("gpt2").params().numel == 124_439_808
    assert get_architecture("t5-3b").params().numel == 2_851_598_336
    assert 11.9e9 < get_architecture("dall-e-12b").params().numel < 12.4e9


@pytest.mark.timeout(120)
def test_gpt2_activation_coefficients_match_a_recount():
    pytest.importorskip("transformers")
    from crowdtrain.memcalc.calibrate import fit_family

    fitted = fit_family("gpt2")
    table = ACTIVATION_COEFFS["gpt2"]
    for p in ("4", "2"):
        assert fitted["layer"][int(p)] == pytest.approx(table["layer"][p], abs=0.01)
        for feature in ("h", "V"):  # h and a are collinear in GPT-2: compare their sum
            got = fitted["head"][int(p)].get(feature, 0) + (fitted["head"][int(p)].get("a", 0) if feature == "h" else 0)
            assert got == pytest.approx(table["head"][p][feature], abs=0.01)


@pytest.mark.timeout(120)
def test_preset_counts_match_the_code():
    from crowdtrain.memcalc.calibrate import count_preset

    stored = json.loads(PRESETS_JSON.read_text())
    for name in ("tiny", "demo"):
        assert count_preset(name) == stored[name], "run `python -m crowdtrain.memcalc.calibrate presets`"


@pytest.mark.parametrize("changes", [{}, {"rotary": False}, {"layer_scale": True}, {"heads": 2, "ff_mult": 3},
                                     {"share_ids": (0, 1, 0, 2), "patterns": ("axial_row", "axial_col", "axial_row",
                                                                              "conv_like")}])
def test_param_count_of_a_model_config_matches_the_built_model(changes):
    """What `crowdtrain join` sizes a run's model by, before building it."""
    import dataclasses

    from crowdtrain.memcalc.architectures import crowdtrain_param_count
    from crowdtrain.model import DalleTransformer, get_preset

    config = dataclasses.replace(get_preset("tiny"), **changes)
    assert crowdtrain_param_count(config) == sum(p.numel() for p in DalleTransformer(config).parameters())
    stored = json.loads(PRESETS_JSON.read_text())
    for name in ("tiny", "demo", "paper"):
        assert crowdtrain_param_count(get_preset(name)) == stored[name]["unique_params"]


def test_options_move_memory_the_right_way():
    base = estimate("gpt2-large", batch_size=4)
    assert estimate("gpt2-large", batch_size=4, checkpointing=True).gpu.activations < base.gpu.activations / 5
    eight = estimate("gpt2-large", batch_size=4, optimizer="8bit")
    assert eight.gpu.optimizer_states < base.gpu.optimizer_states / 3.5
    off = estimate("gpt2-large", batch_size=4, offload=True)
    assert off.gpu.optimizer_states == 0 and off.cpu.optimizer_states == base.gpu.optimizer_states
    assert off.traffic_bytes_per_step == 2 * 4 * base.unique_params
    shared = estimate("crowdtrain-paper", reversible=True)
    assert shared.unique_params == get_architecture("crowdtrain-paper").preset["unique_params"]  # counted on meta
    assert shared.unique_params < shared.params / 5  # 64 layers in 5 sharing groups
    with pytest.raises(ValueError, match="optimizer"):
        estimate("gpt2", optimizer="sgd")
    with pytest.raises(ValueError, match="unknown model"):
        estimate("gpt5")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case_name", ["gpt2 fp32 adam", "gpt2 fp32 8bit ckpt", "gpt2 mixed adam",
                                       "demo fp32 adam reversible", "demo pure16 8bit"])
def test_estimate_within_15_percent_of_measured(case_name):
    from crowdtrain.memcalc.validate import CASES, measure_case

    case = next(c for c in CASES if c.name == case_name)
    result = measure_case(case)
    assert abs(result["error"]) < 0.15, result


def test_cli_json():
    out = subprocess.run([sys.executable, "-m", "crowdtrain.cli", "memcalc", "--model", "gpt2-large", "--optimizer",
                          "8bit", "--offload", "--checkpointing", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["gpu_total_gb"] > 0 and data["cpu_total_gb"] > 0
    assert set(data["gpu_gb"]) >= {"weights", "gradients", "optimizer_states", "activations", "buffers"}
    assert data["gpu_gb"]["optimizer_states"] == 0 and data["cpu_gb"]["optimizer_states"] > 0
