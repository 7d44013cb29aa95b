"""The `agentrl` command line.

`agentrl schemes` lists the registered credit schemes and batch transforms
with their options. The training, rollout, serving and conversion commands
(`train`, `rollout-worker`, `serve`, `eval`, `plot`, `convert`) are part of
later milestones and exit with a message saying so.
"""

import argparse
import sys

NOT_BUILT = {
    "train": "the trainer (issue 5: sharded jitted update, Grain pipeline, orbax resume)",
    "rollout-worker": "the external rollout worker (issue 4: rollouts and environments)",
    "serve": "the OpenAI-compatible server over the JAX engine (issue 4)",
    "eval": "evaluation (issue 5)",
    "plot": "metric plots (issue 5)",
    "convert": "checkpoint conversion to and from Hugging Face (issue 3: Flax Qwen)",
    "plan": "memory planning for a model and mesh (issue 3: Flax Qwen)",
}


def _schemes(_args) -> int:
    from agentrl import credit

    for name in credit.available_schemes():
        scheme = credit.get_scheme(name)
        print(f"{name:10s} values={scheme.needs_values:8s} loss={scheme.loss_aggregation:24s} "
              f"{scheme.description}")
        for option, default in scheme.options.items():
            print(f"{'':12s}{option} = {default!r}")
    for name in credit.available_transforms():
        transform = credit.get_transform(name)
        print(f"{name:10s} (batch transform) {transform.description}")
        for option, default in transform.options.items():
            print(f"{'':12s}{option} = {default!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("schemes", help="list credit schemes and batch transforms")
    for name, what in NOT_BUILT.items():
        commands.add_parser(name, help=f"not built yet: {what}")
    args, _ = parser.parse_known_args(argv)
    if args.command == "schemes":
        return _schemes(args)
    print(f"agentrl {args.command}: not built yet; it arrives with {NOT_BUILT[args.command]}.",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
