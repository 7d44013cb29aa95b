"""Train-step speed and MFU of a Qwen2.5-0.5B-sized model on one GPU (H100), one script.

    python benchmarks/gpu_check.py                          # the H100 check, ~5-8 minutes
    python benchmarks/gpu_check.py --batch 8 --seq-len 2048 --remat full,dots_no_batch,none \\
        --attention cudnn,xla --param-dtype float32 --peak-tflops 989
    python benchmarks/gpu_check.py --smoke                  # tiny model on CPU, ~30 s

What one step is: the full jitted train step of the trainer — forward, the
chunked log-prob loss (`token_logprobs_and_entropy`, mean token negative
log-likelihood of random tokens), backward, and an optax AdamW update, with
the state (parameters + optimizer state) donated. Parameters are created
directly sharded by `Policy.init` on a one-device mesh.

Precision (`--param-dtype`): compute is bfloat16 (matmuls and activations;
RMSNorm, softmax and RoPE in float32). With `float32` (default) the
parameters are float32 master weights cast to bfloat16 inside each matmul;
with `bfloat16` they are stored in bfloat16 and the update is computed in
float32 and rounded. AdamW moments are float32 either way.

For every (attention, remat) pair: compile time, XLA's memory analysis of the
step (temporary buffers), the median step time of `--steps` steps after
`--warmup`, tokens/s, and MFU:

    MFU = tokens/s · (6·N + 12·L·T·h·d_h) / peak

* N: the parameters every token multiplies: all layer weights and the LM
  head (for a tied model the embedding table counts once, as the head; an
  untied model's input embedding is a lookup and is excluded).
* 12·L·T·h·d_h: attention score and value FLOPs per token (forward 4·T·h·d_h
  per layer, ×3 with the backward; PaLM, Chowdhery et al. 2022, App. B),
  counting the full T × T square, not the causal half.
* Model FLOPs only: recomputation (remat, the log-prob chunks' checkpoint) is
  not counted, as in the MFU definition.
* peak: `--peak-tflops`, default 989 (H100 SXM dense bfloat16).

`attention="cudnn"` is `jax.nn.dot_product_attention(implementation="cudnn")`;
if it fails to compile (no cuDNN, unsupported shape) the row says why and the
XLA rows still run. A row that runs out of memory says so. Rows run in order
until `--time-budget-s` is spent; the rest are reported as skipped.

Only agentrl, jax, optax and numpy are imported. The timing table is printed
last.
"""

import argparse
import dataclasses
import functools
import math
import os
import platform
import statistics
import sys
import time
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from agentrl import parallel, plan
from agentrl.models.config import model_config, param_count
from agentrl.models.policy import Policy
from agentrl.models.qwen import QwenModel, token_logprobs_and_entropy

GIB = 1024**3


@dataclasses.dataclass
class Row:
    attention: str
    remat: str
    status: str = "skipped"
    compile_s: float = math.nan
    step_s: float = math.nan
    step_min_s: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    xla_temp_gib: float = math.nan
    plan_activations_gib: float = math.nan
    loss_first: float = math.nan
    loss_last: float = math.nan


def matmul_params(config) -> int:
    """N of `6·N`: layer weights and the LM head (an untied input embedding excluded)."""
    total = param_count(config)
    if not config.tie_word_embeddings:
        total -= config.vocab_size * config.hidden_size
    return total


def flops_per_token(config, seq_len: int) -> float:
    attention = 12 * config.num_hidden_layers * seq_len * (
        config.num_attention_heads * config.head_dim)
    return 6 * matmul_params(config) + attention


