"""LoRA: merging, splitting, and PEFT adapters checked against `peft` itself.

The reference: `transformers` + `peft.PeftModel.from_pretrained` on the same
tiny base checkpoint, loading the adapter we export (and we load adapters that
`peft` wrote). Logits agree to 1e-4.
"""

import json

import flax.linen as nn
import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from agentrl import cli
from agentrl.models import lora, weights
from agentrl.models.policy import Policy, abstract_params, load_pretrained
from agentrl.models.qwen import LORA_TARGETS, QwenModel
from tests.models.hf_reference import VOCAB, build_hf_model, hf_forward

TOKENS = np.random.RandomState(1).randint(0, VOCAB, (2, 9))
SPECS = {
    "qwen2_tied": lora.lora_spec(4, 8.0, targets=LORA_TARGETS),
    "qwen3_untied": lora.lora_spec(2, 3.0, dropout=0.05, targets=("q_proj", "o_proj",
                                                                   "down_proj")),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """`{variant: (HF directory, Policy)}`; the qwen2 base is sharded by transformers."""
    root = tmp_path_factory.mktemp("lora_bases")
    out = {}
    for variant in SPECS:
        family, tie = variant.split("_")[0], variant.endswith("_tied")
        model = build_hf_model(family, tie, seed=7)
        shard = "20KB" if family == "qwen2" else "5GB"
        model.save_pretrained(root / variant, max_shard_size=shard)
        out[variant] = (root / variant, load_pretrained(root / variant))
    return out


def _random_adapters(config, spec, seed=0):
    """Non-zero `lora_a` and `lora_b` (B is zero at init, which would test nothing)."""
    shapes = nn.meta.unbox(abstract_params(QwenModel(config, spec)))
    _, adapter_shapes = lora.split_lora(shapes)
    rng = np.random.RandomState(seed)
    return jax.tree_util.tree_map(
        lambda leaf: (0.1 * rng.standard_normal(leaf.shape)).astype(leaf.dtype), adapter_shapes)


@pytest.fixture(scope="module")
def adapted(bases, tmp_path_factory):
    """`{variant: (spec, params with adapters, our logits, adapter dir, PEFT logits)}`."""
    out = {}
    for variant, spec in SPECS.items():
        directory, base = bases[variant]
        params = lora.join_lora(base.params, _random_adapters(base.config, spec))
        ours = np.asarray(Policy(base.config, params, lora=spec).logits(TOKENS))
        adapter_dir = tmp_path_factory.mktemp("adapter") / variant
        lora.save_peft_adapter(adapter_dir, params, spec, base.config,
                               base_model_name_or_path=str(directory))
        out[variant] = (spec, params, ours, adapter_dir, _peft_logits(directory, adapter_dir))
    return out


def _hf_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def _peft_logits(base_dir, adapter_dir):
    model = peft.PeftModel.from_pretrained(_hf_model(base_dir), adapter_dir).eval()
    return hf_forward(model, TOKENS)[0]


# ---------------------------------------------------------------------------
# Merge / split (JAX).
# ---------------------------------------------------------------------------


def test_merge_lora_computes_the_adapted_model(bases, adapted):
    _, base = bases["qwen3_untied"]
    spec, params, ours, *_ = adapted["qwen3_untied"]
    merged = lora.merge_lora(params, spec)
    assert "lora_a" not in str(jax.tree_util.tree_structure(merged))
    merged_logits = np.asarray(Policy(base.config, merged).logits(TOKENS))
    np.testing.assert_allclose(merged_logits, ours, atol=1e-5, rtol=0)
    assert np.abs(ours - np.asarray(base.logits(TOKENS))).max() > 0.1  # the adapter matters


def test_split_and_join_are_inverse(adapted):
    _, params, *_ = adapted["qwen2_tied"]
    base, adapters = lora.split_lora(params)
    leaves = jax.tree_util.tree_leaves_with_path(adapters)
    assert len(leaves) == 2 * len(LORA_TARGETS)
    assert all(path[-1].key in ("lora_a", "lora_b") for path, _ in leaves)
    rejoined = lora.join_lora(base, adapters)
    assert jax.tree_util.tree_structure(rejoined) == jax.tree_util.tree_structure(params)


# ---------------------------------------------------------------------------
# PEFT export / import.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(SPECS))
def test_exported_adapter_matches_peft(adapted, variant):
    spec, _, ours, adapter_dir, peft_logits = adapted[variant]
    np.testing.assert_allclose(ours, peft_logits, atol=1e-4, rtol=0)
    adapter_config = json.loads((adapter_dir / lora.PEFT_CONFIG).read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["task_type"] == "CAUSAL_LM"
    assert adapter_config["r"] == spec.rank and adapter_config["lora_alpha"] == spec.alpha
    assert adapter_config["target_modules"] == list(spec.targets)
    assert adapter_config["bias"] == "none" and adapter_config["fan_in_fan_out"] is False
    tensors = load_file(str(adapter_dir / lora.PEFT_WEIGHTS))
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_{}.weight"
    assert tensors[name.format("A")].shape == (spec.rank, 64)
    assert tensors[name.format("B")].shape == (4 * (16 if variant == "qwen2_tied" else 24),
                                               spec.rank)
    assert len(tensors) == 2 * 3 * len(spec.targets)


@pytest.mark.parametrize("variant", sorted(SPECS))
def test_merged_export_matches_peft(bases, adapted, variant, tmp_path):
    _, base = bases[variant]
    spec, params, _, _, peft_logits = adapted[variant]
    Policy(base.config, params, lora=spec).save_pretrained(tmp_path)
    merged = hf_forward(_hf_model(tmp_path).eval(), TOKENS)[0]
    np.testing.assert_allclose(merged, peft_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_load_of_save_is_exact(bases, adapted, scan_layers, tmp_path):
    _, base = bases["qwen3_untied"]
    spec, params, *_ = adapted["qwen3_untied"]
    config = base.config.replace(scan_layers=scan_layers)
    if not scan_layers:
        params = weights.unstack_layers(params, config.num_hidden_layers)
    lora.save_peft_adapter(tmp_path, params, spec, config)
    loaded_spec, adapters = lora.load_peft_adapter(tmp_path, config)
    assert loaded_spec == spec
    _, expected = lora.split_lora(params)
    assert jax.tree_util.tree_structure(adapters) == jax.tree_util.tree_structure(expected)
    for got, want in zip(jax.tree_util.tree_leaves(adapters), jax.tree_util.tree_leaves(expected),
                         strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))


def test_adapter_written_by_peft_loads(bases, tmp_path):
    """rsLoRA scaling and `layers_to_transform` (other layers get zeros)."""
    directory, base = bases["qwen2_tied"]
    torch.manual_seed(3)
    peft_config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["k_proj", "up_proj"],
                                  init_lora_weights=False, use_rslora=True,
                                  layers_to_transform=[0, 2], task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(_hf_model(directory), peft_config).eval()
    peft_model.save_pretrained(tmp_path)
    spec, adapters = lora.load_peft_adapter(tmp_path, base.config)
    assert spec.targets == ("k_proj", "up_proj") and spec.rank == 4
    assert spec.alpha / spec.rank == pytest.approx(16 / 2)  # α / √r
    up_b = adapters["layers"]["layer"]["mlp"]["up_proj"]["lora_b"]
    assert np.all(up_b[1] == 0) and np.any(up_b[0] != 0)
    ours = Policy(base.config, lora.join_lora(base.params, adapters), lora=spec).logits(TOKENS)
    np.testing.assert_allclose(np.asarray(ours), hf_forward(peft_model, TOKENS)[0], atol=1e-4,
                               rtol=0)


def test_adapter_errors_name_the_problem(bases, adapted, tmp_path):
    _, qwen2 = bases["qwen2_tied"]
    _, qwen3 = bases["qwen3_untied"]
    _, _, _, adapter_dir, _ = adapted["qwen3_untied"]
    shape_error = r"layer 0 o_proj lora_A has shape \(2, 96\), expected \(2, 64\)"
    with pytest.raises(ValueError, match=shape_error):
        lora.load_peft_adapter(adapter_dir, qwen2.config)
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        lora.load_peft_adapter(tmp_path, qwen3.config)
    (tmp_path / lora.PEFT_CONFIG).write_text((adapter_dir / lora.PEFT_CONFIG).read_text())
    with pytest.raises(FileNotFoundError, match="safe_serialization=True"):
        lora.load_peft_adapter(tmp_path, qwen3.config)
    (tmp_path / lora.PEFT_WEIGHTS).write_bytes((adapter_dir / lora.PEFT_WEIGHTS).read_bytes())
    dora = {**json.loads((adapter_dir / lora.PEFT_CONFIG).read_text()), "use_dora": True}
    (tmp_path / lora.PEFT_CONFIG).write_text(json.dumps(dora))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        lora.load_peft_adapter(tmp_path, qwen3.config)
    with pytest.raises(KeyError, match="no lora_a / lora_b"):
        lora.save_peft_adapter(tmp_path / "x", qwen3.params, SPECS["qwen3_untied"], qwen3.config)
    wider = lora.lora_spec(2, 3.0, targets=("q_proj", "v_proj"))
    _, params, *_ = adapted["qwen3_untied"]
    with pytest.raises(KeyError, match="'v_proj'"):
        lora.save_peft_adapter(tmp_path / "x", params, wider, qwen3.config)


# ---------------------------------------------------------------------------
# `agentrl convert merge-lora`.
# ---------------------------------------------------------------------------


def test_cli_merge_lora_matches_peft(bases, adapted, tmp_path, capsys):
    directory, _ = bases["qwen2_tied"]
    _, _, _, adapter_dir, peft_logits = adapted["qwen2_tied"]
    out = tmp_path / "merged"
    assert cli.main(["convert", "merge-lora", str(directory), str(adapter_dir), str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    # The base's sharded layout is kept, file for file.
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(
        p.name for p in directory.glob("*.safetensors"))
    assert len(list(out.glob("*.safetensors"))) > 2
    assert (out / weights.SAFETENSORS_INDEX).is_file()
    merged = hf_forward(_hf_model(out).eval(), TOKENS)[0]
    np.testing.assert_allclose(merged, peft_logits, atol=1e-4, rtol=0)

    assert cli.main(["convert", "merge-lora", str(directory), str(adapter_dir), str(out)]) == 1
    assert "already holds safetensors" in capsys.readouterr().err
    wrong_base = bases["qwen3_untied"][0]
    code = cli.main(["convert", "merge-lora", str(wrong_base), str(adapter_dir),
                     str(tmp_path / "bad")])
    assert code == 1
    assert "is the config the adapter's base model?" in capsys.readouterr().err


def test_cli_merge_lora_bfloat16(bases, adapted, tmp_path):
    directory, _ = bases["qwen3_untied"]
    _, _, _, adapter_dir, peft_logits = adapted["qwen3_untied"]
    code = cli.main(["convert", "merge-lora", str(directory), str(adapter_dir), str(tmp_path),
                     "--dtype", "bfloat16"])
    assert code == 0
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.dtype == torch.bfloat16
    logits = hf_forward(model.float().eval(), TOKENS)[0]
    assert 0 < np.abs(logits - peft_logits).max() < 5e-2
