"""An HF checkpoint directory of the model our engine serves, for peers that read only HF.

The tensors are the ones our engine loads (scheduler.weights.load_checkpoint: the GGUF
dequantised to fp32, q/k rows un-permuted to HF's rotate-half layout), saved as fp32
safetensors beside transformers' config.json and the tokenizer files. Written once per
GGUF file into bench/.cache and published by an atomic rename.

    python bench/hf_checkpoint.py [--model smollm2] [--check]   # path; --check: HF parity
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "bench", ".cache")
sys.path.insert(0, os.path.join(ROOT, "src"))

from scheduler.model_source import prepare_tokenizer_dir, publish_directory, resolve_model  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def hf_checkpoint(model: str = "smollm2") -> str:
    """Directory of ``model`` as an HF fp32 checkpoint (itself when it already is one)."""
    path = resolve_model(model)
    if os.path.isdir(path):
        return path
    tokenizer_dir = prepare_tokenizer_dir(path)
    final = os.path.join(CACHE, "hf-" + os.path.basename(tokenizer_dir))  # (named by the GGUF's identity)
    if os.path.isfile(os.path.join(final, "model.safetensors")):
        return final
    os.makedirs(CACHE, exist_ok=True)
    return publish_directory(final, lambda out: _write(path, tokenizer_dir, out), "model.safetensors")


def _write(gguf_path: str, tokenizer_dir: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from scheduler.weights import load_checkpoint

    ours, state_dict = load_checkpoint(gguf_path, torch.float32)
    config = AutoConfig.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    config.architectures = [ours.architecture]  # (vLLM picks its model class by it)
    config.dtype = torch.float32
    config.save_pretrained(out)
    if ours.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # safetensors refuses shared tensors; HF re-ties it
    save_file({k: v.contiguous() for k, v in state_dict.items()}, os.path.join(out, "model.safetensors"))
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), out)


def check_parity(model: str, path: str, new_tokens: int = 24) -> bool:
    """HF transformers on ``path`` and our engine give the same greedy tokens for a prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.messages import SamplingParams

    prompt = AutoTokenizer.from_pretrained(path)("The three largest cities of France are")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    theirs = out[0, len(prompt) :].tolist()
    engine = Engine(EngineConfig(model=model, device="cpu", dtype="float32"))
    mine = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    mine = list(mine[0].output_ids)
    print(f"HF:     {theirs}\nengine: {mine}")
    return theirs == mine


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--check", action="store_true", help="compare HF's greedy tokens on it with our engine's")
    args = ap.parse_args()
    path = hf_checkpoint(args.model)
    print(path)
    sys.exit(0 if not args.check or check_parity(args.model, path) else 1)
