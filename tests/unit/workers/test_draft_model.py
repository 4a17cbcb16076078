"""The draft-model drafter (issue 23, TOLLWAY_SPECULATIVE=draft) on tiny random-weight models: greedy
tokens identical with a draft model on and off in every scheduling regime, with the model as its
own draft (nearly every draft accepted) and with a different one (most rolled back); the drafter's
per-sequence cache proposing what a fresh one would and going away with its sequence; a draft model
that is missing or does not share the tokenizer refused with a clear error."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import click
import pytest
import torch
from safetensors.torch import load_file, save_file

from ops.offline import build_engine, engine_config
from workers.engine.config import EngineConfig
from workers.engine.draft_model import DraftModelError, DraftTarget, ModelDrafter
from workers.engine.drafter import make_drafter
from workers.engine.engine import Engine
from workers.engine.request import Sequence, Status
from workers.models.loader import LoadedModel
from workers.models.tiny import write_tiny_model_folder
from workers.settings import WorkerSettings
from workers.wire.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
NOISE = 0.3  # of the head's spread: about a quarter of the drafted tokens accepted
REGIMES = {
    "batched": EngineConfig(num_blocks=200),
    "chunked": EngineConfig(num_blocks=200, max_batch_tokens=16),  # chunked prefill beside drafted decodes
    "preempting": EngineConfig(num_blocks=14, block_size=8),  # 14 blocks cannot hold all four
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 40, (40,), generator=gen).tolist()
    return [system + torch.randint(3, 40, (n,), generator=gen).tolist() for n in (5, 17, 1, 30)]


@pytest.fixture(scope="module")
def other_draft(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` with noise on its output head: a draft often right, often not."""
    folder = tmp_path_factory.mktemp("draft") / "other"
    shutil.copytree(tiny.folder, folder)
    weights = load_file(str(folder / "model.safetensors"))
    head = weights["lm_head.weight"]
    noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(5))
    weights["lm_head.weight"] = head + NOISE * head.std() * noise
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def target_of(loaded: LoadedModel) -> DraftTarget:
    m = loaded.model
    return DraftTarget(m.config.vocab_size, m.dtype, m.device, loaded.folder / "tokenizer.json")


def assert_no_leaks(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable()
    assert not engine.sequences and not engine.has_work()


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("draft", ["self", "other"])
def test_greedy_tokens_identical_with_a_draft_model(tiny, prompts, other_draft, regime: str, draft: str) -> None:
    config = REGIMES[regime]
    expected = [s.output_ids for s in Engine(tiny, config).generate_batch(prompts, GREEDY)]
    folder = tiny.folder if draft == "self" else other_draft
    spec = Engine(tiny, EngineConfig(**{**vars(config), "speculative": "draft", "draft_model": str(folder),
                                        "speculative_timed": False}))
    assert isinstance(spec.drafter, ModelDrafter)
    for _ in range(2):  # the second round starts from prefix-cache hits
        assert [s.output_ids for s in spec.generate_batch(prompts, GREEDY)] == expected
        assert_no_leaks(spec)
    stats = spec.spec_stats
    assert stats.drafted_tokens > 0
    if draft == "self":  # fp32, the same weights: the draft's greedy is the target's (measured: all accepted)
        assert stats.accepted_tokens / stats.drafted_tokens > 0.9
    else:  # roll-backs, and drafts after them from the cropped cache (measured: 22-24% accepted)
        assert 0.1 < stats.accepted_tokens / stats.drafted_tokens < 0.5
    if regime == "preempting":
        assert spec.scheduler.preemptions > 0
    gc.collect()
    assert not spec.drafter.states  # every sequence's draft cache went with it


def test_a_cached_proposal_is_a_fresh_one(tiny, other_draft, prompts) -> None:
    drafter = make_drafter("draft", draft_model=other_draft, target=target_of(tiny))
    assert isinstance(drafter, ModelDrafter)
    seq = Sequence("x", prompts[0], GREEDY)
    tokens = list(prompts[0])
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        draft = drafter.propose(tokens, 4, seq)
        assert draft == drafter.propose(tokens, 4)  # without a key: a fresh cache for this call
        state = drafter.states[seq]
        assert state.cache.get_seq_length() == len(state.consumed) == len(tokens) + 3
        # accept a prefix of the draft, then a correction (sometimes nothing: a rejected first token)
        accepted = step % 5
        tokens += draft[:accepted] + torch.randint(3, 40, (1,), generator=gen).tolist()
    assert drafter.propose(tokens[:30], 2, seq) == drafter.propose(tokens[:30], 2)  # a shorter history (preempted)
    assert drafter.propose(tokens, 0, seq) == []
    seq.status = Status.FINISHED
    drafter.propose(tokens, 2, Sequence("y", tokens, GREEDY))
    assert seq not in drafter.states  # a finished sequence's cache goes when the next sequence's state is made


def test_draft_model_refused_without_the_models_tokenizer(tiny, tmp_path: Path) -> None:
    bigger = write_tiny_model_folder(tmp_path / "bigger", "llama", vocab_size=200)
    with pytest.raises(DraftModelError, match=r"vocabulary of 200 tokens.*share the model's tokenizer"):
        Engine(tiny, EngineConfig(speculative="draft", draft_model=str(bigger)))
    with pytest.raises(click.ClickException, match=r"TOLLWAY_DRAFT_MODEL: .*share the model's tokenizer"):
        build_engine(tiny, EngineConfig(speculative="draft", draft_model=str(bigger)), "tiny")
    renamed = write_tiny_model_folder(tmp_path / "renamed", "llama")
    tokenizer = renamed / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"w7"', '"w7x"'))
    with pytest.raises(DraftModelError, match="different tokenizer"):
        make_drafter("draft", draft_model=renamed, target=target_of(tiny))


def test_settings_resolve_the_draft_model_or_refuse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOLLWAY_SPECULATIVE", "draft")
    with pytest.raises(click.ClickException, match="needs TOLLWAY_DRAFT_MODEL"):
        engine_config(WorkerSettings())
    monkeypatch.setenv("TOLLWAY_DRAFT_MODEL", "no-such-model")
    with pytest.raises(click.ClickException, match="TOLLWAY_DRAFT_MODEL: unknown model 'no-such-model'"):
        engine_config(WorkerSettings())
    monkeypatch.setenv("TOLLWAY_DRAFT_MODEL", str(tmp_path))
    with pytest.raises(click.ClickException, match=r"TOLLWAY_DRAFT_MODEL: .* is not a model folder"):
        engine_config(WorkerSettings())
    folder = write_tiny_model_folder(tmp_path / "home" / "models" / "tiny-draft", "llama")
    monkeypatch.setenv("TOLLWAY_DRAFT_MODEL", "tiny-draft")  # a name, resolved as TOLLWAY_MODEL is
    config = engine_config(WorkerSettings())
    assert config.speculative == "draft" and config.draft_model == str(folder)
    monkeypatch.setenv("TOLLWAY_SPECULATIVE", "ngram")
    assert engine_config(WorkerSettings()).draft_model is None  # only `draft` loads it


def test_seeded_sampled_requests_reproduce_with_a_draft_model(tiny, prompts, other_draft) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    config = EngineConfig(num_blocks=200, speculative="draft", draft_model=str(other_draft))
    runs = [[s.output_ids for s in Engine(tiny, config).generate_batch(prompts, params)] for _ in range(2)]
    assert runs[0] == runs[1]
    engine = Engine(tiny, config)
    engine.generate_batch(prompts, params)
    assert engine.spec_stats.accepted_tokens > 0  # drafts were verified by rejection sampling
