"""The `Engine` protocol: token ids in, sampled token ids and log-probabilities out.

Every rollout loop talks to an engine through `generate`, a batched, blocking
call: one list of token-id prompts, one `SamplingParams` (or one per prompt),
one `Completion` per prompt. Two engines implement it:

* `agentrl.rollout.jax_engine.JaxEngine`: in-process, jitted prefill +
  KV-cache decode over the Flax Qwen model (default; the CPU path).
* `agentrl.rollout.vllm_engine.VLLMEngine`: a client of one or more vLLM
  OpenAI-compatible servers (token-id prompts, token ids and logprobs back).

Token-in/token-out (SPEC §1): completions carry the sampled ids verbatim,
including the stop token that ended them, and the log-probability of each
under the *sampling* distribution (after temperature, top-k and top-p), which
is the behaviour policy of the importance ratio.
"""

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one continuation.

    Attributes:
      temperature: softmax temperature; 0 means greedy (log-probabilities are
        then 0 for the chosen token).
      top_p: nucleus mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; 0 disables it.
      max_new_tokens: generation budget.
      stop_token_ids: generation ends after emitting one of these (it is
        included in the completion).
      seed: per-request seed for reproducible sampling (None: engine's stream).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1].")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 disables it).")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1.")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass
class Completion:
    """One sampled continuation.

    Attributes:
      token_ids: the sampled ids, the stop token included when it ended them.
      logprobs: log-probability of each sampled id under the sampling
        distribution (same length as token_ids).
      finish_reason: `"stop"` (a stop token) or `"length"` (budget reached).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Completion: {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs."
            )


@runtime_checkable
class Engine(Protocol):
    """Batched generation over token ids."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[Completion]:
        """One `Completion` per prompt, in order."""
        ...


def per_prompt_params(
    prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
) -> list[SamplingParams]:
    """Expands one `SamplingParams` to every prompt, or checks one per prompt."""
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(
            f"generate: {len(prompts)} prompts but {len(params)} SamplingParams; pass one "
            "SamplingParams for all or one per prompt."
        )
    return params
