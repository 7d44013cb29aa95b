"""Multi-step tool-use loops over an `Engine`, token-in/token-out (SPEC §1).

An `EpisodeBuilder` grows one trajectory: policy tokens are appended exactly as
the engine sampled them (with their log-probabilities, `loss_mask = 1`, the
current `step_id` / `turn_id`), environment inserts as chat-template deltas
(`agentrl.models.chat.render_delta`, `loss_mask = 0`, ids −1). Nothing is
re-tokenised. All loops here are lock-step batched: every active episode's
next step is generated in one `engine.generate` call, then the tools of all
episodes run (in parallel), then the next step.

* `run_tool_loop`: generate; parse Hermes tool calls; execute them (schema
  validation and errors come from the tool registry, returned to the policy);
  append the results; repeat until a final answer, a step limit, a per-step
  token limit or a context limit.
* `run_dialogue_loop` (CM2, SPEC §5.5): the user turns of a reference
  dialogue; after each step the checklist judge fills `sat_after`; after a
  turn's final reply the strictness rule decides whether the next user
  message is sent.
"""

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from agentrl.envs.judges import ChecklistItem
from agentrl.envs.tools import truncate_middle
from agentrl.models import chat
from agentrl.models.tokenizer import Tokenizer
from agentrl.rollout.engine import Completion, Engine, SamplingParams
from agentrl.types import Trajectory

DEFAULT_SAMPLING = SamplingParams()


class ToolExecutor(Protocol):
    """Runs a batch of parsed calls; one result text per call, never raises."""

    def __call__(self, calls: Sequence[Mapping[str, Any]]) -> list[str]: ...


def registry_executor(registry) -> ToolExecutor:
    """Adapts an `agentrl.envs.tools.ToolRegistry` (its `call_many`) to a `ToolExecutor`."""

    def execute(calls):
        return [result.content for result in registry.call_many(list(calls))]

    return execute


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Limits and sampling of a tool loop.

    Attributes:
      max_steps: policy generations per episode (per turn in dialogues).
      max_step_tokens: new tokens per generation.
      max_context_tokens: total tokens of an episode; generation stops when
        the next step would not fit.
      max_tool_output_chars: longer tool results are cut in the middle.
      sampling: temperature / top-p / top-k / seed (its `max_new_tokens` and
        `stop_token_ids` are set per step by the loop).
      enable_thinking: Qwen3 generation prompt option.
      final_answer_tool: a tool whose call ends the episode (PORTool's
        `response_gen`); None: an answer without tool calls ends it.
      steps_are_turns: give each step its own `turn_id` (MT-GRPO / MT-PPO
        "turns" in single-question settings) instead of one turn per user
        message.
    """

    max_steps: int = 8
    max_step_tokens: int = 512
    max_context_tokens: int = 4096
    max_tool_output_chars: int = 4000
    sampling: SamplingParams = DEFAULT_SAMPLING
    enable_thinking: bool = True
    final_answer_tool: str | None = None
    steps_are_turns: bool = False


@dataclasses.dataclass
class EpisodeBuilder:
    """One trajectory under construction (host-side, token-in/token-out)."""

    prompt_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[bool] = dataclasses.field(default_factory=list)
    step_id: list[int] = dataclasses.field(default_factory=list)
    turn_id: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    messages: list[dict] = dataclasses.field(default_factory=list)
    step: int = 0
    turn: int = 0
    done: bool = False
    finish: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def add_environment(self, ids: Sequence[int]) -> None:
        """Appends environment ids (prompt, tool results, user turns): loss_mask 0."""
        ids = [int(i) for i in ids]
        self.tokens += ids
        self.loss_mask += [False] * len(ids)
        self.step_id += [-1] * len(ids)
        self.turn_id += [-1] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_policy(self, completion: Completion) -> None:
        """Appends a completion's sampled ids verbatim, as step `self.step`."""
        if not completion.token_ids:
            return
        count = len(completion.token_ids)
        self.tokens += [int(i) for i in completion.token_ids]
        self.loss_mask += [True] * count
        self.step_id += [self.step] * count
        self.turn_id += [self.turn] * count
        self.logprobs += [float(x) for x in completion.logprobs]

    def finish_with(self, reason: str) -> None:
        self.done = True
        self.finish = reason

    def to_trajectory(self, **fields) -> Trajectory:
        metadata = {**self.metadata, "finish": self.finish, "messages": self.messages}
        return Trajectory(
            prompt_id=self.prompt_id,
            tokens=np.asarray(self.tokens, np.int32),
            loss_mask=np.asarray(self.loss_mask, bool),
            step_id=np.asarray(self.step_id, np.int32),
            turn_id=np.asarray(self.turn_id, np.int32),
            rollout_logprobs=np.asarray(self.logprobs, np.float32),
            metadata=metadata,
            **fields,
        )


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """A task instance: its messages (system, user) and the tool schemas it offers."""

    prompt_id: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def start_episode(tokenizer: Tokenizer, prompt: PromptSpec, config: LoopConfig) -> EpisodeBuilder:
    """An episode holding the encoded prompt and generation header."""
    episode = EpisodeBuilder(prompt_id=prompt.prompt_id, metadata=dict(prompt.metadata))
    episode.messages = [dict(m) for m in prompt.messages]
    episode.add_environment(chat.encode_messages(
        tokenizer, prompt.messages, tools=list(prompt.tools) or None,
        add_generation_prompt=True, enable_thinking=config.enable_thinking))
    return episode


