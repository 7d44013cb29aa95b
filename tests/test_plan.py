"""`agentrl plan`: parameter counts, per-device bytes by hand, the CLI and its errors."""

import json
import math

import pytest

from agentrl import cli, plan
from agentrl.models.config import PRESETS, model_config, param_count

QWEN2_5_7B_PARAMS = 7_615_616_512


def plan_7b(mesh, **kwargs):
    options = dict(batch_size=8, seq_len=4096, device_memory_gb=80)
    options.update(kwargs)
    config = model_config("qwen2_5_7b", dtype="bfloat16", param_dtype="bfloat16",
                          remat=options.pop("remat", "full"),
                          attention_impl=options.pop("attention_impl", None))
    return plan.plan_memory(config, mesh, **options)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_eval_shape_count_equals_param_count(name):
    config = model_config(name)
    result = plan.plan_memory(config, {"data": 1}, batch_size=1, seq_len=8, device_memory_gb=80)
    assert result.param_count == param_count(config)
    # One device, float32: the parameters are the whole model.
    assert result.categories["parameters"] == 4 * param_count(config)


def test_qwen2_5_7b_count():
    assert plan_7b({"fsdp": 8}).param_count == QWEN2_5_7B_PARAMS


def test_7b_bf16_fsdp8_parameter_bytes_by_hand():
    # DEFAULT_RULES shard `embed` (3584 = 8 · 448) over fsdp; the q/k/v biases
    # ([L, heads, head_dim], no embed axis) stay replicated.
    layers, heads, kv_heads, head_dim = 28, 28, 4, 128
    replicated = layers * (heads * head_dim + 2 * kv_heads * head_dim)
    per_device = (QWEN2_5_7B_PARAMS - replicated) // 8 + replicated
    assert per_device == 952_064_960
    result = plan_7b({"data": 1, "fsdp": 8, "tensor": 1})
    assert result.categories["parameters"] == 2 * per_device == 1_904_129_920
    assert result.categories["parameters"] == pytest.approx(2 * QWEN2_5_7B_PARAMS / 8, rel=1e-3)
    assert result.categories["gradients"] == 2 * per_device
    # AdamW: float32 mu and nu, sharded like the parameters, + an int32 step count.
    assert result.categories["optimizer_state"] == 2 * 4 * per_device + 4
    assert result.batch_per_device == 1


def test_7b_tensor8_replicates_heads_that_do_not_divide():
    # 28 query heads and 4 kv heads do not divide by 8: attention weights are
    # replicated; the MLP (18944 = 8 · 2368) and vocab (152064 = 8 · 19008) shard.
    d, f, v, layers, hd = 3584, 18944, 152064, 28, 128
    attention = d * 28 * hd + 2 * d * 4 * hd + 28 * hd * d + (28 + 2 * 4) * hd
    per_layer = attention + 3 * d * f // 8 + 2 * d
    per_device = layers * per_layer + 2 * v * d // 8 + d
    result = plan_7b({"tensor": 8})
    assert result.categories["parameters"] == 2 * per_device == 3_343_133_696
    assert result.categories["gathered_weights"] == 0  # no FSDP


def test_fsdp_that_divides_nothing_replicates_everything():
    result = plan_7b({"fsdp": 3}, batch_size=3)
    assert result.categories["parameters"] == 2 * QWEN2_5_7B_PARAMS


def test_mesh_larger_than_this_machine():
    result = plan_7b({"data": 2, "fsdp": 32}, batch_size=64)
    assert sum(result.mesh.values()) == 35 and math.prod(result.mesh.values()) == 64
    assert result.categories["parameters"] < 2 * QWEN2_5_7B_PARAMS / 31
    assert result.batch_per_device == 1


def test_master_weights_add_a_float32_copy():
    result = plan_7b({"fsdp": 8}, master_weights=True)
    assert result.categories["master_weights"] == 2 * result.categories["parameters"]


