"""The tensor-parallel ranks other than 0: one process each, started by rank 0's runner on
its host, and by ``run_node`` on the other hosts (``--nnodes``, ``--node-rank`` > 0).

A rank loads its shard of the weights and its share of the KV cache, then runs what rank 0
sends: each step's forward pass over the same flattened batch (the all-reduces inside
pair the ranks layer by layer), and each LM head call on the rows rank 0 samples from. It
holds no scheduler: block tables and slots come with each step, so every rank writes its KV
heads into the same blocks. Ranks on rank 0's host get their commands down a pipe; ranks
on other hosts over ZMQ from rank 0 (``RemoteRanks``, on the port after --dist-init-addr's).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import sys

import msgspec
import torch
import zmq

from .config import EngineConfig
from .tensor_parallel import Command, TpGroup, init_process_group

logger = logging.getLogger(__name__)
STOP_WAIT_S = 10.0
HELLO_WAIT_S = 60.0  # for the other hosts' ranks to say where they are, once all joined the group


class RemoteRanks:
    """Rank 0's command channel to the ranks of other hosts: a ZMQ ROUTER each of them
    connects to and greets with its rank, so rank 0 knows whom to send each command."""

    def __init__(self, address: str, ranks: range):
        self.ranks = ranks
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.bind(address)
        self.peers: list[bytes] = []

    def wait_for_hellos(self) -> None:
        """Called once every rank joined the group (each greets before it joins)."""
        seen = set()
        while len(seen) < len(self.ranks):
            if not self.socket.poll(HELLO_WAIT_S * 1000):
                missing = sorted(set(self.ranks) - seen)
                raise RuntimeError(f"tensor-parallel rank(s) {missing} joined the group but never greeted rank 0")
            peer, rank = self.socket.recv_multipart()
            seen.add(int(rank))
            self.peers.append(peer)

    def send(self, command: Command) -> None:
        if isinstance(command.args, torch.Tensor):  # (an accelerator's tensor travels as bytes)
            command = Command(command.kind, command.args.cpu())
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for peer in self.peers:
            self.socket.send_multipart([peer, payload], copy=False)

    def close(self) -> None:
        self.socket.close()
        self.ctx.term()


class RemoteCommands:
    """A rank's commands from rank 0 on another host (what a pipe's ``recv`` is locally):
    EOFError once rank 0 is gone."""

    def __init__(self, address: str, rank: int):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.socket.connect(address)
        self.socket.send(str(rank).encode())

    def recv(self) -> Command:
        while True:
            ready = dict(self.poller.poll())
            if self.socket in ready:
                return pickle.loads(self.socket.recv())
            if self.monitor in ready:
                self.monitor.recv_multipart()
                raise EOFError("rank 0 closed the connection")


class Workers:
    """Ranks 1..N-1: this host's as processes of rank 0's, with the pipes their commands go
    down, and the other hosts' reached through ``remote``."""

    def __init__(self, processes: list[multiprocessing.Process], pipes: list, remote: RemoteRanks | None = None):
        self.processes = processes
        self.pipes = pipes
        self.remote = remote

    def send(self, command: Command) -> None:
        for pipe in self.pipes:
            pipe.send(command)
        if self.remote is not None:
            self.remote.send(command)

    def check(self) -> None:
        """RuntimeError naming the ranks that are gone (the group cannot step without them)."""
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank(s) gone: {', '.join(dead)}")

    def join(self) -> None:
        for p in self.processes:
            p.join(STOP_WAIT_S)
        self.kill()
        if self.remote is not None:
            self.remote.close()

    def kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join()


def ranks_per_node(config: EngineConfig) -> int:
    return config.tp_size // config.nnodes


def group_addresses(config: EngineConfig) -> tuple[str, str]:
    """Where the ranks meet (torch.distributed's init method) and where the other hosts'
    ranks take rank 0's commands: --dist-init-addr's port and the next one."""
    if config.dist_init_addr is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}", ""
    host, port = config.dist_init_addr.rsplit(":", 1)
    return f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}"


def start_workers(config: EngineConfig, device: torch.device) -> tuple[Workers, TpGroup]:
    """Start this host's ranks 1..n-1 and join the group as rank 0 (the other hosts' ranks,
    started by their own ``run_node``, join it too)."""
    init_method, commands = group_addresses(config)
    size, local = config.tp_size, ranks_per_node(config)
    remote = RemoteRanks(commands, range(local, size)) if config.nnodes > 1 else None
    processes, pipes = _spawn(config, range(1, local), init_method, lambda rank: None)
    workers = Workers(processes, pipes, remote)
    try:
        group = init_process_group(0, size, init_method, device)
        share_config(config)
        if remote is not None:
            remote.wait_for_hellos()
        return workers, group
    except BaseException:
        workers.kill()
        if remote is not None:
            remote.close()
        raise


