"""Qwen tokenizers (agentrl/models/tokenizer.py): bundled BPE and tokenizer.json parity."""

import json
import re

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from agentrl.models.chat import chat_flavour
from agentrl.models.tokenizer import (
    BPE_VOCAB_SIZE,
    QWEN3_ADDED_TOKENS,
    QWEN25_ADDED_TOKENS,
    QWEN_PATTERN,
    BundledQwenTokenizer,
    TokenizerJsonTokenizer,
    byte_level_string,
    get_tokenizer,
    nfc,
    qwen_bpe_ranks,
)

PROPERTY = settings(max_examples=150, deadline=None)
FLAVOURS = ["qwen2.5", "qwen3"]
# Qwen2.5-Instruct / Qwen3 tokenizer_config.json `added_tokens_decoder`: id → content.
EXPECTED_IDS = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
    151646: "<|object_ref_start|>", 151647: "<|object_ref_end|>", 151648: "<|box_start|>",
    151649: "<|box_end|>", 151650: "<|quad_start|>", 151651: "<|quad_end|>",
    151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>",
    151658: "</tool_call>", 151659: "<|fim_prefix|>", 151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>", 151662: "<|fim_pad|>", 151663: "<|repo_name|>",
    151664: "<|file_sep|>",
}
QWEN3_EXTRA_IDS = {151665: "<tool_response>", 151666: "</tool_response>",
                   151667: "<think>", 151668: "</think>"}

# Text a tokenizer must handle: unicode, code, whitespace runs, CJK, emoji, numbers.
FRAGMENTS = [
    "def f(x):\n    return x ** 2\n", "\t\t", "    ", "\n\n\n", " \n ", "\r\n", "1234567890",
    "3.14159", "-42", "中文分词测试", "日本語のテキスト", "한국어", "🙂🚀👩‍👩‍👧", "e\u0301", "Å",
    "x = [1, 2, 3]  # comment", "'s 're 've 'll", "HELLO World", "{\"a\": 1}", "ÿþ", "\u00a0",
    " Ġworld", "naïve café", "<think>", "</tool_response>", "<|im_end|>", "<|im_start|>",
]
corpus_text = st.one_of(
    st.text(max_size=120),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=12).map(
        "".join
    ),
)


@pytest.fixture(scope="module", params=FLAVOURS)
def bundled(request):
    return get_tokenizer(request.param)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_known_ids(flavour):
    tokenizer = get_tokenizer(flavour)
    assert tokenizer.encode("Hello") == [9707]
    assert tokenizer.encode("Hello world") == [9707, 1879]
    assert tokenizer.decode([9707, 1879]) == "Hello world"
    # Qwen splits digits one by one (\p{N}), unlike cl100k's \p{N}{1,3}.
    assert len(tokenizer.encode("12345")) == 5


@pytest.mark.parametrize(
    ("flavour", "expected_ids", "vocab_size"),
    [("qwen2.5", EXPECTED_IDS, 151665), ("qwen3", {**EXPECTED_IDS, **QWEN3_EXTRA_IDS}, 151669)],
)
def test_added_tokens_have_their_real_ids(flavour, expected_ids, vocab_size):
    tokenizer = get_tokenizer(flavour)
    assert tokenizer.vocab_size == vocab_size
    assert tokenizer.special_tokens == {token: i for i, token in expected_ids.items()}
    for token_id, token in expected_ids.items():
        assert tokenizer.encode(token) == [token_id]
        assert tokenizer.decode([token_id]) == token
        assert tokenizer.token_to_id(token) == token_id
        assert tokenizer.id_to_token(token_id) == token


def test_added_token_tables_match_the_expected_ids():
    assert dict(enumerate(QWEN25_ADDED_TOKENS, BPE_VOCAB_SIZE)) == EXPECTED_IDS
    assert dict(enumerate(QWEN3_ADDED_TOKENS, BPE_VOCAB_SIZE)) == {**EXPECTED_IDS,
                                                                   **QWEN3_EXTRA_IDS}


def test_think_and_tool_response_are_plain_text_in_qwen25():
    qwen25, qwen3 = get_tokenizer("qwen2.5"), get_tokenizer("qwen3")
    for tag, tag_id in [("<think>", 151667), ("</tool_response>", 151666)]:
        ids = qwen25.encode(tag)
        assert len(ids) > 1 and max(ids) < BPE_VOCAB_SIZE
        assert qwen25.decode(ids) == tag
        assert qwen25.token_to_id(tag) is None
        assert qwen3.encode(tag) == [tag_id]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        qwen25.decode([151667])


def test_eos_pad_and_stop_ids(bundled):
    assert bundled.eos_token_id == 151645  # <|im_end|>: the instruct models' chat EOS
    assert bundled.pad_token_id == 151643  # <|endoftext|>
    assert bundled.stop_token_ids == (151645, 151643)


def test_names_aliases_and_cache():
    assert get_tokenizer("qwen2") is get_tokenizer("qwen2.5")
    assert get_tokenizer("Qwen3") is get_tokenizer("qwen3")
    assert get_tokenizer("qwen2").name == "qwen2.5"
    assert isinstance(get_tokenizer("qwen3"), BundledQwenTokenizer)


def test_unknown_names_and_directories_without_tokenizer_json_raise(tmp_path):
    with pytest.raises(ValueError, match=r"bundled name .*'qwen3'.* tokenizer\.json"):
        get_tokenizer("Qwen/Qwen3-8B")  # a hub id: never downloaded
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + r".*tokenizer\.json"):
        get_tokenizer(tmp_path)


def test_allow_special_false_encodes_added_tokens_as_text(bundled):
    text = "a<|im_end|>b<tool_call>"
    ids = bundled.encode(text, allow_special=False)
    assert max(ids) < BPE_VOCAB_SIZE
    assert bundled.decode(ids) == text
    assert bundled.encode(text) == [*bundled.encode("a"), 151645, *bundled.encode("b"), 151657]