def step_params(episode: EpisodeBuilder, config: LoopConfig, stop_ids: Sequence[int]
                ) -> SamplingParams | None:
    """This step's sampling parameters, or None when no token fits the context."""
    room = config.max_context_tokens - len(episode.tokens)
    if room <= 0:
        return None
    seed = config.sampling.seed
    if seed is not None:  # distinct, reproducible streams per episode and step
        key = repr((seed, episode.prompt_id, episode.metadata.get("member", 0),
                    episode.metadata.get("branch", ""), episode.step, episode.turn))
        seed = zlib.crc32(key.encode()) % (2**31)
    return dataclasses.replace(
        config.sampling, max_new_tokens=min(config.max_step_tokens, room),
        stop_token_ids=tuple(stop_ids), seed=seed)


def generate_steps(engine: Engine, episodes: Sequence[EpisodeBuilder], config: LoopConfig,
                   stop_ids: Sequence[int]) -> list[tuple[EpisodeBuilder, Completion]]:
    """One generation for every active episode (episodes out of room finish)."""
    requests = []
    for episode in episodes:
        params = step_params(episode, config, stop_ids)
        if params is None:
            episode.finish_with("context")
            continue
        requests.append((episode, params))
    if not requests:
        return []
    completions = engine.generate([e.tokens for e, _ in requests], [p for _, p in requests])
    return [(episode, completion)
            for (episode, _), completion in zip(requests, completions, strict=True)]


def apply_completion(episode: EpisodeBuilder, completion: Completion, tokenizer: Tokenizer,
                     config: LoopConfig) -> chat.ParsedAssistant:
    """Appends the policy's tokens and the parsed assistant message."""
    episode.add_policy(completion)
    parsed = chat.parse_assistant(tokenizer.decode(
        [t for t in completion.token_ids if t not in _stop_set(tokenizer)]))
    episode.messages.append(parsed.to_message())
    if parsed.errors:
        episode.metadata.setdefault("parse_errors", []).append(list(parsed.errors))
    return parsed


def _stop_set(tokenizer: Tokenizer) -> set[int]:
    return set(getattr(tokenizer, "stop_token_ids", (tokenizer.eos_token_id,)))


def tool_messages(calls: Sequence[Mapping[str, Any]], outputs: Sequence[str],
                  config: LoopConfig) -> list[dict]:
    return [{"role": "tool", "name": call.get("name"),
             "content": truncate_middle(output, config.max_tool_output_chars)}
            for call, output in zip(calls, outputs, strict=True)]


def record_final_results(episode: EpisodeBuilder, calls, outputs, config: LoopConfig) -> None:
    """Results of the last step's calls: kept in metadata, not in the tokens.

    `episode.messages` always renders to exactly the episode's tokens; calls
    made by a step after which the episode ends are executed (their results
    may matter, e.g. `response_gen`) but never shown to the policy.
    """
    episode.metadata["final_tool_results"] = tool_messages(calls, outputs, config)