def _spawn(config: EngineConfig, ranks: range, init_method: str, commands_address) -> tuple[list, list]:
    """Start one process per rank; (the processes, the sending ends of their pipes).
    ``commands_address(rank)``: the ZMQ address its commands come from, or None for a pipe
    from this process."""
    spawn = multiprocessing.get_context("spawn")  # (a forked torch is not safe to use)
    encoded = msgspec.json.encode(config)
    processes, pipes = [], []
    for rank in ranks:
        address = commands_address(rank)
        if address is None:
            receiver, sender = spawn.Pipe(duplex=False)
            pipes.append(sender)
        args = (encoded, rank, init_method, address or receiver)
        processes.append(spawn.Process(target=_main, args=args, name=f"tp-rank-{rank}", daemon=True))
    for p in processes:
        p.start()
    if processes:
        pids = ", ".join(str(p.pid) for p in processes)
        logger.info("tensor parallel: ranks %d-%d of %d (processes %s)", ranks[0], ranks[-1], config.tp_size, pids)
    return processes, pipes


def share_config(config: EngineConfig) -> EngineConfig:
    """Rank 0's config, on every rank (another host's command line may differ in what
    must agree: the KV cache's size, the block size), with this host's place kept."""
    box = [msgspec.json.encode(config)]
    torch.distributed.broadcast_object_list(box, src=0)
    return msgspec.structs.replace(msgspec.json.decode(box[0], type=EngineConfig), node_rank=config.node_rank)


def run_node(config: EngineConfig) -> int:
    """A host other than rank 0's (``--node-rank`` > 0): run its share of the ranks until
    rank 0 stops them (exit 0) or is gone (exit 1)."""
    init_method, commands = group_addresses(config)
    per = ranks_per_node(config)
    first = config.node_rank * per
    processes, _ = _spawn(config, range(first, first + per), init_method, lambda rank: commands)
    stopped = []

    def stop(signum, frame) -> None:  # (the group cannot go on without these ranks: rank 0 fails too)
        stopped.append(signum)
        for p in processes:
            p.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for p in processes:
        p.join()
    failed = [f"{p.name} (exit code {p.exitcode})" for p in processes if p.exitcode != 0]
    if stopped:
        logger.info("stopped by signal %d", stopped[0])
        return 0
    if failed:
        logger.error("rank(s) ended without rank 0's word: %s", ", ".join(failed))
    return 1 if failed else 0


def _die_with_parent() -> None:
    """Rank 0's process stops this one (its "stop" command, or a kill); signals meant for the
    daemon's process group (a drain's SIGTERM, Ctrl-C) must not end a rank under it."""
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _main(encoded_config: bytes, rank: int, init_method: str, commands) -> None:
    """One rank: ``commands`` is a pipe's receiving end, or the ZMQ address of rank 0's
    channel to other hosts."""
    _die_with_parent()
    log_format = f"%(asctime)s %(levelname)s tp-rank-{rank}[%(process)d]: %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    from .model_runner import ModelRunner
    from .resolve import resolve_platform

    config = msgspec.json.decode(encoded_config, type=EngineConfig)
    if isinstance(commands, str):
        commands = RemoteCommands(commands, rank)  # (greets before joining: see RemoteRanks)
    tp = init_process_group(rank, config.tp_size, init_method, resolve_platform(config, rank).device)
    config = share_config(config)
    runner = ModelRunner(config, tp=tp)
    vocab = runner.model_config.vocab_size
    with torch.inference_mode():
        while True:
            try:
                command = commands.recv()
            except EOFError:  # rank 0 is gone
                sys.exit(1)
            if command.kind == "forward":
                runner.forward(*command.args)
            elif command.kind == "graph":  # a decode-only step on the CUDA graphs
                runner.graphs.run(*command.args)
            elif command.kind == "logits":
                hidden = command.args.to(runner.device)  # (from rank 0's device, or the network)
                tp.gather_vocab(runner.model.compute_logits(runner.backend, hidden), vocab)
            elif command.kind == "stop":
                break
    torch.distributed.destroy_process_group()
