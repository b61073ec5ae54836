"""The real daemon on a Hugging Face checkpoint directory (config.json + safetensors) rather
than the bundled GGUF: a tiny random Llama with a 320-token vocabulary (smaller than the
daemon's own warm-up ids once were), served over gRPC with HF's greedy tokens."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import transformers

from helpers import Daemon, scheduler_stub
from scheduler.model_source import TOKENIZER_FILES, prepare_tokenizer_dir, resolve_model
from test_e2e_grpc import make_request, one_complete
from test_model_parity import COMMON, hf_reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, HF model) of a random Llama; the tokenizer files are SmolLM2's (the
    daemon needs one; these requests send token ids)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON), dtype=torch.float32).eval()
    hf.save_pretrained(path)
    tokenizer_dir = prepare_tokenizer_dir(resolve_model("smollm2"))
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path / name)
    return path, hf


def test_a_checkpoint_directory_serves_hf_greedy_tokens(tiny, tmp_path):
    path, hf = tiny
    with Daemon(model=str(path), kv_cache_tokens=2048, log_dir=tmp_path) as d, scheduler_stub(d.address) as stub:
        for prompt in ([5, 17, 300, 42], list(range(2, 60))):
            done = one_complete(stub, make_request(prompt, max_new_tokens=10, ignore_eos=True))
            assert list(done.output_ids) == hf_reference(hf, prompt, 10)[0]
            assert done.finish_reason == "length"