def append_tool_results(episode: EpisodeBuilder, calls, outputs, tokenizer: Tokenizer,
                        config: LoopConfig, *, cut_off: bool) -> None:
    """Appends the tool results and the next generation header as one delta."""
    messages = tool_messages(calls, outputs, config)
    episode.messages += messages
    episode.add_environment(chat.render_delta(
        tokenizer, messages, add_generation_prompt=True, enable_thinking=config.enable_thinking,
        close_turn=cut_off))


def run_tool_loop(
    engine: Engine,
    tokenizer: Tokenizer,
    prompts: Sequence[PromptSpec],
    execute: ToolExecutor,
    config: LoopConfig | None = None,
    *,
    group_size: int = 1,
    on_step: Callable[[EpisodeBuilder, chat.ParsedAssistant], None] | None = None,
) -> list[Trajectory]:
    """Multi-step tool use for `group_size` rollouts of every prompt.

    Each step: generate (one batched engine call for all active episodes);
    parse the Hermes tool calls; execute them (in parallel, through
    `execute`); append the results as a delta with `loss_mask = 0`. An
    episode ends with `finish` = `"answer"` (no tool call), `"final_tool"`
    (`config.final_answer_tool` called), `"max_steps"`, `"step_tokens"`
    (the generation hit `max_step_tokens` without a stop token) or
    `"context"`.

    Returns:
      `len(prompts) × group_size` trajectories, grouped by prompt, each with
      `metadata["finish"]`, `["messages"]`, `["member"]` and the prompt's
      metadata.
    """
    config = config or LoopConfig()
    stop_ids = sorted(_stop_set(tokenizer))
    episodes = []
    for prompt in prompts:
        for member in range(group_size):
            episode = start_episode(tokenizer, prompt, config)
            episode.metadata["member"] = member
            episodes.append(episode)
    while True:
        active = [e for e in episodes if not e.done]
        if not active:
            break
        pending = []
        for episode, completion in generate_steps(engine, active, config, stop_ids):
            parsed = apply_completion(episode, completion, tokenizer, config)
            if on_step is not None:
                on_step(episode, parsed)
            cut_off = completion.finish_reason == "length"
            names = [call["name"] for call in parsed.tool_calls]
            if cut_off and not parsed.tool_calls:
                episode.finish_with("step_tokens")
            elif not parsed.tool_calls:
                episode.finish_with("answer")
            else:
                pending.append((episode, parsed.tool_calls, cut_off, names))
        _run_tools(pending, execute, tokenizer, config)
    return [e.to_trajectory() for e in episodes]


def _run_tools(pending, execute: ToolExecutor, tokenizer: Tokenizer, config: LoopConfig) -> None:
    """Executes every pending episode's calls in one batch and advances the episodes."""
    if not pending:
        return
    flat_calls = [call for _, calls, _, _ in pending for call in calls]
    outputs = execute(flat_calls)
    offset = 0
    for episode, calls, cut_off, names in pending:
        results = outputs[offset: offset + len(calls)]
        offset += len(calls)
        if config.final_answer_tool is not None and config.final_answer_tool in names:
            record_final_results(episode, calls, results, config)
            episode.finish_with("final_tool")
            continue
        episode.step += 1
        if config.steps_are_turns:
            episode.turn += 1
        if episode.step >= config.max_steps:
            record_final_results(episode, calls, results, config)
            episode.finish_with("max_steps")
            continue
        append_tool_results(episode, calls, results, tokenizer, config, cut_off=cut_off)


# ---------------------------------------------------------------------------
# Multi-turn dialogues with checklist judging (CM2).
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DialogueSpec:
    """A reference dialogue: user turns, their checklists, tools, recorded tool I/O."""

    prompt_id: str
    user_turns: tuple[str, ...]
    checklists: tuple[tuple[ChecklistItem, ...], ...]
    system: str | None = None
    tools: tuple[dict, ...] = ()
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if len(self.user_turns) != len(self.checklists):
            raise ValueError(
                f"DialogueSpec {self.prompt_id!r}: {len(self.user_turns)} user turns but "
                f"{len(self.checklists)} checklists; give one checklist per turn."
            )


