"""Orbax checkpoints: parameter trees (`save_params`) and whole runs (`TrainCheckpointer`).

    save_params("/ckpt/run1/params", policy.params, policy.config, step=100)
    config, params = restore_params("/ckpt/run1/params", mesh=mesh)   # latest step

`TrainCheckpointer` (end of this module) saves the whole training state
(`TrainState`, the data iterators' JSON state, metadata) every N steps, keeps
the last K and restores onto any mesh; see its docstring. The rest of this
docstring is about `save_params`.

Layout. With `step=None` the directory itself is one checkpoint; with a step
it holds one checkpoint per step (`directory/100/`, orbax `CheckpointManager`).
A checkpoint has two orbax items: `params` (the tree, `StandardSave`: OCDBT /
tensorstore, each host writes its own shards) and `agentrl` (JSON: the
`QwenConfig` and, for LoRA trees, the `LoraSpec`).

Atomicity. Orbax writes into `<name>.orbax-checkpoint-tmp-<n>` and renames it
to `<name>` once every item is written (`commit_success.txt` marks the
finished checkpoint on object stores). `restore_params` takes only finalized
checkpoints, so a save interrupted half-way is never mistaken for one.

Restoring places every array straight into the shardings the model wants on
the given mesh (`agentrl.models.policy.param_shardings`); the checkpoint may
have been written from another mesh shape.
"""

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from agentrl import parallel
from agentrl.models.config import QwenConfig
from agentrl.models.qwen import LoraSpec, QwenModel

PARAMS_ITEM = "params"
META_ITEM = "agentrl"
FORMAT = "agentrl-params-v1"


def _meta(config: QwenConfig, lora: LoraSpec | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"format": FORMAT, "config": dataclasses.asdict(config), "lora": None}
    if lora is not None and lora.rank > 0:
        meta["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                        "targets": list(lora.targets)}
    return meta


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**{
        PARAMS_ITEM: ocp.StandardCheckpointHandler(), META_ITEM: ocp.JsonCheckpointHandler()}))


def _manager(directory: pathlib.Path) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory, options=options, item_handlers={
        PARAMS_ITEM: ocp.StandardCheckpointHandler(), META_ITEM: ocp.JsonCheckpointHandler()})


def save_params(
    directory: str | pathlib.Path,
    params: Any,
    config: QwenConfig,
    *,
    step: int | None = None,
    lora: LoraSpec | None = None,
) -> pathlib.Path:
    """Writes `params` and `config` as one orbax checkpoint (atomically).

    Call it from every process of a multi-host job: each writes its shards.

    Args:
      directory: with `step=None`, the checkpoint directory (must not exist);
        otherwise the root holding one checkpoint per step.
      params: the parameter tree (`jax.Array`s, sharded or not, or numpy).
      config: the model config, stored as JSON beside the arrays.
      step: training step (None: a single checkpoint at `directory`).
      lora: the LoRA settings when `params` holds adapters (stored so that
        `restore_lora_spec` and the converters can merge or export them).

    Returns:
      The finished checkpoint's directory.
    """
    directory = pathlib.Path(directory).absolute()
    args = ocp.args.Composite(**{
        PARAMS_ITEM: ocp.args.StandardSave(params),
        META_ITEM: ocp.args.JsonSave(_meta(config, lora)),
    })
    if step is None:
        if directory.exists():
            raise FileExistsError(
                f"save_params: {directory} exists; pass a new directory, delete it, or save "
                "with step=N into a directory of steps."
            )
        with _checkpointer() as checkpointer:
            checkpointer.save(directory, args=args)
        return directory
    with _manager(directory) as manager:
        if step in manager.all_steps():
            raise FileExistsError(
                f"save_params: step {step} already exists in {directory}; pass another step or "
                "delete that step's directory."
            )
        manager.save(step, args=args)
        manager.wait_until_finished()
    return directory / str(step)


