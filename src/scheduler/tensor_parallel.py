"""Tensor parallelism (``--tp-size N``) over torch.distributed: N ranks, one process each,
every layer split Megatron-style.

- q/k/v and gate/up are column-parallel: each rank holds its heads (its share of the KV
  heads, or one KV head copied to several ranks when N exceeds them) and its share of the
  MLP's columns; o and down are row-parallel and their outputs summed by an all-reduce.
- The embedding and the LM head are split by vocabulary: each rank looks up (or scores)
  its share, the embedding's parts are summed and the logits gathered on rank 0, where
  sampling runs once.
- Rank 0 is the scheduler's runner: before each forward pass (and each LM head call) it
  sends the other ranks what they need to do the same on their shard (``Command``, over a
  pipe: an idle rank waits there, not in a collective that would time out); they loop on
  those commands in their own processes (``tp_worker.py``).

gloo on CPUs, NCCL on CUDA (the device layer's backend on NPUs).
"""

from __future__ import annotations

import dataclasses
import datetime
import mmap
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kernels.util import cdiv

from .model_config import ModelConfig

COLLECTIVE_TIMEOUT_S = 300.0


@dataclass
class Command:
    """What rank 0 asks the other ranks to run next (pickled)."""

    kind: str  # "forward" | "graph" | "logits" | "stop"
    args: Any = None


class TpGroup:
    """This process's rank in the tensor-parallel group, and the group's collectives."""

    def __init__(self, rank: int, size: int, device: torch.device, name: str = ""):
        self.rank, self.size, self.device = rank, size, device
        self.name = name  # unique to the group (its shared memory's name)
        self.shared: SharedMemoryAllReduce | None = None

    def use_shared_memory(self, max_elements: int) -> None:
        """CPU ranks of one host: all-reduces of up to ``max_elements`` go through shared
        memory (every rank calls this at the same point)."""
        if self.device.type == "cpu":
            self.shared = SharedMemoryAllReduce(self, max_elements)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is not None and x.numel() <= self.shared.max_elements:
            return self.shared.all_reduce(x)
        dist.all_reduce(x)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0: the full ``[rows, vocab]`` logits from every rank's ``[rows, vocab/N]``
        share; the other ranks: None."""
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else None


class SharedMemoryAllReduce:
    """All-reduce for ranks on one host through a shared buffer: each rank writes its tensor
    into its row, waits for every row, and sums them all in rank order, so every rank gets the
    same sum. gloo's TCP round trips cost a millisecond each on a small host, and a step has
    two all-reduces a layer. Two buffers, used in turn: a rank that is one all-reduce ahead
    writes the other one, and none can be two ahead (it would need every row of the next).
    Ordering relies on x86 making stores visible in program order (a rank's row before its
    sequence number)."""

    def __init__(self, group: TpGroup, max_elements: int):
        self.rank, self.size, self.max_elements = group.rank, group.size, max_elements
        nbytes = 8 * self.size + 2 * 4 * self.size * max_elements
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(shm, f"servicer-tp-{group.name}")
        if group.rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, nbytes)
        dist.barrier()
        if group.rank != 0:
            fd = os.open(path, os.O_RDWR)
        dist.barrier()
        if group.rank == 0:
            os.unlink(path)  # (the name goes; the mapping stays while a rank lives)
        self.memory = mmap.mmap(fd, nbytes)
        os.close(fd)
        buf = np.frombuffer(self.memory, dtype=np.uint8)
        self.written = buf[: 8 * self.size].view(np.int64)  # per rank: the number of its last all-reduce
        rows = buf[8 * self.size :].view(np.float32).reshape(2, self.size, max_elements)
        self.rows = torch.from_numpy(rows)
        self.seq = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.seq += 1
        n = x.numel()
        rows = self.rows[self.seq % 2, :, :n]
        rows[self.rank].view(x.shape).copy_(x)  # (any strides: a short CPU batch's may be column-major)
        self.written[self.rank] = self.seq
        while self.written.min() < self.seq:
            os.sched_yield()  # (ranks may outnumber the cores)
        if x.dtype == torch.float32 and x.is_contiguous():
            torch.sum(rows, dim=0, out=x.view(-1))
        else:
            x.copy_(rows.sum(0).view(x.shape))
        return x


# -- how the model is split ------------------------------------------------------------------


def check_divisible(config: ModelConfig, size: int) -> None:
    """ValueError for a model that ``size`` ranks cannot split evenly."""
    c = config
    problems = []
    if c.num_heads % size:
        problems.append(f"{c.num_heads} attention heads")
    if c.num_kv_heads % size and size % c.num_kv_heads:
        problems.append(f"{c.num_kv_heads} KV heads (nor do they divide it)")
    if c.intermediate_size % size:
        problems.append(f"an MLP of {c.intermediate_size} columns")
    if problems:
        raise ValueError(f"--tp-size {size} does not divide {c.architecture}'s {', '.join(problems)}")


def kv_heads(config: ModelConfig, rank: int, size: int) -> range:
    """The KV heads rank ``rank`` holds: its share, or the one its query heads read when
    there are fewer KV heads than ranks (copied on ``size / num_kv_heads`` ranks)."""
    kv = config.num_kv_heads
    if kv >= size:
        per = kv // size
        return range(rank * per, (rank + 1) * per)
    head = rank // (size // kv)
    return range(head, head + 1)


def vocab_share(config: ModelConfig, size: int) -> int:
    """Rows of the embedding (and LM head) per rank; the last rank's are padded."""
    return cdiv(config.vocab_size, size)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """One rank's model: its heads and MLP columns (the vocabulary stays whole here; the
    embedding and LM head take ``vocab_share`` rows)."""
    if size == 1:
        return config
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
    )


