"""`TrainCheckpointer`: keep-K, every-N, restore onto another mesh, atomicity, SIGKILL resume."""

import json
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from agentrl import parallel
from agentrl.models.config import QwenConfig
from agentrl.models.policy import param_shardings
from agentrl.models.qwen import QwenModel
from agentrl.train.checkpoint import TrainCheckpointer, abstract_like
from agentrl.train.state import TrainState

CONFIG = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
MODEL = QwenModel(CONFIG)
TX = optax.adam(1e-3)
REPO = pathlib.Path(__file__).resolve().parents[2]


def _mesh(data, fsdp, tensor):
    devices = jax.devices()[: data * fsdp * tensor]
    return parallel.make_mesh(parallel.MeshConfig(data=data, fsdp=fsdp, tensor=tensor), devices)


def _state_shardings(mesh):
    """What a trainer asks for: parameters and Adam moments as the model shards them."""
    params, _ = param_shardings(MODEL, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    adam = optax.ScaleByAdamState(count=replicated, mu=params, nu=params)
    return TrainState(step=replicated, params={"policy": params},
                      opt_state={"actor": (adam, optax.EmptyState())}, rng=replicated,
                      skipped=replicated)


def _state(mesh, seed=0, step=3):
    """A TrainState with random parameters and Adam moments (as `TX.init` lays them out)."""
    shardings, shapes = param_shardings(MODEL, mesh)
    rng = np.random.RandomState(seed)

    def random_tree():
        return jax.tree_util.tree_map(
            lambda shape, sharding: jax.device_put(
                rng.standard_normal(shape.shape).astype(shape.dtype), sharding),
            shapes, shardings)

    params = random_tree()
    adam = optax.ScaleByAdamState(count=jnp.asarray(step, jnp.int32), mu=random_tree(),
                                  nu=jax.tree_util.tree_map(jnp.abs, random_tree()))
    opt_state = (adam, optax.EmptyState())
    assert (jax.tree_util.tree_structure(opt_state)
            == jax.tree_util.tree_structure(jax.eval_shape(TX.init, params)))
    return TrainState(step=jnp.asarray(step, jnp.int32), params={"policy": params},
                      opt_state={"actor": opt_state},
                      rng=jax.random.fold_in(jax.random.key(seed), step),
                      skipped=jnp.asarray(1, jnp.int32))


def _small_state(step):
    params = {"w": jnp.full((4, 2), float(step)), "b": jnp.zeros(2)}
    return TrainState(step=jnp.asarray(step, jnp.int32), params=params,
                      opt_state={"actor": TX.init(params)}, rng=jax.random.key(step),
                      skipped=jnp.zeros((), jnp.int32))


@pytest.fixture(scope="module")
def sharded_state():
    return _state(_mesh(1, 4, 2))


def _assert_same_values(actual, expected):
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual),
                            jax.tree_util.tree_leaves(expected), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_every_n_and_keep_last_k(tmp_path):
    checkpointer = TrainCheckpointer(tmp_path, keep=2, every=3)
    saved = [step for step in range(1, 11)
             if checkpointer.save(step, _small_state(step), data_state={"step": step})]
    assert saved == [3, 6, 9]
    assert checkpointer.all_steps() == [6, 9] and checkpointer.latest_step() == 9
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["6", "9"]
    assert checkpointer.save(10, _small_state(10), data_state={"step": 10}, force=True)
    assert checkpointer.all_steps() == [9, 10]
    assert not checkpointer.save(10, _small_state(0), data_state={}, force=True)  # kept as is
    assert not checkpointer.should_save(10) and checkpointer.should_save(12)
    assert not (tmp_path / "6").exists()
    # A new checkpointer on the same directory sees the same steps and contents.
    reopened = TrainCheckpointer(tmp_path, keep=2, every=3)
    assert reopened.latest_step() == 10
    state, data_state, _ = reopened.restore(abstract_state=_small_state(0))
    assert int(state.step) == 10 and data_state == {"step": 10}
    np.testing.assert_array_equal(state.params["w"], np.full((4, 2), 10.0))
    state, data_state, _ = reopened.restore(9, abstract_state=_small_state(0))
    assert int(state.step) == 9 and data_state == {"step": 9}