def checkpoint_steps(directory: str | pathlib.Path) -> list[int]:
    """Finished steps in a directory of steps (unfinished saves are left out)."""
    directory = pathlib.Path(directory).absolute()
    if not directory.is_dir():
        return []
    return sorted(int(path.name) for path in directory.iterdir()
                  if path.name.isdigit() and _is_checkpoint(path))


def _is_checkpoint(path: pathlib.Path) -> bool:
    """A finished single checkpoint: finalized by orbax, with both items."""
    return (path.is_dir() and not ocp.utils.is_tmp_checkpoint(path)
            and ocp.utils.is_checkpoint_finalized(path)
            and (path / PARAMS_ITEM).is_dir() and (path / META_ITEM).exists())


def resolve_checkpoint(directory: str | pathlib.Path, step: int | None = None) -> pathlib.Path:
    """The finished checkpoint that `restore_params(directory, step=step)` reads.

    `step=None`: `directory` itself if it is a checkpoint, else the latest
    finished step under it.
    """
    directory = pathlib.Path(directory).absolute()
    if step is None and _is_checkpoint(directory):
        return directory
    steps = checkpoint_steps(directory)
    if step is None and steps:
        step = steps[-1]
    if step is not None and step in steps:
        return directory / str(step)
    if step is not None:
        raise FileNotFoundError(
            f"restore_params: no finished checkpoint for step {step} in {directory}; "
            f"finished steps: {steps}."
        )
    raise FileNotFoundError(
        f"restore_params: {directory} is not a finished agentrl checkpoint and holds no "
        "finished steps (an interrupted save leaves only a *.orbax-checkpoint-tmp-* directory); "
        "pass a directory written by save_params."
    )


def _read_meta(path: pathlib.Path) -> dict[str, Any]:
    with _checkpointer() as checkpointer:
        restored = checkpointer.restore(path, args=ocp.args.Composite(**{
            META_ITEM: ocp.args.JsonRestore()}))
    meta = restored[META_ITEM]
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is an orbax checkpoint but not one written by save_params.")
    return dict(meta)


def _lora_of(meta: Mapping[str, Any]) -> LoraSpec | None:
    lora = meta.get("lora")
    if not lora:
        return None
    return LoraSpec(rank=int(lora["rank"]), alpha=float(lora["alpha"]),
                    dropout=float(lora["dropout"]), targets=tuple(lora["targets"]))


def restore_lora_spec(directory: str | pathlib.Path, *, step: int | None = None
                      ) -> LoraSpec | None:
    """The LoRA settings saved with a checkpoint (None when it has no adapters)."""
    return _lora_of(_read_meta(resolve_checkpoint(directory, step)))


def _adapter_spec(stored_tree: Any) -> LoraSpec:
    """Rank and targets read off the stored `lora_a` leaves (for the shardings only)."""
    rank, targets = 0, set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(stored_tree):
        names = [getattr(key, "key", None) for key in path]
        if names[-1] == "lora_a":
            rank = leaf.shape[-1]
            targets.add(names[-2])
    return LoraSpec(rank=rank, targets=tuple(sorted(targets)))


def _target_tree(stored_tree: Any, config: QwenConfig, lora: LoraSpec | None, mesh, rules):
    """`jax.ShapeDtypeStruct`s with the model's shardings (replicated where it has none)."""
    from agentrl.models.policy import param_shardings

    spec = lora if lora is not None else _adapter_spec(stored_tree)
    model_shardings, model_shapes = param_shardings(QwenModel(config, spec), mesh, rules)
    known = {path: (sharding, tuple(shape.shape)) for (path, sharding), shape in zip(
        jax.tree_util.tree_leaves_with_path(model_shardings),
        jax.tree_util.tree_leaves(model_shapes), strict=True)}
    replicated = NamedSharding(mesh, PartitionSpec())

    def target(path, leaf):
        sharding, shape = known.get(path, (replicated, None))
        if shape != tuple(leaf.shape):
            sharding = replicated
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(target, stored_tree)


