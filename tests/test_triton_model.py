"""The Triton path of the whole model, on the CPU under ``TRITON_INTERPRET=1``.

* the fused kernels the model uses on GPUs (qkv split + q/k norm + rope + KV store; SiLU-mul)
  against the torch reference;
* a tiny random Qwen3 / Llama through the real engine with ``kernel_backend="triton"``
  (varlen metadata, unified attention, fused kernels) against the torch backend: same greedy
  tokens, with chunked prefill and a prefix-cache hit in the mix;
* the CUDA-graph bookkeeping: capture sizes, padding, and a padded decode batch run through
  the graphs' static buffers (eagerly: no GPU here) giving the unpadded rows' results.
"""

from __future__ import annotations

import logging
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest
import torch

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from kernels import activation, triton_ops  # noqa: E402
from kernels import attention as ref_attn  # noqa: E402
from kernels import rotary as ref_rotary  # noqa: E402
from kernels.backend import TritonBackend  # noqa: E402
from kernels.triton_attention import build_varlen  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.cuda_graphs import DecodeGraphs, capture_sizes, decode_inputs, padded_size  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.messages import SamplingParams  # noqa: E402
from scheduler.model_config import ModelConfig  # noqa: E402
from scheduler.model_runner import LoadedModel, ModelRunner  # noqa: E402
from scheduler.models import build_model  # noqa: E402


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [32, 80])  # 80: half a head is no power of two (padded, masked)
def test_qkv_rope_store_matches_reference(qk_norm, dtype, D):
    g = torch.Generator().manual_seed(0)
    T, H, KVH, bs, nb = 5, 6, 2, 16, 8
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    table = ref_rotary.rope_cos_sin(D, 128, 10000.0)
    positions = torch.tensor([0, 3, 17, 40, 99])
    cos, sin = table[positions].chunk(2, dim=-1)
    slots = torch.tensor([5, -1, 33, 64, 100])  # -1: a padded row, nothing stored
    qw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype) if qk_norm else None
    kw = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype) if qk_norm else None
    caches = [torch.full((nb, bs, KVH, D), 7.0, dtype=dtype) for _ in range(4)]

    q = triton_ops.qkv_rope_store(qkv, H, KVH, cos, sin, caches[0], caches[1], slots, qw, kw, 1e-6)
    rq, _, _ = ref_attn.qkv_rope_store(qkv, H, KVH, cos, sin, caches[2], caches[3], slots, qw, kw, 1e-6)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(q, rq, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    torch.testing.assert_close(caches[1], caches[3], **tol)


def test_silu_and_mul_matches_reference():
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(0))  # > one 1024-column tile
    torch.testing.assert_close(triton_ops.silu_and_mul(x), activation.silu_and_mul(x), atol=1e-6, rtol=1e-6)


# -- the whole model through the engine ----------------------------------------------------

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=None,
)


def tiny_model(family: str, head_dim: int = 32) -> LoadedModel:
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[family]
    hf_config = cls(**TINY, **({"head_dim": head_dim} if family == "qwen3" else {}))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    model = build_model(config)
    model.load_weights({k: v.clone() for k, v in hf.state_dict().items()})
    return LoadedModel("random", config, model.eval())


def engine(loaded: LoadedModel, backend: str, small_batch_gemv: bool = False) -> Engine:
    config = EngineConfig(
        model="random",
        device="cpu",
        kernel_backend=backend,
        kv_cache_tokens=1024,
        max_num_batched_tokens=48,
        max_running_requests=8,
        num_threads=1,
        small_batch_gemv=small_batch_gemv,
    )
    return Engine(config, ModelRunner(config, loaded))


@pytest.mark.parametrize(
    "family, head_dim", [("qwen3", 32), ("llama", 16), ("qwen3", 80)], ids=["qwen3", "llama", "qwen3-head_dim-80"]
)
def test_triton_backend_generates_like_torch_backend(family, head_dim):
    loaded = tiny_model(family, head_dim)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(1, 300, (37,), generator=g).tolist()
    prompts = [shared + [5, 6], torch.randint(1, 300, (70,), generator=g).tolist(), [9], shared + [7]]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    # triton+gemv: steps of <= 16 tokens (the decodes, a 1-token prompt) take the fused
    # small-batch projections (kernels/triton_gemv.py), longer ones the plain Triton path.
    for backend in ("torch", "cpu", "triton", "triton+gemv"):
        eng = engine(loaded, backend.split("+")[0], small_batch_gemv=backend.endswith("gemv"))
        assert eng.runner.backend.name == backend.split("+")[0]
        assert getattr(eng.runner.backend, "small_batch_gemv", False) == backend.endswith("gemv")
        first = eng.generate(prompts[:3], sp)  # 70-token prompt: chunked (48-token budget)
        second = eng.generate(prompts[3:], sp)  # shares 32 cached tokens with prompt 0
        assert second[0].num_cached_tokens == 32
        runs[backend] = [c.output_ids for c in first + second]
    assert runs["triton"] == runs["torch"] == runs["cpu"] == runs["triton+gemv"]


def test_pdl_is_refused_without_a_hopper_gpu(caplog):
    """--pdl needs sm_90+ (griddepcontrol): elsewhere it is refused with a warning, and the
    small-batch kernels launch as usual."""
    config = EngineConfig(
        model="random",
        device="cpu",
        kernel_backend="triton",
        kv_cache_tokens=256,
        num_threads=1,
        small_batch_gemv=True,
        pdl=True,
    )
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(config, tiny_model("qwen3"))
    assert runner.backend.small_batch_gemv and not runner.backend.pdl
    assert "pdl needs" in caplog.text


