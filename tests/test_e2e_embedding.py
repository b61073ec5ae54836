"""The real daemon serving an embedding model and a classifier (random weights of the bundled
tokenizer's vocabulary, written by the test) over gRPC and behind the real router's
/v1/embeddings and /v1/classify, against HF transformers on the same weights."""

from __future__ import annotations

import json
import os
import shutil
import uuid

import grpc
import pytest
import torch
import transformers
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from helpers import Daemon, Router, scheduler_stub, wait_kv_free, wait_until
from scheduler.model_source import TOKENIZER_FILES, prepare_tokenizer_dir, resolve_model
from test_e2e_grpc import make_request

VOCAB_SIZE = 49152  # the bundled tokenizer's
CONTEXT = 8192
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=CONTEXT,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _checkpoint(path, model_cls: str, **extra):
    """A random Qwen3 ``model_cls`` saved at ``path`` with the bundled tokenizer's files."""
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(transformers.Qwen3Config(**SHAPE, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(path)
    tokenizer_dir = prepare_tokenizer_dir(resolve_model("smollm2"))
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path / name)
    return model


def embed_request(ids, rid=None, text="") -> pb.EmbedRequest:
    """As the router builds it: only the id and the tokenized input."""
    return pb.EmbedRequest(
        request_id=rid or f"embed-{uuid.uuid4().hex[:16]}",
        tokenized=pb.TokenizedInput(original_text=text, input_ids=list(ids)),
    )


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(daemon, router, HF base model, tokenizer) of a Qwen3Model (an embedding model by its
    architecture alone: no flag)."""
    path = tmp_path_factory.mktemp("qwen3-embedding")
    hf = _checkpoint(path, "Qwen3Model")
    logs = tmp_path_factory.mktemp("embedder-logs")
    with Daemon(model=str(path), max_running_requests=64, kv_cache_tokens=40000, log_dir=logs) as daemon:
        with Router(daemon.port, log_dir=logs) as router:
            yield daemon, router, hf, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def stub(embedder):
    with scheduler_stub(embedder[0].address) as s:
        yield s


def hf_embedding(hf, ids) -> list[float]:
    with torch.inference_mode():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1).tolist()


def assert_close(got, want, tol=1e-4):
    assert len(got) == len(want)
    err = max(abs(a - b) for a, b in zip(got, want))
    assert err < tol, f"max |diff| {err:.2e}"


def test_the_daemon_says_it_embeds(embedder, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert not info.is_generation
    assert info.architectures == ["Qwen3Model"] and info.num_labels == 0 and not info.id2label_json
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert server.server_args.fields["is_embedding"].bool_value


def test_embed_equals_hf(embedder, stub):
    _, _, hf, _ = embedder
    for ids in ([5, 17, 300, 42], list(range(100, 700))):  # (the second prefills in chunks)
        reply = stub.Embed(embed_request(ids), timeout=60)
        assert reply.prompt_tokens == len(ids) and reply.embedding_dim == SHAPE["hidden_size"]
        assert_close(list(reply.embedding), hf_embedding(hf, ids))


def test_router_embeddings_return_the_grpc_vector(embedder, stub):
    """/v1/embeddings tokenizes the text with special tokens and forwards the ids: the vector
    is the one a direct Embed of those ids returns, with their count as usage."""
    _, router, _, tokenizer = embedder
    text = "The quick brown fox jumps over the lazy dog."
    r = router.post("/v1/embeddings", {"model": router.model, "input": text})
    assert r.status == 200, r.text
    body = r.json()
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    direct = stub.Embed(embed_request(ids), timeout=60)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert_close(body["data"][0]["embedding"], list(direct.embedding), tol=1e-6)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "the input is empty"),
        ([7] * (CONTEXT + 1), f"the context limit is {CONTEXT}"),
        ([5, VOCAB_SIZE], f"token id {VOCAB_SIZE} is outside the vocabulary"),
    ],
    ids=["empty", "over-the-context", "out-of-vocabulary"],
)
def test_bad_input_is_invalid_argument(embedder, stub, ids, message):
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(embed_request(ids), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    assert embedder[0].health_status() == "SERVING"


def test_generate_on_an_embedding_daemon_is_invalid_argument(embedder, stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(make_request([5, 6, 7], max_new_tokens=4), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not Generate" in e.value.details()
    assert embedder[0].health_status() == "SERVING"


def test_concurrent_embeds_share_steps_and_a_cancelled_one_frees_its_blocks(embedder, stub):
    g = torch.Generator().manual_seed(2)
    inputs = [
        torch.randint(3, VOCAB_SIZE, (int(n),), generator=g).tolist()
        for n in torch.randint(64, 512, (64,), generator=g)
    ]
    before = _stats(stub)
    futures = [stub.Embed.future(embed_request(ids), timeout=300) for ids in inputs]
    replies = [f.result() for f in futures]
    assert [r.prompt_tokens for r in replies] == [len(ids) for ids in inputs]
    after = _stats(stub)
    assert after["num_pooled_requests"] - before["num_pooled_requests"] == 64
    steps = after["steps"] - before["steps"]
    assert steps < 64, f"64 embeds took {steps} steps: they did not share them"
    assert after["max_batch_size"] > 1

    # A long input prefills over many steps; cancelled while it runs, its KV is freed at once.
    long_input = torch.randint(3, VOCAB_SIZE, (CONTEXT,), generator=g).tolist()
    call = stub.Embed.future(embed_request(long_input), timeout=300)
    wait_until(lambda: _stats(stub)["num_used_tokens"] > 0, 60, "the long embed to hold KV")
    call.cancel()
    assert wait_kv_free(stub) == (0, 0, 0)
    assert _stats(stub)["num_pooled_requests"] == after["num_pooled_requests"], "it was cancelled, not answered"


def _stats(stub) -> dict:
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).scheduler_info
    return {k: v.number_value for k, v in info.fields.items() if v.WhichOneof("kind") == "number_value"}


def test_classifier_behind_the_router(tmp_path):
    """A *ForSequenceClassification checkpoint: Embed returns HF's logits, GetModelInfo its
    labels, and /v1/classify names the label HF's argmax does."""
    path = tmp_path / "classifier"
    hf = _checkpoint(path, "Qwen3ForSequenceClassification", num_labels=len(LABELS), id2label=LABELS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with Daemon(model=str(path), kv_cache_tokens=4096, log_dir=tmp_path) as daemon:
        with scheduler_stub(daemon.address) as stub, Router(daemon.port, log_dir=tmp_path) as router:
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert not info.is_generation and info.num_labels == len(LABELS)
            assert json.loads(info.id2label_json) == {str(k): v for k, v in LABELS.items()}
            for text in ("I loved every minute of it.", "Terrible service, never again!", "It is a chair."):
                ids = tokenizer(text, add_special_tokens=True)["input_ids"]
                with torch.inference_mode():
                    logits = hf(torch.tensor([ids])).logits[0]
                reply = stub.Embed(embed_request(ids), timeout=60)
                assert_close(list(reply.embedding), logits.tolist())
                r = router.post("/v1/classify", {"model": router.model, "input": text})
                assert r.status == 200, r.text
                answer = r.json()["data"][0]
                assert answer["label"] == LABELS[int(logits.argmax())]
                assert answer["num_classes"] == len(LABELS)
            assert daemon.health_status() == "SERVING"


def test_embed_on_a_generation_daemon_is_invalid_argument(daemon, grpc_stub):
    """(The session's daemon serves the bundled generation model.)"""
    with pytest.raises(grpc.RpcError) as e:
        grpc_stub.Embed(embed_request([5, 6, 7]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--is-embedding" in e.value.details()
    assert daemon.health_status() == "SERVING"