def restore_params(
    directory: str | pathlib.Path,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: parallel.Rules | None = None,
    step: int | None = None,
) -> tuple[QwenConfig, Any]:
    """Reads a `save_params` checkpoint straight into the mesh's shardings.

    Args:
      directory: a checkpoint, or a directory of steps.
      mesh: the device mesh (default: one device); it need not match the
        mesh the checkpoint was saved from.
      rules: logical-axis rules (default `parallel.DEFAULT_RULES`).
      step: the step to read (default: `directory` itself, else the latest).

    Returns:
      `(config, params)`: the stored `QwenConfig` and the tree of
      `jax.Array`s, each sharded as `param_shardings` places it (arrays the
      model does not know are replicated). Dtypes are the stored ones.
    """
    path = resolve_checkpoint(directory, step)
    meta = _read_meta(path)
    config = QwenConfig(**meta["config"])
    mesh = mesh if mesh is not None else parallel.make_mesh(devices=jax.devices()[:1])
    rules = rules if rules is not None else parallel.DEFAULT_RULES
    with _checkpointer() as checkpointer:
        stored = checkpointer.metadata(path).item_metadata[PARAMS_ITEM].tree
        target = _target_tree(stored, config, _lora_of(meta), mesh, rules)
        restored = checkpointer.restore(path, args=ocp.args.Composite(**{
            PARAMS_ITEM: ocp.args.StandardRestore(target)}))
    return config, restored[PARAMS_ITEM]


# ---------------------------------------------------------------------------
# Whole-run checkpoints: TrainState + data iterator state + metadata.
# ---------------------------------------------------------------------------

STATE_ITEM = "state"
DATA_ITEM = "data"
RUN_META_ITEM = "meta"
TRAIN_FORMAT = "agentrl-train-v1"


def _versions() -> dict[str, str]:
    import importlib.metadata
    import platform

    versions = {"python": platform.python_version()}
    for package in ("agentrl", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "unknown"
    return versions


def _check_json(value: Any, what: str) -> None:
    import json

    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"TrainCheckpointer.save: {what} must be JSON-serialisable (dicts, lists, str, "
            f"finite numbers, bool, None): {error}; convert it (e.g. ConfigDict.to_dict(), "
            "int(jax_scalar)) before saving.") from None


def abstract_like(state: Any, shardings: Any = None) -> Any:
    """`jax.ShapeDtypeStruct`s of a state (arrays or shape structs), with `shardings` if given.

    `shardings`: a tree of `jax.sharding.Sharding` matching `state` (None: keep
    each leaf's own sharding).
    """
    if shardings is None:
        return jax.tree_util.tree_map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                              sharding=getattr(leaf, "sharding", None)), state)
    return jax.tree_util.tree_map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        state, shardings)