# -- CUDA-graph bookkeeping ----------------------------------------------------------------


def test_capture_sizes_and_padding():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(100)[-1] == 112 and capture_sizes(100)[4] == 16
    assert capture_sizes(6) == [1, 2, 4, 6] and capture_sizes(1) == [1]
    sizes = capture_sizes(64)
    assert [padded_size(sizes, n) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert padded_size(sizes, 65) is None
    vecs, table = decode_inputs([11, 12], [3, 20], [[4], [5, 6]], 16, 4)
    assert vecs.tolist() == [[11, 12, 0, 0], [66, 6 * 16 + 3, -1, -1], [2, 19, 0, 0], [3, 20, 0, 0]]
    assert table.tolist() == [[4, 0], [5, 6]]


def test_padded_decode_through_static_buffers_matches_eager():
    loaded = tiny_model("qwen3")
    model, mc = loaded.model, loaded.config
    # num_sms=64 makes the graphs' decode attention split the keys (flash-decoding) 16 ways
    ops = TritonBackend(torch.device("cpu"), 16, num_kv_heads=mc.num_kv_heads, num_sms=64)
    shape = (32, 16, mc.num_kv_heads, mc.head_dim)
    g = torch.Generator().manual_seed(2)
    kv_a = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(mc.num_layers)]
    kv_b = [(k.clone(), v.clone()) for k, v in kv_a]
    ids, seq_lens, tables = [3, 50, 7], [5, 20, 33], [[2], [9, 4], [11, 12, 13]]
    with torch.inference_mode():
        meta = build_varlen([1, 1, 1], seq_lens, tables, 16, "cpu")
        eager = model(ops, torch.tensor(ids), kv_a, meta)
        graphs = DecodeGraphs(model, ops, kv_b, max_batch=8, max_blocks=16, device=torch.device("cpu"))
        bs = graphs.load_inputs(ids, seq_lens, tables)
        assert bs == 4
        padded = graphs._forward(bs)
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()  # the pad row (no keys) is zeros through attention, never NaN
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):  # the pad row stored nothing
        torch.testing.assert_close(ka, kb)
        torch.testing.assert_close(va, vb)


# -- fused temperature sampling --------------------------------------------------------------


def test_gumbel_sampling_greedy_rows_and_distribution():
    from kernels.triton_sampling import VOCAB_SLICE, gumbel_sample

    g = torch.Generator().manual_seed(0)
    vocab = VOCAB_SLICE + 300  # two vocab slices
    logits = torch.randn(6, vocab, generator=g)
    logits[0, 4200] = 50.0  # greedy row: the max sits in the second slice
    temps = torch.tensor([0.0, 0.0, 0.7, 0.7, 1.0, 1.0])
    tokens = gumbel_sample(logits, temps, seed=123)
    assert tokens[0] == 4200 and tokens[1] == logits[1].argmax()
    assert ((tokens >= 0) & (tokens < vocab)).all()
    assert torch.equal(tokens, gumbel_sample(logits, temps, seed=123))  # same seed, same draw

    # In distribution: 1500 rows over a 4-token vocabulary vs softmax(logits / T) (seeded:
    # the same draws every run; the CPU interpreter runs the rows one by one).
    small = torch.tensor([2.0, 1.0, 0.0, -1.0]).repeat(1500, 1)
    draws = gumbel_sample(small, torch.full((1500,), 0.8), seed=7)
    freq = torch.bincount(draws, minlength=4).float() / 1500
    expected = torch.softmax(small[0] / 0.8, dim=0)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_filtered_rows_sample_on_the_device_through_the_rejection_kernel():
    """GPUs sample top-k / top-p / min-p / seeded rows with the Triton rejection kernel
    (uniforms drawn up front, no host sync): greedy rows stay exact, draws stay in their
    kept sets, and a seeded row draws the same token whatever shares its batch."""
    from kernels.sampling import SamplingTensors, sample

    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 3

    # rows: greedy, top_k 1, top_p 0.5, top_k 3, min_p 0.3, seeded with top_p 0.9
    temperature, top_p = [0.0, 0.8, 0.8, 0.8, 0.8, 0.8], [1.0, 1.0, 0.5, 1.0, 1.0, 0.9]
    top_k, min_p = [0, 1, 0, 3, 0, 0], [0.0, 0.0, 0.0, 0.0, 0.3, 0.0]

    def run(rows: list[int]):
        seeded = [(j, torch.Generator().manual_seed(11)) for j, r in enumerate(rows) if r == 5]
        p = SamplingTensors.build(
            [temperature[r] for r in rows],
            [top_p[r] for r in rows],
            [top_k[r] for r in rows],
            "cpu",
            min_p=[min_p[r] for r in rows],
            seeded=seeded,
            vocab=vocab,
            kernel_generator=torch.Generator().manual_seed(len(rows)),
        )
        assert p.uniforms is not None
        return sample(logits[rows].clone(), p).tolist()

    tokens = run(list(range(6)))
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()  # greedy, top_k 1
    assert tokens[3] in logits[3].topk(3).indices.tolist()
    probs = torch.softmax(logits[4] / 0.8, dim=0)
    assert probs[tokens[4]] >= 0.3 * probs.max()  # min_p
    sorted_p, order = torch.sort(torch.softmax(logits[2] / 0.8, dim=0), descending=True)
    above = sorted_p[: order.tolist().index(tokens[2])].sum()
    assert above < 0.5  # top_p: less than half the mass is more likely than the draw
    assert run([5])[0] == tokens[5] == run([3, 5, 0])[1]  # the seeded row, alone or in company
