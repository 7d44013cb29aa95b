"""Jitted wall time of the credit functions at realistic sizes (issue 2 benchmark).

    python benchmarks/credit_bench.py [--repeats 20] [--markdown]

Each function is jitted with its options static, called once to compile, then
timed `--repeats` times (inputs already on device, `block_until_ready`); the
table gives the median and the minimum in milliseconds. Sizes:

* GRPO / MT-GRPO: N = 512 prompts × G = 8 × K = 8 turns
* checklist: N = 64, G = 48, L = 8 turns, S = 8 steps, C = 8 items
* tree: N = 128 queries, n = 8, S = 8 (random trees with shared prefixes)
* segment: B = 1280, S = 15
* GAE: B = 256, T = 8192
* VSPO resample: N = 512 groups × G = 8; PPO loss + token_mean: B = 256, T = 8192
"""

import argparse
import functools
import platform
import statistics
import time

import jax
import numpy as np

from agentrl import credit, losses


def random_trees(rng, num_queries, n, num_steps):
    """Node ids by random partition refinement: copies share prefix nodes."""
    node_id = np.full((num_queries, n, num_steps), -1, np.int32)
    lengths = rng.integers(1, num_steps + 1, size=(num_queries, n))
    for q in range(num_queries):
        next_id, blocks = 0, [[j] for j in range(n // 2)] + [list(range(n // 2, n))]
        for depth in range(num_steps):
            new_blocks = []
            for block in blocks:
                alive = [j for j in block if lengths[q, j] > depth]
                if not alive:
                    continue
                node_id[q, alive, depth] = next_id
                next_id += 1
                labels = rng.integers(0, 2, size=len(alive))
                new_blocks += [[j for j, lab in zip(alive, labels, strict=True) if lab == k]
                               for k in (0, 1)]
            blocks = [b for b in new_blocks if b]
    step_mask = node_id >= 0
    outcome = rng.choice([-1.0, 0.0, 1.0], size=(num_queries, n)).astype(np.float32)
    fmt = rng.random((num_queries, n, num_steps)).astype(np.float32)
    tokens = rng.integers(20, 400, size=(num_queries, n, num_steps)).astype(np.int32)
    return node_id, step_mask, outcome, fmt, tokens


def prefix_mask(rng, shape, low=1):
    lengths = rng.integers(low, shape[-1] + 1, size=shape[:-1])
    return np.arange(shape[-1]) < lengths[..., None]


def cases(rng):
    """(name, size, fn, args) with fn already closed over its static options."""
    n, g, k = 512, 8, 8
    yield ("grpo", f"N={n} G={g}", jax.jit(credit.grpo_advantages),
           (rng.random((n, g), np.float32),))
    yield ("mt_grpo", f"N={n} G={g} K={k}", jax.jit(credit.mt_grpo_advantages),
           (rng.random((n, g, k), np.float32), prefix_mask(rng, (n, g, k)),
            rng.random((n, g), np.float32)))
    n, g, turns, steps, items = 64, 48, 8, 8, 8
    fn = jax.jit(functools.partial(credit.checklist_credit, scale="none"))
    weights = np.full((n, g, turns, items), 1 / items, np.float32)
    yield ("checklist", f"N={n} G={g} L={turns} S={steps} C={items}", fn,
           (rng.random((n, g, turns, steps, items)) < 0.3,
            np.tril(rng.random((n, g, turns, items, items)) < 0.3, k=-1), weights,
            prefix_mask(rng, (n, g, turns, steps)), np.ones((n, g, turns, items), bool),
            prefix_mask(rng, (n, g, turns))))
    yield ("tree", "N=128 n=8 S=8", jax.jit(credit.tree_credit), random_trees(rng, 128, 8, 8))
    b, s = 1280, 15
    yield ("segment", f"B={b} S={s}", jax.jit(credit.segment_advantages),
           (rng.random((b, s), np.float32), prefix_mask(rng, (b, s)),
            rng.integers(0, 2, size=b).astype(np.float32)))
    b, t = 256, 8192
    mask = rng.random((b, t)) < 0.7
    yield ("gae", f"B={b} T={t}",
           jax.jit(functools.partial(credit.gae_advantages, gamma=1.0, lambda_=0.95)),
           (rng.random((b, t), np.float32) * (rng.random((b, t)) < 0.01),
            rng.random((b, t), np.float32), mask))
    yield ("vspo_resample", "N=512 G=8", jax.jit(credit.vspo_resample),
           ((rng.random((512, 8)) < 0.5).astype(np.float32), jax.random.key(0)))

    def ppo_step(logp, old_logp, advantages, mask):
        per_token = losses.ppo_clip_loss(logp, old_logp, advantages)
        return losses.aggregate_loss(per_token, mask, "token_mean")

    yield ("ppo_loss+token_mean", f"B={b} T={t}", jax.jit(ppo_step),
           (-rng.random((b, t), np.float32), -rng.random((b, t), np.float32),
            rng.normal(size=(b, t)).astype(np.float32), mask))


def time_call(fn, args, repeats):
    args = jax.device_put(args)
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"# jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{jax.device_count()} device(s), {platform.processor() or platform.machine()}, "
          f"median of {args.repeats} after warm-up")
    print("| function | size | median ms | min ms |")
    print("|---|---|---:|---:|")
    for name, size, fn, fn_args in cases(rng):
        median, best = time_call(fn, fn_args, args.repeats)
        print(f"| {name} | {size} | {median:.2f} | {best:.2f} |", flush=True)


if __name__ == "__main__":
    main()
