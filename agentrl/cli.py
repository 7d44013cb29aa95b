"""The `agentrl` command line.

`agentrl schemes` lists the registered credit schemes and batch transforms
with their options. `agentrl plan` prints the per-device memory of a training
step for a model and a mesh (`agentrl/plan.py`). `agentrl convert` converts
checkpoints between Hugging Face, orbax and PEFT layouts
(`agentrl/models/convert.py`; `agentrl convert --help`). The training, rollout
and serving commands (`train`, `rollout-worker`, `serve`, `eval`, `plot`) are
part of later milestones and exit with a message saying so.
"""

import argparse
import sys

NOT_BUILT = {
    "train": "the trainer (issue 5: sharded jitted update, Grain pipeline, orbax resume)",
    "rollout-worker": "the external rollout worker (issue 4: rollouts and environments)",
    "serve": "the OpenAI-compatible server over the JAX engine (issue 4)",
    "eval": "evaluation (issue 5)",
    "plot": "metric plots (issue 5)",
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("schemes", help="list credit schemes and batch transforms")
    _add_convert_parser(commands)
    # `agentrl plan` parses its own flags (agentrl/plan.py; `agentrl plan --help`).
    commands.add_parser("plan", add_help=False,
                        help="per-device memory of a train step for a model and mesh")
    for name, what in NOT_BUILT.items():
        commands.add_parser(name, help=f"not built yet: {what}")
    args, unknown = parser.parse_known_args(argv)
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
    print(f"agentrl {args.command}: not built yet; it arrives with {NOT_BUILT[args.command]}.",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