class StepJudge(Protocol):
    """`judge(items, current, previous) -> one verdict per item` after a step.

    `agentrl.envs.judges.ChecklistJudge` (LLM, CM2 App. A.1.4) and `RuleJudge`
    implement it; `current` is the turn's messages so far, `previous` the
    earlier turns.
    """

    def judge(self, items: Sequence[ChecklistItem], current: Sequence[Mapping[str, Any]],
              previous: Sequence[Mapping[str, Any]] = ()) -> list[bool]: ...


@dataclasses.dataclass
class _DialogueState:
    spec: DialogueSpec
    turn_start: int = 0  # index in episode.messages of the turn's user message
    steps_in_turn: int = 0
    verdicts: list[list[list[bool]]] = dataclasses.field(default_factory=list)

    def satisfied(self, turn: int) -> np.ndarray:
        rows = self.verdicts[turn]
        return np.any(np.asarray(rows, bool), axis=0) if rows else np.zeros(
            len(self.spec.checklists[turn]), bool)


def item_weights(items: Sequence[ChecklistItem]) -> np.ndarray:
    """`w_{t,c}`: given weights; items without one share the rest of 1 equally."""
    given = [item.weight for item in items if item.weight is not None]
    missing = len(items) - len(given)
    rest = max(0.0, 1.0 - float(sum(given))) / missing if missing else 0.0
    return np.asarray([rest if item.weight is None else item.weight for item in items],
                      np.float32)


def checklist_arrays(spec: DialogueSpec, verdicts: Sequence[Sequence[Sequence[bool]]]
                     ) -> dict[str, Any]:
    """Trajectory fields `checklist_*` `[L, S, C]` for the reference turns L (SPEC §5)."""
    num_turns = len(spec.checklists)
    num_items = max([1, *(len(items) for items in spec.checklists)])
    num_steps = max([1, *(len(v) for v in verdicts)])
    sat_after = np.zeros((num_turns, num_steps, num_items), bool)
    step_mask = np.zeros((num_turns, num_steps), bool)
    deps = np.zeros((num_turns, num_items, num_items), bool)
    weights = np.zeros((num_turns, num_items), np.float32)
    item_mask = np.zeros((num_turns, num_items), bool)
    for t, items in enumerate(spec.checklists):
        index = {item.id: c for c, item in enumerate(items)}
        weights[t, : len(items)] = item_weights(items)
        for c, item in enumerate(items):
            item_mask[t, c] = True
            for prerequisite in item.dependency:
                if prerequisite not in index:
                    raise ValueError(
                        f"dialogue {spec.prompt_id!r} turn {t}: item {item.id!r} depends on "
                        f"{prerequisite!r}, which is not an item of that turn ({sorted(index)})."
                    )
                deps[t, c, index[prerequisite]] = True
        for s, row in enumerate(verdicts[t] if t < len(verdicts) else []):
            sat_after[t, s, : len(row)] = row
            step_mask[t, s] = True
    return dict(
        checklist_sat_after=sat_after,
        checklist_deps=deps,
        checklist_weights=weights,
        checklist_item_mask=item_mask,
        checklist_step_mask=step_mask,
        reference_turns=num_turns,
    )