def make_train_step(config, optimizer, mesh, rules):
    """`step(state, tokens) -> (state, metrics)`: loss, grad, AdamW; state donated."""
    model = QwenModel(config)
    param_dtype = jnp.dtype(config.param_dtype)

    def loss_fn(params, tokens):
        hidden = model.apply({"params": params}, tokens)["hidden"]
        unembed = model.apply({"params": params}, method=QwenModel.unembedding)
        logp, entropy = token_logprobs_and_entropy(
            hidden[:, :-1], tokens[:, 1:], unembed, chunk_size=config.logits_chunk_size
        )
        return -jnp.mean(logp), jnp.mean(entropy)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state, tokens):
        params, opt_state = state
        (loss, entropy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        to32 = functools.partial(jax.tree_util.tree_map, lambda x: x.astype(jnp.float32))
        updates, opt_state = optimizer.update(to32(grads), opt_state, to32(params))
        params = jax.tree_util.tree_map(
            lambda p, u: (p.astype(jnp.float32) + u).astype(param_dtype), params, updates
        )
        grad_norm = optax.tree.norm(grads)
        return (params, opt_state), {"loss": loss, "entropy": entropy, "grad_norm": grad_norm}

    def run(state, tokens):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return step(state, tokens)

    def lower(state, tokens):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return step.lower(state, tokens)

    return run, lower


def short_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "out of memory: " + text[:120]
    return text[:160]


def run_row(row: Row, args, base_config, tokens, mesh, peak_flops: float) -> None:
    config = base_config.replace(
        remat=row.remat, attention_impl=None if row.attention == "xla" else row.attention
    )
    optimizer = optax.adamw(args.learning_rate, weight_decay=0.0, mu_dtype=jnp.float32)
    rules = parallel.DEFAULT_RULES
    try:
        policy = Policy.init(config, 0, mesh=mesh, rules=rules)
        params = policy.params
        opt_state = optimizer.init(
            jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
        )
        state = (params, opt_state)
        run, lower = make_train_step(config, optimizer, mesh, rules)
        start = time.perf_counter()
        compiled = lower(state, tokens).compile()
        row.compile_s = time.perf_counter() - start
        memory = compiled.memory_analysis()
        if memory is not None:
            row.xla_temp_gib = memory.temp_size_in_bytes / GIB
        losses, times = [], []
        for index in range(args.warmup + args.steps):
            start = time.perf_counter()
            with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
                state, metrics = compiled(state, tokens)
            jax.block_until_ready(state)
            elapsed = time.perf_counter() - start
            losses.append(float(metrics["loss"]))
            if index >= args.warmup:
                times.append(elapsed)
        del run
    except Exception as err:  # every failure (compile, OOM) is reported in the table
        row.status = "failed: " + short_error(err)
        if args.verbose:
            traceback.print_exc()
        return
    tokens_per_step = tokens.size
    row.step_s = statistics.median(times)
    row.step_min_s = min(times)
    row.tokens_per_s = tokens_per_step / row.step_s
    row.mfu = row.tokens_per_s * flops_per_token(config, tokens.shape[1]) / peak_flops
    row.loss_first, row.loss_last = losses[0], losses[-1]
    row.status = "ok" if all(map(math.isfinite, losses)) else "non-finite loss"
    estimate = plan.plan_memory(config, {"data": 1}, batch_size=tokens.shape[0],
                                seq_len=tokens.shape[1], device_memory_gb=80)
    row.plan_activations_gib = estimate.categories["activations"] / GIB
    del state, compiled


def format_table(rows: list[Row]) -> str:
    header = (f"{'attention':<10}{'remat':<15}{'compile s':>10}{'step ms':>10}{'min ms':>9}"
              f"{'tokens/s':>11}{'MFU %':>7}{'XLA temp GiB':>14}{'plan act GiB':>14}"
              f"{'loss first→last':>18}  status")
    lines = [header, "-" * len(header)]
    for r in rows:
        losses = (f"{r.loss_first:.3f}→{r.loss_last:.3f}" if math.isfinite(r.loss_first)
                  else "-")
        lines.append(
            f"{r.attention:<10}{r.remat:<15}{r.compile_s:>10.1f}{1e3 * r.step_s:>10.1f}"
            f"{1e3 * r.step_min_s:>9.1f}{r.tokens_per_s:>11,.0f}{100 * r.mfu:>7.1f}"
            f"{r.xla_temp_gib:>14.2f}{r.plan_activations_gib:>14.2f}{losses:>18}  {r.status}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2_5_0_5b", help="a model_config preset")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--remat", default="full,dots_no_batch,none",
                        help="comma-separated remat policies")
    parser.add_argument("--attention", default="cudnn,xla",
                        help="comma-separated: cudnn, xla")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--logits-chunk-size", type=int, default=512)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense peak of the chip, TFLOP/s (H100 SXM bf16: 989)")
    parser.add_argument("--time-budget-s", type=float, default=480.0,
                        help="start no new row after this many seconds")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, B=2, T=64, 2 steps, remat=full: a CPU test")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.batch, args.seq_len = "tiny", 2, 64
        args.steps, args.warmup = 2, 1
        if args.remat == parser.get_default("remat"):
            args.remat = "full"

    started = time.perf_counter()
    base_config = model_config(args.model, dtype="bfloat16", param_dtype=args.param_dtype,
                               logits_chunk_size=args.logits_chunk_size)
    device = jax.devices()[0]
    mesh = parallel.make_mesh(devices=[device])
    tokens = jnp.asarray(np.random.default_rng(0).integers(
        0, base_config.vocab_size, size=(args.batch, args.seq_len), dtype=np.int32))
    peak_flops = args.peak_tflops * 1e12
    print(f"device: {device.device_kind} ({device.platform}), {platform.node()}; jax "
          f"{jax.__version__}, optax {optax.__version__}; XLA_PYTHON_CLIENT_MEM_FRACTION="
          f"{os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', 'default (0.75)')}")
    print(f"model: {args.model}, {param_count(base_config):,} parameters "
          f"(N = {matmul_params(base_config):,} in matmuls), params {args.param_dtype}, "
          f"compute bfloat16, AdamW moments float32; batch {args.batch} × {args.seq_len}; "
          f"FLOPs/token {flops_per_token(base_config, args.seq_len):.4g}; peak "
          f"{args.peak_tflops:g} TFLOP/s", flush=True)

    rows = [Row(attention, remat) for attention in args.attention.split(",")
            for remat in args.remat.split(",")]
    for row in rows:
        if time.perf_counter() - started > args.time_budget_s:
            row.status = f"skipped: time budget {args.time_budget_s:g} s spent"
            continue
        print(f"running attention={row.attention} remat={row.remat} ...", flush=True)
        run_row(row, args, base_config, tokens, mesh, peak_flops)
        print(f"  {row.status}; median step {1e3 * row.step_s:.1f} ms", flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s\n")
    print(format_table(rows))
    return 0 if any(row.status == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
