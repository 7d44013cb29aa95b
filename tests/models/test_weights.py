"""HF safetensors ⇄ agentrl parameters: mapping, sharded loading, export, errors.

The reference is `transformers` itself: tiny random Qwen2 / Qwen3 checkpoints
(tied and untied) written by `save_pretrained`, and the logits of the
checkpoints we export, loaded back by `AutoModelForCausalLM.from_pretrained`.
"""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from agentrl import parallel
from agentrl.models import weights
from agentrl.models.config import QwenConfig
from agentrl.models.policy import load_pretrained, param_shardings
from agentrl.models.qwen import QwenModel
from tests.models.hf_reference import VARIANTS, VOCAB, build_hf_model, hf_forward

TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 8))


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """`{variant: (directory, torch model)}` for the four tiny HF models."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for variant, (family, tie) in VARIANTS.items():
        model = build_hf_model(family, tie, seed=len(out))
        model.save_pretrained(root / variant)
        out[variant] = (root / variant, model)
    return out


@pytest.fixture(scope="module")
def reference_logits(hf_checkpoints):
    return {variant: hf_forward(model, TOKENS)[0]
            for variant, (_, model) in hf_checkpoints.items()}


def _state_dict(directory) -> dict[str, np.ndarray]:
    reader = weights.SafetensorsReader(directory)
    return {name: reader.get(name) for name in reader.names()}


def _transformers_logits(directory) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return hf_forward(model.eval(), TOKENS)[0]


def _assert_trees_equal(actual, expected):
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual),
                            jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


# ---------------------------------------------------------------------------
# The mapping.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_to_params_round_trip_is_exact(hf_checkpoints, variant):
    directory, _ = hf_checkpoints[variant]
    tensors = _state_dict(directory)
    config = QwenConfig.from_hf(directory)
    params = weights.hf_to_params(tensors, config)
    layer = params["layers"]["layer"]
    d, hd, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    assert layer["self_attn"]["q_proj"]["kernel"].shape == (layers, d, 4, hd)
    assert layer["self_attn"]["o_proj"]["kernel"].shape == (layers, 4, hd, d)
    assert ("bias" in layer["self_attn"]["k_proj"]) == (config.model_type == "qwen2")
    assert ("q_norm" in layer["self_attn"]) == (config.model_type == "qwen3")
    assert ("lm_head" in params) == (not config.tie_word_embeddings)
    back = weights.params_to_hf(params, config)
    assert sorted(back) == sorted(tensors)  # tied checkpoints carry no lm_head.weight
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(back[name], tensor, err_msg=name)


def test_qwen3_head_dim_is_not_hidden_over_heads(hf_checkpoints):
    config = QwenConfig.from_hf(hf_checkpoints["qwen3_untied"][0])
    assert config.head_dim == 24 != config.hidden_size // config.num_attention_heads
    assert config.qk_norm and not config.attention_bias and not config.tie_word_embeddings


def test_per_layer_layout_round_trips():
    stacked = {"embed_tokens": np.ones((3, 2)),
               "layers": {"layer": {"mlp": {"kernel": np.arange(12.0).reshape(3, 2, 2)}}}}
    per_layer = weights.unstack_layers(stacked, 3)
    assert sorted(per_layer) == ["embed_tokens", "layers_0", "layers_1", "layers_2"]
    np.testing.assert_array_equal(per_layer["layers_2"]["layer"]["mlp"]["kernel"],
                                  [[8.0, 9.0], [10.0, 11.0]])
    _assert_trees_equal(weights.stack_layers(per_layer, 3), stacked)


# ---------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_load_pretrained_and_export_match_transformers(hf_checkpoints, reference_logits,
                                                       variant, tmp_path):
    directory, _ = hf_checkpoints[variant]
    policy = load_pretrained(directory)
    expected = weights.hf_to_params(_state_dict(directory), policy.config)
    _assert_trees_equal(policy.params, expected)
    np.testing.assert_allclose(np.asarray(policy.logits(TOKENS)), reference_logits[variant],
                               atol=1e-4, rtol=0)
    policy.save_pretrained(tmp_path / "export")
    exported = _transformers_logits(tmp_path / "export")
    np.testing.assert_allclose(exported, reference_logits[variant], atol=1e-5, rtol=0)
    hf_config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert hf_config["tie_word_embeddings"] == policy.config.tie_word_embeddings
    assert QwenConfig.from_hf(tmp_path / "export") == policy.config


def test_sharded_checkpoints_load_identically(hf_checkpoints, reference_logits, tmp_path):
    directory, model = hf_checkpoints["qwen2_untied"]
    single = load_pretrained(directory)

    ours = tmp_path / "ours"
    weights.save_hf_checkpoint(ours, single.params, single.config, max_shard_bytes=40_000)
    files = sorted(path.name for path in ours.glob("*.safetensors"))
    assert len(files) >= 3 and (ours / weights.SAFETENSORS_INDEX).is_file()
    assert not (ours / weights.SAFETENSORS_SINGLE).exists()
    index = json.loads((ours / weights.SAFETENSORS_INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == files
    _assert_trees_equal(load_pretrained(ours).params, single.params)
    np.testing.assert_allclose(_transformers_logits(ours), reference_logits["qwen2_untied"],
                               atol=1e-5, rtol=0)

    theirs = tmp_path / "theirs"
    model.save_pretrained(theirs, max_shard_size="20KB")
    assert len(list(theirs.glob("*.safetensors"))) >= 3
    assert (theirs / weights.SAFETENSORS_INDEX).is_file()
    _assert_trees_equal(load_pretrained(theirs).params, single.params)


def test_resaving_fewer_shards_leaves_no_stale_files(hf_checkpoints, tmp_path):
    policy = load_pretrained(hf_checkpoints["qwen3_tied"][0])
    weights.save_hf_checkpoint(tmp_path, policy.params, policy.config, max_shard_bytes=40_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) >= 3
    weights.save_hf_checkpoint(tmp_path, policy.params, policy.config)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / weights.SAFETENSORS_INDEX).exists()
    _assert_trees_equal(load_pretrained(tmp_path).params, policy.params)


def test_load_into_mesh_reads_only_each_devices_shard(hf_checkpoints, reference_logits,
                                                      monkeypatch):
    directory, _ = hf_checkpoints["qwen3_untied"]
    single = load_pretrained(directory)
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, fsdp=2, tensor=2))
    calls = []
    make_array = jax.make_array_from_callback

    def instrumented(shape, sharding, callback, *args, **kwargs):
        def checked(index):
            shard = callback(index)
            calls.append((shape, shard.shape))
            assert shard.shape == sharding.shard_shape(shape), (shape, index)
            return shard

        return make_array(shape, sharding, checked, *args, **kwargs)

    monkeypatch.setattr(jax, "make_array_from_callback", instrumented)
    sharded = load_pretrained(directory, mesh=mesh)
    monkeypatch.undo()

    assert len(calls) > 2 * len(jax.tree_util.tree_leaves(sharded.params))
    smaller = [call for call in calls if math.prod(call[1]) < math.prod(call[0])]
    assert len(smaller) > len(calls) // 2  # most parameters really are split
    shardings, _ = param_shardings(QwenModel(sharded.config), mesh)
    for (path, array), sharding in zip(jax.tree_util.tree_leaves_with_path(sharded.params),
                                       jax.tree_util.tree_leaves(shardings), strict=True):
        assert array.sharding == sharding, path
        for shard in array.addressable_shards:
            assert shard.data.shape == sharding.shard_shape(array.shape), path
    q_kernel = sharded.params["layers"]["layer"]["self_attn"]["q_proj"]["kernel"]
    assert q_kernel.sharding.shard_shape(q_kernel.shape) == (3, 32, 2, 24)  # fsdp, tensor
    _assert_trees_equal(sharded.params, single.params)
    np.testing.assert_allclose(np.asarray(sharded.logits(TOKENS)),
                               reference_logits["qwen3_untied"], atol=1e-4, rtol=0)


def test_bfloat16_load_is_close_to_float32(hf_checkpoints, reference_logits):
    directory, _ = hf_checkpoints["qwen2_tied"]
    policy = load_pretrained(directory, dtype="bfloat16")
    dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(policy.params)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    assert policy.config.dtype == policy.config.param_dtype == "bfloat16"
    logits = np.asarray(policy.logits(TOKENS), np.float32)
    error = np.abs(logits - reference_logits["qwen2_tied"]).max()
    assert 0 < error <= 2e-2


def test_unscanned_policy_exports(hf_checkpoints, reference_logits, tmp_path):
    directory, _ = hf_checkpoints["qwen3_tied"]
    policy = load_pretrained(directory, scan_layers=False)
    assert "layers" not in policy.params and "layers_2" in policy.params
    np.testing.assert_allclose(np.asarray(policy.logits(TOKENS)), reference_logits["qwen3_tied"],
                               atol=1e-4, rtol=0)
    policy.save_pretrained(tmp_path)
    np.testing.assert_allclose(_transformers_logits(tmp_path), reference_logits["qwen3_tied"],
                               atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------


def _copy_without(src, dst, dropped):
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / weights.SAFETENSORS_SINGLE))
    save_file({k: v for k, v in tensors.items() if k not in dropped},
              str(dst / weights.SAFETENSORS_SINGLE))


def test_missing_tensors_are_named(hf_checkpoints, tmp_path):
    dropped = ["model.layers.2.mlp.up_proj.weight", "model.norm.weight"]
    _copy_without(hf_checkpoints["qwen2_untied"][0], tmp_path, dropped)
    with pytest.raises(KeyError) as error:
        load_pretrained(tmp_path)
    for name in dropped:
        assert name in str(error.value)
    assert "config.json" in str(error.value)


def test_untied_config_on_tied_weights_names_lm_head(hf_checkpoints, tmp_path):
    _copy_without(hf_checkpoints["qwen2_tied"][0], tmp_path, [])
    hf_config = json.loads((tmp_path / "config.json").read_text())
    hf_config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(KeyError, match=r"lm_head\.weight"):
        load_pretrained(tmp_path)


def test_directory_without_safetensors(hf_checkpoints, tmp_path):
    shutil.copy(hf_checkpoints["qwen2_tied"][0] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        load_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("change, error, match", [
    ({"model_type": "llama"}, ValueError, "model_type='llama'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, NotImplementedError, "yarn"),
])
def test_unsupported_configs_are_refused(hf_checkpoints, tmp_path, change, error, match):
    _copy_without(hf_checkpoints["qwen2_tied"][0], tmp_path, [])
    hf_config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf_config, **change}))
    with pytest.raises(error, match=match):
        load_pretrained(tmp_path)


# ---------------------------------------------------------------------------
# Progress bars.
# ---------------------------------------------------------------------------


def test_progress_falls_back_to_plain_lines_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "tqdm.auto", None)
    items = list(weights.progress(range(20), total=20, desc="writing x"))
    assert items == list(range(20))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "writing x: 2/20" and lines[-1] == "writing x: 20/20"
    assert weights.progress([1, 2], enabled=False) == [1, 2]
