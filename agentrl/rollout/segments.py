"""CARL segment rollouts: invoke → execute → assimilate → replace → commit (SPEC §9.1).

Seed: `carl_segment_credit.txt` §3 (Figure 1), App. B (transient and persistent
states). An **invoke** segment writes reasoning and a Python code block and
ends at the closing code fence; the rollout runs the code in the sandbox and
appends its stdout (the transient state s̃). An **assimilate** segment reads it
and writes a `<context>…</context>` block (at most `max_assimilate_tokens`,
256 in the paper); the rollout then *replaces* the raw stdout by that block
(the persistent state). A **commit** segment writes the final answer
(`\\boxed{}`) up to EOS. At most `max_segments` segments (15).

Because the raw output is visible only to the assimilate segment that
follows it, one episode is stored as several rows ("views"), each holding the
exact context its trained segments were generated from:

* view j (j < K, K tool calls) = persistent prefix + invoke_j + raw output_j +
  assimilate_j; it trains invoke_j and assimilate_j;
* view K = persistent prefix + commit (or the last unfinished segment).

The persistent prefix (prompt, earlier invoke segments and context blocks) has
`loss_mask = 0` in later views, so every generated token is trained exactly
once. Each row's `step_id` is the episode-level segment index, so the
`segment` credit scheme sees the whole episode's boundaries in every row:
`metadata["boundaries"][k] = (view, position)` locates the state before
segment k (transient states included) for the critic.
"""

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from agentrl.models.tokenizer import Tokenizer
from agentrl.rewards.answers import extract_boxed
from agentrl.rollout.engine import Completion, Engine, SamplingParams
from agentrl.types import Trajectory

CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
CONTEXT_END = "</context>"


@dataclasses.dataclass(frozen=True)
class SegmentConfig:
    """Limits of a CARL episode (paper: 15 segments, T_assimilate = 256)."""

    max_segments: int = 15
    max_segment_tokens: int = 512
    max_assimilate_tokens: int = 256
    max_context_tokens: int = 4096
    max_output_chars: int = 2000
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    output_template: str = "\n```output\n{output}\n```\n"


def cut_after(tokenizer: Tokenizer, completion: Completion, marker_end: Callable[[str], int | None]
              ) -> tuple[Completion, bool]:
    """Keeps the shortest token prefix whose text contains the marker (e.g. a code fence).

    `marker_end(text)` returns the end index of the marker in text, or None.
    Returns the (possibly cut) completion and whether the marker was found.
    """
    text = tokenizer.decode(completion.token_ids)
    if marker_end(text) is None:
        return completion, False
    for count in range(1, len(completion.token_ids) + 1):
        if marker_end(tokenizer.decode(completion.token_ids[:count])) is not None:
            return Completion(completion.token_ids[:count], completion.logprobs[:count],
                              "stop"), True
    return completion, False


def code_block_end(text: str) -> int | None:
    match = CODE_BLOCK.search(text)
    return None if match is None else match.end()


def context_end(text: str) -> int | None:
    index = text.find(CONTEXT_END)
    return None if index < 0 else index + len(CONTEXT_END)


@dataclasses.dataclass
class _Episode:
    prompt_id: str
    persistent: list[int]  # the persistent context (prompt + kept segments)
    persistent_mask: list[bool]
    views: list[dict] = dataclasses.field(default_factory=list)
    current: dict | None = None  # the view under construction
    segment: int = 0
    kinds: list[str] = dataclasses.field(default_factory=list)
    boundaries: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    phase: str = "act"  # "act" (invoke or commit next) or "assimilate"
    done: bool = False
    finish: str = ""
    answer: str | None = None
    tool_calls: int = 0
    member: int = 0

    def open_view(self) -> None:
        n = len(self.persistent)
        self.current = dict(tokens=list(self.persistent), loss_mask=[False] * n,
                            step_id=[-1] * n, logprobs=[0.0] * n)

    def context(self) -> list[int]:
        return self.current["tokens"]

    def add_segment(self, completion: Completion, kind: str) -> None:
        view = self.current
        self.boundaries.append((len(self.views), len(view["tokens"])))
        self.kinds.append(kind)
        count = len(completion.token_ids)
        view["tokens"] += list(completion.token_ids)
        view["loss_mask"] += [True] * count
        view["step_id"] += [self.segment] * count
        view["logprobs"] += list(completion.logprobs)
        self.segment += 1

    def add_environment(self, ids: Sequence[int]) -> None:
        view = self.current
        view["tokens"] += list(ids)
        view["loss_mask"] += [False] * len(ids)
        view["step_id"] += [-1] * len(ids)
        view["logprobs"] += [0.0] * len(ids)

    def close_view(self) -> None:
        self.views.append(self.current)
        self.current = None


