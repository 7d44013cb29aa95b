"""Orbax parameter checkpoints (real orbax, 8 CPU devices) and `agentrl convert`."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import peft
import pytest
import torch
import transformers
from safetensors import safe_open

from agentrl import cli, parallel
from agentrl.models import lora
from agentrl.models.config import QwenConfig
from agentrl.models.policy import Policy, load_pretrained, param_shardings
from agentrl.models.qwen import QwenModel
from agentrl.train import checkpoint
from tests.models.hf_reference import VOCAB, build_hf_model, hf_forward

CONFIG = QwenConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
TOKENS = np.random.RandomState(2).randint(0, VOCAB, (2, 8))


def _mesh(data, fsdp, tensor):
    devices = jax.devices()[: data * fsdp * tensor]
    return parallel.make_mesh(parallel.MeshConfig(data=data, fsdp=fsdp, tensor=tensor), devices)


def _random_params(config, mesh, spec=None, seed=0):
    """Random parameters placed with the model's shardings (no init to compile)."""
    model = QwenModel(config) if spec is None else QwenModel(config, spec)
    shardings, shapes = param_shardings(model, mesh)
    rng = np.random.RandomState(seed)
    return jax.tree_util.tree_map(
        lambda shape, sharding: jax.device_put(
            (0.05 * rng.standard_normal(shape.shape)).astype(shape.dtype), sharding),
        shapes, shardings)


@pytest.fixture(scope="module")
def policy():
    """Random parameters sharded over (data 1, fsdp 4, tensor 2)."""
    mesh = _mesh(1, 4, 2)
    return Policy(CONFIG, _random_params(CONFIG, mesh), mesh)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """`(directory, logits)` of a tiny Qwen3 HF checkpoint."""
    directory = tmp_path_factory.mktemp("hf") / "qwen3"
    model = build_hf_model("qwen3", False, seed=5)
    model.save_pretrained(directory)
    return directory, hf_forward(model, TOKENS)[0]


def _assert_equal_values(actual, expected):
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual),
                            jax.tree_util.tree_leaves(expected), strict=True):
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def _assert_shardings(params, config, mesh, spec=None):
    model = QwenModel(config) if spec is None else QwenModel(config, spec)
    shardings, _ = param_shardings(model, mesh)
    for (path, array), sharding in zip(jax.tree_util.tree_leaves_with_path(params),
                                       jax.tree_util.tree_leaves(shardings), strict=True):
        assert array.sharding == sharding, path


