"""Cold-start SFT data: demonstrations as token sequences built like rollouts.

A demonstration (prompt messages, then assistant / tool / user turns) becomes
exactly the token sequence a rollout producing it would have: the prompt with
the generation header, each assistant turn as its canonical tokens plus
`<|im_end|>` (`loss_mask = 1`), each environment insert as a chat delta
(`loss_mask = 0`). So SFT trains the policy on the same token layout RL later
samples from (SPEC §1), and tests can check the two agree.
"""

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agentrl.models import chat
from agentrl.models.tokenizer import Tokenizer


def assistant_ids(tokenizer: Tokenizer, message: Mapping[str, Any], flavour: str) -> list[int]:
    """The tokens a policy writes for an assistant message, `<|im_end|>` included."""
    rendered = chat.render_messages([message], flavour=flavour)
    body = rendered.split("<|im_start|>assistant\n", 1)[1].rsplit("<|im_end|>", 1)[0]
    return [*tokenizer.encode(body), tokenizer.token_to_id("<|im_end|>")]


def demonstration_tokens(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None = None, *,
                         enable_thinking: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens [T] int32, loss_mask [T] bool)` of a demonstration.

    The prompt is the messages before the first assistant turn.
    """
    flavour = chat.chat_flavour(tokenizer)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("demonstration has no assistant message to learn from.")
    tokens = chat.encode_messages(tokenizer, messages[:first], tools=list(tools or []) or None,
                                  add_generation_prompt=True, enable_thinking=enable_thinking)
    mask = [False] * len(tokens)
    index = first
    while index < len(messages):
        message = messages[index]
        if message["role"] == "assistant":
            ids = assistant_ids(tokenizer, message, flavour)
            tokens += ids
            mask += [True] * len(ids)
            index += 1
            continue
        inserts = []
        while index < len(messages) and messages[index]["role"] != "assistant":
            inserts.append(messages[index])
            index += 1
        if index >= len(messages):
            break  # nothing to generate after the last environment insert
        ids = chat.render_delta(tokenizer, inserts, add_generation_prompt=True,
                                enable_thinking=enable_thinking)
        tokens += ids
        mask += [False] * len(ids)
    return np.asarray(tokens, np.int32), np.asarray(mask, bool)


def pack_rows(examples: Sequence[tuple[np.ndarray, np.ndarray]], length: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pads examples into `(tokens, segment_ids, loss_mask)` of shape `[N, length]`.

    Longer examples are cut at `length` (their tail is not trained).
    """
    count = len(examples)
    tokens = np.zeros((count, length), np.int32)
    segments = np.zeros((count, length), np.int32)
    mask = np.zeros((count, length), bool)
    for row, (ids, loss_mask) in enumerate(examples):
        n = min(len(ids), length)
        tokens[row, :n] = ids[:n]
        segments[row, :n] = 1
        mask[row, :n] = loss_mask[:n]
    return tokens, segments, mask


def length_buckets(lengths: Sequence[int], batch_size: int, max_length: int, multiple: int = 16
                   ) -> list[tuple[int, np.ndarray]]:
    """Groups examples of similar length: `[(padded_length, example indices)]`.

    `lengths`: `[N]` token counts; each bucket's indices are an int `[n_b]`
    array, and the buckets partition `range(N)`, shortest first.

    An example goes to the bucket of its length rounded up to `multiple`
    (capped at `max_length`); a bucket with fewer than `batch_size` examples
    joins the next longer one, so every bucket can fill a batch (the longest
    may hold fewer examples when there are fewer than `batch_size` in all).
    Padding each batch only to its bucket's length saves the attention's
    quadratic cost on short examples (HF's `group_by_length`), and the number
    of compiled shapes stays at the number of buckets.
    """
    if batch_size < 1 or max_length < 1 or multiple < 1:
        raise ValueError(f"batch_size={batch_size}, max_length={max_length} and "
                         f"multiple={multiple} must all be >= 1.")
    padded = np.minimum(-(-np.asarray(lengths, np.int64) // multiple) * multiple, max_length)
    buckets, pending = [], np.zeros((0,), np.int64)
    for length in np.unique(padded):
        pending = np.concatenate([pending, np.flatnonzero(padded == length)])
        if len(pending) >= batch_size:
            buckets.append((int(length), pending))
            pending = np.zeros((0,), np.int64)
    if len(pending):
        if buckets:  # too few long examples left: they join the longest bucket
            buckets[-1] = (int(padded[pending].max()), np.concatenate([buckets[-1][1], pending]))
        else:
            buckets.append((int(padded[pending].max()), pending))
    return buckets


def bucket_batches(buckets: Sequence[tuple[int, np.ndarray]], batch_size: int, steps: int,
                   rng: np.random.Generator) -> list[tuple[int, np.ndarray]]:
    """`steps` batches `(padded_length, indices [<= batch_size])`, each from one bucket.

    The bucket is drawn with probability proportional to its size, then
    `batch_size` of its examples without replacement (all of them when the
    bucket is smaller), so every example is equally likely to be trained on.
    """
    sizes = np.asarray([len(indices) for _, indices in buckets], np.float64)
    choice = rng.choice(len(buckets), size=steps, p=sizes / sizes.sum())
    batches = []
    for b in choice:
        length, indices = buckets[b]
        take = min(batch_size, len(indices))
        batches.append((length, indices[rng.choice(len(indices), size=take, replace=False)]))
    return batches


OUTPUT_BLOCK = re.compile(r"```output\n.*?\n```\n", re.S)


def segment_demonstration_tokens(tokenizer: Tokenizer, instance) -> tuple[np.ndarray, np.ndarray]:
    """A CARL episode's tokens (SPEC §9.1) from `metadata["carl_demonstration"]`.

    The prompt uses `metadata["carl_system"]`; the assistant text is the
    policy's (`loss_mask = 1`) except the `` ```output ``` `` blocks the
    environment appends after each code block (`loss_mask = 0`); the text ends
    with `<|im_end|>`. This is the transient view (raw output visible), the
    one the assimilate segments are generated from.
    """
    messages = [dict(m) for m in instance.prompt.messages]
    system = instance.metadata.get("carl_system")
    if system is not None:
        messages[0] = {"role": "system", "content": system}
    tokens = chat.encode_messages(tokenizer, messages, add_generation_prompt=True)
    mask = [False] * len(tokens)
    text = instance.metadata["carl_demonstration"]
    position = 0
    for match in OUTPUT_BLOCK.finditer(text):
        policy = tokenizer.encode(text[position:match.start()])
        environment = tokenizer.encode(match.group(0), allow_special=False)
        tokens += policy + environment
        mask += [True] * len(policy) + [False] * len(environment)
        position = match.end()
    tail = [*tokenizer.encode(text[position:]), tokenizer.token_to_id("<|im_end|>")]
    tokens += tail
    mask += [True] * len(tail)
    return np.asarray(tokens, np.int32), np.asarray(mask, bool)