def test_token_strings_use_byte_level_spelling(bundled):
    assert bundled.id_to_token(1879) == "Ġworld"
    assert bundled.token_to_id("Ġworld") == 1879
    assert bundled.token_to_id("not a token ✗") is None
    assert bundled.id_to_token(-1) is None
    assert bundled.id_to_token(bundled.vocab_size) is None


def test_added_tokens_are_cut_out_before_nfc():
    # NFC would merge `>` + U+0338 into `≯`; Hugging Face splits added tokens first.
    assert get_tokenizer("qwen3").encode("<|im_end|>\u0338")[0] == 151645


@PROPERTY
@given(corpus_text)
def test_round_trip(text):
    for flavour in FLAVOURS:
        tokenizer = get_tokenizer(flavour)
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        special = re.compile("|".join(map(re.escape, sorted(tokenizer.special_tokens,
                                                            key=len, reverse=True))))
        pieces = special.split(text)
        tokens = special.findall(text)
        expected = "".join(nfc(p) + t for p, t in zip(pieces, [*tokens, ""], strict=True))
        assert tokenizer.decode(ids) == expected
        assert tokenizer.decode(tokenizer.encode(text, allow_special=False)) == nfc(text)


@PROPERTY
@given(corpus_text, st.sampled_from(QWEN3_ADDED_TOKENS), corpus_text)
def test_added_tokens_split_the_text(left, token, right):
    tokenizer = get_tokenizer("qwen3")
    joined = tokenizer.encode(left + token + right)
    assert joined == [*tokenizer.encode(left), tokenizer.special_tokens[token],
                      *tokenizer.encode(right)]


# ---------------------------------------------------------------------------
# tokenizer.json parity: a Hugging Face tokenizer built from the same ranks.
# ---------------------------------------------------------------------------


def build_tokenizer_json(added_tokens) -> tokenizers.Tokenizer:
    """Qwen's tokenizer.json layout (NFC, Split + ByteLevel, BPE) from the bundled ranks.

    Merges: every split `left + right` of a token into two tokens, ordered by
    the token's rank (as transformers' TikTokenConverter derives them).
    """
    ranks = qwen_bpe_ranks()
    vocab = {byte_level_string(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        splits = [(ranks[token[:k]], ranks[token[k:]], token[:k], token[k:])
                  for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
        merges += [(rank, byte_level_string(left), byte_level_string(right))
                   for _, _, left, right in sorted(splits)]
    merges.sort(key=lambda merge: merge[0])
    merges = [(left, right) for _, left, right in merges]
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # Qwen marks the first 14 added tokens special, the tags (<tool_call>, …) not.
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=k < 14)
                          for k, token in enumerate(added_tokens)])
    return tokenizer


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """A Qwen3-like checkpoint directory: tokenizer.json + configs (built once)."""
    directory = tmp_path_factory.mktemp("qwen3_checkpoint")
    build_tokenizer_json(QWEN3_ADDED_TOKENS).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [151645, 151643], "pad_token_id": 151643}))
    return directory


@pytest.fixture(scope="session")
def from_json(checkpoint_dir):
    return get_tokenizer(checkpoint_dir)


def test_checkpoint_tokenizer_attributes(from_json, checkpoint_dir):
    assert isinstance(from_json, TokenizerJsonTokenizer)
    assert from_json.name == str(checkpoint_dir)
    assert from_json.vocab_size == 151669
    assert from_json.special_tokens == get_tokenizer("qwen3").special_tokens
    assert from_json.eos_token_id == 151645
    assert from_json.pad_token_id == 151643
    assert from_json.stop_token_ids == (151645, 151643)
    assert from_json.encode("Hello world") == [9707, 1879]
    assert chat_flavour(from_json) == "qwen3"


def test_checkpoint_without_configs_falls_back_to_im_end(checkpoint_dir, tmp_path):
    spec = json.loads((checkpoint_dir / "tokenizer.json").read_text())
    spec["added_tokens"] = spec["added_tokens"][: len(QWEN25_ADDED_TOKENS)]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = get_tokenizer(str(tmp_path))
    assert tokenizer.vocab_size == 151665
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (151645, 151643)
    assert tokenizer.stop_token_ids == (151645,)
    assert tokenizer.encode("<think>") == get_tokenizer("qwen2.5").encode("<think>")
    assert chat_flavour(tokenizer) == "qwen2.5"


@settings(max_examples=200, deadline=None)
@given(corpus_text)
def test_tokenizer_json_parity(from_json, text):
    bundled = get_tokenizer("qwen3")
    ids = bundled.encode(text)
    assert from_json.encode(text) == ids
    assert from_json.encode(text, allow_special=False) == bundled.encode(text,
                                                                         allow_special=False)
    assert from_json.decode(ids) == bundled.decode(ids)


@PROPERTY
@given(st.integers(0, 151668))
def test_token_string_parity(from_json, token_id):
    bundled = get_tokenizer("qwen3")
    token = bundled.id_to_token(token_id)
    assert from_json.id_to_token(token_id) == token
    assert from_json.token_to_id(token) == bundled.token_to_id(token) == token_id


def test_special_token_parity(from_json):
    bundled = get_tokenizer("qwen3")
    text = "".join(f"x{token} " for token in QWEN3_ADDED_TOKENS)
    assert from_json.encode(text) == bundled.encode(text)
    for token, token_id in bundled.special_tokens.items():
        assert from_json.encode(token) == [token_id]
        assert from_json.decode([token_id]) == token
    with pytest.raises(ValueError, match="outside the vocabulary"):
        from_json.decode([151669])
