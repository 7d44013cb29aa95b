"""Generation tokens/s: `JaxEngine` vs `transformers` `generate`, CPU fp32, same model and prompts.

    python benchmarks/rollout_bench.py [--batch 16] [--prompt-len 64] [--new-tokens 128]
        [--rounds 5] [--warmup 1] [--threads N] [--modes greedy,sampled,filtered]
        [--decode-loops device,host] [--markdown]

Both sides get the same random Qwen2-architecture model (`CONFIG`: vocab
32000, d 512, 6 layers, 8 query / 2 key-value heads of 64, SwiGLU 1536,
untied head; 51.4 M parameters): the transformers model is saved with
`save_pretrained` and loaded with `agentrl.models.load_pretrained`. Same
prompts (`--batch` random prompts of `--prompt-len` tokens), same budget:
every row generates exactly `--new-tokens` tokens (no stop tokens;
transformers gets `min_new_tokens` = `max_new_tokens` and no EOS).

Modes (the same `SamplingParams` / `GenerationConfig` on both sides):
* greedy: temperature 0 / `do_sample=False`.
* sampled: temperature 1, no top-k, no top-p.
* filtered: temperature 0.7, top-k 50, top-p 0.9.

Timed: one whole `generate` call (prefill + decode + returning the ids),
after `--warmup` calls (the engine's first call compiles). Rounds are
interleaved: each round runs every row once, so load from other jobs on a
shared machine hits all rows alike. tokens/s = batch × new tokens / seconds.
The greedy ids of both implementations are compared (random models have
near-ties, so a late divergence from float rounding is possible; the
matching prefix is reported).

Threads: `torch.set_num_threads(--threads)`; XLA's CPU client uses all cores,
so `--threads` should equal `os.cpu_count()` (the default). `--threads 1`
also makes XLA single-threaded (`--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1`, set before jax is imported) and pins the
process to one core: one core for both, the fairer comparison on a machine
shared with other jobs (oversubscribed OpenMP threads make PyTorch erratic).
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

THREADS_DEFAULT = os.cpu_count() or 1


def _threads_from_argv(argv: list[str]) -> int:
    """`--threads N` read before argparse: XLA's thread flags must precede `import jax`."""
    for index, arg in enumerate(argv):
        if arg == "--threads" and index + 1 < len(argv):
            return int(argv[index + 1])
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
    return THREADS_DEFAULT


_THREADS = _threads_from_argv(sys.argv)
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, str(_THREADS))
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
if _THREADS == 1:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SINGLE_THREAD_XLA_FLAGS}".strip()
    if hasattr(os, "sched_setaffinity"):  # and pin the process to one core
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from agentrl.models.config import param_count  # noqa: E402
from agentrl.models.policy import load_pretrained  # noqa: E402
from agentrl.rollout.engine import SamplingParams  # noqa: E402
from agentrl.rollout.jax_engine import JaxEngine  # noqa: E402

CONFIG = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)
MODES = {
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
    "sampled": dict(temperature=1.0, top_k=0, top_p=1.0),
    "filtered": dict(temperature=0.7, top_k=50, top_p=0.9),
}


def hf_generate_fn(model, prompts: np.ndarray, new_tokens: int, mode: dict):
    """`step() -> [B, new_tokens]` ids from `model.generate` with the mode's settings."""
    input_ids = torch.from_numpy(prompts).long()
    attention_mask = torch.ones_like(input_ids)
    sample = mode["temperature"] > 0
    config = transformers.GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=sample,
        temperature=mode["temperature"] if sample else 1.0, top_k=mode["top_k"],
        top_p=mode["top_p"], eos_token_id=None, pad_token_id=0, bos_token_id=None,
    )

    def step():
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 generation_config=config)
        return out[:, prompts.shape[1]:].numpy()

    return step


def engine_generate_fn(engine: JaxEngine, prompts: np.ndarray, new_tokens: int, mode: dict):
    """`step() -> [B, new_tokens]` ids from `engine.generate`."""
    params = SamplingParams(max_new_tokens=new_tokens, **mode)
    prompt_lists = prompts.tolist()

    def step():
        return np.asarray([c.token_ids for c in engine.generate(prompt_lists, params)])

    return step