def test_activation_terms_by_hand_and_ordering():
    result = plan_7b({"fsdp": 8})
    # remat=full saves each layer's input: L · B_d · T · D · 2 bytes.
    assert result.activation_terms["saved_per_layer"] == 28 * 1 * 4096 * 3584 * 2
    # Three float32 [B_d, 512, V] log-prob buffers + hidden and its cotangent.
    assert result.activation_terms["loss"] == 3 * 512 * 152064 * 4 + 2 * 4096 * 3584 * 2
    totals = {remat: plan_7b({"fsdp": 8}, remat=remat).categories["activations"]
              for remat in ("none", "dots", "dots_no_batch", "full")}
    assert totals["none"] > totals["dots"] > totals["dots_no_batch"] > totals["full"]
    flash = plan_7b({"fsdp": 8}, attention_impl="cudnn").categories["activations"]
    assert flash < totals["full"]


def test_fits_depends_on_device_memory():
    assert plan_7b({"fsdp": 8}).fits
    small = plan_7b({"fsdp": 8}, device_memory_gb=16)
    assert not small.fits
    assert small.usable_bytes == 12 * 10**9


def test_cli_table(capsys):
    status = cli.main(["plan", "--model", "qwen2_5_7b", "--mesh", "data=1,fsdp=8,tensor=1",
                       "--device-memory-gb", "80", "--batch", "8", "--seq-len", "4096",
                       "--dtype", "bfloat16", "--remat", "full"])
    out = capsys.readouterr().out
    assert status == 0
    assert "7,615,616,512 parameters" in out
    assert "parameters (bfloat16)                             1.77" in out
    assert "fits       yes" in out


def test_cli_json_and_does_not_fit_status(capsys):
    status = cli.main(["plan", "--model", "qwen2_5_7b", "--mesh", "fsdp=8", "--batch", "8",
                       "--seq-len", "4096", "--device-memory-gb", "16", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 1
    assert report["fits"] is False
    assert report["bytes_per_device"]["parameters"] == 1_904_129_920
    assert report["total_bytes"] == sum(report["bytes_per_device"].values())


def test_cli_hf_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model_config("qwen3_0_6b").to_hf()))
    status = cli.main(["plan", "--hf-config", str(path), "--mesh", "fsdp=2", "--batch", "2",
                       "--seq-len", "256", "--device-memory-gb", "24", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0
    assert report["param_count"] == param_count(model_config("qwen3_0_6b"))
    assert report["model_type"] == "qwen3"


def test_cli_config_file_with_override(capsys):
    status = cli.main(["plan", "--config", "configs/plan_qwen2_5_7b.py:16",
                       "--config.batch_size=32", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0
    assert report["mesh"] == {"data": 1, "fsdp": 16, "tensor": 1}
    assert report["batch_per_device"] == 2
    assert report["param_count"] == QWEN2_5_7B_PARAMS


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "data=16", "--num-devices", "8"], "needs 16 devices, but 8 are available"),
    (["--mesh", "data=1,fsdp=8,tensor=1", "--num-devices", "4"], "needs 8 devices, but 4"),
    (["--mesh", "pipeline=2"], "is not AXIS=SIZE"),
    (["--mesh", "data=two"], "is not an integer"),
    (["--mesh", "data=-1"], "pass --num-devices"),
    (["--mesh", "fsdp=8", "--batch", "6"], "batch_size=6 does not split"),
    (["--mesh", "fsdp=8", "--model", "qwen9"], "neither a preset"),
])
def test_cli_errors_are_clear(capsys, argv, message):
    defaults = {"--model": "qwen2_5_7b", "--batch": "8", "--seq-len": "1024",
                "--device-memory-gb": "80"}
    for flag, value in defaults.items():
        if flag not in argv:
            argv = [*argv, flag, value]
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentrl plan: error:")
    assert message in err


def test_cli_missing_flags_are_named(capsys):
    assert cli.main(["plan", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "--mesh" in err and "--batch" in err and "--device-memory-gb" in err