def run_dialogue_loop(
    engine: Engine,
    tokenizer: Tokenizer,
    dialogues: Sequence[DialogueSpec],
    execute: Callable[[DialogueSpec], ToolExecutor],
    judge: StepJudge,
    config: LoopConfig | None = None,
    *,
    group_size: int = 1,
) -> list[Trajectory]:
    """CM2 rollouts of reference dialogues (SPEC §5.5).

    Per turn t: the user message of the reference dialogue, then policy steps
    (tool calls go to `execute(spec)`, e.g. the hybrid simulator of that
    dialogue). After every step the judge answers, for each item of turn t,
    whether the turn's messages so far satisfy it (`sat_after`). After a step
    without tool calls (the turn's final reply), the next user message is
    sent iff every strict item of turn t is satisfied (monotone: by any step
    of the turn); otherwise the rollout ends (`finish="strict_failed"`).
    `finish` is `"completed"` after the last turn, or `"max_steps"` /
    `"step_tokens"` / `"context"` as in `run_tool_loop` (`max_steps` counts
    the steps of one turn).

    Returns:
      `len(dialogues) × group_size` trajectories with the `checklist_*`
      fields and `reference_turns` filled.
    """
    config = config or LoopConfig()
    stop_ids = sorted(_stop_set(tokenizer))
    states: dict[int, _DialogueState] = {}
    episodes = []
    for spec in dialogues:
        messages = ([{"role": "system", "content": spec.system}] if spec.system else [])
        messages.append({"role": "user", "content": spec.user_turns[0]})
        prompt = PromptSpec(spec.prompt_id, tuple(messages), spec.tools, spec.metadata)
        for member in range(group_size):
            episode = start_episode(tokenizer, prompt, config)
            episode.metadata["member"] = member
            states[id(episode)] = _DialogueState(spec, turn_start=len(messages) - 1,
                                                 verdicts=[[]])
            episodes.append(episode)
    while True:
        active = [e for e in episodes if not e.done]
        if not active:
            break
        stepped = generate_steps(engine, active, config, stop_ids)
        tool_work = []
        for episode, completion in stepped:
            parsed = apply_completion(episode, completion, tokenizer, config)
            cut_off = completion.finish_reason == "length"
            if parsed.tool_calls:
                tool_work.append((episode, parsed.tool_calls, cut_off))
            else:
                _judge_step(episode, states[id(episode)], judge)
                if cut_off:
                    episode.finish_with("step_tokens")
                else:
                    _end_of_turn(episode, states[id(episode)], tokenizer, config)
        for episode, calls, cut_off in tool_work:
            state = states[id(episode)]
            outputs = execute(state.spec)(calls)
            messages = tool_messages(calls, outputs, config)
            _judge_step(episode, state, judge, extra=messages)
            state.steps_in_turn += 1
            episode.step += 1
            if state.steps_in_turn >= config.max_steps:
                record_final_results(episode, calls, outputs, config)
                episode.finish_with("max_steps")
                continue
            episode.messages += messages
            episode.add_environment(chat.render_delta(
                tokenizer, messages, add_generation_prompt=True,
                enable_thinking=config.enable_thinking, close_turn=cut_off))
    return [e.to_trajectory(**checklist_arrays(states[id(e)].spec, states[id(e)].verdicts))
            for e in episodes]


def _judge_step(episode: EpisodeBuilder, state: _DialogueState, judge: StepJudge,
                extra: Sequence[Mapping[str, Any]] = ()) -> None:
    """Judges the turn after a step (its action plus the action's tool results, `extra`)."""
    items = state.spec.checklists[episode.turn]
    turn_messages = episode.messages[state.turn_start:] + list(extra)
    previous = episode.messages[: state.turn_start]
    verdicts = [bool(v) for v in judge.judge(items, turn_messages, previous)]
    if len(verdicts) != len(items):
        raise ValueError(
            f"judge returned {len(verdicts)} verdicts for {len(items)} checklist items of "
            f"dialogue {state.spec.prompt_id!r} turn {episode.turn}; return one per item."
        )
    state.verdicts[episode.turn].append(verdicts)


def _end_of_turn(episode: EpisodeBuilder, state: _DialogueState, tokenizer: Tokenizer,
                 config: LoopConfig) -> None:
    """The strictness rule after a turn's final reply (SPEC §5.5)."""
    turn = episode.turn
    items = state.spec.checklists[turn]
    satisfied = state.satisfied(turn)
    strict_ok = all(sat for item, sat in zip(items, satisfied, strict=True) if item.strict)
    if not strict_ok:
        episode.finish_with("strict_failed")
        return
    if turn + 1 >= len(state.spec.user_turns):
        episode.finish_with("completed")
        return
    user = {"role": "user", "content": state.spec.user_turns[turn + 1]}
    episode.messages.append(user)
    state.turn_start = len(episode.messages) - 1
    state.steps_in_turn = 0
    state.verdicts.append([])
    episode.step += 1
    episode.turn += 1
    episode.add_environment(chat.render_delta(
        tokenizer, [user], add_generation_prompt=True, enable_thinking=config.enable_thinking))