def timed_interleaved(steps: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each `steps[name]()`, in interleaved rounds (see the docstring)."""
    for name, step in steps.items():
        for _ in range(warmup):
            start = time.perf_counter()
            step()
            print(f"  warmup {name}: {time.perf_counter() - start:.2f} s", file=sys.stderr,
                  flush=True)
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


def matching_prefix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`[B]` length of the common prefix of each row of two `[B, T]` id arrays."""
    same = np.cumprod(a == b, axis=1)
    return same.sum(axis=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=THREADS_DEFAULT)
    parser.add_argument("--modes", default="greedy,sampled,filtered")
    parser.add_argument("--decode-loops", default="device",
                        help="comma-separated JaxEngine decode_loop values to time")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.threads not in (1, os.cpu_count() or 1):
        print(f"warning: --threads {args.threads} but XLA uses all {os.cpu_count()} cores.",
              file=sys.stderr)
    prompts = np.random.default_rng(0).integers(
        3, CONFIG["vocab_size"], size=(args.batch, args.prompt_len), dtype=np.int32)
    modes = args.modes.split(",")
    loops = args.decode_loops.split(",")
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        reference = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG)).eval()
        reference.save_pretrained(path, safe_serialization=True)
        policy = load_pretrained(path, dtype="float32")
    count = param_count(policy.config)
    engines = {loop: JaxEngine(policy, max_batch_size=args.batch, decode_loop=loop,
                               show_progress=False) for loop in loops}
    steps, outputs = {}, {}
    for mode in modes:
        steps[f"transformers {mode}"] = hf_generate_fn(reference, prompts, args.new_tokens,
                                                       MODES[mode])
        for loop, engine in engines.items():
            steps[f"JaxEngine[{loop}] {mode}"] = engine_generate_fn(engine, prompts,
                                                                    args.new_tokens, MODES[mode])
    if "greedy" in modes:
        outputs = {name: steps[name]() for name in steps if name.endswith("greedy")}
    times = timed_interleaved(steps, args.rounds, args.warmup)

    new_tokens = args.batch * args.new_tokens
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"threads: torch {torch.get_num_threads()}, XLA "
          f"{'1' if args.threads == 1 else 'all cores'}; load average {os.getloadavg()[0]:.1f}; "
          f"jax {jax.__version__}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"model: Qwen2 architecture, {count / 1e6:.1f} M parameters; batch {args.batch} × "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens per row; fp32; median of "
          f"{args.rounds} interleaved rounds after {args.warmup} warmup")
    if outputs:
        reference_ids = outputs["transformers greedy"]
        for name, ids in outputs.items():
            if name.startswith("JaxEngine"):
                prefix = matching_prefix(ids, reference_ids)
                same = int((prefix == args.new_tokens).sum())
                print(f"greedy ids, {name} vs transformers: {same}/{args.batch} rows identical; "
                      f"shortest common prefix {prefix.min()}")
    print()
    rows = []
    for mode in modes:
        baseline = statistics.median(times[f"transformers {mode}"])
        for name in [n for n in steps if n.endswith(f" {mode}")]:
            t = times[name]
            rows.append((name, statistics.median(t), min(t), max(t), baseline))
    if args.markdown:
        print("| implementation | mode | median s | min s | max s | tokens/s | vs transformers |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, median, fastest, slowest, baseline in rows:
            label, mode = name.rsplit(" ", 1)
            print(f"| {label} | {mode} | {median:.2f} | {fastest:.2f} | {slowest:.2f} | "
                  f"{new_tokens / median:,.0f} | {baseline / median:.2f}× |")
    else:
        print(f"{'implementation':<30}{'median s':>10}{'min s':>8}{'max s':>8}{'tokens/s':>10}"
              f"{'ratio':>8}")
        for name, median, fastest, slowest, baseline in rows:
            print(f"{name:<30}{median:>10.2f}{fastest:>8.2f}{slowest:>8.2f}"
                  f"{new_tokens / median:>10,.0f}{baseline / median:>7.2f}×")
        print("(ratio: transformers seconds / row seconds, same mode; > 1 is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
