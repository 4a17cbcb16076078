"""The text workload of the whole-stack bench (`stack_gsp.py`) and its results table.

Prompts are chat conversations whose text is random words from a fixed vocabulary (seeded), so a
chat template and a real tokenizer see text, not random token ids: G groups x P prompts, each
group's system prompt ~S tokens (every prompt's unique in the no-sharing workload), each user
question ~Q tokens. Every system gets the same conversations; in-process systems get the token ids
the gateway would compute (`TextTokenizer.encode_chat`, the gateway's own tokenizer code).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.request import Sequence
from workers.models.loader import LoadedModel
from workers.wire.sampling import SamplingParams
from workers.wire.tokenizer import TextTokenizer

_WORDS = """
account action address agent answer archive area article balance bank basket battery billing board
book border branch bridge budget buffer cable calendar camera capital card carrier catalog channel
chapter check city client cloud cluster code column company contract cost country course credit
customer data date deadline delivery desk device dinner discount document domain door draft driver
engine entry error event factory feature field file filter finance flight folder forecast format
garden gateway goal group guide harbor health history holiday hotel invoice issue item journal key
kitchen label language layer ledger letter library limit line list market meeting memory message
method metric model module month network note number office order owner package page partner
payment period picture plan platform policy price printer process product profile project queue
quota rate record region report request resource result river route rule salary sample schedule
screen season section server service session setting signal station status storage store street
student summary supplier support system table target task team tenant ticket token topic total
trace train travel update user value vendor version village volume warehouse weather window worker
please always never carefully briefly politely quickly clearly only every each the a an of to in
for with on by from about into over under after before between during without within and or but
"""
VOCABULARY = _WORDS.split()


def words_to_tokens(rng: random.Random, num_tokens: int, count: Callable[[str], int]) -> str:
    """Random vocabulary words, in sentences, until the text is at least `num_tokens` tokens."""
    words: list[str] = []
    text = ""
    while count(text) < num_tokens:
        word = rng.choice(VOCABULARY)
        words.append(word.capitalize() if not words or words[-1].endswith(".") else word)
        if len(words) % 12 == 0:
            words[-1] += "."
        text = " ".join(words)
    return text


Messages = list[dict[str, str]]


def chat_workload(tokenizer: TextTokenizer, shared: bool, groups: int, per_group: int, system: int,
                  question: int, seed: int) -> list[Messages]:
    """`groups * per_group` conversations, group by group: a system prompt of ~`system` tokens
    (shared by the group's prompts when `shared`) and a user question of ~`question` tokens."""
    rng = random.Random(seed)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    conversations = []
    for _ in range(groups):
        group_system = words_to_tokens(rng, system, count)
        for _ in range(per_group):
            system_text = group_system if shared else words_to_tokens(rng, system, count)
            conversations.append([{"role": "system", "content": system_text},
                                  {"role": "user", "content": words_to_tokens(rng, question, count) + "?"}])
    return conversations


@dataclass
class Run:
    """One system's pass over one workload. `wall_s` runs from the first request sent to the last
    token received; output tokens are those actually produced (usage, else counted)."""

    name: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float]
    note: str = ""
    cpu_s: float = float("nan")  # CPU time of the serving processes during the run (see stack_gsp)

    @property
    def output_rate(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def ttft(self, q: float) -> float:
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def row(self) -> str:
        p50 = statistics.median(self.ttft_s) if self.ttft_s else float("nan")
        return (f"{self.name:36} {self.output_rate:9.1f} {p50:8.2f} {self.ttft(0.9):8.2f} {self.wall_s:8.2f}"
                f" {self.cpu_s:7.1f} {self.output_tokens:7d} {self.prompt_tokens:8d}  {self.note}")


HEADER = (f"{'system':36} {'out tok/s':>9} {'TTFT p50':>8} {'TTFT p90':>8} {'wall s':>8} {'CPU s':>7} {'out tok':>7}"
          f" {'prompt t':>8}  (seconds)")


def run_engine_in_flight(loaded: LoadedModel, prompts: list[list[int]], output: int, in_flight: int,
                         kv_budget_bytes: int, name: str = "") -> Run:
    """tollway's engine in-process (engine_gsp's Engine path), fed as the HTTP clients feed a server:
    at most `in_flight` requests at a time, the next one added as soon as one finishes."""
    engine = Engine(loaded, EngineConfig(max_batch_tokens=1024, kv_budget_bytes=kv_budget_bytes))
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    queue = list(enumerate(prompts))
    queue.reverse()
    active: list[Sequence] = []
    done: list[Sequence] = []
    start = time.perf_counter()
    while queue or active:
        while queue and len(active) < in_flight:
            i, prompt = queue.pop()
            active.append(engine.add_request(f"r{i}", prompt, params))
        engine.step()
        done.extend(s for s in active if s.finished)
        active = [s for s in active if not s.finished]
    seconds = time.perf_counter() - start
    while engine.has_work():  # finished sequences hand their blocks back on the next step
        engine.step()
    engine.check_integrity()
    ttfts = [s.first_token_time - s.arrival_time for s in done if s.first_token_time is not None]
    hit = sum(s.prompt_cached_len for s in done) / max(1, sum(s.prompt_len for s in done))
    return Run(name, seconds, sum(s.prompt_len for s in done), sum(s.output_len for s in done), ttfts,
               f"prefix hit {hit:.1%}")