def _transformers_logits(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return hf_forward(model.eval(), TOKENS)[0]


# ---------------------------------------------------------------------------
# save_params / restore_params.
# ---------------------------------------------------------------------------


def test_sharded_save_restores_onto_another_mesh(policy, tmp_path):
    path = checkpoint.save_params(tmp_path / "ckpt", policy.params, CONFIG)
    assert path == tmp_path / "ckpt"
    for mesh in [_mesh(2, 2, 2), _mesh(1, 1, 1)]:
        config, params = checkpoint.restore_params(path, mesh=mesh)
        assert config == CONFIG
        _assert_equal_values(params, policy.params)
        _assert_shardings(params, config, mesh)
    config, params = checkpoint.restore_params(path, mesh=_mesh(2, 2, 2))
    kernel = params["layers"]["layer"]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.shard_shape(kernel.shape) == (2, 32, 48)  # fsdp × tensor
    np.testing.assert_allclose(np.asarray(Policy(config, params, _mesh(2, 2, 2)).logits(TOKENS)),
                               np.asarray(policy.logits(TOKENS)), atol=1e-5, rtol=0)


def test_steps_and_latest(policy, tmp_path):
    doubled = jax.tree_util.tree_map(lambda x: 2 * x, policy.params)
    assert checkpoint.save_params(tmp_path, policy.params, CONFIG, step=1) == tmp_path / "1"
    checkpoint.save_params(tmp_path, doubled, CONFIG, step=5)
    assert checkpoint.checkpoint_steps(tmp_path) == [1, 5]
    _assert_equal_values(checkpoint.restore_params(tmp_path)[1], doubled)
    _assert_equal_values(checkpoint.restore_params(tmp_path, step=1)[1], policy.params)
    with pytest.raises(FileNotFoundError, match=r"step 3 .* finished steps: \[1, 5\]"):
        checkpoint.restore_params(tmp_path, step=3)
    with pytest.raises(FileExistsError, match="step 5 already exists"):
        checkpoint.save_params(tmp_path, policy.params, CONFIG, step=5)
    with pytest.raises(FileExistsError, match="exists"):
        checkpoint.save_params(tmp_path / "1", policy.params, CONFIG)


def _crash_before_commit(monkeypatch, names):
    """The process dies after every item is written, before the checkpoint's final rename."""
    temporary_path = ocp.path.atomicity.AtomicRenameTemporaryPath
    finalize = temporary_path.finalize

    async def crash(self, *args, **kwargs):
        if self.get_final().name in names:
            raise RuntimeError("simulated crash before the rename")
        return await finalize(self, *args, **kwargs)

    monkeypatch.setattr(temporary_path, "finalize", crash)


def test_interrupted_save_is_not_a_checkpoint(policy, tmp_path, monkeypatch):
    checkpoint.save_params(tmp_path / "steps", policy.params, CONFIG, step=1)
    _crash_before_commit(monkeypatch, {"single", "2"})
    with pytest.raises(RuntimeError, match="simulated crash"):
        checkpoint.save_params(tmp_path / "single", policy.params, CONFIG)
    with pytest.raises(RuntimeError, match="simulated crash"):
        checkpoint.save_params(tmp_path / "steps", jax.tree_util.tree_map(lambda x: x + 1,
                                                                         policy.params),
                               CONFIG, step=2)
    monkeypatch.undo()

    # Everything was written, under temporary names.
    leftovers = sorted(p.name for p in tmp_path.rglob("*orbax-checkpoint-tmp*")
                       if p.parent in (tmp_path, tmp_path / "steps"))
    assert len(leftovers) == 2 and any(name.startswith("single.") for name in leftovers)
    assert any((tmp_path / "steps").glob("2.orbax-checkpoint-tmp*/params"))

    with pytest.raises(FileNotFoundError, match="interrupted save"):
        checkpoint.restore_params(tmp_path / "single")
    for leftover in tmp_path.glob("single.orbax-checkpoint-tmp*"):
        with pytest.raises(FileNotFoundError):
            checkpoint.restore_params(leftover)
    assert checkpoint.checkpoint_steps(tmp_path / "steps") == [1]
    _assert_equal_values(checkpoint.restore_params(tmp_path / "steps")[1], policy.params)
    with pytest.raises(FileNotFoundError, match="step 2"):
        checkpoint.restore_params(tmp_path / "steps", step=2)


def test_lora_bfloat16_and_unscanned_trees(tmp_path):
    spec = lora.lora_spec(4, 8.0, targets=("q_proj", "down_proj"))
    config = CONFIG.replace(param_dtype="bfloat16", dtype="bfloat16", scan_layers=False)
    mesh = _mesh(2, 2, 2)
    adapted = _random_params(config, mesh, spec, seed=3)
    checkpoint.save_params(tmp_path, adapted, config, step=0, lora=spec)
    restored_config, params = checkpoint.restore_params(tmp_path, mesh=_mesh(1, 8, 1))
    assert restored_config == config
    assert checkpoint.restore_lora_spec(tmp_path) == spec
    assert params["layers_1"]["layer"]["mlp"]["down_proj"]["lora_a"].shape == (96, 4)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype("bfloat16")}
    _assert_equal_values(params, adapted)
    _assert_shardings(params, config, _mesh(1, 8, 1), spec)


