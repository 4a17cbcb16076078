"""The engine: one step = schedule, run the model, update request state, sample, detect stops,
report deltas.

Ownership: the scheduler (scheduler.py) owns the sequences' state and, through the KV cache facade
(cache.manager.KVCacheManager), their blocks; the engine owns what a request needs beyond that:
each choice's generator, detokenizer and spans, the stop checks, the deltas and the usage.
Single-threaded: `AsyncEngine` (workers/engine/async_engine.py) drives it from one thread.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from opentelemetry.trace import Tracer

from cache.block_pool import BlockPool
from cache.kv_storage import KVStorage
from cache.manager import KVCacheManager
from kernels.dispatch import AttentionChoice, select_backend
from workers.engine import grammar
from workers.engine.admission import Policy
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.detokenize import OutputText
from workers.engine.grammar import GrammarCompiler, GrammarMasks
from workers.engine.phase_spans import PhaseSpans, TraceParent
from workers.engine.request import FinishReason, Priority, Sequence, Status
from workers.engine.runner import ModelRunner
from workers.engine.sampler import SampleResult, sample
from workers.engine.scheduler import Scheduler, StepUpdate
from workers.models.loader import LoadedModel
from workers.models.packed_linear import pack_linears
from workers.wire.sampling import SamplingParams


@dataclass
class Delta:
    """What one step produced for one choice of a request. A choice's last delta carries its
    finish_reason; the request's very last delta (all n choices finished) also carries usage."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    index: int = 0