def run_segment_rollout(
    engine: Engine,
    tokenizer: Tokenizer,
    prompts: Sequence[tuple[str, Sequence[int]]],
    run_code: Callable[[str], str],
    config: SegmentConfig | None = None,
    *,
    group_size: int = 1,
) -> list[list[Trajectory]]:
    """CARL episodes for `group_size` rollouts of each `(prompt_id, prompt_ids)`.

    Args:
      engine: an `Engine`.
      tokenizer: the policy's tokenizer (decoding for the fence / context
        markers; encoding of tool output).
      prompts: `(prompt_id, token ids of the rendered prompt with the
        generation header)`.
      run_code: executes a code block, returns the text to append (e.g.
        `agentrl.envs.sandbox.python_tool`).
      config: limits and sampling.
      group_size: rollouts per prompt.

    Returns:
      One list of view rows per episode (grouped by prompt). Every row has
      `metadata` with `episode`, `view`, `segment_kinds`, `boundaries`,
      `finish`, `answer` (the `\\boxed{}` content or None), `tool_calls`.
    """
    config = config or SegmentConfig()
    stop_ids = sorted(set(getattr(tokenizer, "stop_token_ids", (tokenizer.eos_token_id,))))
    episodes = []
    for prompt_id, prompt_ids in prompts:
        for member in range(group_size):
            episode = _Episode(prompt_id, list(prompt_ids), [False] * len(prompt_ids),
                               member=member)
            episode.open_view()
            episodes.append(episode)
    while True:
        active = [e for e in episodes if not e.done]
        if not active:
            break
        requests = []
        for episode in active:
            room = config.max_context_tokens - len(episode.context())
            budget = (config.max_assimilate_tokens if episode.phase == "assimilate"
                      else config.max_segment_tokens)
            if room <= 0 or episode.segment >= config.max_segments:
                _finish(episode, "context" if room <= 0 else "max_segments")
                continue
            params = dataclasses.replace(config.sampling, max_new_tokens=min(budget, room),
                                         stop_token_ids=tuple(stop_ids))
            requests.append((episode, params))
        if not requests:
            continue
        completions = engine.generate([e.context() for e, _ in requests],
                                      [p for _, p in requests])
        for (episode, _), completion in zip(requests, completions, strict=True):
            if episode.phase == "assimilate":
                _assimilate(episode, completion, tokenizer)
            else:
                _act(episode, completion, tokenizer, run_code, config)
    return [_rows(episode, index) for index, episode in enumerate(episodes)]


def _act(episode: _Episode, completion: Completion, tokenizer: Tokenizer,
         run_code: Callable[[str], str], config: SegmentConfig) -> None:
    """An invoke (ends at a closing code fence) or a commit (ends at EOS)."""
    cut, is_invoke = cut_after(tokenizer, completion, code_block_end)
    if not is_invoke:
        episode.add_segment(completion, "commit")
        text = tokenizer.decode(completion.token_ids)
        episode.answer = extract_boxed(text)
        _finish(episode, "commit" if completion.finish_reason == "stop" else "segment_tokens")
        return
    episode.add_segment(cut, "invoke")
    code = CODE_BLOCK.search(tokenizer.decode(cut.token_ids)).group(1)
    output = run_code(code)
    if len(output) > config.max_output_chars:
        output = output[: config.max_output_chars] + "\n[output truncated]"
    episode.add_environment(tokenizer.encode(config.output_template.format(output=output),
                                             allow_special=False))
    episode.tool_calls += 1
    episode.persistent += list(cut.token_ids)
    episode.persistent_mask += [True] * len(cut.token_ids)
    episode.phase = "assimilate"


def _assimilate(episode: _Episode, completion: Completion, tokenizer: Tokenizer) -> None:
    """The `<context>` block; the raw output is then replaced by it."""
    cut, found = cut_after(tokenizer, completion, context_end)
    episode.add_segment(cut, "assimilate")
    episode.persistent += list(cut.token_ids)
    episode.persistent_mask += [True] * len(cut.token_ids)
    episode.close_view()
    if not found:
        _finish(episode, "assimilate_unterminated")
        return
    episode.phase = "act"
    episode.open_view()


def _finish(episode: _Episode, reason: str) -> None:
    if episode.current is not None:
        episode.close_view()
    episode.done = True
    episode.finish = reason


def _rows(episode: _Episode, index: int) -> list[Trajectory]:
    rows = []
    for view_index, view in enumerate(episode.views):
        rows.append(Trajectory(
            prompt_id=episode.prompt_id,
            tokens=np.asarray(view["tokens"], np.int32),
            loss_mask=np.asarray(view["loss_mask"], bool),
            step_id=np.asarray(view["step_id"], np.int32),
            turn_id=np.where(np.asarray(view["loss_mask"], bool), 0, -1).astype(np.int32),
            rollout_logprobs=np.asarray(view["logprobs"], np.float32),
            episode_steps=episode.segment,
            metadata=dict(
                episode=index, member=episode.member, view=view_index,
                num_views=len(episode.views), segment_kinds=list(episode.kinds),
                boundaries=list(episode.boundaries), finish=episode.finish,
                answer=episode.answer, tool_calls=episode.tool_calls,
            ),
        ))
    return rows