class Shard:
    """Which part of each HF-named tensor rank ``rank`` keeps."""

    def __init__(self, config: ModelConfig, rank: int, size: int):
        d = config.head_dim
        q_per = config.num_heads // size
        self.rank = rank
        self.q_rows = slice(rank * q_per * d, (rank + 1) * q_per * d)
        kv = kv_heads(config, rank, size)
        self.kv_rows = slice(kv.start * d, kv.stop * d)
        cols_per = config.intermediate_size // size
        self.cols = slice(rank * cols_per, (rank + 1) * cols_per)
        self.vocab = vocab_share(config, size)

    def take(self, name: str, w) -> torch.Tensor:
        """This rank's part of tensor ``name``. ``w``: the tensor, or a safetensors slice (then
        only that part is read from the file)."""
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if part == "q_proj":
            return w[self.q_rows]
        if part in ("k_proj", "v_proj"):
            return w[self.kv_rows]
        if part in ("gate_proj", "up_proj"):
            return w[self.cols]
        if part in ("o_proj", "down_proj"):
            if name.endswith(".bias"):  # added once: by rank 0, before the sum
                return w[:] if self.rank == 0 else torch.zeros_like(w[:])
            return w[:, self.q_rows] if part == "o_proj" else w[:, self.cols]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return _pad_rows(w[self.rank * self.vocab : (self.rank + 1) * self.vocab], self.vocab)
        return w[:]  # norms: every rank holds them whole


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def init_process_group(rank: int, size: int, init_method: str, device: torch.device) -> TpGroup:
    """Join the group. The ranks meet at once (before loading weights) and then run each step
    in lockstep, so a collective that waits this long means a rank is gone."""
    backend = "nccl" if device.type == "cuda" else "hccl" if device.type == "npu" else "gloo"
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type != "cpu":  # (each rank's collectives on its own device)
        getattr(torch, device.type).set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    return TpGroup(rank, size, device, name=init_method.rsplit(":", 1)[-1])  # (the port: one group's at a time)