@dataclass
class _Request:
    """Per-request bookkeeping across its n choices."""

    parent: Sequence
    open_choices: int  # not yet finished, counting choices not yet forked
    completion_tokens: int = 0


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 8  # 16 left up to 12% of allocated slots empty at peak when decodes cross blocks together
    num_blocks: int | None = None  # None: sized from kv_budget_bytes
    kv_budget_bytes: int = 2 * 2**30
    max_batch_tokens: int = 1024
    max_running: int = 64
    max_wait_s: float = 30.0
    max_context: int | None = None  # None: the model's max_position_embeddings (capped at 8192)
    attention: AttentionChoice = "auto"  # the attention backend (kernels/dispatch.py); auto: by device
    cuda_graphs: bool = False  # decode steps replayed as CUDA graphs by batch bucket (CUDA only; not yet measured)
    scheduling: Policy = "fair"  # admission and preemption order (workers/engine/admission.py)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, name: str | None = None,
                 tracer: Tracer | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        self.name = name or loaded.folder.name
        model = loaded.model
        c = model.config
        num_blocks = config.num_blocks or max(
            1, config.kv_budget_bytes // KVStorage.bytes_per_block(
                c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, model.dtype))
        self.cache = KVCacheManager(num_blocks, config.block_size)
        backend = select_backend(model.device, config.attention)
        if backend == "native":  # the native decode step's matmuls run on prepacked weights
            pack_linears(model)
        graphs = config.cuda_graphs and model.device.type == "cuda"
        # With CUDA graphs the storage holds one block more than the pool hands out: the padding rows'.
        kv = model.allocate_kv(num_blocks + graphs, config.block_size)
        self.runner = ModelRunner(model, kv, backend,
                                  DecodeGraphs(model, kv, num_blocks, backend) if graphs else None)
        self.scheduler = Scheduler(self.cache, config.max_batch_tokens, config.max_running, config.max_wait_s,
                                   config.scheduling)
        self.max_context = config.max_context or min(c.max_position_embeddings, 8192)
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.grammars = GrammarCompiler(loaded.folder, c.vocab_size, loaded.eos_token_ids)
        self.masks = GrammarMasks(c.vocab_size)
        self.sequences: dict[str, Sequence] = {}  # request id -> its first choice, while running
        self.finished_counts: dict[str, int] = {}  # by finish reason of each choice, since start
        self._requests: dict[str, _Request] = {}
        self._texts: dict[tuple[str, int], OutputText] = {}
        # Spans of traced requests' phases; None when tracing is off (then the step loop does no tracing work).
        self._phases = PhaseSpans(tracer) if tracer is not None else None

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_ids: Seq[int], params: SamplingParams, namespace: str = "default",
        priority: Priority = Priority.INTERACTIVE, trace: TraceParent | None = None, weight: float = 1.0,
    ) -> Sequence:
        """Queue a request; ValueError (the caller's 4xx) for an unusable one. With `trace`, its
        phases become spans under `trace.context` (when the engine has a tracer)."""
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already running")
        self.validate_request(prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), params, namespace, priority, pending_forks=params.n - 1,
                       weight=weight)
        seq.generator = self._generator(params, 0)
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar)
        self.sequences[request_id] = seq
        self._requests[request_id] = _Request(seq, params.n)
        self._texts[(request_id, 0)] = OutputText(self.loaded.tokenizer, params.stop)
        self.scheduler.add(seq)
        if trace is not None and self._phases is not None:
            self._phases.add(seq, trace)
        return seq

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
        seed = params.seed + index if params.seed is not None else random.getrandbits(63)
        return torch.Generator(device=self.loaded.model.device).manual_seed(seed)

    def validate_request(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """ValueError for a request this engine cannot serve (reads only immutable state: thread-safe)."""
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        vocab = self.loaded.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_context}")
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # GrammarError (a ValueError) when refused; cached

    def abort(self, request_id: str) -> Delta | None:
        """Abort every open choice; returns the request's last delta (with usage), or None if gone."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        last = None
        for seq in self.scheduler.sequences_of(request_id):
            self.scheduler.finish(seq, FinishReason.ABORT)
            last = self._final_delta(seq, Delta(request_id, index=seq.index))
        return last

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        """schedule → run the model → update (the scheduler's: computed lengths, prefix commits, forks
        of n > 1 choices) → sample → deltas. The update comes before sampling because a forked
        choice draws its first token from its parent's logits in the same draw."""
        phases = self._phases
        if phases is not None:
            start_ns, preemptions = time.time_ns(), self.scheduler.preemptions
        batch = self.scheduler.schedule()
        if phases is not None and self.scheduler.preemptions != preemptions:
            phases.preempted(start_ns)
        deltas = [self._final_delta(s, Delta(s.request_id, index=s.index)) for s in self.scheduler.take_finished()]
        if not batch.seqs:
            return deltas
        masks = self.masks.start(batch.sampling)  # grammar masks fill while the model runs
        logits = self.runner.run(batch)
        update = self.scheduler.update(batch)
        if phases is not None:
            phases.step(batch.seqs, batch.num_new, start_ns, time.time_ns())
        if not update.sampling:
            return deltas
        if masks is not None and update.forks:
            masks.result()  # forking reads the parents' matchers: not while the helper fills from them
        sampling, logits = self._start_forks(update, logits)
        constrain = None
        if masks is not None or any(fork.child.matcher is not None for fork in update.forks):
            def constrain(work: torch.Tensor) -> None:
                self.masks.constrain(work, sampling, masks, len(update.sampling))
        result = sample(logits, sampling, constrain)
        now = time.monotonic()
        for row, seq in enumerate(sampling):
            deltas.append(self._advance(seq, row, result, now))
        return deltas

    def _start_forks(self, update: StepUpdate, logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """The engine's side of the choices forked this step (generator, text, spans); each samples
        its first token from its parent's row. Returns every sampling sequence and its logits row."""
        if not update.forks:
            return update.sampling, logits
        for fork in update.forks:
            child = fork.child
            child.generator = self._generator(child.params, child.index)
            grammar.fork(fork.parent, child)
            if self._phases is not None:
                self._phases.fork(fork.parent, child, time.time_ns())
            self._texts[(child.request_id, child.index)] = OutputText(self.loaded.tokenizer, child.params.stop)
        children = [fork.child for fork in update.forks]
        return update.sampling + children, torch.cat([logits, logits[[fork.row for fork in update.forks]]])

    def _advance(self, seq: Sequence, row: int, result: SampleResult, now: float) -> Delta:
        """Append the token sampled in `row`, then check stops: a stop token (not emitted), a stop
        string, the length."""
        token = result.token_ids[row]
        seq.output_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        delta = Delta(seq.request_id, [token], index=seq.index)
        if result.logprobs is not None and seq.params.logprobs is not None:
            delta.logprobs = [result.logprobs[row]]
            delta.top_logprobs = [result.top_logprobs[row]] if result.top_logprobs else None
        text = self._texts[(seq.request_id, seq.index)]
        grammar_open = grammar.accept(seq, token)  # False: the grammar ended (or refused: it stops too)
        is_eos = token in self.eos_token_ids
        if token in seq.params.stop_token_ids or (is_eos and (not seq.params.ignore_eos or not grammar_open)):
            seq.output_ids.pop()  # the stop token is not part of the completion
            delta.token_ids = []
            self.scheduler.finish(seq, FinishReason.STOP)
            return self._final_delta(seq, delta)
        delta.text, stopped = text.update(seq.output_ids)
        if stopped or not grammar_open:
            self.scheduler.finish(seq, FinishReason.STOP)
            return self._final_delta(seq, delta, flush=not stopped)
        if seq.output_len >= seq.params.max_tokens or seq.total_len >= self.max_context:
            self.scheduler.finish(seq, FinishReason.LENGTH)
            return self._final_delta(seq, delta)
        return delta

    def _final_delta(self, seq: Sequence, delta: Delta, flush: bool = True) -> Delta:
        """Close one choice; the request's last open choice also reports usage and retires it."""
        text = self._texts.pop((seq.request_id, seq.index))
        if flush:
            delta.text += text.flush(seq.output_ids)
        assert seq.finish_reason is not None
        delta.finish_reason = seq.finish_reason.value
        if self._phases is not None:
            self._phases.finish(seq, time.time_ns(), delta.finish_reason)
        self.finished_counts[delta.finish_reason] = self.finished_counts.get(delta.finish_reason, 0) + 1
        request = self._requests[seq.request_id]
        request.completion_tokens += seq.output_len
        request.open_choices -= 1 + seq.pending_forks  # choices never forked close with their parent
        seq.pending_forks = 0
        if request.open_choices == 0:
            parent = request.parent
            delta.usage = {"prompt_tokens": parent.prompt_len, "cached_tokens": parent.prompt_cached_len,
                           "completion_tokens": request.completion_tokens}
            del self._requests[seq.request_id], self.sequences[seq.request_id]
        return delta

    # -- offline --------------------------------------------------------------------------------
    def generate_batch(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams], namespace: str = "default",
    ) -> list[Sequence]:
        """Run prompts to completion together; returns their finished sequences in prompt order."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        seqs = [self.add_request(f"offline-{id(self)}-{i}", p, sp, namespace)
                for i, (p, sp) in enumerate(zip(prompts, all_params, strict=True))]
        while self.has_work():
            self.step()
        return seqs

    # -- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pool and tree agree with what running sequences hold (AssertionError otherwise)."""
        self.scheduler.check_integrity()

    def kv_utilization(self) -> tuple[int, int]:
        """(tokens held, capacity) of the blocks running sequences hold; a shared block counts once."""
        return self.scheduler.kv_utilization()

    def info(self) -> dict[str, object]:
        held, capacity = self.kv_utilization()
        stats = self.cache.stats()
        return {
            "model": self.name,
            "dtype": str(self.loaded.model.dtype).removeprefix("torch."),
            "quantization": self.loaded.quantization,
            "context_length": self.max_context,
            "block_size": stats.block_size,
            "blocks": {"total": stats.num_blocks, "free": stats.num_free, "used": stats.num_used,
                       "evictable": stats.num_evictable},
            "kv_utilization": held / capacity if capacity else None,
            "cache": stats.namespaces,
            "finished": dict(self.finished_counts),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.preemptions,
            "scheduling": self.scheduler.policy,
            "tenants": self.scheduler.tenant_stats(),
        }

    def all_blocks_free_or_evictable(self) -> bool:
        return self.cache.all_free_or_evictable()

    @property
    def pool(self) -> BlockPool:
        """The cache's block pool (read-only use: tests and benchmarks look at ref counts and sizes)."""
        return self.cache.pool

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.scheduler.running if s.status is Status.RUNNING)
