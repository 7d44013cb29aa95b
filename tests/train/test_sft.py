"""SFT data: demonstrations tokenised like rollouts, length buckets, the SFT schedule."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.envs.tasks import get_task
from agentrl.models import get_tokenizer
from agentrl.rollout.agent_loop import LoopConfig, registry_executor, run_tool_loop
from agentrl.train.config import validate
from agentrl.train.sft import bucket_batches, demonstration_tokens, length_buckets, pack_rows
from agentrl.train.state import OptimizerConfig
from tests.envs.tasks.test_tasks import DemonstrationPolicy
from tests.rollout.scripted import ScriptedEngine
from tests.train.tiny_config import tiny_base

TOKENIZER = get_tokenizer("qwen2.5")


def test_demonstration_tokens_equal_the_rollout_that_replays_them():
    task = get_task("arithmetic", hard_fraction=0.5, demo_tool_rate=0.5)
    instances = task.instances(12, seed=4)
    assert {len(i.demonstration) for i in instances} == {3, 5}  # direct and tool-calling
    engine = ScriptedEngine(TOKENIZER, DemonstrationPolicy(instances))
    trajectories = run_tool_loop(engine, TOKENIZER, [i.prompt for i in instances],
                                 registry_executor(task.registry()), LoopConfig(max_steps=3))
    for instance, trajectory in zip(instances, trajectories, strict=True):
        tokens, mask = demonstration_tokens(TOKENIZER, instance.demonstration,
                                            instance.prompt.tools)
        np.testing.assert_array_equal(tokens, trajectory.tokens)
        np.testing.assert_array_equal(mask, trajectory.loss_mask)


def test_pack_rows_pads_and_cuts():
    examples = [(np.arange(1, 4), np.array([0, 1, 1], bool)),
                (np.arange(1, 7), np.ones(6, bool))]
    tokens, segments, mask = pack_rows(examples, 5)
    np.testing.assert_array_equal(tokens, [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(segments, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=80),
       batch_size=st.integers(1, 16), max_length=st.integers(16, 256))
def test_length_buckets_cover_every_example_once_and_fit_it(lengths, batch_size, max_length):
    buckets = length_buckets(lengths, batch_size, max_length)
    indices = np.concatenate([rows for _, rows in buckets])
    assert sorted(indices.tolist()) == list(range(len(lengths)))
    padded = [length for length, _ in buckets]
    assert padded == sorted(set(padded))  # one shape per bucket, shortest first
    for index, (length, rows) in enumerate(buckets):
        assert length <= max_length and (length % 16 == 0 or length == max_length)
        assert all(min(lengths[i], max_length) <= length for i in rows)
        # Only the last (longest) bucket may fall short of a batch.
        assert len(rows) >= batch_size or index == len(buckets) - 1
    if len(lengths) >= batch_size:
        assert all(len(rows) >= batch_size for _, rows in buckets)


def test_length_buckets_group_short_and_long_and_reject_bad_sizes():
    lengths = [177] * 40 + [231] * 40 + [250] * 3
    buckets = length_buckets(lengths, 8, 256)
    assert [(length, len(rows)) for length, rows in buckets] == [(192, 40), (256, 43)]
    with pytest.raises(ValueError, match="batch_size=0"):
        length_buckets(lengths, 0, 256)


def test_bucket_batches_draw_every_example_equally_often():
    buckets = length_buckets([10] * 30 + [40] * 90, 6, 64)
    rng = np.random.default_rng(0)
    batches = bucket_batches(buckets, 6, 4000, rng)
    counts = np.zeros(120)
    for length, rows in batches:
        assert len(rows) == 6 and len(set(rows.tolist())) == 6
        assert length == (16 if rows.max() < 30 else 48)
        assert (rows < 30).all() or (rows >= 30).all()  # one bucket per batch
        counts[rows] += 1
    expected = 4000 * 6 / 120
    assert np.abs(counts / expected - 1).max() < 0.25
    again = bucket_batches(buckets, 6, 4000, np.random.default_rng(0))  # deterministic
    assert all((a[1] == b[1]).all() for a, b in zip(again, batches, strict=True))


def test_cosine_schedule_warms_up_then_decays_to_zero():
    # With a constant gradient Adam's normalised step is 1, so each update is -lr(t).
    tx = OptimizerConfig(learning_rate=1e-3, warmup_steps=10, decay_steps=90).build()
    params = {"w": np.zeros(3, np.float32)}
    state = tx.init(params)
    rates = []
    for _ in range(100):
        updates, state = tx.update({"w": np.ones(3, np.float32)}, state, params)
        rates.append(-float(updates["w"][0]))
    rates = np.asarray(rates)
    np.testing.assert_allclose(rates[:11], np.linspace(0, 1e-3, 11), atol=1e-8)
    assert (np.diff(rates[10:]) < 0).all()  # cosine decay after the warm-up
    np.testing.assert_allclose(rates[55], 1e-3 * 0.5 * (1 + np.cos(np.pi * 45 / 90)), atol=1e-8)
    assert rates[-1] < 1e-6
    constant = OptimizerConfig(learning_rate=1e-3).build()
    state = constant.init(params)
    for _ in range(3):
        updates, state = constant.update({"w": np.ones(3, np.float32)}, state, params)
        assert -float(updates["w"][0]) == pytest.approx(1e-3, rel=1e-4)


def test_sft_schedule_fields_are_validated(tmp_path):
    config = tiny_base(tmp_path)
    config.sft.steps = 10
    config.sft.schedule = "linear"
    with pytest.raises(ValueError, match=r"config\.sft\.schedule='linear'"):
        validate(config)
    config = tiny_base(tmp_path)
    config.sft.steps = 10
    config.sft.warmup_steps = 10
    with pytest.raises(ValueError, match=r"config\.sft\.warmup_steps=10"):
        validate(config)
