"""Grammar-constrained decoding: compiled grammars and the per-step token bitmask (xgrammar).

- `GrammarCompiler` turns a request's `GrammarSpec` (workers/wire/grammar.py) into a compiled
  grammar for this model's vocabulary, cached by the spec's hash. It loads xgrammar (and builds the
  vocabulary's token table, ~0.3 s) on first use, or when `prepare()`d (`tollway worker` does at
  start, before it serves).
- Each constrained sequence owns a matcher (`Sequence.matcher`): the grammar's state after its
  output so far. It advances with every accepted token (`accept`). A forked choice (n > 1) gets
  `matcher.fork()` at its parent's state; a preempted sequence keeps its output tokens and so its
  matcher, which stays exact (`rebuild` replays the output where a matcher must be made anew).
- `GrammarMasks` fills one bitmask row per constrained sampling row (int32 words, bit t of row r =
  token t allowed) and applies it to the logits before sampling (-inf on every disallowed token).
  The fill only needs the matchers' state, known at schedule time, so `start` runs it on a helper
  thread while the model's forward pass runs, and `constrain` waits for it (xgrammar's fill
  releases the GIL).

Vocabulary: the model's (its logits' width); ids the tokenizer does not know are never allowed.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from workers.engine.request import Sequence
from workers.wire.grammar import GrammarSpec

log = logging.getLogger(__name__)
MAX_CACHED_GRAMMARS = 256
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: " before its message


class GrammarError(ValueError):
    """A grammar the compiler refuses (an unsupported or contradictory schema): the caller's 400."""


class GrammarCompiler:
    """Compiled grammars for one model's vocabulary, cached by spec hash. Thread-safe: the worker
    validates (compiles) on its event loop's side, the engine thread makes matchers."""

    def __init__(self, folder: Path, vocab_size: int, stop_token_ids: Seq[int]) -> None:
        self.folder, self.vocab_size, self.stop_token_ids = folder, vocab_size, list(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def prepare(self) -> None:
        """Load xgrammar and build the vocabulary's token table now (~2 s), not on the first
        constrained request (which would stall the worker's event loop while it validates)."""
        with self._lock:
            self._xgrammar_compiler()

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.folder / "tokenizer.json"))
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (xgrammar.CompiledGrammar); GrammarError when refused."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiler = self._xgrammar_compiler()
        try:
            compiled = _compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors derive from these
            reason = _SOURCE_PREFIX.sub("", str(exc)).strip()
            raise GrammarError(f"the schema cannot be used for constrained decoding: {reason}") from exc
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def rebuild(self, spec: GrammarSpec, output_ids: Seq[int]) -> Any:
        """A matcher at the state after `output_ids` (replayed token by token)."""
        matcher = self.matcher(spec)
        for token in output_ids:
            if not matcher.accept_token(token):
                raise GrammarError(f"token {token} does not fit the grammar")
        return matcher


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if spec.kind == "json_schema":
        assert spec.schema is not None  # parse_grammar guarantees it
        return compiler.compile_json_schema(spec.schema, any_whitespace=False, strict_mode=True)
    tags = [{"type": "tag", "begin": t.begin, "end": t.end,
             "content": {"type": "json_schema", "json_schema": json.loads(t.schema)}} for t in spec.tags]
    if spec.at_least_one:  # calls only, one per line: no free text before, between or after them
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": spec.stop_after_first}
    else:  # free text, in which a trigger opens a call
        fmt = {"type": "triggered_tags", "triggers": list(spec.triggers), "tags": tags, "at_least_one": False,
               "stop_after_first": spec.stop_after_first}
    return compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))


class GrammarMasks:
    """The bitmask of one step's constrained rows, filled beside the forward pass and applied to
    the logits before sampling. Owned by the engine thread (the helper only runs `_fill`)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask = torch.empty(0, (vocab_size + 31) // 32, dtype=torch.int32)
        self._pool: ThreadPoolExecutor | None = None
        self.fill_s = 0.0  # seconds spent filling masks (benchmarks read it)
        self.rows_filled = 0

    def _rows(self, num_rows: int) -> torch.Tensor:
        old = self._bitmask
        if old.shape[0] < num_rows:  # grown with its rows kept: forks fill theirs after `start`
            self._bitmask = torch.empty(max(num_rows, 2 * old.shape[0]), old.shape[1], dtype=torch.int32)
            self._bitmask[: old.shape[0]] = old
        return self._bitmask

    def _fill(self, seqs: Seq[Sequence]) -> None:
        import time

        start = time.perf_counter()
        bitmask = self._rows(len(seqs))
        for row, seq in enumerate(seqs):
            if seq.matcher is not None:
                seq.matcher.fill_next_token_bitmask(bitmask, row)
                self.rows_filled += 1
        self.fill_s += time.perf_counter() - start

    def start(self, seqs: Seq[Sequence]) -> Future[None] | None:
        """Begin filling the rows of `seqs` (the step's sampling sequences, in row order) on the
        helper thread; None when none is constrained."""
        if not any(seq.matcher is not None for seq in seqs):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tollway-grammar")
        return self._pool.submit(self._fill, list(seqs))

    def constrain(self, logits: torch.Tensor, seqs: Seq[Sequence], pending: Future[None] | None,
                  num_started: int) -> None:
        """Mask logits [B, V] in place: rows [0, num_started) were filled by `start`, later rows
        (choices forked this step, sharing their parent's state) are filled now."""
        if pending is not None:
            pending.result()
        rows = [r for r, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return
        late = [r for r in rows if r >= num_started]
        if late:
            bitmask = self._rows(len(seqs))
            for row in late:
                seqs[row].matcher.fill_next_token_bitmask(bitmask, row)
        import xgrammar as xgr

        # non_blocking: a pageable source is staged at once, so the host never waits for the device's queue here
        xgr.apply_token_bitmask_inplace(logits, self._bitmask[: len(seqs)].to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size, indices=rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def accept(seq: Sequence, token: int) -> bool:
    """Advance the sequence's matcher by its newly sampled token; False when the grammar is done
    (the token ended it) or refused it (only a stop token can be refused: masking allows no other)."""
    matcher = seq.matcher
    if matcher is None:
        return True
    if not matcher.accept_token(token):
        log.warning("request %s: token %d refused by its grammar", seq.request_id, token)
        return False
    return not matcher.is_terminated()


def fork(parent: Sequence, child: Sequence) -> None:
    """The child choice continues from the parent's grammar state (before this step's token)."""
    if parent.matcher is not None:
        child.matcher = parent.matcher.fork()
