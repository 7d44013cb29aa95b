"""Forward + backward tokens/s of the agentrl Qwen model vs Hugging Face transformers, CPU fp32.

    python benchmarks/model_bench.py [--batch 4] [--seq-len 512] [--steps 5] [--warmup 2]
        [--threads 2] [--markdown]

Both implementations get the same random Qwen2-architecture model (`CONFIG`,
63.0 M parameters: vocab 32000, d 512, 8 layers, 8 query / 2 key-value heads
of 64, SwiGLU 2048, untied head), the same weights (the transformers model is
saved with `save_pretrained` and loaded with
`agentrl.models.policy.load_pretrained`), the same tokens and the same loss:
mean next-token cross-entropy over the `B × (T − 1)` predicted positions.

Timed per step: forward, loss and backward to all parameter gradients
(`jax.jit(jax.value_and_grad(loss))` vs `loss.backward()`; no optimizer
update). Median, minimum and maximum of `--steps` steps after `--warmup`
steps (the first agentrl step compiles). Steps are interleaved: each round
runs every implementation once, so load from other jobs on a shared machine
hits all rows alike.

Rows:
* agentrl chunked: the trainer's path, `token_logprobs_and_entropy` (logits
  only per `logits_chunk_size` chunk, rematerialised in the backward pass).
* agentrl full logits: `QwenModel.logits` → `[B, T, V]` → log-softmax.
* agentrl chunked (remat=...): rows for the other `--remat` policies asked for.

GFLOP/s is model FLOPs (`6·N + 12·L·T·h·d_h` per token, N = layer weights +
LM head) per second; the script also measures one fp32 GEMM in each framework
right before the table, the ceiling both implementations are bounded by.
* transformers sdpa / eager: `Qwen2ForCausalLM(...)(input_ids, labels=...)`,
  PyTorch eager mode, attention by `torch.nn.functional.scaled_dot_product_attention`
  (the transformers default) or by its explicit-softmax "eager" attention.

Threads: `torch.set_num_threads(--threads)` (+ OMP/MKL variables); XLA's CPU
client sizes its intra-op pool to the machine's cores, so `--threads` should
equal `os.cpu_count()` for a fair comparison (the script warns otherwise).
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

THREADS_DEFAULT = os.cpu_count() or 1
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, str(THREADS_DEFAULT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from agentrl.models.config import param_count  # noqa: E402
from agentrl.models.policy import load_pretrained  # noqa: E402
from agentrl.models.qwen import QwenModel, token_logprobs_and_entropy  # noqa: E402

CONFIG = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)


def model_flops_per_token(config, seq_len: int) -> float:
    """`6·N + 12·L·T·h·d_h`: N the matmul weights (layers + LM head; the lookup is free)."""
    n = param_count(config) - (0 if config.tie_word_embeddings
                               else config.vocab_size * config.hidden_size)
    return 6 * n + 12 * config.num_hidden_layers * seq_len * (
        config.num_attention_heads * config.head_dim)


def gemm_rates(size=(2048, 512, 2048), repeats=10) -> tuple[float, float]:
    """fp32 GFLOP/s of one `[m, k] × [k, n]` matmul in JAX and in PyTorch (the roofline)."""
    m, k, n = size
    rng = np.random.default_rng(0)
    a, b = rng.random((m, k), np.float32), rng.random((k, n), np.float32)
    jax_mm = jax.jit(jnp.matmul)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    rates = []
    for call in (lambda: jax_mm(ja, jb).block_until_ready(), lambda: ta @ tb):
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        rates.append(2 * m * k * n / statistics.median(times) / 1e9)
    return rates[0], rates[1]


def timed_interleaved(steps: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each `steps[name]()`, measured in interleaved rounds.

    Every round calls each step once, in order, so load from other processes on
    a shared machine spreads over all implementations instead of biasing one.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    for round_index in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
        print(f"  round {round_index + 1}/{rounds}: "
              + ", ".join(f"{name} {times[name][-1]:.2f} s" for name in steps),
              file=sys.stderr, flush=True)
    return times


def hf_model(path: str, attention: str):
    model = transformers.Qwen2ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attention
    )
    return model.train()  # dropout is 0 in this config; train mode as in fine-tuning


def hf_step(model, tokens):
    input_ids = torch.from_numpy(tokens).long()

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss

    return step


def hf_loss_and_grad_norm(model, tokens) -> tuple[float, float]:
    loss = hf_step(model, tokens)().detach()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    return float(loss), float(norm)


def agentrl_loss_fn(policy, path: str):
    """`loss(params, tokens)`: mean next-token cross-entropy by the chosen path."""
    model = policy.model
    chunk = policy.config.logits_chunk_size

    def loss(params, tokens):
        hidden = model.apply({"params": params}, tokens)["hidden"]
        targets = tokens[:, 1:]
        if path == "chunked":
            unembed = model.apply({"params": params}, method=QwenModel.unembedding)
            logp, _ = token_logprobs_and_entropy(hidden[:, :-1], targets, unembed,
                                                 chunk_size=chunk)
        else:
            logits = model.apply({"params": params}, hidden[:, :-1], method=QwenModel.logits)
            log_probs = jax.nn.log_softmax(logits, axis=-1)
            logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return -jnp.mean(logp)

    return loss


def agentrl_step(policy, path: str, tokens):
    grad_fn = jax.jit(jax.value_and_grad(agentrl_loss_fn(policy, path)))
    tokens = jnp.asarray(tokens)
    params = policy.params

    def step():
        loss, grads = grad_fn(params, tokens)
        jax.block_until_ready(grads)
        return loss

    return step, grad_fn, tokens


def agentrl_loss_and_grad_norm(policy, path, tokens) -> tuple[float, float]:
    _, grad_fn, tokens = agentrl_step(policy, path, tokens)
    loss, grads = grad_fn(policy.params, tokens)
    norm = np.sqrt(sum(float(jnp.sum(jnp.square(g.astype(jnp.float64 if jax.config.x64_enabled
                                                            else jnp.float32))))
                       for g in jax.tree_util.tree_leaves(grads)))
    return float(loss), float(norm)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=THREADS_DEFAULT)
    parser.add_argument("--remat", default="none",
                        help="comma-separated agentrl remat policies to time (chunked path)")
    parser.add_argument("--hf-attention", default="sdpa,eager",
                        help="comma-separated transformers attention implementations")
    parser.add_argument("--skip-full-logits", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.threads != (os.cpu_count() or 1):
        print(f"warning: --threads {args.threads} but XLA uses all {os.cpu_count()} cores.",
              file=sys.stderr)
    tokens = np.random.default_rng(0).integers(
        0, CONFIG["vocab_size"], size=(args.batch, args.seq_len), dtype=np.int32
    )
    tokens_per_step = args.batch * args.seq_len
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        reference = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG))
        reference.save_pretrained(path, safe_serialization=True)
        del reference

        # Same weights, loss and gradient norm at init.
        hf_loss, hf_norm = hf_loss_and_grad_norm(hf_model(path, "sdpa"), tokens)
        policies = {remat: load_pretrained(path, dtype="float32", remat=remat)
                    for remat in dict.fromkeys(["none", *args.remat.split(",")])}
        base = policies["none"]
        count = param_count(base.config)
        checks = []
        for loss_path in ("chunked", "full_logits"):
            loss, norm = agentrl_loss_and_grad_norm(base, loss_path, tokens)
            checks.append((loss_path, loss, norm))

        steps = {}
        hf_models = []
        for attention in args.hf_attention.split(","):
            hf_models.append(hf_model(path, attention))
            steps[f"transformers {attention}"] = hf_step(hf_models[-1], tokens)
        for remat, policy in policies.items():
            if remat != "none" and remat not in args.remat.split(","):
                continue
            label = "agentrl chunked" + ("" if remat == "none" else f" (remat={remat})")
            steps[label] = agentrl_step(policy, "chunked", tokens)[0]
        if not args.skip_full_logits:
            steps["agentrl full logits"] = agentrl_step(base, "full_logits", tokens)[0]
        times = timed_interleaved(steps, args.steps, args.warmup)
        rows = [(name, statistics.median(t), min(t), max(t)) for name, t in times.items()]

    flops = model_flops_per_token(base.config, args.seq_len) * tokens_per_step
    gemm_jax, gemm_torch = gemm_rates()
    baseline = next(row[1] for row in rows if row[0].startswith("transformers"))
    baseline_name = next(row[0] for row in rows if row[0].startswith("transformers"))
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"threads: torch {torch.get_num_threads()}, XLA {os.cpu_count()} (all cores); "
          f"jax {jax.__version__}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}")
    print(f"model: Qwen2 architecture, {count / 1e6:.1f} M parameters ({CONFIG}); "
          f"batch {args.batch} × {args.seq_len} = {tokens_per_step} tokens; fp32; "
          f"median of {args.steps} steps after {args.warmup}")
    print(f"model FLOPs/step {flops / 1e9:.0f} G (6·N + 12·L·T·h·d_h per token); fp32 GEMM "
          f"2048×512×2048 now: jax {gemm_jax:.0f} GFLOP/s, torch {gemm_torch:.0f} GFLOP/s")
    print(f"loss at init (same weights): transformers {hf_loss:.6f} (grad norm {hf_norm:.6f})")
    for loss_path, loss, norm in checks:
        print(f"  agentrl {loss_path}: {loss:.6f} (|Δ| {abs(loss - hf_loss):.2e}), grad norm "
              f"{norm:.6f} (rel Δ {abs(norm - hf_norm) / hf_norm:.2e})")
    print()
    if args.markdown:
        print(f"| implementation | median s/step | min | max | tokens/s | GFLOP/s | "
              f"vs {baseline_name} |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, median, fastest, slowest in rows:
            print(f"| {name} | {median:.3f} | {fastest:.3f} | {slowest:.3f} | "
                  f"{tokens_per_step / median:,.0f} | {flops / median / 1e9:.0f} | "
                  f"{baseline / median:.2f}× |")
    else:
        print(f"{'implementation':<34}{'median s':>10}{'min s':>9}{'max s':>9}{'tokens/s':>11}"
              f"{'GFLOP/s':>9}{'ratio':>8}")
        for name, median, fastest, slowest in rows:
            print(f"{name:<34}{median:>10.3f}{fastest:>9.3f}{slowest:>9.3f}"
                  f"{tokens_per_step / median:>11,.0f}{flops / median / 1e9:>9.0f}"
                  f"{baseline / median:>7.2f}×")
        print(f"(ratio: {baseline_name} seconds / row seconds; > 1 is faster)")
    failures = [p for p, loss, _ in checks if abs(loss - hf_loss) > 1e-3 * max(1.0, abs(hf_loss))]
    if failures:
        print(f"error: agentrl loss ({failures}) disagrees with transformers at init.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
