"""The tensor-parallel ranks other than 0: one process each, started by rank 0's runner.

A rank loads its shard of the weights and its share of the KV cache, then runs what rank 0
sends: each step's forward pass over the same flattened batch (the all-reduces inside
pair the ranks layer by layer), and each LM head call on the rows rank 0 samples from. It
holds no scheduler: block tables and slots come with each step, so every rank writes its KV
heads into the same blocks.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys

import msgspec
import torch

from .config import EngineConfig
from .tensor_parallel import Command, TpGroup, init_process_group

logger = logging.getLogger(__name__)
STOP_WAIT_S = 10.0


class Workers:
    """Ranks 1..N-1 as processes of rank 0's, and the pipes their commands go down."""

    def __init__(self, processes: list[multiprocessing.Process], pipes: list):
        self.processes = processes
        self.pipes = pipes

    def send(self, command: Command) -> None:
        for pipe in self.pipes:
            pipe.send(command)

    def check(self) -> None:
        """RuntimeError naming the ranks that are gone (the group cannot step without them)."""
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank(s) gone: {', '.join(dead)}")

    def join(self) -> None:
        for p in self.processes:
            p.join(STOP_WAIT_S)
        self.kill()

    def kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join()


def start_workers(config: EngineConfig, device: torch.device) -> tuple[Workers, TpGroup]:
    """Start ranks 1..N-1 and join the group as rank 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    size = config.tp_size
    spawn = multiprocessing.get_context("spawn")  # (a forked torch is not safe to use)
    encoded = msgspec.json.encode(config)
    processes, pipes = [], []
    for rank in range(1, size):
        receiver, sender = spawn.Pipe(duplex=False)
        args = (encoded, rank, size, init_method, receiver)
        processes.append(spawn.Process(target=_main, args=args, name=f"tp-rank-{rank}", daemon=True))
        pipes.append(sender)
    for p in processes:
        p.start()
    logger.info("tensor parallel: %d ranks (processes %s)", size, ", ".join(str(p.pid) for p in processes))
    workers = Workers(processes, pipes)
    try:
        return workers, init_process_group(0, size, init_method, device)
    except BaseException:
        workers.kill()
        raise


def _die_with_parent() -> None:
    """Rank 0's process stops this one (its "stop" command, or a kill); signals meant for the
    daemon's process group (a drain's SIGTERM, Ctrl-C) must not end a rank under it."""
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _main(encoded_config: bytes, rank: int, size: int, init_method: str, commands) -> None:
    _die_with_parent()
    log_format = f"%(asctime)s %(levelname)s tp-rank-{rank}[%(process)d]: %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    from .device import resolve_device
    from .model_runner import ModelRunner

    config = msgspec.json.decode(encoded_config, type=EngineConfig)
    tp = init_process_group(rank, size, init_method, resolve_device(config.device))
    runner = ModelRunner(config, tp=tp)
    vocab = runner.model_config.vocab_size
    with torch.inference_mode():
        while True:
            try:
                command = commands.recv()
            except EOFError:  # rank 0 is gone
                break
            if command.kind == "forward":
                runner.forward(*command.args)
            elif command.kind == "logits":
                tp.gather_vocab(runner.model.compute_logits(runner.backend, command.args), vocab)
            elif command.kind == "stop":
                break
    torch.distributed.destroy_process_group()