@pytest.mark.parametrize("target", [(1, 1, 1), (2, 2, 2)])
def test_restore_onto_another_mesh(sharded_state, tmp_path, target):
    checkpointer = TrainCheckpointer(tmp_path / "ckpt", keep=1, every=1)
    data_state = {"prompts": {"grain": {"next_index": 17}}, "trajectories": None}
    extra = {"config": {"lr": 1e-3, "mesh": [1, 4, 2]}}
    assert checkpointer.save(3, sharded_state, data_state=data_state, extra=extra)

    mesh = _mesh(*target)
    shardings = _state_shardings(mesh)
    abstract = abstract_like(jax.eval_shape(lambda: sharded_state), shardings)
    state, restored_data, restored_extra = checkpointer.restore(abstract_state=abstract)
    assert isinstance(state, TrainState)
    _assert_same_values(state, sharded_state)
    for (path, array), sharding in zip(jax.tree_util.tree_leaves_with_path(state),
                                       jax.tree_util.tree_leaves(shardings), strict=True):
        assert array.sharding.is_equivalent_to(sharding, array.ndim), path
    kernel = state.params["policy"]["layers"]["layer"]["mlp"]["up_proj"]["kernel"]
    expected_shard = (2, 16, 32) if target == (2, 2, 2) else kernel.shape  # fsdp × tensor
    assert kernel.sharding.shard_shape(kernel.shape) == expected_shard
    assert restored_data == data_state and restored_extra == extra
    meta = checkpointer.meta()
    assert meta["step"] == 3 and meta["versions"]["jax"] == jax.__version__
    # The restored key continues the same random stream.
    np.testing.assert_array_equal(jax.random.uniform(state.rng, (3,)),
                                  jax.random.uniform(sharded_state.rng, (3,)))


def test_restore_without_target_gives_the_stored_tree_on_one_device(sharded_state, tmp_path):
    checkpointer = TrainCheckpointer(tmp_path, every=1)
    checkpointer.save(3, sharded_state, data_state={})
    state, _, _ = checkpointer.restore(3)
    leaf = state["params"]["policy"]["embed_tokens"]
    np.testing.assert_array_equal(leaf, sharded_state.params["policy"]["embed_tokens"])
    assert leaf.sharding.device_set == {jax.devices()[0]}
    assert int(state["step"]) == 3


def test_interrupted_save_is_never_restored(sharded_state, tmp_path, monkeypatch):
    checkpointer = TrainCheckpointer(tmp_path, keep=3, every=1)
    checkpointer.save(1, sharded_state, data_state={"at": 1})
    temporary_path = ocp.path.atomicity.AtomicRenameTemporaryPath
    finalize = temporary_path.finalize

    async def crash(self, *args, **kwargs):
        if self.get_final().name == "2":
            raise RuntimeError("simulated crash before the rename")
        return await finalize(self, *args, **kwargs)

    monkeypatch.setattr(temporary_path, "finalize", crash)
    later = sharded_state.replace(step=jnp.asarray(2, jnp.int32))
    with pytest.raises(RuntimeError, match="simulated crash"):
        checkpointer.save(2, later, data_state={"at": 2})
    monkeypatch.undo()
    assert list(tmp_path.glob("2.orbax-checkpoint-tmp*"))  # everything written, not committed

    reopened = TrainCheckpointer(tmp_path, keep=3, every=1)
    assert reopened.latest_step() == 1
    state, data_state, _ = reopened.restore(abstract_state=abstract_like(sharded_state))
    assert int(state.step) == 3 and data_state == {"at": 1}
    assert not list(tmp_path.glob("2.orbax-checkpoint-tmp*"))  # cleaned up on reopening
    with pytest.raises(FileNotFoundError, match=r"step 2 .* finished steps: \[1\]"):
        reopened.restore(2, abstract_state=abstract_like(sharded_state))


def test_errors_are_clear(sharded_state, tmp_path):
    checkpointer = TrainCheckpointer(tmp_path / "empty", every=1)
    assert checkpointer.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        checkpointer.restore()
    with pytest.raises(TypeError, match="data_state must be JSON-serialisable"):
        checkpointer.save(1, sharded_state, data_state={"x": np.zeros(2)})
    with pytest.raises(TypeError, match="extra must be JSON-serialisable"):
        checkpointer.save(1, sharded_state, data_state={}, extra={"lr": float("nan")})
    assert checkpointer.latest_step() is None
    with pytest.raises(ValueError, match="keep=0"):
        TrainCheckpointer(tmp_path / "x", keep=0)


