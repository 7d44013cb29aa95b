"""A scripted policy behind the `Engine` protocol, for testing loop logic.

The loops' job is bookkeeping (which tokens are the policy's, which the
environment's, when to stop, what to execute); testing it needs a policy whose
choices the test controls. `ScriptedEngine` decodes each prompt, asks
`respond(prompt_text)` for the assistant's text, and returns its canonical
token ids plus `<|im_end|>` with a fixed log-probability. Loops are also run
end to end with the real `JaxEngine` on tiny models (tests/rollout/).
"""

from agentrl.rollout.engine import Completion, SamplingParams, per_prompt_params

SCRIPTED_LOGPROB = -0.25


class ScriptedEngine:
    def __init__(self, tokenizer, respond):
        self.tokenizer = tokenizer
        self.respond = respond
        self.calls = 0
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params: SamplingParams | list[SamplingParams]):
        self.calls += 1
        out = []
        for prompt, p in zip(prompts, per_prompt_params(prompts, params), strict=True):
            self.prompts.append(list(prompt))
            text = self.respond(self.tokenizer.decode(list(prompt)))
            ids = [*self.tokenizer.encode(text), self.tokenizer.eos_token_id]
            finish = "stop"
            if len(ids) > p.max_new_tokens:
                ids, finish = ids[: p.max_new_tokens], "length"
            out.append(Completion(ids, [SCRIPTED_LOGPROB] * len(ids), finish))
        return out
