"""Megatron-style sharding of a loaded Llama-family model across the ranks of a process group.

Every rank loads the whole checkpoint, then keeps its shard (the rest is freed):
- q/k/v and gate/up are column-parallel: rank r keeps its heads' rows (q heads
  [r·Hq/n, (r+1)·Hq/n), KV heads likewise, so each rank's GQA groups stay whole) and its slice of
  the intermediate rows; their outputs stay local.
- o and down are row-parallel: rank r keeps the matching input columns; the partial products are
  summed across ranks (`all_reduce`, in fp32) into the residual stream, which is then the same on
  every rank.
- the embedding and LM head are vocab-parallel: rank r owns token rows [r·P, (r+1)·P) with
  P = ceil(V / n) (the last shard zero-padded to P rows, so gathers have equal sizes); a lookup is
  the owner's row summed with zeros, the logits are every rank's columns gathered.
Each rank's KV storage therefore holds only its KV heads, with the same block layout everywhere:
a block id means the same tokens on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.models.config import ModelConfig
from workers.models.llama import DecoderLayer, LlamaForCausalLM

TENSOR_PARALLEL_TYPES = ("llama", "mistral", "qwen2")
"""Families whose layers `shard_layers` knows (the plain Llama decoder layer)."""


class TensorParallelError(ValueError):
    """A tensor parallel size this model (or these settings) cannot be split by."""


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None: the default group


def check_tensor_parallel(config: ModelConfig, size: int, quantization: str = "none") -> None:
    """TensorParallelError unless the model splits evenly into `size` ranks (size 1 always does)."""
    if size < 1:
        raise TensorParallelError(f"the tensor parallel size must be at least 1, got {size}")
    if size == 1:
        return
    if config.model_type not in TENSOR_PARALLEL_TYPES or config.num_experts:
        raise TensorParallelError(f"tensor parallelism is built for {', '.join(TENSOR_PARALLEL_TYPES)} models; "
                                  f"model_type {config.model_type!r} runs with --tensor-parallel-size 1 only")
    if quantization != "none":
        raise TensorParallelError(f"tensor parallelism runs unquantized weights only; got quantization {quantization!r}")
    if size > config.num_kv_heads:
        raise TensorParallelError(f"tensor parallel size {size} exceeds the model's {config.num_kv_heads} KV heads "
                                  "(KV heads are split across ranks, never replicated)")
    for what, count in (("query heads", config.num_q_heads), ("KV heads", config.num_kv_heads),
                        ("intermediate size", config.intermediate_size)):
        if count % size:
            raise TensorParallelError(f"tensor parallel size {size} does not divide the model's {count} {what}")


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear holding copies of `weight` [out, in] (and `bias`), so the full tensors can be freed."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous().clone(), requires_grad=False)
    return linear


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's input columns; forward(x) -> the sum over ranks, fp32."""

    def __init__(self, linear: nn.Linear, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.linear, self.tp = linear, tp

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x).float()  # summed in fp32: bf16 partials are not rounded twice
        dist.all_reduce(out, group=self.tp.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """Token rows [start, end) of the vocabulary (padded to `weight`'s rows); forward(ids) -> fp32
    rows of every id, each from the rank that owns it."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.end, self.tp = start, end, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        owned = (local >= 0) & (local < self.end - self.start)
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight).float()
        rows = rows * owned.unsqueeze(-1)
        dist.all_reduce(rows, group=self.tp.group)
        return rows


def vocab_shard(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int, int]:
    """(start, end, padded rows) of this rank's vocabulary shard."""
    per = -(-vocab_size // tp.size)
    start = min(vocab_size, tp.rank * per)
    return start, min(vocab_size, start + per), per


def _padded_rows(weight: torch.Tensor, start: int, end: int, rows: int) -> torch.Tensor:
    shard = weight.new_zeros(rows, weight.shape[1])
    shard[: end - start] = weight[start:end]
    return shard


@torch.no_grad()
def shard_layers(model: LlamaForCausalLM, tp: TensorParallelGroup) -> None:
    """Replace a loaded model's projections, embedding and head by this rank's shards, in place
    (check_tensor_parallel first). Modules are swapped with setattr: their classes change."""
    c = model.config
    r, n, d = tp.rank, tp.size, c.head_dim
    hq, hk, inter = c.num_q_heads // n, c.num_kv_heads // n, c.intermediate_size // n

    def rows(t: torch.Tensor, size: int) -> torch.Tensor:
        return t[r * size : (r + 1) * size]

    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)  # a ModuleList yields plain Modules to the type checker
        splits = (c.q_size, c.kv_size, c.kv_size)
        q, k, v = layer.qkv_proj.weight.split(splits)
        bias = None
        if layer.qkv_proj.bias is not None:
            qb, kb, vb = layer.qkv_proj.bias.split(splits)
            bias = torch.cat([rows(qb, hq * d), rows(kb, hk * d), rows(vb, hk * d)])
        layer.qkv_proj = _linear(torch.cat([rows(q, hq * d), rows(k, hk * d), rows(v, hk * d)]), bias)
        layer.o_proj = RowParallelLinear(  # type: ignore[assignment]
            _linear(layer.o_proj.weight[:, r * hq * d : (r + 1) * hq * d]), tp)
        gate, up = layer.gate_up_proj.weight.chunk(2)
        layer.gate_up_proj = _linear(torch.cat([rows(gate, inter), rows(up, inter)]))
        layer.down_proj = RowParallelLinear(  # type: ignore[assignment]
            _linear(layer.down_proj.weight[:, r * inter : (r + 1) * inter]), tp)
        layer.num_q_heads, layer.num_kv_heads = hq, hk
        layer._splits = (hq * d, hk * d, hk * d)
    start, end, per = vocab_shard(c.vocab_size, tp)
    embedding = VocabParallelEmbedding(_padded_rows(model.embed_tokens.weight, start, end, per), start, end, tp)
    head_weight = embedding.weight if c.tie_word_embeddings else _padded_rows(model.lm_head.weight, start, end, per)
    model.embed_tokens = embedding  # type: ignore[assignment]
    head = nn.Linear(c.hidden_size, per, bias=False, device="meta")
    head.weight = head_weight if isinstance(head_weight, nn.Parameter) else nn.Parameter(head_weight,
                                                                                          requires_grad=False)
    model.lm_head = head
