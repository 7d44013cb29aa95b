"""The `agentrl` command line.

* `agentrl train --config FILE.py[:ARG] [--config.field=value ...]`: the
  training job (`agentrl/train/loop.py`); resumes from the workdir's latest
  checkpoint.
* `agentrl eval --config ...`: held-out evaluation of the workdir's latest
  checkpoint.
* `agentrl rollout-worker --config ... --worker-id I`: an external rollout
  worker writing trajectory shards (async mode).
* `agentrl serve`: an OpenAI-compatible server over the JAX engine.
* `agentrl schemes`: the registered credit schemes and batch transforms.
* `agentrl plan`: per-device memory of a training step for a model and mesh.
* `agentrl convert`: checkpoints between Hugging Face, orbax and PEFT layouts.
* `agentrl plot WORKDIR`: PNG learning curves.
"""

import argparse
import sys

NOT_BUILT: dict[str, str] = {}


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


CONVERSIONS = {
    "hf-to-orbax": "HF checkpoint directory -> orbax parameter checkpoint",
    "orbax-to-hf": "orbax parameter checkpoint -> HF directory (LoRA adapters merged)",
    "merge-lora": "PEFT LoRA adapter merged into an HF checkpoint -> HF directory",
    "orbax-to-peft": "LoRA adapters of an orbax checkpoint -> PEFT adapter directory",
}


def _add_convert_parser(commands) -> None:
    convert = commands.add_parser("convert", help="convert checkpoints (HF, orbax, PEFT)")
    kinds = convert.add_subparsers(dest="conversion", required=True)
    dtypes = ("float32", "bfloat16", "float16")
    for name, what in CONVERSIONS.items():
        sub = kinds.add_parser(name, help=what, description=what)
        if name == "merge-lora":
            sub.add_argument("base", help="base HF checkpoint directory")
            sub.add_argument("adapter", help="PEFT adapter directory")
        else:
            sub.add_argument("src", help="source directory")
        sub.add_argument("dst", help="output directory")
        sub.add_argument("--dtype", choices=dtypes, default=None,
                         help="stored dtype (default: the source's; hf-to-orbax: float32)")
        if name != "merge-lora":
            sub.add_argument("--step", type=int, default=None,
                             help="orbax step (hf-to-orbax: save as this step; otherwise read "
                                  "it, default the latest)")
        if name == "orbax-to-hf":
            sub.add_argument("--max-shard-size", default="5GB",
                             help="largest safetensors file, e.g. 5GB, 500MB")
        if name == "orbax-to-peft":
            sub.add_argument("--base-model", default=None,
                             help="base_model_name_or_path recorded in adapter_config.json")


def _convert(args) -> int:
    from agentrl.models import convert

    try:
        if args.conversion == "hf-to-orbax":
            out = convert.hf_to_orbax(args.src, args.dst, dtype=args.dtype or "float32",
                                      step=args.step)
        elif args.conversion == "orbax-to-hf":
            out = convert.orbax_to_hf(args.src, args.dst, dtype=args.dtype, step=args.step,
                                      max_shard_bytes=convert.parse_size(args.max_shard_size))
        elif args.conversion == "merge-lora":
            out = convert.merge_lora_into_hf(args.base, args.adapter, args.dst, dtype=args.dtype)
        else:
            out = convert.orbax_to_peft(args.src, args.dst, step=args.step, dtype=args.dtype,
                                        base_model_name_or_path=args.base_model)
    except (FileNotFoundError, FileExistsError, KeyError, ValueError,
            NotImplementedError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"agentrl convert {args.conversion}: {message}", file=sys.stderr)
        return 1
    print(f"agentrl convert {args.conversion}: wrote {out}")
    return 0


def _training_command(args, unknown: list[str], parser) -> int:
    bad = [u for u in unknown if not u.startswith("--config.")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (config fields are set with "
                     "--config.field=value)")
    import os

    if os.environ.get("JAX_COORDINATOR_ADDRESS"):  # multi-host (launch/slurm.sbatch)
        import jax

        jax.distributed.initialize()
    from agentrl.train.config import load_config

    try:
        config = load_config(args.config, unknown)
    except (FileNotFoundError, KeyError, TypeError, ValueError, AttributeError) as err:
        print(f"agentrl {args.command}: {err}", file=sys.stderr)
        return 2
    if args.command == "rollout-worker":
        from agentrl.train.worker import run_worker

        return run_worker(config, worker_id=args.worker_id, max_shards=args.max_shards)
    from agentrl.train.loop import Trainer

    try:
        trainer = Trainer(config)
    except ValueError as err:
        print(f"agentrl {args.command}: {err}", file=sys.stderr)
        return 2
    if args.command == "eval":
        from agentrl.train.checkpoint import TrainCheckpointer

        with TrainCheckpointer(trainer.workdir / "checkpoints") as checkpointer:
            if not trainer.restore(checkpointer):
                print(f"agentrl eval: no checkpoint in {trainer.workdir / 'checkpoints'}; train "
                      "first.", file=sys.stderr)
                return 2
        print(trainer.evaluate())
        return 0
    trainer.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("schemes", help="list credit schemes and batch transforms")
    _add_convert_parser(commands)
    # `agentrl plan` parses its own flags (agentrl/plan.py; `agentrl plan --help`).
    commands.add_parser("plan", add_help=False,
                        help="per-device memory of a train step for a model and mesh")
    serve = commands.add_parser(
        "serve", help="OpenAI-compatible server (vLLM's protocol) over the JAX engine",
        description="An OpenAI-compatible HTTP server over JaxEngine speaking vLLM's protocol "
                    "(agentrl/rollout/server.py).")
    from agentrl.rollout.server import add_serve_arguments

    add_serve_arguments(serve)
    plot = commands.add_parser(
        "plot", help="PNG learning curves from a run's metrics.jsonl",
        description="Writes PNG learning curves (reward, success, tool calls, KL, entropy, "
                    "losses, step time) from WORKDIR/metrics.jsonl (agentrl/train/plot.py).")
    from agentrl.train.plot import add_plot_arguments

    add_plot_arguments(plot)
    for name, what in (("train", "run the training job"),
                       ("eval", "evaluate the workdir's latest checkpoint"),
                       ("rollout-worker", "external rollout worker (async mode)")):
        sub = commands.add_parser(name, help=what, description=what)
        sub.add_argument("--config", required=True,
                         help="FILE.py[:ARG]; override fields with --config.field=value")
        if name == "rollout-worker":
            sub.add_argument("--worker-id", type=int, default=0)
            sub.add_argument("--max-shards", type=int, default=None,
                             help="stop after writing this many shards (default: forever)")
    for name, what in NOT_BUILT.items():
        commands.add_parser(name, help=f"not built yet: {what}")
    args, unknown = parser.parse_known_args(argv)
    if args.command in ("train", "eval", "rollout-worker"):
        return _training_command(args, unknown, parser)
    if args.command == "serve":
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        from agentrl.rollout.server import serve_main

        return serve_main(args)
    if args.command == "plot":
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        from agentrl.train.plot import plot_main

        return plot_main(args)
    if args.command == "schemes":
        return _schemes(args)
    if args.command == "convert":
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return _convert(args)
    if args.command == "plan":
        from agentrl import plan

        plan_argv = list(sys.argv[1:] if argv is None else argv)
        return plan.main(plan_argv[plan_argv.index("plan") + 1:])
    print(f"agentrl {args.command}: unknown command.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
