"""Model configs we cannot run exactly are refused with a clear error, never served with
silently different outputs; sliding-window models are limited to what full attention
computes exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.model_config import ModelConfig
from scheduler.models import build_model

transformers = pytest.importorskip("transformers")

LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.mark.parametrize(
    "change,error",
    [
        (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act 'gelu_pytorch_tanh'"),
        (dict(model_type="gemma", architectures=None), "model_type 'gemma'"),  # no longer taken for a Llama
    ],
)
def test_configs_we_cannot_run_exactly_are_refused(change, error):
    with pytest.raises(NotImplementedError, match=error):
        ModelConfig.from_hf_dict({**LLAMA, **change})


@pytest.mark.parametrize(
    "change,error",
    [
        (
            dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "rope scaling 'llama3' needs low_freq_factor, high_freq_factor, original_max_position_embeddings",
        ),
        (dict(rope_scaling={"type": "linear"}), "rope scaling 'linear' needs factor"),
        (dict(quantization_config={"quant_method": "fp8"}), r"quantised checkpoints \(fp8\) are not supported"),
    ],
)
def test_incomplete_or_quantised_configs_are_refused_by_name(change, error):
    with pytest.raises((ValueError, NotImplementedError), match=error):
        ModelConfig.from_hf_dict({**LLAMA, **change})


def test_qwen_has_a_sliding_window_only_when_a_layer_slides():
    qwen = {
        **LLAMA,
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "sliding_window": 16,
        "use_sliding_window": True,
    }
    window = lambda **kw: ModelConfig.from_hf_dict({**qwen, **kw}).sliding_window  # noqa: E731
    assert window(max_window_layers=2) is None  # HF: layers >= max_window_layers slide; none here
    assert window(max_window_layers=1) == 16
    assert window(use_sliding_window=False, max_window_layers=0) is None
    assert window(layer_types=["full_attention", "sliding_attention"], max_window_layers=2) == 16


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


def _gguf_reader(**fields):
    """Just the metadata ModelConfig.from_gguf reads (a narrow stand-in for GGUFReader)."""
    base = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.vocab_size": 320,
        "llama.feed_forward_length": 128,
        "llama.block_count": 2,
    }
    return SimpleNamespace(fields={k: _Field(v) for k, v in {**base, **fields}.items()}, tensors=[])


def test_gguf_rope_scaling_is_linear_or_refused():
    config = ModelConfig.from_gguf(
        _gguf_reader(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    )
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    for fields in (
        {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
        {"llama.rope.scaling.type": "linear"},
    ):  # no factor
        with pytest.raises(NotImplementedError, match="rope scaling"):
            ModelConfig.from_gguf(_gguf_reader(**fields))


def _tiny_hf(cls_name: str, **kw):
    torch.manual_seed(0)
    config = getattr(transformers, cls_name)(
        **{k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures")}, **kw
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_sliding_window_limits_the_context(tmp_path):
    from scheduler.model_runner import ModelRunner

    _tiny_hf("MistralConfig", sliding_window=16).save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", kv_cache_tokens=256)
    assert ModelRunner(config).max_model_len == 16  # full attention is exact up to the window
    with pytest.raises(ValueError, match="sliding window"):
        ModelRunner(EngineConfig(model=str(tmp_path), device="cpu", kv_cache_tokens=256, max_model_len=32))


def test_tied_config_takes_only_an_identical_lm_head_copy():
    hf = _tiny_hf("LlamaConfig", tie_word_embeddings=True)
    config = ModelConfig.from_hf_dict({**LLAMA, "tie_word_embeddings": True})
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    build_model(config).load_weights(dict(state))  # the usual stored copy: fine
    state["lm_head.weight"] += 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        build_model(config).load_weights(state)


def test_loading_consumes_the_state_dict():
    """The model adopts the checkpoint's tensors and each entry leaves the dict once used:
    no second copy of the weights outlives the load (fused and cast ones included)."""
    hf = _tiny_hf("LlamaConfig")
    config = ModelConfig.from_hf_dict(LLAMA)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    model = build_model(config, dtype=torch.bfloat16)
    model.load_weights(state)
    assert state == {}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_gguf_tensors_arrive_in_the_target_dtype():
    """Dequantised one at a time and cast at once: never the whole model in float32."""
    from scheduler.model_source import resolve_model
    from scheduler.weights import load_checkpoint

    _, fp32 = load_checkpoint(resolve_model("smollm2"))
    _, bf16 = load_checkpoint(resolve_model("smollm2"), torch.bfloat16)
    assert fp32.keys() == bf16.keys() and all(t.dtype == torch.bfloat16 for t in bf16.values())
    name = "model.layers.0.self_attn.q_proj.weight"  # (unpermuted before the cast)
    assert torch.equal(bf16[name], fp32[name].to(torch.bfloat16))


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32},  # Qwen's long-context setting
        {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {"factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 0.9},
        {"factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.7, "mscale_all_dim": 1.3},
        {"factor": None, "original_max_position_embeddings": 64},  # factor: the ratio of the two contexts
    ],
)
def test_yarn_rope_matches_hf(rope):
    """Our YaRN frequencies and cos/sin scale against transformers' own on the same config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kernels.rotary import rope_attention_factor, rope_inv_freq

    hf_config = transformers.Qwen3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **rope},
    )
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    assert config.rope_scaling["rope_type"] == "yarn"
    torch.testing.assert_close(
        rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), hf_inv_freq, rtol=1e-6, atol=0
    )
    assert rope_attention_factor(config.rope_scaling) == pytest.approx(hf_factor, rel=1e-12)


def test_granite_scalars_take_hf_defaults_and_gguf_granite_is_refused():
    granite = {**LLAMA, "model_type": "granite", "architectures": ["GraniteForCausalLM"]}
    config = ModelConfig.from_hf_dict(granite)  # HF's defaults: all 1.0, the attention one replacing 1/sqrt(d)
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (1.0, 1.0, 1.0)
    assert config.attention_multiplier == 1.0
    assert ModelConfig.from_hf_dict(LLAMA).attention_multiplier is None  # 1/sqrt(head_dim)
    with pytest.raises(NotImplementedError, match="GGUF architecture 'granite'"):
        ModelConfig.from_gguf(_gguf_reader(**{"general.architecture": "granite"}))


def test_yarn_extends_the_context_to_factor_times_the_original():
    """Qwen's documented setting: 32k trained, yarn x4 -> a 131,072-token context (vLLM
    derives it the same way); transformers leaves max_position_embeddings as written."""
    qwen = {**LLAMA, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 40960}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert ModelConfig.from_hf_dict({**qwen, "rope_scaling": yarn}).max_position_embeddings == 131072
    assert ModelConfig.from_hf_dict(qwen).max_position_embeddings == 40960
