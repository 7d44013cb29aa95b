"""`benchmarks/gpu_check.py --smoke`: the GPU check's train step runs on CPU, table last."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_smoke_trains_and_prints_the_table_last(capsys):
    gpu_check = load_gpu_check()
    assert gpu_check.main(["--smoke"]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("attention"))
    rows = {tuple(line.split()[:2]): line for line in lines[header + 2:]}
    assert len(lines) == header + 2 + len(rows) == header + 4  # the table is last
    xla = rows[("xla", "full")]
    assert xla.endswith("ok")
    first, last = (float(v) for v in xla.split()[-2].split("→"))
    assert last < first  # AdamW on a fixed batch lowers the loss
    # Tests run on CPU (conftest): the cuDNN row reports its failure, the XLA rows still ran.
    assert "failed: RuntimeError: cuDNN is not detected" in rows[("cudnn", "full")]


def test_mfu_flops_formula():
    gpu_check = load_gpu_check()
    config = gpu_check.model_config("qwen2_5_0_5b")
    # Tied: every parameter multiplies (the table is the LM head too).
    assert gpu_check.matmul_params(config) == 494_032_768
    # 6·N + 12·L·T·h·d_h with L = 24, h·d_h = 14·64 = 896, T = 2048.
    assert gpu_check.flops_per_token(config, 2048) == 6 * 494_032_768 + 12 * 24 * 2048 * 896
    untied = gpu_check.model_config("qwen2_5_7b")
    assert gpu_check.matmul_params(untied) == 7_615_616_512 - 152064 * 3584