# ---------------------------------------------------------------------------
# SIGKILL and resume: the same metrics as an uninterrupted run.
# ---------------------------------------------------------------------------

TOY_RUN = textwrap.dedent('''
    """A toy training run using the real data, checkpoint and metrics components."""
    import os
    import signal
    import sys

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from agentrl.data import PromptIterator
    from agentrl.train.checkpoint import TrainCheckpointer
    from agentrl.train.metrics import MetricsWriter
    from agentrl.train.state import TrainState


    def main(workdir, total, kill_at):
        records = [{"id": f"q{i}", "messages": [{"role": "user", "content": str(i)}],
                    "golds": [str(i % 7)]} for i in range(256)]
        prompts = PromptIterator(records, seed=0)
        tx = optax.adam(0.05)
        params = {"w": jnp.zeros((4,)), "b": jnp.zeros((1,))}
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state={"actor": tx.init(params)}, rng=jax.random.key(0),
                           skipped=jnp.zeros((), jnp.int32))
        checkpointer = TrainCheckpointer(os.path.join(workdir, "checkpoints"), keep=2, every=3)
        start = 0
        if checkpointer.latest_step() is not None:
            state, data_state, _ = checkpointer.restore(abstract_state=state)
            prompts.set_state(data_state["prompts"])
            start = int(state.step)
        writer = MetricsWriter(workdir, resume_step=start, tensorboard=False)

        @jax.jit
        def update(state, x, y):
            rng, noise_key = jax.random.split(state.rng)

            def loss_fn(p):
                noise = 0.1 * jax.random.normal(noise_key, y.shape)
                return jnp.mean((x @ p["w"] + p["b"] + noise - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            updates, opt = tx.update(grads, state.opt_state["actor"], state.params)
            return state.replace(step=state.step + 1,
                                 params=optax.apply_updates(state.params, updates),
                                 opt_state={"actor": opt}, rng=rng), loss

        for step in range(start + 1, total + 1):
            batch = prompts.next_batch(8)
            ids = np.array([int(r.prompt.prompt_id[1:]) for r in batch], np.float32)
            x = np.stack([ids / 256, ids % 3, (ids % 5) / 5, np.ones_like(ids)], 1)
            y = np.array([int(r.golds[0]) for r in batch], np.float32)
            state, loss = update(state, x, y)
            writer.write(step, {"loss": loss, "reward": -loss,
                                "first_prompt": batch[0].prompt.prompt_id})
            if step == kill_at:
                with open(writer.path, "a") as f:
                    f.write('{"step": 99, "lo')  # a line cut off mid-write
                os.kill(os.getpid(), signal.SIGKILL)
            checkpointer.save(step, state, data_state={"prompts": prompts.get_state()})
        writer.close()
        checkpointer.close()


    if __name__ == "__main__":
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
''')


def _start(script, workdir, total, kill_at):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(script), str(workdir), str(total), str(kill_at)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _metrics(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for record in records:
        del record["wall_time"]
    return records


def test_sigkill_and_resume_gives_the_uninterrupted_metrics(tmp_path):
    script = tmp_path / "toy_run.py"
    script.write_text(TOY_RUN)
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    killed = _start(script, interrupted, 10, 8)
    runpy.run_path(str(script))["main"](str(reference), 10, -1)  # meanwhile, uninterrupted
    _, err = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    # Killed after step 8's metrics, before its checkpoint: checkpoints 3 and 6 remain.
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["3", "6"]
    assert (interrupted / "metrics.jsonl").read_text().endswith('"lo')

    # Resume from what the killed process left on disk (steps 1-8 ran in another process than
    # the reference, so equality also covers compiling in a fresh process).
    runpy.run_path(str(script))["main"](str(interrupted), 10, -1)
    expected = _metrics(reference)
    assert [r["step"] for r in expected] == list(range(1, 11))
    assert _metrics(interrupted) == expected
    assert len({r["first_prompt"] for r in expected}) > 5  # the data really advanced
