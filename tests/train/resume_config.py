"""Tiny configs for the subprocess tests (loaded by path, like every config).

`arg`: "" (SIGKILL-and-resume of `agentrl train`) or "async" (async mode: the
trainer consumes the shards of `agentrl rollout-worker` processes).
"""

from agentrl.train.config import load_sibling


def get_config(arg: str = ""):
    module = load_sibling(__file__, "tiny_config.py")
    config = module.tiny_base("/tmp/agentrl-resume", steps=4)
    config.train.checkpoint_every = 1
    config.train.eval_every = 2
    if arg == "async":
        config.async_rollout.enabled = True
        config.async_rollout.workers = 1
        config.async_rollout.max_staleness = 100
        config.train.eval_every = 0
    elif arg:
        raise ValueError(f"resume_config: unknown arg {arg!r}; use '' or 'async'.")
    return config
