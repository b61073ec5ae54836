"""resolve(): every "auto" and None of an EngineConfig decided from DEVICE_DEFAULTS, once,
for the device, dtype and model; combinations that cannot run are refused at start-up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scheduler.config import DEVICE_DEFAULTS, EngineConfig, describe_default
from scheduler.model_config import ModelConfig
from scheduler.resolve import ResolvedConfig, resolve
from test_model_config import LLAMA

MODEL = ModelConfig.from_hf_dict(LLAMA)  # a tiny Llama: 2 layers, 2 KV heads of 16
WEIGHTS = 2**20


def cpu(**overrides) -> ResolvedConfig:
    return resolve(EngineConfig(device="cpu", **overrides), MODEL, WEIGHTS)


def test_cpu_defaults_come_from_the_table():
    rc, row = cpu(), DEVICE_DEFAULTS["cpu"]
    assert rc.device == torch.device("cpu") and rc.dtype == torch.float32 == getattr(torch, row.dtype)
    assert rc.kernel_backend == row.kernel_backend == "cpu"
    assert rc.max_running_requests == row.max_running_requests
    assert rc.max_num_batched_tokens == row.max_num_batched_tokens
    assert rc.long_prefill_token_threshold == row.max_num_batched_tokens // 2
    assert rc.overlap_schedule is row.overlap_schedule is False
    assert not rc.cuda_graph and rc.max_speculative_rows == 0
    assert rc.max_model_len == MODEL.max_position_embeddings
    per_token = 2 * MODEL.num_layers * MODEL.num_kv_heads * MODEL.head_dim * 4
    assert rc.num_kv_blocks == 2**31 // (per_token * rc.block_size)  # the table's 2GiB
    assert rc.served_model_name == "smollm2" and rc.speculative_algorithm == "none"
    assert rc.max_queued_requests == 4 * row.max_running_requests
    # nothing left undecided (no disaggregation is a decision: mode null; no pooling: it generates)
    left = {f.name for f in dataclasses.fields(rc) if getattr(rc, f.name) in (None, "auto")}
    assert left == {"disaggregation", "pooling"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.max_model_len = 1


def test_what_the_user_sets_wins():
    rc = cpu(
        dtype="bfloat16",
        kernel_backend="torch",
        max_running_requests=3,
        max_num_batched_tokens=100,
        long_prefill_token_threshold=0,
        kv_cache_tokens=100,
        max_model_len=64,
        overlap_schedule=True,
        cpu_packed_weights=False,
        served_model_name="named",
    )
    assert (rc.dtype, rc.kernel_backend, rc.max_running_requests) == (torch.bfloat16, "torch", 3)
    assert (rc.max_num_batched_tokens, rc.long_prefill_token_threshold) == (100, 0)
    assert rc.num_kv_blocks == 7 + 1 and rc.kv_capacity_tokens == 112  # whole blocks + the null block
    assert rc.max_model_len == 64 and rc.overlap_schedule and not rc.cpu_packed_weights
    assert rc.served_model_name == "named"


def test_speculation_resolves_its_cost_model_per_dtype():
    rc = cpu(speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    assert rc.speculative_num_draft_tokens == 4 and not rc.overlap_schedule
    assert rc.speculative_doubling_rows == DEVICE_DEFAULTS["cpu"].speculative_doubling_rows["float32"]
    assert cpu(speculative_num_draft_tokens=4).speculative_num_draft_tokens == 0  # (no algorithm)


@pytest.mark.parametrize(
    "overrides, error",
    [
        (dict(kernel_backend="fast"), "unknown kernel backend 'fast'"),
        (dict(kernel_backend="triton"), "TRITON_INTERPRET=1"),
        (dict(speculative_algorithm="eagle"), "not supported"),
        (dict(speculative_algorithm="ngram", overlap_schedule=True), "overlap schedule"),
        (dict(max_model_len=257), "exceeds the model's context"),
        (dict(kv_cache_memory="1KiB"), "fewer than 2 blocks"),
        (dict(tp_size=2, overlap_schedule=True), "cannot run with --tp-size"),
    ],
)
def test_what_cannot_run_is_refused(overrides, error, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=error):
        cpu(**overrides)


def test_replicas_and_ranks_share_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert cpu().num_threads == 8
    assert cpu(tp_size=2, dp_size=2).num_threads == 2
    assert cpu(tp_size=2, nnodes=2).num_threads == 8  # (one rank on each host)


def test_help_texts_read_the_table():
    assert describe_default("max_running_requests") == "64 on cpu, 256 on cuda and npu"
    assert describe_default("kernel_backend") == "cpu on cpu, triton on cuda, torch on npu"