class TrainCheckpointer:
    """Orbax checkpoints of a whole run: every `every` steps, keeping the last `keep`.

        checkpointer = TrainCheckpointer(workdir / "checkpoints", keep=3, every=100)
        step = checkpointer.latest_step()
        if step is not None:
            state, data_state, extra = checkpointer.restore(abstract_state=abstract)
            prompts.set_state(data_state["prompts"])
        ...
        checkpointer.save(step, state, data_state={"prompts": prompts.get_state()},
                          extra={"config": config.to_dict()})

    Layout: `directory/<step>/` holds three orbax items: `state` (the
    `TrainState` pytree, `StandardSave`: OCDBT/tensorstore, each host writes
    its shards; the PRNG key is stored as a typed key), `data` (JSON: the data
    iterators' states) and `meta` (JSON: format, step, library versions and
    the caller's `extra`, e.g. the config).

    Atomicity: orbax writes `<step>.orbax-checkpoint-tmp-*` and renames it
    once all three items are on disk; `latest_step` and `restore` see only
    finished steps, and leftovers of a killed save are deleted when the next
    `TrainCheckpointer` opens the directory.

    Multi-host: call `save`/`restore` from every process; `data_state` and
    `extra` must be the same on all of them (process 0 writes the JSON).
    """

    def __init__(self, directory: str | pathlib.Path, *, keep: int | None = 3, every: int = 1):
        if keep is not None and keep < 1:
            raise ValueError(f"TrainCheckpointer: keep={keep} must be >= 1 (or None: keep all).")
        if every < 1:
            raise ValueError(f"TrainCheckpointer: every={every} must be >= 1.")
        self.directory = pathlib.Path(directory).absolute()
        self.keep = keep
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(),
            DATA_ITEM: ocp.JsonCheckpointHandler(),
            RUN_META_ITEM: ocp.JsonCheckpointHandler(),
        })

    # -- saving ------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would write (step a multiple of `every`, not yet saved)."""
        return step % self.every == 0 and step not in self._manager.all_steps()

    def save(self, step: int, state: Any, *, data_state: Mapping[str, Any],
             extra: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Saves when `step % every == 0` (or `force`); returns whether it saved.

        A step that is already saved is left as it is (False). Blocks until
        the checkpoint is finished and older ones beyond `keep` are deleted.
        """
        step = int(step)
        if step in self._manager.all_steps() or not (force or step % self.every == 0):
            return False
        data_state = dict(data_state)
        extra = dict(extra or {})
        _check_json(data_state, "data_state")
        _check_json(extra, "extra")
        meta = {"format": TRAIN_FORMAT, "step": step, "versions": _versions(), "extra": extra}
        self._manager.save(step, args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(state),
            DATA_ITEM: ocp.args.JsonSave(data_state),
            RUN_META_ITEM: ocp.args.JsonSave(meta),
        }), force=True)
        self._manager.wait_until_finished()
        return True

    # -- reading -----------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Finished steps, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finished step (None: no checkpoint yet)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"TrainCheckpointer.restore: no finished checkpoint in {self.directory}; "
                    "check latest_step() is not None before restoring.")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"TrainCheckpointer.restore: no finished checkpoint for step {step} in "
                f"{self.directory}; finished steps: {steps}.")
        return step

    def meta(self, step: int | None = None) -> dict[str, Any]:
        """The `meta` item of a step (format, step, versions, extra)."""
        step = self._resolve(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            RUN_META_ITEM: ocp.args.JsonRestore()}))
        meta = dict(restored[RUN_META_ITEM])
        if meta.get("format") != TRAIN_FORMAT:
            raise ValueError(f"{self.directory / str(step)} is not a TrainCheckpointer checkpoint "
                             f"(meta format {meta.get('format')!r}, expected {TRAIN_FORMAT!r}).")
        return meta

    def restore(self, step: int | None = None, *, abstract_state: Any = None,
                shardings: Any = None) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """Reads a checkpoint straight into the target shardings.

        Args:
          step: the step (None: the latest finished one).
          abstract_state: the target tree (a `TrainState` of arrays or of
            `jax.ShapeDtypeStruct`s, e.g. `jax.eval_shape(init)`); the result
            has its structure, dtypes and shardings. None: the stored tree
            (plain dicts/lists), every array on the first device.
          shardings: a tree of shardings matching `abstract_state`,
            overriding its leaves' own (e.g. a new mesh's).

        Returns:
          `(state, data_state, extra)`.
        """
        step = self._resolve(step)
        meta = self.meta(step)
        if abstract_state is None:
            stored = self._manager.item_metadata(step)[STATE_ITEM]
            stored = getattr(stored, "tree", stored)
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            target = jax.tree_util.tree_map(
                lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
                stored)
        else:
            target = abstract_like(abstract_state, shardings)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardRestore(target),
            DATA_ITEM: ocp.args.JsonRestore(),
        }))
        return restored[STATE_ITEM], dict(restored[DATA_ITEM]), dict(meta["extra"])

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "TrainCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

