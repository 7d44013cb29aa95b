"""PORTool tree rollout (Algorithm 1 of `portool_rewarded_tree.txt`; SPEC §6.1).

For each query: n first steps are generated independently. Then, for depth
t = 2..T_max: completed trajectories (their last step called the final-answer
tool, `response_gen`) move out; if n are complete the query stops; otherwise
every incomplete trajectory is duplicated `forks` times and `n − n_c` copies
are drawn uniformly without replacement, each extended by one generated step
and its tool responses. After T_max the incomplete ones are appended, so a
query yields exactly n trajectories (as long as `forks × incomplete ≥ n − n_c`
at each depth; `forks = n`, the default, guarantees it). Copies share their
prefix steps: a step node has an id unique within its query, and every
trajectory through it carries that id (`Trajectory.node_id`).

Every step gets the PORTool format score (§3.2, `portool_format_score`) from
its text and its calls' success flags (`Trajectory.fmt_score`).
"""

import copy
from collections.abc import Sequence

import numpy as np

from agentrl.rewards.portool import portool_format_score
from agentrl.rollout.agent_loop import (
    EpisodeBuilder,
    LoopConfig,
    PromptSpec,
    _stop_set,
    append_tool_results,
    apply_completion,
    generate_steps,
    record_final_results,
    start_episode,
)
from agentrl.types import Trajectory


class _Branch:
    """An episode of the tree plus its node ids and per-step format scores."""

    def __init__(self, episode: EpisodeBuilder):
        self.episode = episode
        self.nodes: list[int] = []
        self.fmt: list[float] = []
        self.complete = False

    def copy(self) -> "_Branch":
        twin = _Branch(copy.deepcopy(self.episode))
        twin.nodes, twin.fmt, twin.complete = list(self.nodes), list(self.fmt), self.complete
        return twin


def _call_outputs(execute, calls):
    """`(contents, ok flags)`; executors may return strings or objects with `.content/.ok`."""
    results = execute(calls) if calls else []
    contents = [getattr(r, "content", r) for r in results]
    ok = [bool(getattr(r, "ok", not str(r).startswith("Error"))) for r in results]
    return contents, ok


def _extend(engine, tokenizer, branches: list[_Branch], execute, config: LoopConfig,
            stop_ids, next_node: dict[str, int]) -> None:
    """Generates one step for every branch, runs its tools, scores its format."""
    by_episode = {id(b.episode): b for b in branches}
    stepped = generate_steps(engine, [b.episode for b in branches], config, stop_ids)
    for branch in branches:
        if branch.episode.done and not branch.complete:  # out of context
            branch.complete = True
    for episode, completion in stepped:
        branch = by_episode[id(episode)]
        query = episode.prompt_id
        branch.nodes.append(next_node[query])
        next_node[query] += 1
        step_text = tokenizer.decode([t for t in completion.token_ids if t not in stop_ids])
        parsed = apply_completion(episode, completion, tokenizer, config)
        contents, ok = _call_outputs(execute, parsed.tool_calls)
        branch.fmt.append(portool_format_score(step_text, ok))
        names = [call["name"] for call in parsed.tool_calls]
        cut_off = completion.finish_reason == "length"
        if config.final_answer_tool in names or not parsed.tool_calls:
            record_final_results(episode, parsed.tool_calls, contents, config)
            episode.finish_with("final_tool" if parsed.tool_calls else "answer")
            branch.complete = True
            continue
        episode.step += 1
        append_tool_results(episode, parsed.tool_calls, contents, tokenizer, config,
                            cut_off=cut_off)


def run_tree_rollout(
    engine,
    tokenizer,
    prompts: Sequence[PromptSpec],
    execute,
    config: LoopConfig | None = None,
    *,
    n: int = 8,
    forks: int | None = None,
    max_depth: int | None = None,
    seed: int = 0,
) -> list[Trajectory]:
    """PORTool Algorithm 1 for every query; `len(prompts) × n` trajectories.

    Args:
      engine: an `Engine`.
      tokenizer: the policy's tokenizer.
      prompts: the queries.
      execute: tool executor (e.g. `registry_executor(registry)`); results
        may carry `.ok` flags (used by the format score).
      config: loop limits; `final_answer_tool` defaults to `"response_gen"`.
      n: trajectories per query.
      forks: copies made of each incomplete trajectory per depth (f; default n).
      max_depth: T_max (default `config.max_steps`).
      seed: seed of the uniform draws of copies.

    Returns:
      Trajectories grouped by query (n each), with `node_id` and `fmt_score`
      per step and `metadata["depth_reached"]`.
    """
    config = config or LoopConfig(final_answer_tool="response_gen")
    forks = n if forks is None else forks
    max_depth = config.max_steps if max_depth is None else max_depth
    rng = np.random.default_rng(seed)
    stop_ids = sorted(_stop_set(tokenizer))
    next_node = {p.prompt_id: 0 for p in prompts}
    if len(next_node) != len(prompts):
        raise ValueError("run_tree_rollout: prompt_ids must be unique (they key the trees).")
    open_branches: dict[str, list[_Branch]] = {}
    completed: dict[str, list[_Branch]] = {p.prompt_id: [] for p in prompts}
    for prompt in prompts:
        open_branches[prompt.prompt_id] = []
        for member in range(n):
            episode = start_episode(tokenizer, prompt, config)
            episode.metadata.update(member=member, branch=f"{member}")
            open_branches[prompt.prompt_id].append(_Branch(episode))
    _extend(engine, tokenizer, [b for bs in open_branches.values() for b in bs], execute,
            config, stop_ids, next_node)
    for _depth in range(2, max_depth + 1):
        to_extend = []
        for query, branches in open_branches.items():
            completed[query] += [b for b in branches if b.complete]
            incomplete = [b for b in branches if not b.complete]
            needed = n - len(completed[query])
            if needed <= 0 or not incomplete:
                open_branches[query] = incomplete if needed > 0 else []
                continue
            pool = [b for b in incomplete for _ in range(forks)]
            chosen = rng.choice(len(pool), size=min(needed, len(pool)), replace=False)
            copies = []
            for index in sorted(chosen):
                twin = pool[index].copy()
                twin.episode.metadata["branch"] = f"{twin.episode.metadata['branch']}.{index}"
                copies.append(twin)
            open_branches[query] = copies
            to_extend += copies
        if not to_extend:
            break
        _extend(engine, tokenizer, to_extend, execute, config, stop_ids, next_node)
    trajectories = []
    for prompt in prompts:
        query = prompt.prompt_id
        branches = completed[query] + [b for b in open_branches[query] if b.complete] + [
            b for b in open_branches[query] if not b.complete]
        for member, branch in enumerate(branches[:n]):
            if not branch.episode.done:
                branch.episode.finish_with("max_depth")
            branch.episode.metadata.update(member=member, depth_reached=len(branch.nodes))
            trajectories.append(branch.episode.to_trajectory(
                node_id=np.asarray(branch.nodes, np.int32),
                fmt_score=np.asarray(branch.fmt, np.float32)))
    return trajectories
