"""The training job: SFT warm start, optional CARL critic warm-up, then RL.

`Trainer(config).run()` is `agentrl train --config ...`. One RL step
(synchronous mode, the default):

    prompts (Grain) → rollout (tool loop | dialogue | tree | segments, JaxEngine)
      → rewards → collate to a fixed-shape Batch → critic values (if needed)
      → credit scheme (+ VSPO) → old / reference log-probs → jitted PPO update
      → weight swap into the engine → metrics, checkpoint, evaluation

Everything a step does is a deterministic function of the config, the seed,
the step number and the restored state, so a run killed and resumed from its
last checkpoint continues with the same metrics as an uninterrupted run.
"""

import dataclasses
import functools
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from agentrl import credit, parallel
from agentrl.data.prompts import PromptIterator, read_prompts
from agentrl.envs.judges import RuleJudge
from agentrl.envs.tasks import final_assistant_text, get_task
from agentrl.envs.tools import python_tool
from agentrl.models import QwenConfig, get_tokenizer, model_config
from agentrl.models.chat import encode_messages, render_messages
from agentrl.models.policy import Policy
from agentrl.models.qwen import LoraSpec
from agentrl.models.tokenizer import compact_tokenizer
from agentrl.rollout.agent_loop import (
    LoopConfig,
    registry_executor,
    run_dialogue_loop,
    run_tool_loop,
)
from agentrl.rollout.engine import SamplingParams
from agentrl.rollout.jax_engine import JaxEngine
from agentrl.rollout.segments import SegmentConfig, run_segment_rollout
from agentrl.rollout.tree import run_tree_rollout
from agentrl.train import config as config_lib
from agentrl.train.checkpoint import (
    TrainCheckpointer,
    abstract_like,
    restore_params,
    save_params,
)
from agentrl.train.metrics import MetricsWriter, ProgressBar, read_metrics
from agentrl.train.plot import plot_metrics
from agentrl.train.sft import (
    bucket_batches,
    demonstration_tokens,
    length_buckets,
    pack_rows,
    segment_demonstration_tokens,
)
from agentrl.train.state import (
    ModelSpec,
    OptimizerConfig,
    TrainState,
    build_optimizers,
    init_train_state,
    lora_only,
)
from agentrl.train.step import (
    LossConfig,
    TrainBatch,
    compute_logprobs,
    ppo_update,
    score_positions,
    sft_update,
    token_values,
)
from agentrl.train.worker import publish_policy, shard_dir
from agentrl.types import Batch, Trajectory, collate, to_device


def build_model_config(c: ml_collections.ConfigDict) -> QwenConfig:
    runtime = dict(dtype=c.model.dtype, param_dtype=c.model.dtype, remat=c.model.remat)
    if c.model.hf_path:
        return QwenConfig.from_hf(c.model.hf_path, **runtime)
    return model_config(c.model.name, **runtime, **dict(c.model.overrides))


def build_lora(c: ml_collections.ConfigDict) -> LoraSpec:
    lora = c.model.lora
    if lora.rank <= 0:
        return LoraSpec()
    return LoraSpec(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                    targets=tuple(lora.targets))


def build_loss(c: ml_collections.ConfigDict) -> LossConfig:
    scheme = credit.get_scheme(c.credit.scheme)
    critic = "none"
    if c.value.mode != "none":
        critic = "boundary" if scheme.needs_values == "boundary" else "token"
    return LossConfig(
        clip_low=c.loss.clip_low, clip_high=c.loss.clip_high,
        dual_clip=c.loss.dual_clip or None,
        aggregation=c.loss.aggregation or scheme.loss_aggregation,
        norm_length=c.loss.norm_length or None, kl_coef=c.loss.kl_coef, kl_kind=c.loss.kl_kind,
        entropy_coef=c.loss.entropy_coef, value_coef=c.loss.value_coef,
        value_clip=c.loss.value_clip or None, critic=critic, tis_cap=c.loss.tis_cap or None)


def build_optimizer_configs(c: ml_collections.ConfigDict) -> dict[str, OptimizerConfig]:
    out = {}
    for name in ("actor", "critic", "critic_backbone"):
        group = c.optim[name]
        if name == "critic_backbone" and group.learning_rate <= 0:
            continue
        out[name] = OptimizerConfig(learning_rate=group.learning_rate,
                                    warmup_steps=group.warmup_steps,
                                    weight_decay=group.weight_decay,
                                    clip_norm=group.clip_norm or None)
    return out


