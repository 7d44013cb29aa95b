"""BM25 search over a local corpus, and the search tool of Search-R1-style agents.

`BM25Index` wraps `bm25s` (Lucene BM25, numpy backend, sparse scores):
documents are `{"id", "title", "text"}`; the title and the text are indexed
together. Tokenisation is bm25s's own: lower-cased `\\w\\w+` words, English
stop words removed (bm25s ships the list), no stemmer. Nothing is downloaded.
Ranking is deterministic: score descending, then corpus order.

`search_tool(index)` is a `Tool` whose output is formatted like Search-R1's
retriever, the text an agent loop puts inside `<information>…</information>`:

    Doc 1(Title: Paris) Paris is the capital of France.
    Doc 2(Title: Lyon) Lyon is a city in France.
"""

import dataclasses
import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import bm25s
import numpy as np

from agentrl.envs.tools import Tool

__all__ = ["BM25Index", "Hit", "format_hits", "search_tool"]

_DOCUMENTS_FILE = "documents.jsonl"
_META_FILE = "agentrl_index.json"
_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Hit:
    """One retrieved document and its BM25 score."""

    id: str
    title: str
    text: str
    score: float


def _check_documents(documents: Sequence[Mapping[str, Any]]) -> list[dict]:
    checked, seen = [], set()
    for index, document in enumerate(documents):
        if not isinstance(document, Mapping) or not isinstance(document.get("text"), str):
            raise ValueError(f"document {index} must be a dict with a str 'text' (and 'id', "
                             f"'title'), got {str(document)[:120]!r}")
        doc_id = str(document.get("id", index))
        if doc_id in seen:
            raise ValueError(f"document {index} repeats the id {doc_id!r}; ids must be unique")
        seen.add(doc_id)
        checked.append({"id": doc_id, "title": str(document.get("title") or ""),
                        "text": document["text"]})
    if not checked:
        raise ValueError("documents is empty; pass at least one {'id', 'title', 'text'} dict")
    return checked


class BM25Index:
    """A BM25 index of documents with deterministic top-k search.

    Build with `BM25Index.build(documents)`, reload with `BM25Index.load(dir)`.

    Args (of `build`):
      documents: `{"id", "title", "text"}` dicts (ids unique; a missing id is
        the position, a missing title is "").
      k1, b: BM25 parameters (Lucene variant).
      stopwords: `"en"` (bm25s's English list) or None.
    """

    def __init__(self, retriever: "bm25s.BM25", documents: list[dict], *, stopwords: str | None):
        self._retriever = retriever
        self.documents = documents
        self.stopwords = stopwords

    @classmethod
    def build(cls, documents: Sequence[Mapping[str, Any]], *, k1: float = 1.5, b: float = 0.75,
              stopwords: str | None = "en") -> "BM25Index":
        if stopwords not in ("en", None):
            raise ValueError(f"stopwords={stopwords!r} must be 'en' or None")
        documents = _check_documents(documents)
        retriever = bm25s.BM25(k1=k1, b=b, method="lucene", backend="numpy")
        tokens = cls._tokenize([f"{d['title']}\n{d['text']}" for d in documents], stopwords)
        retriever.index(tokens, show_progress=False)
        return cls(retriever, documents, stopwords=stopwords)

    @staticmethod
    def _tokenize(texts: Iterable[str], stopwords: str | None) -> list[list[str]]:
        return bm25s.tokenize(list(texts), stopwords=stopwords or [], stemmer=None,
                              return_ids=False, show_progress=False)

    def __len__(self) -> int:
        return len(self.documents)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for `query` (`[num_documents]`, float32)."""
        token_ids = self._retriever.get_tokens_ids(self._tokenize([query], self.stopwords)[0])
        if not token_ids:
            return np.zeros(len(self.documents), np.float32)
        return np.asarray(self._retriever.get_scores_from_ids(token_ids))

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The `k` best documents with a positive score, best first (ties: corpus order).

        A query with no indexed word returns `[]`.
        """
        if not isinstance(query, str):
            raise ValueError(f"query must be a str, got {type(query).__name__}")
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        scores = self.scores(query)
        positive = np.flatnonzero(scores > 0)
        # Stable sort on -score keeps corpus order among equal scores.
        order = positive[np.argsort(-scores[positive], kind="stable")][:k]
        return [Hit(self.documents[i]["id"], self.documents[i]["title"],
                    self.documents[i]["text"], float(scores[i])) for i in order]

    def save(self, directory: str | os.PathLike) -> None:
        """Write the index (bm25s's arrays) and the documents to `directory`."""
        path = pathlib.Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._retriever.save(str(path), show_progress=False)
        with open(path / _DOCUMENTS_FILE, "w", encoding="utf-8") as out:
            for document in self.documents:
                out.write(json.dumps(document, ensure_ascii=False) + "\n")
        meta = {"format_version": _FORMAT_VERSION, "stopwords": self.stopwords,
                "num_documents": len(self.documents), "bm25s_version": bm25s.__version__}
        (path / _META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")

    @classmethod
    def load(cls, directory: str | os.PathLike, *, mmap: bool = False) -> "BM25Index":
        """Read an index written by `save` (`mmap=True` maps the score arrays)."""
        path = pathlib.Path(directory)
        if not (path / _META_FILE).is_file():
            raise FileNotFoundError(f"{path} holds no agentrl BM25 index ({_META_FILE} is "
                                    "missing); build one with BM25Index.build(...).save(dir)")
        meta = json.loads((path / _META_FILE).read_text(encoding="utf-8"))
        if meta.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"{path}: index format_version {meta.get('format_version')!r} is "
                             f"not {_FORMAT_VERSION}; rebuild the index")
        retriever = bm25s.BM25.load(str(path), mmap=mmap, show_progress=False, load_corpus=False)
        with open(path / _DOCUMENTS_FILE, encoding="utf-8") as lines:
            documents = [json.loads(line) for line in lines if line.strip()]
        if len(documents) != meta["num_documents"]:
            raise ValueError(f"{path}: {len(documents)} documents for an index of "
                             f"{meta['num_documents']}; the directory is incomplete")
        return cls(retriever, documents, stopwords=meta["stopwords"])


def format_hits(hits: Sequence[Hit]) -> str:
    """Search-R1's retrieval text: `Doc i(Title: <title>) <text>` per line."""
    return "".join(f"Doc {i + 1}(Title: {hit.title}) {hit.text}\n" for i, hit in enumerate(hits))


def search_tool(index: BM25Index, *, k: int = 3, name: str = "search",
                no_results: str = "No results found.") -> Tool:
    """A `Tool` searching `index`: argument `query` (string); output `format_hits`."""
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")

    def search(query: str) -> str:
        hits = index.search(query, k=k)
        return format_hits(hits) if hits else no_results

    return Tool(
        name, f"Search the knowledge corpus and return the top {k} passages for a query.",
        {"type": "object",
         "properties": {"query": {"type": "string", "description": "The search query."}},
         "required": ["query"], "additionalProperties": False},
        search,
    )
