"""Embedding and classification models in the engine (prefill-only requests, pooled), against
HF transformers on the same random weights: base models (last token, L2-normalised), a causal
LM under --is-embedding, sentence-transformers layouts (mean, CLS, last + Normalize) and a
``*ForSequenceClassification`` head."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import test_model_parity
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.messages import SamplingParams
from scheduler.model_config import ModelConfig
from scheduler.pooling import PoolingSpec, detect_pooling
from scheduler.scheduler import AdmissionError

COMMON = {**test_model_parity.COMMON, "eos_token_id": 2}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _perturb(model: torch.nn.Module) -> None:
    """HF inits norms to 1 (and the score head small): spread them so mistakes show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)


def _write(path, model_cls: str, config_cls: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).eval()
    _perturb(model)
    model.save_pretrained(path)
    return model


def _write_sentence_transformers(path, pooling_flag: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    flags = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken", "pooling_mode_max_tokens")
    config = {"word_embedding_dimension": COMMON["hidden_size"], **{f: f == pooling_flag for f in flags}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))


def _prompts() -> list[list[int]]:
    """Mixed lengths (chunked past the 16-token threshold), no pad id (HF's classifier scores the
    last non-pad token), and a repeat whose blocks the first leaves in the prefix cache."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (1, 7, 33, 90, 16)]
    return prompts + [prompts[3]]


def _hf_hidden(path, prompt: list[int]) -> torch.Tensor:
    base = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return base(torch.tensor([prompt])).last_hidden_state[0]


def _engine(path, **options) -> Engine:
    config = EngineConfig(
        model=str(path),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=2048,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=16,
        **options,
    )
    return Engine(config)


def _check(ours: list[list[float]], refs: list[torch.Tensor]) -> None:
    for i, (vector, ref) in enumerate(zip(ours, refs)):
        got = torch.tensor(vector)
        assert got.shape == ref.shape, f"prompt {i}"
        err = (got - ref).abs().max().item()
        assert err < 1e-4, f"prompt {i}: max |diff| {err:.2e}"


@pytest.mark.parametrize(
    ("model_cls", "config_cls"), [("Qwen3Model", "Qwen3Config"), ("LlamaModel", "LlamaConfig")], ids=["qwen3", "llama"]
)
def test_base_model_embeds_its_last_token_normalised(tmp_path, model_cls, config_cls):
    """A bare ``*Model`` checkpoint (tensors without ``model.``) is an embedding model by itself."""
    _write(tmp_path, model_cls, config_cls)
    engine = _engine(tmp_path)
    assert engine.config.pooling == PoolingSpec(method="last", normalize=True, source=engine.config.pooling.source)
    prompts = _prompts()
    refs = [torch.nn.functional.normalize(_hf_hidden(tmp_path, p)[-1], dim=-1) for p in prompts]
    _check(engine.embed(prompts), refs)
    stats = engine.stats_dict()
    assert stats["num_pooled_requests"] == len(prompts)
    assert stats["max_batch_size"] > 1, "the prompts shared steps"
    assert stats["num_used_blocks"] == 0, "no request keeps KV blocks"
    assert engine.load.cache_hit_rate > 0, "the repeated prompt hit the prefix cache"


def test_causal_lm_under_is_embedding(tmp_path):
    """A causal LM's checkpoint serves embeddings when asked (its LM head left unloaded), and
    generations otherwise; each engine refuses the other kind of request."""
    _write(tmp_path, "Qwen3ForCausalLM", "Qwen3Config", tie_word_embeddings=False)
    generator = _engine(tmp_path)
    assert generator.config.pooling is None
    with pytest.raises(AdmissionError, match="generation model.*--is-embedding"):
        generator.embed([[5, 6, 7]])
    engine = _engine(tmp_path, is_embedding=True)
    assert engine.runner.model.lm_head is None
    with pytest.raises(AdmissionError, match="embedding model.*not Generate"):
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    prompts = _prompts()
    refs = [torch.nn.functional.normalize(_hf_hidden(tmp_path, p)[-1], dim=-1) for p in prompts]
    _check(engine.embed(prompts), refs)


@pytest.mark.parametrize(
    ("flag", "normalize"),
    [("pooling_mode_mean_tokens", False), ("pooling_mode_cls_token", False), ("pooling_mode_lasttoken", True)],
    ids=["mean", "cls", "last-normalize"],
)
def test_sentence_transformers_pooling(tmp_path, flag, normalize):
    """modules.json and 1_Pooling/config.json choose the pooling (and 2_Normalize the norm);
    mean and CLS read every prompt row, so the repeated prompt is computed again."""
    _write(tmp_path, "LlamaForCausalLM", "LlamaConfig")
    _write_sentence_transformers(tmp_path, flag, normalize)
    engine = _engine(tmp_path)
    method = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}.get(flag, "last")
    assert (engine.config.pooling.method, engine.config.pooling.normalize) == (method, normalize)
    prompts = _prompts()
    refs = []
    for p in prompts:
        hidden = _hf_hidden(tmp_path, p)
        pooled = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[method]
        refs.append(torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled)
    _check(engine.embed(prompts), refs)
    if method != "last":
        assert engine.load.cache_hit_rate == 0


def test_sentence_transformers_modules_it_cannot_run_are_refused(tmp_path):
    _write(tmp_path, "LlamaForCausalLM", "LlamaConfig")
    _write_sentence_transformers(tmp_path, "pooling_mode_max_tokens", False)
    config = ModelConfig.from_hf_dir(str(tmp_path))
    with pytest.raises(NotImplementedError, match="exactly one of last-token, mean or CLS"):
        detect_pooling(str(tmp_path), config, False)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(NotImplementedError, match="cannot run: Dense"):
        detect_pooling(str(tmp_path), config, False)


def test_classifier_logits_equal_hf(tmp_path):
    hf = _write(tmp_path, "Qwen3ForSequenceClassification", "Qwen3Config", num_labels=3, id2label=LABELS)
    engine = _engine(tmp_path)
    assert engine.config.pooling.labels == tuple(LABELS.values())
    prompts = _prompts()
    with torch.inference_mode():
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    _check(engine.embed(prompts), refs)


def test_labels_default_to_hf_names():
    config = {
        **COMMON,
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "architectures": ["Qwen3ForSequenceClassification"],
    }
    assert ModelConfig.from_hf_dict(config).labels == ("LABEL_0", "LABEL_1")
    config["id2label"] = {"0": "no", "2": "yes", "1": "maybe"}
    assert ModelConfig.from_hf_dict(config).labels == ("no", "maybe", "yes")


def test_an_embedding_that_fills_the_context_is_admitted(tmp_path):
    _write(tmp_path, "Qwen3Model", "Qwen3Config")
    engine = _engine(tmp_path, max_model_len=64)
    (vector,) = engine.embed([[7] * 64])
    assert len(vector) == COMMON["hidden_size"]
    with pytest.raises(AdmissionError, match="the input has 65 tokens; the context limit is 64"):
        engine.embed([[7] * 65])


@pytest.mark.parametrize("model_cls", ["Qwen3Model", "Qwen3ForSequenceClassification"], ids=["base", "classifier"])
def test_two_tensor_parallel_ranks_pool_as_hf(tmp_path, model_cls):
    """Each rank reads its slices (a base model's names carry no ``model.``); rank 0 pools the
    hidden states the all-reduces made whole, and scores them with the head it holds whole."""
    extra = {"num_labels": 3, "id2label": LABELS} if model_cls.endswith("Classification") else {}
    hf = _write(tmp_path, model_cls, "Qwen3Config", **extra)
    engine = _engine(tmp_path, tp_size=2, num_threads=1)
    try:
        prompts = _prompts()
        with torch.inference_mode():
            if extra:
                refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
            else:
                refs = [
                    torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
                    for p in prompts
                ]
        _check(engine.embed(prompts), refs)
    finally:
        engine.runner.close()