def _boxed_state_shardings(spec: ModelSpec, txs, mesh, rules):
    """Shardings of the TrainState, from the logical names of boxed parameters."""
    def abstract(key):
        boxed = spec.init(key)
        opt = {name: tx.init(_channel_of(boxed, name, spec.value)) for name, tx in txs.items()}
        return TrainState(step=jnp.zeros((), jnp.int32), params=boxed, opt_state=opt,
                          rng=key, skipped=jnp.zeros((), jnp.int32))

    shapes = jax.eval_shape(abstract, jax.random.key(0))
    return parallel.tree_shardings(shapes, mesh, rules), shapes


def _channel_of(params, channel, value):
    if channel == "actor" or channel == "critic_backbone":
        return params["policy"]
    return params["value_head"] if value == "shared" else params["critic"]


@dataclasses.dataclass
class StepTimer:
    """Wall time per phase of a step."""

    times: dict[str, float] = dataclasses.field(default_factory=dict)

    def phase(self, name):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.times[name] = timer.times.get(name, 0.0) + time.perf_counter() - self.start
                return False

        return _Phase()


class Trainer:
    """Builds everything from a validated config and runs the job."""

    def __init__(self, config: ml_collections.ConfigDict, *, log=print):
        config_lib.validate(config)
        self.config = config
        self.log = log
        self.workdir = pathlib.Path(config.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
        c = config
        self.mesh = parallel.make_mesh(parallel.MeshConfig(c.mesh.data, c.mesh.fsdp, c.mesh.tensor))
        self.rules = parallel.DEFAULT_RULES
        self.task = get_task(c.task.name, **dict(c.task.options))
        self.train_instances = (
            read_prompts(c.data.train_prompts) if c.data.train_prompts
            else self.task.instances(c.task.train_size, seed=c.seed, split="train"))
        self.eval_instances = (
            read_prompts(c.data.eval_prompts) if c.data.eval_prompts
            else self.task.instances(c.task.eval_size, seed=c.seed, split="validation"))
        self.registry = self.task.registry()
        self.tokenizer = get_tokenizer(c.tokenizer)
        self.model_config = build_model_config(c)
        if c.model.compact_vocab:
            self.tokenizer = compact_tokenizer(self.tokenizer, self._task_texts())
            self.model_config = self.model_config.replace(
                vocab_size=self.tokenizer.vocab_size,
                eos_token_id=self.tokenizer.eos_token_id, bos_token_id=None)
        self.spec = ModelSpec(self.model_config, build_lora(c), value=c.value.mode,
                              head=c.value.head)
        self.loss = build_loss(c)
        self.txs = build_optimizers(self.spec, build_optimizer_configs(c))
        self.scheme = credit.get_scheme(c.credit.scheme)
        self.rows = c.rollout.prompts_per_step * (
            c.rollout.tree_n if c.rollout.loop == "tree" else c.rollout.group_size)
        self.length = c.rollout.max_context_tokens
        self.state = self._init_state()
        self.reference = (jax.tree_util.tree_map(jnp.copy, self.state.params)
                          if c.loss.kl_coef > 0 else None)
        self.engine = self._build_engine()
        self.prompts = PromptIterator(self.train_instances, seed=c.seed)
        self.steps_done = 0

    def _task_texts(self) -> list[str]:
        """Every text the task can show the model (for `compact_vocab`)."""
        c = self.config
        instances = [*self.train_instances, *self.eval_instances,
                     *self.task.instances(c.sft.demonstrations, seed=c.seed + 17, split="train")]
        texts = []
        for instance in instances:
            texts.append(render_messages(list(instance.demonstration),
                                         tools=list(instance.prompt.tools) or None))
            texts += [str(v) for v in instance.metadata.values() if isinstance(v, str)]
        return texts

    def _build_engine(self):
        c = self.config
        if c.rollout.engine == "vllm":
            from agentrl.rollout.vllm_engine import VLLMEngine

            return VLLMEngine(list(c.rollout.vllm_urls), c.rollout.vllm_model or "policy")
        return JaxEngine(
            Policy(self.model_config, self.state.params["policy"], self.mesh, self.rules,
                   self.spec.lora),
            max_batch_size=c.rollout.max_batch_size, max_total_length=self.length, seed=c.seed,
            show_progress=False)

    def sync_engine(self) -> None:
        """The engine samples from the current policy (in place, or exported to vLLM)."""
        if isinstance(self.engine, JaxEngine):
            self.engine.update_params(self.state.params["policy"])
            return
        export = self.workdir / "sync" / f"step_{self.steps_done}"
        policy = Policy(self.model_config, self.state.params["policy"], self.mesh, self.rules,
                        self.spec.lora)
        self.engine.sync_weights(policy, export)

    # -- state -------------------------------------------------------------

    def _init_state(self) -> TrainState:
        shardings, _ = _boxed_state_shardings(self.spec, self.txs, self.mesh, self.rules)
        spec, txs = self.spec, self.txs

        @functools.partial(jax.jit, out_shardings=shardings)
        def init(key):
            return init_train_state(spec, txs, key)

        with self._context():
            state = init(jax.random.key(self.config.seed))
        if self.config.model.hf_path:
            from agentrl.models.policy import load_pretrained

            loaded = load_pretrained(self.config.model.hf_path, dtype=self.config.model.dtype,
                                     mesh=self.mesh, rules=self.rules)
            params = dict(state.params)
            params["policy"] = _merge_into(params["policy"], loaded.params)
            state = state.replace(params=params)
        self.state_shardings = shardings
        return state

    def _context(self):
        return parallel.mesh_and_rules(self.mesh, self.rules)

    # -- jitted functions --------------------------------------------------

    @functools.cached_property
    def _update(self):
        c = self.config
        fn = functools.partial(ppo_update, self.spec, self.loss, self.txs,
                               epochs=c.train.ppo_epochs, num_minibatches=c.train.num_minibatches)
        return jax.jit(fn, donate_argnums=(0,))

    @functools.cached_property
    def _logprobs(self):
        return jax.jit(functools.partial(compute_logprobs, self.spec))

    @functools.cached_property
    def _values(self):
        return jax.jit(functools.partial(token_values, self.spec))

    @functools.cached_property
    def _credit(self):
        c = self.config
        transform = c.credit.transform or None

        def run(batch, key):
            return credit.compute_credit(
                batch, c.credit.scheme, options=dict(c.credit.options), transform=transform,
                transform_options=dict(c.credit.transform_options), key=key)

        return jax.jit(run)

    # -- SFT ---------------------------------------------------------------

    def sft(self) -> dict[str, float]:
        """Cold-start SFT on the task's demonstrations (`config.sft`)."""
        c = self.config
        if c.sft.steps <= 0:
            return {}
        demos = self.task.instances(c.sft.demonstrations, seed=c.seed + 17, split="train")
        if c.rollout.loop == "segment":
            examples = [segment_demonstration_tokens(self.tokenizer, d) for d in demos]
        else:
            examples = [demonstration_tokens(self.tokenizer, d.demonstration, d.prompt.tools)
                        for d in demos]
        tokens, segments, mask = pack_rows(examples, self.length)
        lengths = [min(len(ids), self.length) for ids, _ in examples]
        buckets = length_buckets(lengths, c.sft.batch_size, self.length)
        decay = c.sft.steps - c.sft.warmup_steps if c.sft.schedule == "cosine" else 0
        tx = OptimizerConfig(learning_rate=c.sft.learning_rate, warmup_steps=c.sft.warmup_steps,
                             decay_steps=decay, clip_norm=1.0).build()
        if self.spec.lora.rank > 0:
            tx = lora_only(tx)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=self.state.params,
                           opt_state={"actor": tx.init(self.state.params["policy"])},
                           rng=self.state.rng, skipped=jnp.zeros((), jnp.int32))
        update = jax.jit(functools.partial(sft_update, self.spec, tx))
        batches = bucket_batches(buckets, c.sft.batch_size, c.sft.steps,
                                 np.random.default_rng(c.seed + 23))
        # Each batch holds one bucket: normalise by the expected loss tokens of a
        # batch, not its own count, so every token weighs as in the dataset's mean.
        norm = jnp.float32(c.sft.batch_size * mask.sum() / max(len(examples), 1))
        window = max(1, c.sft.steps // 10)  # losses are logged as means over a tenth of the run
        losses = []
        with self._context():
            for step, (length, rows) in enumerate(batches):
                tokens_b, mask_b = tokens[rows, :length], mask[rows, :length]
                state, metrics = update(state, jnp.asarray(tokens_b),
                                        jnp.asarray(segments[rows, :length]), jnp.asarray(mask_b),
                                        jnp.asarray(score_positions(mask_b)), norm)
                losses.append(float(metrics["sft_loss"]))
                if (step + 1) % window == 0:
                    self.log(f"sft step {step + 1}/{c.sft.steps} loss "
                             f"{np.mean(losses[-window:]):.4f}")
        self.state = self.state.replace(params=state.params)
        self.sync_engine()
        if self.reference is not None:
            self.reference = jax.tree_util.tree_map(jnp.copy, self.state.params)
        return {"sft_loss": float(np.mean(losses[-window:]))}

    # -- rollouts ----------------------------------------------------------

    @functools.cached_property
    def shard_batcher(self):
        """Async mode: batches of whole groups from the workers' shards (staleness-bounded)."""
        from agentrl.data.trajectories import TrajectoryBatcher, TrajectoryShardReader

        c = self.config
        reader = TrajectoryShardReader(shard_dir(c), max_staleness=c.async_rollout.max_staleness,
                                       current_version_fn=lambda: self.steps_done,
                                       timeout_s=600.0)
        group = c.rollout.tree_n if c.rollout.loop == "tree" else c.rollout.group_size
        return TrajectoryBatcher(reader, group_size=group, rows=self.rows,
                                 max_length=self.length, max_steps=c.rollout.max_steps + 1,
                                 max_turns=c.rollout.max_steps + 1)

    def _next_shard_trajectories(self) -> list[Trajectory]:
        return list(next(self.shard_batcher).trajectories)

    def _next_instances(self, count: int):
        return self.prompts.next_batch(count)

    def _loop_config(self, *, greedy: bool, seed: int) -> LoopConfig:
        r = self.config.rollout
        sampling = SamplingParams(temperature=0.0 if greedy else r.temperature, top_p=r.top_p,
                                  top_k=r.top_k, seed=seed)
        return LoopConfig(max_steps=r.max_steps, max_step_tokens=r.max_step_tokens,
                          max_context_tokens=r.max_context_tokens, sampling=sampling,
                          final_answer_tool=r.final_answer_tool or None,
                          steps_are_turns=r.steps_are_turns)

    def rollout(self, instances, *, greedy: bool = False, seed: int = 0,
                group_size: int | None = None) -> list[tuple[Any, Trajectory]]:
        """Runs the configured loop; returns `(instance, trajectory)` pairs with rewards set."""
        r = self.config.rollout
        group = r.group_size if group_size is None else group_size
        config = self._loop_config(greedy=greedy, seed=seed)
        execute = registry_executor(self.registry)
        if r.loop == "tool":
            trajectories = run_tool_loop(self.engine, self.tokenizer, [i.prompt for i in instances],
                                         execute, config, group_size=group)
            pairs = [(instances[k // group], t) for k, t in enumerate(trajectories)]
        elif r.loop == "dialogue":
            trajectories = run_dialogue_loop(self.engine, self.tokenizer,
                                             [i.dialogue for i in instances],
                                             lambda spec: execute, RuleJudge(), config,
                                             group_size=group)
            pairs = [(instances[k // group], t) for k, t in enumerate(trajectories)]
        elif r.loop == "tree":
            n = r.tree_n
            trajectories = run_tree_rollout(self.engine, self.tokenizer,
                                            [i.prompt for i in instances], execute, config, n=n,
                                            forks=r.tree_forks or None, seed=seed)
            pairs = [(instances[k // n], t) for k, t in enumerate(trajectories)]
        else:
            prompts = []
            for instance in instances:
                messages = [dict(m) for m in instance.prompt.messages]
                if "carl_system" in instance.metadata:
                    messages[0] = {"role": "system", "content": instance.metadata["carl_system"]}
                prompts.append((instance.prompt.prompt_id, encode_messages(
                    self.tokenizer, messages, add_generation_prompt=True)))
            seg_config = SegmentConfig(max_segments=2 * r.max_steps + 1,
                                       max_segment_tokens=r.max_step_tokens,
                                       max_context_tokens=r.max_context_tokens,
                                       sampling=config.sampling)
            run_code = python_tool(timeout_s=5.0).fn
            episodes = run_segment_rollout(self.engine, self.tokenizer, prompts,
                                           lambda code: run_code(code), seg_config,
                                           group_size=group)
            pairs = []
            for k, views in enumerate(episodes):
                for view in views:
                    pairs.append((instances[k // group], view))
        for instance, trajectory in pairs:
            self._score(instance, trajectory)
        return pairs

    def _score(self, instance, trajectory: Trajectory) -> None:
        """Outcome (and per-turn) rewards of one trajectory."""
        loop = self.config.rollout.loop
        if loop == "segment":
            answer = trajectory.metadata.get("answer")
            final = f"\\boxed{{{answer}}}" if answer is not None else ""
        else:
            final = final_assistant_text(trajectory.metadata["messages"])
            for result in trajectory.metadata.get("final_tool_results", []):
                if result.get("name") == "response_gen":
                    final = str(result.get("content", final))
        reward = float(self.task.reward(instance, final))
        trajectory.metadata["success"] = reward >= 1.0
        if loop == "tree":  # PORTool R_out: +1 true, −1 false, 0 unable to answer
            answered = bool(final.strip())
            reward = 1.0 if reward >= 1.0 else (-1.0 if answered else 0.0)
        trajectory.outcome = reward
        if self.config.credit.scheme in ("mt_grpo", "mt_ppo"):
            trajectory.turn_rewards = self._turn_rewards(instance, trajectory)

    def _turn_rewards(self, instance, trajectory: Trajectory) -> np.ndarray:
        """Per-turn rewards: MT-GRPO App. D.2 turn components on each tool step.

        0.2 for a tool call that executed without error plus 0.5 when a gold
        answer appears in its result (search-result answer presence).
        """
        messages = trajectory.metadata["messages"]
        golds = [g.casefold() for g in instance.golds]
        rewards = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            results = []
            for follower in messages[index + 1:]:
                if follower["role"] != "tool":
                    break
                results.append(str(follower.get("content", "")))
            executed = bool(results) and not any(r.startswith("Error") for r in results)
            present = any(g in r.casefold() for r in results for g in golds)
            rewards.append(0.2 * executed + 0.5 * present)
        turns = max(trajectory.num_turns, 1)
        return np.asarray((rewards + [0.0] * turns)[:turns], np.float32)

    # -- batching ----------------------------------------------------------

    def _collate(self, trajectories: Sequence[Trajectory]) -> Batch:
        r = self.config.rollout
        group = 1 if r.loop == "segment" else (r.tree_n if r.loop == "tree" else r.group_size)
        rows = list(trajectories)
        pad_to = self.rows if r.loop != "segment" else _bucket(len(rows))
        steps = max(r.max_steps * (2 if r.loop == "segment" else 1) + 1, 1)
        batch = collate(rows, group_size=group, max_length=self.length, max_steps=steps,
                        max_turns=steps)
        if len(rows) < pad_to:
            batch = _pad_rows(batch, pad_to, group)
        return to_device(batch)

    # -- one RL step -------------------------------------------------------

    def rl_step(self) -> dict[str, float]:
        c = self.config
        timer = StepTimer()
        step_seed = c.seed * 1_000_003 + self.steps_done
        with timer.phase("rollout"):
            if c.async_rollout.enabled:
                trajectories = self._next_shard_trajectories()
            else:
                instances = self._next_instances(c.rollout.prompts_per_step)
                pairs = self.rollout(instances, seed=step_seed)
                trajectories = [t for _, t in pairs]
        with timer.phase("credit"), self._context():
            batch = self._collate(trajectories)
            score_index = jnp.asarray(score_positions(batch.loss_mask))
            values = None
            if self.spec.value != "none":
                values = self._values(self.state.params, batch.tokens, _segment_ids(batch))
                if self.scheme.needs_values == "token":
                    batch = batch.replace(values=values)
                elif self.scheme.needs_values == "boundary":
                    batch = batch.replace(boundary_values=_boundary_values(
                        trajectories, np.asarray(values), batch))
            key = jax.random.fold_in(jax.random.key(c.seed), self.steps_done)
            batch, output = self._credit(batch, key)
            segment_ids = _segment_ids(batch)
            old_logp = self._logprobs(self.state.params, batch.tokens, segment_ids, score_index)
            ref_logp = (self._logprobs(self.reference, batch.tokens, segment_ids, score_index)
                        if self.reference is not None else None)
            train_batch = self._train_batch(batch, output, segment_ids, old_logp, ref_logp,
                                            values, score_index, trajectories)
        with timer.phase("update"), self._context():
            self.state, metrics = self._update(self.state, train_batch)
            metrics = {k: float(v) for k, v in metrics.items()}
        self.steps_done += 1  # the new policy's version
        with timer.phase("sync"):
            if c.async_rollout.enabled:
                publish_policy(self)
            else:
                self.sync_engine()
        metrics.update(self._rollout_metrics(batch, output, old_logp, trajectories))
        metrics.update(_credit_metrics(train_batch, values))
        metrics["skipped_updates"] = float(self.state.skipped)
        metrics.update({f"time/{k}": v for k, v in timer.times.items()})
        return metrics

    def _train_batch(self, batch: Batch, output, segment_ids, old_logp, ref_logp, values,
                     score_index, trajectories) -> TrainBatch:
        rows = batch.batch_size
        row_weights = (output.row_weights if output.row_weights is not None
                       else jnp.ones((rows,), jnp.float32)) * batch.row_mask
        fields = dict(
            tokens=batch.tokens, segment_ids=segment_ids,
            loss_mask=batch.loss_mask & batch.row_mask[:, None], step_id=batch.step_id,
            advantages=output.advantages, old_logp=old_logp,
            rollout_logp=(batch.rollout_logprobs if batch.rollout_logprobs is not None
                          else old_logp),
            row_weights=row_weights, ref_logp=ref_logp, score_index=score_index)
        if self.loss.critic == "token":
            fields.update(returns=output.returns, old_values=values)
        elif self.loss.critic == "boundary":
            positions, weights, targets = _boundary_targets(trajectories, batch)
            fields.update(critic_positions=positions, critic_weights=weights,
                          critic_targets=targets)
        return TrainBatch(**fields)

    def _rollout_metrics(self, batch: Batch, output, old_logp, trajectories) -> dict[str, float]:
        mask = np.asarray(batch.loss_mask & batch.row_mask[:, None])
        rollout = np.asarray(batch.rollout_logprobs) if batch.rollout_logprobs is not None else None
        metrics = {f"credit/{k}": float(v) for k, v in output.metrics.items()}
        real = [t for t in trajectories]
        metrics["reward"] = float(np.mean([t.outcome for t in real]))
        if batch.turn_rewards is not None:  # per-turn reward components (MT-GRPO, MT-PPO)
            turn_mask = np.asarray(batch.turn_mask & batch.row_mask[:, None])
            if turn_mask.any():
                metrics["reward/turn"] = float(np.asarray(batch.turn_rewards)[turn_mask].mean())
        metrics["success"] = float(np.mean([t.metadata.get("success", False) for t in real]))
        metrics["tokens_per_episode"] = float(np.mean([t.loss_mask.sum() for t in real]))
        metrics["tool_calls_per_episode"] = float(np.mean([
            sum(len(m.get("tool_calls", [])) for m in t.metadata.get("messages", []))
            if "messages" in t.metadata else t.metadata.get("tool_calls", 0) for t in real]))
        if rollout is not None and mask.any():
            metrics["logprob_mismatch"] = float(
                np.abs(np.asarray(old_logp) - rollout)[mask].mean())
        groups = np.asarray(batch.grouped(batch.outcome))
        metrics["zero_variance_groups"] = float(np.mean(groups.std(axis=1) < 1e-6))
        return metrics

    # -- the job -------------------------------------------------------------

    def run(self) -> dict[str, float]:
        """SFT (fresh runs), CARL warm-up, RL with checkpoints, metrics, plots, export.

        A run whose workdir holds checkpoints resumes from the latest one
        (skipping SFT) and continues exactly where it stopped.
        """
        c = self.config
        checkpointer = TrainCheckpointer(self.workdir / "checkpoints",
                                         keep=c.train.keep_checkpoints,
                                         every=max(1, c.train.checkpoint_every))
        resumed = self.restore(checkpointer)
        writer = MetricsWriter(self.workdir, resume_step=self.steps_done)
        if not resumed:
            sft_metrics = self.sft()
            if c.async_rollout.enabled:
                publish_policy(self)
            metrics = {**sft_metrics, **self.evaluate(), **self.warmup()}
            writer.write(0, metrics)
            self.log(metrics_line(0, metrics))
            if self.reference is not None:  # the frozen KL reference: the policy after SFT
                save_params(self.workdir / "reference", self.state.params["policy"],
                            self.model_config, lora=self.spec.lora if self.spec.lora.rank else None)
            self.save(checkpointer, force=True)
        bar = ProgressBar(c.train.steps, initial=self.steps_done)
        last: dict[str, float] = {}
        while self.steps_done < c.train.steps:
            start = time.perf_counter()
            metrics = self.rl_step()
            metrics["time/step"] = time.perf_counter() - start
            if c.train.eval_every and self.steps_done % c.train.eval_every == 0:
                metrics.update(self.evaluate())
            if self.steps_done == c.train.steps and "eval/success" not in metrics:
                metrics.update(self.evaluate())
            writer.write(self.steps_done, metrics)
            bar.update(self.steps_done, metrics)
            if checkpointer.should_save(self.steps_done) or self.steps_done == c.train.steps:
                self.save(checkpointer, force=True)
            last = metrics
        bar.close()
        writer.close()
        saved_steps = checkpointer.all_steps()
        checkpointer.close()
        if c.train.export_hf:
            Policy(self.model_config, self.state.params["policy"], self.mesh, self.rules,
                   self.spec.lora).save_pretrained(self.workdir / "export")
        plots = []
        try:
            plots = plot_metrics(self.workdir)
        except Exception as err:  # plots are a convenience, never a failure of the run
            self.log(f"plotting failed: {err}")
        self.log(run_summary(self.workdir, saved_steps, plots))
        return last

    def save(self, checkpointer: TrainCheckpointer, *, force: bool = False) -> None:
        data_state = {"prompts": self.prompts.get_state()}
        if self.config.async_rollout.enabled:
            data_state["shards"] = self.shard_batcher.get_state()
        checkpointer.save(self.steps_done, self.state, data_state=data_state,
                          extra={"steps_done": self.steps_done}, force=force)

    def restore(self, checkpointer: TrainCheckpointer) -> bool:
        step = checkpointer.latest_step()
        if step is None:
            return False
        abstract = abstract_like(self.state, self.state_shardings_unboxed())
        state, data_state, extra = checkpointer.restore(step, abstract_state=abstract)
        self.state = state
        self.prompts.set_state(data_state["prompts"])
        if self.config.async_rollout.enabled and "shards" in data_state:
            self.shard_batcher.set_state(data_state["shards"])
        self.steps_done = int(extra["steps_done"])
        self.sync_engine()
        if self.reference is not None:  # the frozen reference is the policy after SFT
            _, policy = restore_params(self.workdir / "reference", mesh=self.mesh,
                                       rules=self.rules)
            self.reference = {**self.state.params, "policy": policy}
        self.log(f"resumed from step {self.steps_done}")
        return True

    def state_shardings_unboxed(self):
        return jax.tree_util.tree_map(lambda x: x.sharding, self.state)

    def warmup(self) -> dict[str, float]:
        """CARL critic-only warm-up with its verification gate (SPEC §9.4)."""
        if self.config.warmup.steps <= 0:
            return {}
        from agentrl.train.warmup import critic_warmup

        return critic_warmup(self)

    # -- evaluation ----------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Greedy rollouts on the held-out split: success rate and mean reward."""
        pairs = self.rollout(self.eval_instances, greedy=True, seed=0, group_size=1)
        if self.config.rollout.loop == "segment":
            finals = {}
            for instance, t in pairs:
                finals[id(instance)] = t.metadata.get("success", False)
            success = float(np.mean(list(finals.values())))
        else:
            success = float(np.mean([t.metadata.get("success", False) for _, t in pairs]))
        return {"eval/success": success}


def _credit_metrics(batch: TrainBatch, values) -> dict[str, float]:
    """The critic's explained variance, 1 − Var(target − V) / Var(target).

    Over the critic's targets: token returns (GAE schemes) or boundary
    Monte-Carlo returns (CARL). Advantage statistics come from the scheme
    (`credit/*`).
    """
    mask = np.asarray(batch.loss_mask)
    metrics = {}
    target = predicted = None
    if batch.returns is not None and values is not None:
        target, predicted = np.asarray(batch.returns)[mask], np.asarray(values)[mask]
    elif batch.critic_positions is not None and values is not None:
        weights = np.asarray(batch.critic_weights) > 0
        predicted = np.take_along_axis(np.asarray(values), np.asarray(batch.critic_positions),
                                       axis=1)[weights]
        target = np.asarray(batch.critic_targets)[weights]
    if target is not None and target.size > 1 and target.var() > 0:
        metrics["explained_variance"] = float(1.0 - (target - predicted).var() / target.var())
    return metrics


def _bucket(rows: int) -> int:
    size = 1
    while size < rows:
        size *= 2
    return size


def _segment_ids(batch: Batch) -> jax.Array:
    """`[B, T]` 1 on each row's real tokens, 0 on padding."""
    positions = jnp.arange(batch.tokens.shape[1])[None, :]
    return (positions < batch.lengths[:, None]).astype(jnp.int32)


def _pad_rows(batch: Batch, rows: int, group: int) -> Batch:
    """Adds all-padding rows (row_mask False) up to `rows` (numpy host batch)."""
    extra = rows - batch.batch_size

    def pad(x):
        if x is None:
            return None
        x = np.asarray(x)
        fill = -1 if x.dtype == np.int32 and x.ndim >= 1 and x.min(initial=0) < 0 else 0
        widths = [(0, extra)] + [(0, 0)] * (x.ndim - 1)
        return np.pad(x, widths, constant_values=fill)

    padded = jax.tree_util.tree_map(pad, batch)
    row_mask = np.zeros(rows, bool)
    row_mask[: batch.batch_size] = np.asarray(batch.row_mask)
    return padded.replace(row_mask=row_mask, group_size=group if rows % group == 0 else 1)


def _boundary_values(trajectories, values: np.ndarray, batch: Batch) -> np.ndarray:
    """Episode-level boundary values for every view row (CARL), `[B, S]`."""
    num_steps = batch.step_mask.shape[1]
    out = np.zeros((batch.batch_size, num_steps), np.float32)
    episodes: dict[tuple, list[int]] = {}
    for row, t in enumerate(trajectories):
        episodes.setdefault((t.prompt_id, t.metadata["episode"]), []).append(row)
    for rows in episodes.values():
        boundaries = trajectories[rows[0]].metadata["boundaries"]
        episode_values = np.zeros(num_steps, np.float32)
        for k, (view, position) in enumerate(boundaries[:num_steps]):
            row = rows[view]
            episode_values[k] = values[row, min(position, values.shape[1] - 1)]
        for row in rows:
            out[row] = episode_values
    return out


def _boundary_targets(trajectories, batch: Batch):
    """`(positions, weights, targets)` `[B, S]` of CARL's MC critic loss.

    Each boundary sits in its own view's row; its weight is 1/(N+1) of its
    episode (SPEC §9.3 per-trajectory mean), so every episode weighs the same.
    """
    num_steps = batch.step_mask.shape[1]
    positions = np.zeros((batch.batch_size, num_steps), np.int32)
    weights = np.zeros((batch.batch_size, num_steps), np.float32)
    targets = np.zeros((batch.batch_size, num_steps), np.float32)
    episodes: dict[tuple, list[int]] = {}
    for row, t in enumerate(trajectories):
        episodes.setdefault((t.prompt_id, t.metadata["episode"]), []).append(row)
    for rows in episodes.values():
        boundaries = trajectories[rows[0]].metadata["boundaries"][:num_steps]
        reward = trajectories[rows[0]].outcome
        slot = {row: 0 for row in rows}
        for view, position in boundaries:
            row = rows[view]
            k = slot[row]
            positions[row, k] = position
            weights[row, k] = 1.0 / len(boundaries)
            targets[row, k] = reward
            slot[row] += 1
    return jnp.asarray(positions), jnp.asarray(weights), jnp.asarray(targets)


def _merge_into(target, source):
    """Copies `source` leaves into `target` (same structure below the shared keys)."""
    if isinstance(target, dict):
        return {k: _merge_into(v, source[k]) if k in source else v for k, v in target.items()}
    return source


def run_summary(workdir: pathlib.Path, checkpoint_steps: Sequence[int], plots) -> str:
    """The end-of-run lines: held-out success at every evaluation, and what was written."""
    records = read_metrics(workdir / "metrics.jsonl")
    evals = [(r["step"], r["eval/success"]) for r in records
             if isinstance(r.get("eval/success"), float)]
    lines = []
    if evals:
        lines.append("held-out success: " + " | ".join(f"step {s} {v:.2f}" for s, v in evals))
    written = [f"checkpoints/ (steps {', '.join(map(str, checkpoint_steps))})", "metrics.jsonl"]
    if (workdir / "tensorboard").exists():
        written.append("tensorboard/")
    if plots:
        written.append(f"plots/ ({len(plots)} PNG)")
    if (workdir / "export").exists():
        written.append("export/ (HF)")
    lines.append(f"wrote {workdir}: " + ", ".join(written))
    return "\n".join(lines)


def metrics_line(step: int, metrics: dict[str, float]) -> str:
    keys = ["reward", "success", "eval/success", "kl", "entropy", "clip_fraction"]
    parts = [f"{k}={metrics[k]:.3f}" for k in keys if k in metrics]
    return f"step {step}: " + " ".join(parts)
