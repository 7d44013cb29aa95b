"""Device mesh, logical-axis rules and sharding helpers.

Models name their dimensions logically (`embed`, `heads`, `kv_heads`, `mlp`,
`vocab`, `batch`, `length`, ...); a list of rules maps each logical name to
mesh axes (`data`, `fsdp`, `tensor`). The same code runs on 1 CPU, 8
simulated CPU devices, one GPU or many hosts: only the mesh and the rules
change. A mesh axis that does not divide a dimension is dropped for that array
(it is replicated along that axis instead of failing), so small test models
run on any mesh.
"""

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# FSDP shards the embedding dimension of every weight; tensor parallelism
# shards heads, the MLP hidden dimension and the vocabulary.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; one of them may be -1 (all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: Rules = DEFAULT_RULES

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        if sizes.count(-1) > 1:
            raise ValueError(f"MeshConfig {sizes}: at most one axis may be -1.")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(
                    f"MeshConfig {dict(zip(MESH_AXES, sizes, strict=True))}: {num_devices} devices "
                    f"do not divide by {known}."
                )
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) > num_devices:
            raise ValueError(
                f"MeshConfig {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} "
                f"devices, but {num_devices} are available; make data × fsdp × tensor at most "
                "the device count (or set one axis to -1 to use all of them)."
            )
        return tuple(sizes)


def make_mesh(config: MeshConfig | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A `(data, fsdp, tensor)` mesh with Auto (GSPMD) axis types.

    A mesh smaller than the device count uses the first `data × fsdp × tensor`
    devices.
    """
    config = config or MeshConfig()
    devices = list(devices) if devices is not None else jax.devices()
    shape = config.shape(len(devices))
    devices = devices[: math.prod(shape)]
    device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def fit_spec(
    spec: PartitionSpec, shape: Sequence[int], mesh_shape: dict[str, int]
) -> PartitionSpec:
    """Drops mesh axes that do not divide their dimension (or that repeat)."""
    used: set[str] = set()
    fitted = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = []
        size = 1
        for axis in axes:
            if axis in used or axis not in mesh_shape:
                continue
            if dim % (size * mesh_shape[axis]) == 0:
                kept.append(axis)
                size *= mesh_shape[axis]
        used.update(kept)
        fitted.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*fitted)


def logical_sharding(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules
) -> NamedSharding:
    """The `NamedSharding` of an array with these logical axes."""
    spec = nn.logical_to_mesh_axes(tuple(logical_axes), rules)
    return NamedSharding(mesh, fit_spec(spec, shape, dict(mesh.shape)))


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names, under the active mesh and rules.

    A no-op when no mesh (`jax.set_mesh`) or no rules (`nn.logical_axis_rules`)
    are active, so model code runs unchanged on a single device.
    """
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    spec = fit_spec(nn.logical_to_mesh_axes(tuple(logical_axes), rules), x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)


def tree_shardings(abstract_tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """Shardings of a tree of `nn.LogicallyPartitioned` (from `jax.eval_shape(init)`).

    Leaves without logical names are replicated.
    """

    def sharding_of(leaf):
        if isinstance(leaf, nn.LogicallyPartitioned):
            value = leaf.value
            return logical_sharding(leaf.names, value.shape, mesh, rules)
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map(
        sharding_of, abstract_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )


def logical_axes_tree(abstract_tree: Any) -> Any:
    """The logical names of every leaf (None for unnamed leaves)."""
    return jax.tree_util.tree_map(
        lambda leaf: tuple(leaf.names) if isinstance(leaf, nn.LogicallyPartitioned) else None,
        abstract_tree,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )


def bytes_per_device(abstract_tree: Any, shardings: Any) -> int:
    """Bytes one device holds of a tree of abstract arrays under these shardings."""
    total = 0
    for leaf, sharding in zip(
        jax.tree_util.tree_leaves(abstract_tree), jax.tree_util.tree_leaves(shardings), strict=True
    ):
        shard_shape = sharding.shard_shape(leaf.shape)
        total += math.prod(shard_shape) * np.dtype(leaf.dtype).itemsize
    return total


@contextlib.contextmanager
def mesh_and_rules(mesh: Mesh, rules):
    """`with jax.set_mesh(mesh), nn.logical_axis_rules(rules)` as one context."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
