"""The engine: one step = schedule, run the model, update request state, sample, detect stops,
report deltas.

Ownership: the scheduler (scheduler.py) owns the sequences' state and, through the KV cache facade
(cache.manager.KVCacheManager), their blocks; the engine owns what a request needs beyond that:
each choice's generator, detokenizer and spans, the stop checks, the deltas and the usage.
Its settings live in workers/engine/config.py, what it reports (`Delta`) in workers/engine/deltas.py,
and the speculative decoding steps it calls (drafting, verifying) in workers/engine/speculative.py;
its KV cache and model runner are built by workers/engine/runner_setup.py.
Single-threaded: `AsyncEngine` (workers/engine/async_engine.py) drives it from one thread.
Where on (`EngineConfig.overlap`; CUDA by default) a step is overlapped with the next
(workers/engine/overlap.py, which owns `in_flight`): its tokens are read and reported one step later.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence as Seq

import torch
from opentelemetry.trace import Tracer

from cache.block_pool import BlockPool
from kernels.metadata import to_device
from workers.engine import engine_info, grammar, overlap, speculative
from workers.engine.batch import StepUpdate
from workers.engine.config import EngineConfig, step_token_budget
from workers.engine.deltas import Delta, OpenRequest, attach_prompt_logprobs
from workers.engine.detokenize import OutputText
from workers.engine.draft_model import DraftTarget
from workers.engine.drafter import make_drafter
from workers.engine.grammar import GrammarCompiler, GrammarMasks
from workers.engine.phase_spans import PhaseSpans, TraceParent
from workers.engine.request import FinishReason, Priority, Sequence, Status
from workers.engine.runner_setup import build_runner
from workers.engine.sampler import SampleResult, sample
from workers.engine.scheduler import Scheduler
from workers.engine.spec_governor import SpeculationGovernor
from workers.models.loader import LoadedModel
from workers.wire.sampling import SamplingParams


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, name: str | None = None,
                 tracer: Tracer | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        self.name = name or loaded.folder.name
        self.cache, self.runner = build_runner(loaded, config)
        step_tokens = step_token_budget(config.max_batch_tokens, loaded.model.device.type)
        self.scheduler = Scheduler(self.cache, step_tokens, config.max_running, config.max_wait_s,
                                   config.scheduling, config.max_running_per_tenant)
        c = loaded.model.config
        self.max_context = config.max_context or min(c.max_position_embeddings, 8192)
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.grammars = GrammarCompiler(loaded.folder, c.vocab_size, loaded.eos_token_ids)
        self.masks = GrammarMasks(c.vocab_size)
        # None: off. A draft model is checked against this model and runs in its dtype on its device.
        self.drafter = make_drafter(config.speculative, config.speculative_ngram, config.draft_model,
                                    DraftTarget(c.vocab_size, loaded.model.dtype, loaded.model.device,
                                                loaded.folder / "tokenizer.json"))
        # Drafting's back-off by measured step cost (None: speculation off, or timing left out by config).
        self.spec_governor = SpeculationGovernor() if self.drafter is not None and config.speculative_timed else None
        self.spec_stats = speculative.SpecStats()
        self.sequences: dict[str, Sequence] = {}  # request id -> its first choice, while running
        self.finished_counts: dict[str, int] = {}  # by finish reason of each choice, since start
        self._requests: dict[str, OpenRequest] = {}
        self._texts: dict[tuple[str, int], OutputText] = {}
        # Spans of traced requests' phases; None when tracing is off (then the step loop does no tracing work).
        self._phases = PhaseSpans(tracer) if tracer is not None else None
        # Overlapped steps (workers/engine/overlap.py): the step whose tokens the host has not read yet, and
        # deltas read outside a step (an abort reads the step in flight) that the next step returns.
        self.overlap = overlap.enabled(config.overlap, loaded.model.device.type)
        self.in_flight: overlap.InFlight | None = None
        self._carried: list[Delta] = []

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
        self._requests[request_id] = OpenRequest(seq, params.n)
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
        # the prompt leaves room for one generated token, unless none is asked for (prefill only)
        if len(prompt_ids) > self.max_context - (params.max_tokens > 0):
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_context}")
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # GrammarError (a ValueError) when refused; cached

    def abort(self, request_id: str) -> Delta | None:
        """Abort every open choice; returns the request's last delta (with usage), or None if gone."""
        if self.in_flight is not None:  # read it first: no placeholder reaches a closing choice
            self._carried += overlap.settle(self, dropping=request_id)
        request = self._requests.get(request_id)
        if request is None:
            return None
        last = None
        for seq in self.scheduler.sequences_of(request_id):
            self.scheduler.finish(seq, FinishReason.ABORT)
            last = self._final_delta(seq, Delta(request_id, index=seq.index))
        return last

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None or bool(self._carried)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        """One step: overlapped with the next (workers/engine/overlap.py) where on, else `plain_step`."""
        return overlap.step(self) if self.overlap else self.plain_step()

    def plain_step(self) -> list[Delta]:
        """One step (`_step`), timed for the speculation governor when there is one."""
        governor = self.spec_governor
        if governor is None:
            return self._step()
        start = time.perf_counter()
        deltas = self._step()
        governor.finished(time.perf_counter() - start)
        return deltas

    def _step(self) -> list[Delta]:
        """schedule → run the model (and keep the prompt logprobs it computed) → update (the
        scheduler's: computed lengths, prefix commits, forks of n > 1 choices) → end the max_tokens 0
        requests whose prompt is computed → sample → deltas. The update comes before sampling
        because a forked choice draws its first token from its parent's logits in the same draw."""
        phases = self._phases
        if phases is not None:
            start_ns, preemptions = time.time_ns(), self.scheduler.preemptions
        if self.drafter is not None:
            speculative.propose_drafts(self.scheduler.running, self.drafter, self.config.speculative_tokens,
                                       self.config.speculative_max_batch, self.max_context, self.spec_governor)
        batch = self.scheduler.schedule()
        if self.spec_governor is not None:
            self.spec_governor.started(batch.seqs, batch.has_drafts)
        if phases is not None and self.scheduler.preemptions != preemptions:
            phases.preempted(start_ns)
        deltas = [self._final_delta(s, Delta(s.request_id, index=s.index)) for s in self.scheduler.take_finished()]
        if not batch.seqs:
            return deltas
        # each sampling sequence's draft ([] for most); drafted ones verify instead of sampling
        drafts = [d for d, samples in zip(batch.drafts, batch.samples, strict=True) if samples]
        plain = [s for s, d in zip(batch.sampling, drafts, strict=True) if not d]
        masks = self.masks.start(plain)  # grammar masks fill while the model runs
        output = self.runner.run(batch)
        for part in output.prompt_logprobs:  # before the update: forked choices share these lists
            part.seq.prompt_logprobs.extend(part.logprobs)
            part.seq.prompt_top_logprobs.extend(part.top)
        logits = output.logits
        update = self.scheduler.update(batch)
        if phases is not None:
            phases.step(batch.seqs, batch.num_new, start_ns, time.time_ns())
        deltas += [self._prefilled(seq) for seq in batch.seqs
                   if seq.params.max_tokens == 0 and seq.computed_len == seq.total_len]
        if batch.has_drafts:
            update, logits, verified = speculative.split_drafted(update, logits, drafts)
            now = time.monotonic()
            deltas.extend(speculative.emit_verified(seq, rows, draft, now, self._emit, self.scheduler, self.spec_stats)
                          for seq, rows, draft in verified)
        if not update.sampling:
            return deltas
        if masks is not None and update.forks:
            masks.result()  # forking reads the parents' matchers: not while the helper fills from them
        sampling, logits = self.start_forks(update, logits)
        constrain = None
        if masks is not None or any(fork.child.matcher is not None for fork in update.forks):
            def constrain(work: torch.Tensor) -> None:
                self.masks.constrain(work, sampling, masks, len(update.sampling))
        result = sample(logits, sampling, constrain)
        now = time.monotonic()
        for row, seq in enumerate(sampling):
            deltas.append(self.advance(seq, row, result, now))
        return deltas

    def start_forks(self, update: StepUpdate, logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """The engine's side of the choices forked this step (generator, text, spans); each samples
        its first token from its parent's row. Returns every sampling sequence and its logits row.
        Called by this step and by overlapped steps (overlap.py)."""
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
        parents = to_device([fork.row for fork in update.forks], torch.long, logits.device)
        return update.sampling + children, torch.cat([logits, logits[parents]])

    def advance(self, seq: Sequence, row: int, result: SampleResult, now: float) -> Delta:
        """Append the token sampled in `row`, then check stops (this step's, or an overlapped step's
        once read: overlap.py)."""
        token = result.token_ids[row]
        delta = Delta(seq.request_id, [token], index=seq.index)
        if not seq.output_ids:
            attach_prompt_logprobs(seq, delta)
        if result.logprobs is not None and seq.params.logprobs is not None:
            delta.logprobs = [result.logprobs[row]]
            delta.top_logprobs = [result.top_logprobs[row]] if result.top_logprobs else None
        return self._emit(seq, token, delta, now)

    def _emit(self, seq: Sequence, token: int, delta: Delta, now: float) -> Delta:
        """Append one token (already in `delta`), then check stops: a stop token (not emitted), a
        stop string, the length."""
        seq.output_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
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

    # -- what overlapped steps (overlap.py) call ----------------------------------------------------
    @property
    def phases(self) -> PhaseSpans | None:
        return self._phases

    def take_carried(self) -> list[Delta]:
        carried, self._carried = self._carried, []
        return carried

    def close_choice(self, seq: Sequence) -> Delta:
        """The closing delta of a choice the scheduler finished."""
        return self._final_delta(seq, Delta(seq.request_id, index=seq.index))

    def _prefilled(self, seq: Sequence) -> Delta:
        """A max_tokens 0 request whose prompt is now computed: it ends ("length") with no token."""
        delta = Delta(seq.request_id, index=seq.index)
        attach_prompt_logprobs(seq, delta)
        self.scheduler.finish(seq, FinishReason.LENGTH)
        return self._final_delta(seq, delta)

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
        delta.usage = request.close_choice(seq)
        if delta.usage is not None:
            if self.drafter is not None:
                delta.speculative = request.speculative()
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
        """A snapshot of what the engine holds and has done (workers/engine/engine_info.py)."""
        return engine_info.describe(self)

    def all_blocks_free_or_evictable(self) -> bool:
        return self.cache.all_free_or_evictable()

    @property
    def pool(self) -> BlockPool:
        """The cache's block pool (read-only use: tests and benchmarks look at ref counts and sizes)."""
        return self.cache.pool

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.scheduler.running if s.status is Status.RUNNING)
