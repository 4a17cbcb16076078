"""Starting the ranks of a tensor parallel model: the calling process is rank 0 (it runs the
engine), ranks 1..n-1 are processes it starts with `torch.multiprocessing` (spawn). They meet on a
`TCPStore` that rank 0 opens on a free port (no port guessing) and form the default
`torch.distributed` group: gloo on CPUs, NCCL on GPUs (rank r on cuda:r; the NCCL path is the same
code but untested: no multi-GPU host here).

Each follower loads the same folder, keeps its shard and serves the leader's calls
(workers/parallel/model.py) until the leader stops it (`TensorParallelRun.close`). Followers are
daemon processes: they die with rank 0.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.dispatch import select_backend
from workers.models.loader import LoadedModel, load_model, read_model_config
from workers.models.packed_linear import pack_linears
from workers.parallel.layers import TensorParallelGroup, check_tensor_parallel
from workers.parallel.model import ShardedLlamaForCausalLM, shard

IDLE_TIMEOUT = datetime.timedelta(days=365)
"""The process group's timeout: a follower waits for the leader's next call for as long as a worker
idles (a dead peer still fails collectives at once: its connection closes)."""
JOIN_TIMEOUT = datetime.timedelta(minutes=10)
"""How long the ranks wait for each other to join the group (the store's timeout)."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to load its shard (picklable: it crosses to the spawned processes)."""

    folder: Path
    dtype: torch.dtype
    device: str  # rank 0's device; on CUDA rank r takes cuda:r
    attention: str
    size: int
    threads: int  # torch threads per rank
    port: int = 0  # the leader's TCPStore


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device.startswith("cuda") else device


def _join_group(spec: RankSpec, rank: int, store: dist.Store) -> TensorParallelGroup:
    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank_device(spec.device, rank))
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.size, timeout=IDLE_TIMEOUT)
    return TensorParallelGroup(rank, spec.size)


def _load_shard(spec: RankSpec, tp: TensorParallelGroup) -> LoadedModel:
    torch.set_num_threads(spec.threads)
    loaded = load_model(spec.folder, spec.dtype, rank_device(spec.device, tp.rank))
    loaded.model = shard(loaded.model, tp)
    return loaded


def _die_with_parent() -> None:
    """On Linux, SIGTERM this process when rank 0 dies, however it dies (daemon processes are only
    reaped when rank 0 exits normally)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def follower_main(spec: RankSpec, rank: int) -> None:
    """A follower's process: join the group, load the shard, serve until stopped."""
    _die_with_parent()
    store = dist.TCPStore("127.0.0.1", spec.port, spec.size, is_master=False, timeout=JOIN_TIMEOUT)
    tp = _join_group(spec, rank, store)
    model = _load_shard(spec, tp).model
    assert isinstance(model, ShardedLlamaForCausalLM)
    backend = select_backend(model.device, spec.attention)
    if backend == "native":  # as the engine does on the leader
        pack_linears(model)
    try:
        model.serve()
    finally:
        dist.destroy_process_group()


@dataclass
class TensorParallelRun:
    """Rank 0's side of a started group: its loaded shard and the followers' processes."""

    loaded: LoadedModel
    processes: list[Any] = field(default_factory=list)
    threads_before: int = 0  # this process's torch threads before it became rank 0 (restored on close)
    closed: bool = False

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the followers and leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        model = self.loaded.model
        try:
            if isinstance(model, ShardedLlamaForCausalLM) and all(p.is_alive() for p in self.processes):
                model.stop_followers()
        finally:
            dist.destroy_process_group()
            if self.threads_before:
                torch.set_num_threads(self.threads_before)
            for process in self.processes:
                process.join(timeout_s)
                if process.is_alive():
                    process.terminate()

    def __enter__(self) -> TensorParallelRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_tensor_parallel(folder: Path, dtype: torch.dtype, device: str, size: int, attention: str = "auto",
                          num_threads: int = 0, quantization: str = "none") -> TensorParallelRun:
    """Start `size` ranks on the model in `folder` (TensorParallelError, a ValueError, before any
    process starts when the model does not split so). Torch threads: `num_threads` (0: every core)
    shared equally among the ranks."""
    check_tensor_parallel(read_model_config(folder), size, quantization)
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group is already running in this process")
    threads = max(1, (num_threads or os.cpu_count() or 1) // size)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
    spec = RankSpec(folder, dtype, device, attention, size, threads, store.port)
    context = mp.get_context("spawn")
    processes = [context.Process(target=follower_main, args=(spec, rank), daemon=True, name=f"tollway-tp-rank{rank}")
                 for rank in range(1, size)]
    for process in processes:
        process.start()
    threads_before = torch.get_num_threads()
    try:
        tp = _join_group(spec, 0, store)
        return TensorParallelRun(_load_shard(spec, tp), processes, threads_before)
    except BaseException:
        torch.set_num_threads(threads_before)
        for process in processes:
            process.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
