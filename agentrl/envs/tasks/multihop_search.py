"""`multihop_search`: 1-3-hop questions over a generated corpus, answered through BM25 search.

The world: people born in cities, cities in countries, countries with
capitals, all with made-up names from a small syllable set (so a tiny model's
vocabulary stays small). Each fact is one document. Questions:

* 1 hop: "In which city was Kalo Venu born?" → the city;
* 2 hops: "In which country was Kalo Venu born?" → city, then its country;
* 3 hops: "What is the capital of the country where Kalo Venu was born?".

The policy calls `search(query)` (BM25 over the corpus, `agentrl.envs.search`)
and ends with `<answer>…</answer>` (MT-GRPO / MT-PPO / PRS), or calls
`response_gen` (PORTool). Reward: exact match (SPEC §7).
"""

import dataclasses
import functools

import numpy as np

from agentrl.envs.search import BM25Index, search_tool
from agentrl.envs.tasks.base import (
    TaskInstance,
    final_assistant_text,
    register_task,
    split_seed,
)
from agentrl.envs.tools import ToolRegistry, response_gen_tool
from agentrl.rewards.answers import exact_match
from agentrl.rewards.parsing import extract_tag
from agentrl.rollout.agent_loop import PromptSpec

SYLLABLES = ("ka", "lo", "ve", "nu", "ri", "ta", "mo", "se", "di", "pa", "zu", "ne")
SYSTEM = ("Answer the question using the search tool. Search for one fact at a time. "
          "Give the final answer as <answer>...</answer>.")


def _name(rng: np.random.Generator, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES, size=syllables)).capitalize()


@dataclasses.dataclass(frozen=True)
class World:
    """The generated facts and their documents."""

    born_in: dict[str, str]
    country_of: dict[str, str]
    capital_of: dict[str, str]

    def documents(self) -> list[dict]:
        docs = []
        for person, city in sorted(self.born_in.items()):
            docs.append({"id": f"born-{person}", "title": person,
                         "text": f"{person} was born in the city of {city}."})
        for city, country in sorted(self.country_of.items()):
            docs.append({"id": f"city-{city}", "title": city,
                         "text": f"{city} is a city in the country of {country}."})
        for country, capital in sorted(self.capital_of.items()):
            docs.append({"id": f"capital-{country}", "title": country,
                         "text": f"The capital of {country} is {capital}."})
        return docs


def make_world(seed: int, people: int = 40, cities: int = 12, countries: int = 4) -> World:
    """A deterministic world: unique names, every city in one country."""
    rng = np.random.default_rng(seed)
    names: set[str] = set()

    def unique(syllables: int) -> str:
        while True:
            name = _name(rng, syllables)
            if name not in names:
                names.add(name)
                return name

    country_names = [unique(2) for _ in range(countries)]
    city_names = [unique(2) for _ in range(cities)]
    people_names = [f"{unique(2)} {unique(2)}" for _ in range(people)]
    country_of = {city: country_names[i % countries] for i, city in enumerate(city_names)}
    capital_of = {}
    for country in country_names:
        own = [c for c in city_names if country_of[c] == country]
        capital_of[country] = own[0]
    born_in = {p: city_names[int(rng.integers(0, cities))] for p in people_names}
    return World(born_in, country_of, capital_of)


QUESTIONS = {
    1: "In which city was {person} born?",
    2: "In which country was {person} born?",
    3: "What is the capital of the country where {person} was born?",
}


def hop_chain(world: World, person: str, hops: int) -> tuple[list[tuple[str, str]], str]:
    """`([(query, document text), ...], answer)` of the reference search chain."""
    city = world.born_in[person]
    chain = [(f"{person} born", f"{person} was born in the city of {city}.")]
    answer = city
    if hops >= 2:
        country = world.country_of[city]
        chain.append((f"{city} country", f"{city} is a city in the country of {country}."))
        answer = country
    if hops >= 3:
        capital = world.capital_of[country]
        chain.append((f"capital of {country}", f"The capital of {country} is {capital}."))
        answer = capital
    return chain, answer


@register_task("multihop_search")
class MultihopSearchTask:
    """Multi-hop questions over a generated corpus, with BM25 search."""

    name = "multihop_search"

    def __init__(self, world_seed: int = 0, max_hops: int = 3, top_k: int = 2,
                 final_tool: bool = False):
        if not 1 <= max_hops <= 3:
            raise ValueError(f"max_hops={max_hops} must be 1, 2 or 3.")
        self.world = make_world(world_seed)
        self.max_hops = max_hops
        self.top_k = top_k
        self.final_tool = final_tool

    @functools.cached_property
    def index(self) -> BM25Index:
        return BM25Index.build(self.world.documents())

    def registry(self) -> ToolRegistry:
        tools = [search_tool(self.index, k=self.top_k)]
        if self.final_tool:
            tools.append(response_gen_tool())
        return ToolRegistry(tools)

    def instances(self, count: int, *, seed: int, split: str = "train") -> list[TaskInstance]:
        rng = np.random.default_rng(split_seed(seed, split))
        registry = self.registry()
        tools = tuple(registry.schemas())
        people = sorted(self.world.born_in)
        out = []
        for index in range(count):
            person = people[int(rng.integers(0, len(people)))]
            hops = int(rng.integers(1, self.max_hops + 1))
            question = QUESTIONS[hops].format(person=person)
            chain, answer = hop_chain(self.world, person, hops)
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question}]
            prompt = PromptSpec(f"multihop-{split}-{seed}-{index}", tuple(messages), tools,
                                {"golds": [answer], "hops": hops})
            demonstration = list(messages)
            for query, _ in chain:
                call = {"name": "search", "arguments": {"query": query}}
                result = registry.call("search", {"query": query}).content
                demonstration += [{"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "name": "search", "content": result}]
            if self.final_tool:
                call = {"name": "response_gen", "arguments": {"response": answer}}
                demonstration.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                demonstration.append({"role": "assistant", "content": f"<answer>{answer}</answer>"})
            out.append(TaskInstance(prompt, (answer,), tuple(demonstration),
                                    metadata={"hops": hops, "person": person}))
        return out

    def reward(self, instance: TaskInstance, final_text: str) -> float:
        answer = extract_tag(final_text or "", "answer")
        if answer is None:
            answer = final_text if self.final_tool else None
        return exact_match(answer, list(instance.golds)) if answer is not None else 0.0

    def reward_from_messages(self, instance: TaskInstance, messages) -> float:
        return self.reward(instance, final_assistant_text(messages))
