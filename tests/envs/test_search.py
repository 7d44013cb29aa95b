"""BM25 index over a generated corpus: ranking, ties, save/load, the search tool's text."""

import random

import numpy as np
import pytest

from agentrl.envs.search import BM25Index, Hit, format_hits, search_tool
from agentrl.envs.tools import ToolRegistry

CITIES = ["Paris", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin",
          "Athens", "Oslo", "Helsinki", "Budapest"]
COUNTRIES = ["France", "Germany", "Spain", "Portugal", "Austria", "Czechia", "Poland", "Ireland",
             "Greece", "Norway", "Finland", "Hungary"]
FILLER = ["river", "museum", "bridge", "market", "railway", "harbour", "festival", "university",
          "cathedral", "garden", "tower", "library"]


def make_corpus(seed=0, n_distractors=200):
    """One entity page per city, plus distractor pages that mention cities in passing."""
    rng = random.Random(seed)
    documents = [
        {"id": f"city-{i}", "title": city,
         "text": f"{city} is the capital of {country}. The {rng.choice(FILLER)} of {city} is "
                 f"famous and {city} hosts a {rng.choice(FILLER)}."}
        for i, (city, country) in enumerate(zip(CITIES, COUNTRIES, strict=True))
    ]
    for j in range(n_distractors):
        words = [*rng.choices(FILLER, k=12), rng.choice(CITIES)]
        rng.shuffle(words)
        documents.append({"id": f"doc-{j}", "title": f"Notes {j}", "text": " ".join(words)})
    return documents


@pytest.fixture(scope="module")
def index():
    return BM25Index.build(make_corpus())


@pytest.mark.parametrize("position", range(len(CITIES)))
def test_entity_query_ranks_its_page_first(index, position):
    city, country = CITIES[position], COUNTRIES[position]
    hits = index.search(f"what is the capital of {country}?", k=3)
    assert hits[0].id == f"city-{position}"
    assert hits[0].title == city
    assert hits[0].score > hits[1].score > 0
    assert index.search(f"{city} capital", k=1)[0].id == f"city-{position}"


def test_hits_are_sorted_and_limited(index):
    hits = index.search("river museum bridge", k=5)
    assert len(hits) == 5
    scores = [hit.score for hit in hits]
    assert scores == sorted(scores, reverse=True)
    assert isinstance(hits[0], Hit) and isinstance(hits[0].score, float)


def test_queries_without_indexed_words_return_nothing(index):
    assert index.search("the of and", k=3) == []  # stop words only
    assert index.search("xylophone", k=3) == []
    assert index.search("", k=3) == []


def test_equal_scores_keep_corpus_order():
    documents = [{"id": str(i), "title": "", "text": "apple pie"} for i in range(5)]
    hits = BM25Index.build(documents).search("apple", k=5)
    assert [hit.id for hit in hits] == ["0", "1", "2", "3", "4"]
    assert len({hit.score for hit in hits}) == 1


def test_title_is_indexed():
    index = BM25Index.build([{"id": "a", "title": "Zanzibar", "text": "An island."},
                             {"id": "b", "title": "Elsewhere", "text": "Another island."}])
    assert [hit.id for hit in index.search("zanzibar")] == ["a"]


def test_save_load_round_trip(tmp_path, index):
    index.save(tmp_path / "bm25")
    loaded = BM25Index.load(tmp_path / "bm25")
    assert len(loaded) == len(index)
    for query in ["capital of Norway", "museum river", "Dublin festival"]:
        assert loaded.search(query, k=4) == index.search(query, k=4)
        np.testing.assert_array_equal(loaded.scores(query), index.scores(query))
    mapped = BM25Index.load(tmp_path / "bm25", mmap=True)
    assert mapped.search("capital of Norway", k=1)[0].id == "city-9"


def test_load_errors_say_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no agentrl BM25 index"):
        BM25Index.load(tmp_path)


def test_build_validates_documents():
    with pytest.raises(ValueError, match="documents is empty"):
        BM25Index.build([])
    with pytest.raises(ValueError, match="repeats the id 'x'"):
        BM25Index.build([{"id": "x", "text": "a b"}, {"id": "x", "text": "c d"}])
    with pytest.raises(ValueError, match="must be a dict with a str 'text'"):
        BM25Index.build([{"id": "x", "title": "no text"}])


def test_format_hits_is_search_r1s():
    hits = [Hit("1", "Paris", "Paris is the capital of France.", 2.0),
            Hit("2", "Lyon", "Lyon is in France.", 1.0)]
    assert format_hits(hits) == ("Doc 1(Title: Paris) Paris is the capital of France.\n"
                                 "Doc 2(Title: Lyon) Lyon is in France.\n")


def test_search_tool_through_the_registry(index):
    registry = ToolRegistry([search_tool(index, k=2)])
    schema = registry.schemas()[0]["function"]
    assert schema["name"] == "search" and schema["parameters"]["required"] == ["query"]
    result = registry.call("search", {"query": "capital of Spain"})
    assert result.ok
    lines = result.content.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("Doc 1(Title: Madrid) Madrid is the capital of Spain.")
    assert lines[1].startswith("Doc 2(Title: ")
    assert registry.call("search", {"query": "xylophone"}).content == "No results found."
    assert "missing required argument 'query'" in registry.call("search", {}).error
