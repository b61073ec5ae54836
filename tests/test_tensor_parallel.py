"""Tensor parallelism on the CPU: ranks as processes over gloo (one thread each), every layer
split across them. Greedy tokens and last-position logits must equal one rank's, on random
Llama / Qwen2 / Qwen3 checkpoints (KV heads split, and copied when the ranks outnumber
them; a vocabulary that does not divide evenly) and on the bundled SmolLM2 split in three,
through chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

import pytest
import torch

from scheduler import tensor_parallel
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.messages import SamplingParams
from scheduler.model_config import ModelConfig
from scheduler.tensor_parallel import Command

transformers = pytest.importorskip("transformers")

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
COMMON = dict(
    vocab_size=321,  # (odd: the last rank's share of the vocabulary is padded)
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
}


def random_checkpoint(family: str, path) -> str:
    cls_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls_name)(**COMMON, **extra), dtype=torch.float32
    )
    with torch.no_grad():  # HF inits biases to 0 and norms to 1, which would hide a wrong split
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    hf.save_pretrained(path)
    return str(path)


def make_engine(model: str, tp: int, **overrides) -> Engine:
    sizes = {"kv_cache_tokens": 2048, **overrides}
    config = EngineConfig(model=model, device="cpu", tp_size=tp, num_threads=1, **sizes)
    return Engine(config)


def last_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The prompt's last-position logits from a fresh engine's runner (blocks 1.. as its table)."""
    runner = engine.runner
    bs = runner.block_size
    args = (prompt, [len(prompt)], [len(prompt)], [list(range(1, 1 + -(-len(prompt) // bs)))])
    with torch.inference_mode():
        if runner.tp is None:
            return runner.model.compute_logits(runner.backend, runner.forward(*args)[-1:])[0]
        runner.workers.send(Command("forward", args))
        return runner._tp_logits(runner.forward(*args)[-1:])[0]


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(5, 60))] for _ in range(n)]


def test_kv_heads_are_split_or_copied():
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=8,
        num_kv_heads=2,
        head_dim=1,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=8,
    )
    assert [tensor_parallel.kv_heads(config, r, 2) for r in range(2)] == [range(0, 1), range(1, 2)]
    assert [tensor_parallel.kv_heads(config, r, 4) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(ValueError, match="3 does not divide"):
        tensor_parallel.check_divisible(config, 3)


def test_a_rank_reads_only_its_slices_of_a_safetensors_checkpoint(tmp_path):
    """Sliced reads give what cutting the whole state dict gives."""
    from scheduler.weights import load_checkpoint

    path = random_checkpoint("llama", tmp_path)
    config, whole = load_checkpoint(path)
    for rank in range(2):
        shard = tensor_parallel.Shard(config, rank, 2)
        expected = {name: shard.take(name, w) for name, w in whole.items()}
        _, sliced = load_checkpoint(path, tp=(rank, 2))
        assert sliced.keys() == expected.keys()
        for name, w in expected.items():
            assert torch.equal(sliced[name], w), name
    assert sliced["model.embed_tokens.weight"].shape[0] == 161  # 321 rows, padded to 2 x 161


@pytest.mark.parametrize("family, tp", [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("llama", 4)])
def test_split_model_gives_one_ranks_tokens_and_logits(family, tp, tmp_path):
    path = random_checkpoint(family, tmp_path)
    batch = prompts(5, COMMON["vocab_size"])
    one = make_engine(path, 1)
    split = make_engine(path, tp)
    try:
        ref = last_logits(one, batch[0])
        got = last_logits(split, batch[0])
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        expected = [c.output_ids for c in one.generate(batch, GREEDY)]
        assert [c.output_ids for c in split.generate(batch, GREEDY)] == expected
    finally:
        split.runner.close()


def test_preemption_under_tp_gives_the_same_tokens(tmp_path):
    """A KV cache of 8 blocks for 5 requests: requests are preempted and recomputed."""
    path = random_checkpoint("llama", tmp_path)
    batch = prompts(5, COMMON["vocab_size"], seed=1)
    sizes = dict(kv_cache_tokens=128, max_num_batched_tokens=32)
    expected = [c.output_ids for c in make_engine(path, 1, **sizes).generate(batch, GREEDY)]
    split = make_engine(path, 2, **sizes)
    try:
        assert [c.output_ids for c in split.generate(batch, GREEDY)] == expected
        assert split.scheduler.num_preemptions > 0
    finally:
        split.runner.close()


def test_smollm2_in_three_ranks_through_chunks_and_prefix_hits():
    """9 heads and 3 KV heads: one KV head a rank. A small step budget cuts prompts into
    chunks, and a shared prefix hits the cache."""
    rng = random.Random(2)
    system = [rng.randrange(100, 49000) for _ in range(100)]
    batch = [system + [rng.randrange(100, 49000) for _ in range(rng.randint(60, 120))] for _ in range(3)]
    sizes = dict(kv_cache_tokens=320, max_num_batched_tokens=64, max_running_requests=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    one = make_engine("smollm2", 1, **sizes)
    expected = [c.output_ids for c in one.generate(batch, params)]
    split = make_engine("smollm2", 3, **sizes)
    try:
        assert [c.output_ids for c in split.generate(batch, params)] == expected
        assert split.scheduler.num_cached_prompt_tokens > 0
    finally:
        split.runner.close()


def test_two_nodes_on_loopback_give_one_nodes_tokens(tmp_path):
    """--nnodes 2: rank 0 here (its engine), rank 1 run by a second `python -m servicer
    --node-rank 1` as another host would, commands over TCP; a different KV size on its
    command line yields to rank 0's."""
    path = random_checkpoint("llama", tmp_path)
    batch = prompts(5, COMMON["vocab_size"], seed=3)
    expected = [c.output_ids for c in make_engine(path, 1).generate(batch, GREEDY)]
    port = free_port_pair()
    nodes = dict(nnodes=2, dist_init_addr=f"127.0.0.1:{port}")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "servicer", "--model", path, "--device", "cpu", "--tp-size", "2", "--num-threads", "1"]
        + [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            nodes["dist_init_addr"],
            "--kv-cache-tokens",
            "999",
        ],
        env=dict(os.environ, PYTHONPATH=SRC),
    )
    try:
        split = make_engine(path, 2, **nodes)
        try:
            assert split.runner.tp.shared is None  # (two hosts: the all-reduces go through gloo)
            assert [c.output_ids for c in split.generate(batch, GREEDY)] == expected
        finally:
            split.runner.close()
        assert node1.wait(30) == 0  # rank 0's stop ends the other node
    finally:
        node1.kill()
        node1.wait()


def free_port_pair() -> int:
    """A port whose next one is free too (--dist-init-addr's port and rank 0's commands)."""
    from helpers import free_port

    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def test_a_rank_reads_only_its_slices_of_a_gguf_checkpoint():
    """SmolLM2's GGUF (Q4_1 and Q8_0 blocks): each of three ranks dequantises its rows, or its
    columns' blocks, and gets exactly what cutting the whole dequantised tensor gives (the
    three-rank test above loads the whole model this way)."""
    import gguf

    from scheduler.model_config import ModelConfig
    from scheduler.model_source import resolve_model
    from scheduler.weights import GgufSlice, gguf_to_hf_name

    reader = gguf.GGUFReader(resolve_model("smollm2"))
    config = ModelConfig.from_gguf(reader)
    tensors = [t for t in reader.tensors if t.name.startswith(("blk.0.", "token_embd"))]
    assert {str(t.tensor_type.name) for t in tensors} >= {"Q4_1", "Q8_0", "F32"}
    for t in tensors:
        name, whole = gguf_to_hf_name(t.name), GgufSlice(t)[:]
        for rank in range(3):
            shard = tensor_parallel.Shard(config, rank, 3)
            assert torch.equal(shard.take(name, GgufSlice(t)), shard.take(name, whole)), (t.name, rank)
