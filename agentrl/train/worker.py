"""External rollout workers (async mode): rollouts → trajectory shards on shared storage.

`agentrl rollout-worker --config C --worker-id I` loops: load the newest
policy the trainer published (`WORKDIR/policy/<version>`, orbax parameters;
with `rollout.engine="vllm"` the trainer syncs the servers instead), take the
next prompts of this worker's slice of the prompt order, roll them out, score
them, and write one shard atomically to `async_rollout.shard_dir` named
`worker<I>-<seq>`. The shard's header carries the policy version and the
worker's data state, so a worker killed at any moment and restarted resumes
from its last finished shard: no shard is lost or written twice.
"""

import pathlib
import re
import shutil
import time

import jax

from agentrl.rollout.shards import SHARD_SUFFIX, list_shards, read_shard, write_shard
from agentrl.train.checkpoint import checkpoint_steps, restore_params, save_params

POLICY_DIR = "policy"


def shard_dir(config) -> pathlib.Path:
    return pathlib.Path(config.async_rollout.shard_dir or
                        pathlib.Path(config.workdir) / "trajectories")


def publish_policy(trainer) -> None:
    """The trainer's side: the current policy as `WORKDIR/policy/<version>` (keep the last 2)."""
    directory = trainer.workdir / POLICY_DIR
    if (directory / str(trainer.steps_done)).exists():  # a resumed run publishes its step again
        shutil.rmtree(directory / str(trainer.steps_done))
    save_params(directory, trainer.state.params["policy"], trainer.model_config,
                step=trainer.steps_done,
                lora=trainer.spec.lora if trainer.spec.lora.rank else None)
    for old in checkpoint_steps(directory)[:-2]:
        shutil.rmtree(directory / str(old), ignore_errors=True)


def _latest_shard(directory: pathlib.Path, worker_id: int):
    pattern = re.compile(rf"worker{worker_id}-(\d+){re.escape(SHARD_SUFFIX)}$")
    mine = [(int(m.group(1)), p) for p in list_shards(directory)
            if (m := pattern.match(p.name))]
    return max(mine) if mine else None


def run_worker(config, *, worker_id: int = 0, max_shards: int | None = None,
               poll_s: float = 1.0, log=print) -> int:
    """Writes shards until `max_shards` (or forever); returns the process exit code."""
    from agentrl.data.prompts import PromptIterator
    from agentrl.train.loop import Trainer

    trainer = Trainer(config, log=log)
    c = config
    workers = max(1, c.async_rollout.workers)
    trainer.prompts = PromptIterator(trainer.train_instances, seed=c.seed,
                                     shard_index=worker_id, shard_count=workers)
    out = shard_dir(c)
    out.mkdir(parents=True, exist_ok=True)
    latest = _latest_shard(out, worker_id)
    sequence = 0
    if latest is not None:
        header, _ = read_shard(latest[1])
        trainer.prompts.set_state(header["metadata"]["data_state"])
        sequence = latest[0] + 1
        log(f"worker {worker_id}: resuming after shard {latest[1].name}")
    version = -1
    written = 0
    while max_shards is None or written < max_shards:
        version = _load_newest_policy(trainer, version, poll_s)
        instances = trainer.prompts.next_batch(c.rollout.prompts_per_step)
        seed = c.seed * 1_000_003 + 7919 * (worker_id + 1) + sequence
        trajectories = [t for _, t in trainer.rollout(instances, seed=seed)]
        for t in trajectories:
            t.policy_version = version
        write_shard(out / f"worker{worker_id}-{sequence:06d}", trajectories,
                    policy_version=version,
                    metadata={"worker": worker_id, "sequence": sequence,
                              "data_state": trainer.prompts.get_state()})
        sequence += 1
        written += 1
    return 0


def _load_newest_policy(trainer, current: int, poll_s: float) -> int:
    """Loads the newest published policy if newer than `current`; returns its version."""
    if trainer.config.rollout.engine == "vllm":
        return current + 1 if current < 0 else current  # the trainer syncs the servers
    directory = trainer.workdir / POLICY_DIR
    steps = checkpoint_steps(directory) if directory.exists() else []
    while not steps and current < 0:
        time.sleep(poll_s)
        steps = checkpoint_steps(directory) if directory.exists() else []
    if not steps or steps[-1] <= current:
        return current
    _, params = restore_params(directory, mesh=trainer.mesh, rules=trainer.rules, step=steps[-1])
    trainer.state = trainer.state.replace(params={**trainer.state.params, "policy": params})
    trainer.engine.update_params(jax.tree_util.tree_map(lambda x: x, params))
    return steps[-1]