def test_restore_refuses_other_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a finished agentrl checkpoint"):
        checkpoint.restore_params(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a finished agentrl checkpoint"):
        checkpoint.restore_params(tmp_path / "missing")
    with ocp.StandardCheckpointer() as other:
        other.save(tmp_path / "plain", {"w": np.ones(3)})
    with pytest.raises(FileNotFoundError, match="save_params"):
        checkpoint.restore_params(tmp_path / "plain")


# ---------------------------------------------------------------------------
# `agentrl convert hf-to-orbax | orbax-to-hf | orbax-to-peft`.
# ---------------------------------------------------------------------------


def test_cli_hf_to_orbax_to_hf(hf_checkpoint, tmp_path, capsys):
    directory, reference = hf_checkpoint
    orbax_dir, hf_out = tmp_path / "orbax", tmp_path / "hf"
    assert cli.main(["convert", "hf-to-orbax", str(directory), str(orbax_dir)]) == 0
    config, params = checkpoint.restore_params(orbax_dir)
    expected = load_pretrained(directory)
    assert config == expected.config
    _assert_equal_values(params, expected.params)

    code = cli.main(["convert", "orbax-to-hf", str(orbax_dir), str(hf_out),
                     "--max-shard-size", "30KB"])
    assert code == 0
    assert f"wrote {hf_out}" in capsys.readouterr().out
    assert len(list(hf_out.glob("*.safetensors"))) > 2
    np.testing.assert_allclose(_transformers_logits(hf_out), reference, atol=1e-5, rtol=0)


def test_cli_bfloat16_and_steps(hf_checkpoint, tmp_path):
    directory, reference = hf_checkpoint
    orbax_dir, hf_out = tmp_path / "orbax", tmp_path / "hf"
    code = cli.main(["convert", "hf-to-orbax", str(directory), str(orbax_dir), "--step", "3"])
    assert code == 0
    assert checkpoint.checkpoint_steps(orbax_dir) == [3]
    code = cli.main(["convert", "orbax-to-hf", str(orbax_dir), str(hf_out), "--step", "3",
                     "--dtype", "bfloat16"])
    assert code == 0
    assert json.loads((hf_out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(hf_out / "model.safetensors"), "pt") as f:
        got = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        want = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_out)
    assert model.dtype == torch.bfloat16
    logits = hf_forward(model.float().eval(), TOKENS)[0]
    assert 0 < np.abs(logits - reference).max() < 5e-2


def test_cli_orbax_with_lora_to_hf_and_peft(hf_checkpoint, tmp_path):
    directory, _ = hf_checkpoint
    base = load_pretrained(directory)
    spec = lora.lora_spec(2, 4.0, targets=("v_proj", "o_proj", "gate_proj"))
    _, adapters = lora.split_lora(_random_params(base.config, base.mesh, spec, seed=1))
    params = lora.join_lora(base.params, adapters)
    ours = np.asarray(Policy(base.config, params, lora=spec).logits(TOKENS))
    checkpoint.save_params(tmp_path / "orbax", params, base.config, lora=spec)

    assert cli.main(["convert", "orbax-to-hf", str(tmp_path / "orbax"),
                     str(tmp_path / "merged")]) == 0
    np.testing.assert_allclose(_transformers_logits(tmp_path / "merged"), ours, atol=1e-4,
                               rtol=0)

    assert cli.main(["convert", "orbax-to-peft", str(tmp_path / "orbax"), str(tmp_path / "peft"),
                     "--base-model", "Qwen/Qwen3-tiny"]) == 0
    adapter_config = json.loads((tmp_path / "peft" / lora.PEFT_CONFIG).read_text())
    assert adapter_config["base_model_name_or_path"] == "Qwen/Qwen3-tiny"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "peft").eval()
    np.testing.assert_allclose(hf_forward(peft_model, TOKENS)[0], ours, atol=1e-4, rtol=0)


def test_cli_errors_name_the_path_and_fix(hf_checkpoint, tmp_path, capsys):
    directory, _ = hf_checkpoint
    assert cli.main(["convert", "orbax-to-hf", str(tmp_path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "save_params" in err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((directory / "config.json").read_text())
    assert cli.main(["convert", "hf-to-orbax", str(tmp_path / "hf"), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "hf") in err and "model.safetensors" in err
    assert cli.main(["convert", "hf-to-orbax", str(directory), str(tmp_path / "o")]) == 0
    assert cli.main(["convert", "hf-to-orbax", str(directory), str(tmp_path / "o")]) == 1
    assert "exists" in capsys.readouterr().err
    assert cli.main(["convert", "orbax-to-peft", str(tmp_path / "o"), str(tmp_path / "p")]) == 1
    assert "orbax-to-hf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["convert", "orbax-to-hf", str(tmp_path / "o"), str(tmp_path / "x"), "--bogus"])
