"""N-gram speculative decoding against plain decoding, side by side in one run (offline
engine, real model, one request at a time): decode tokens/s after the first token.

    python bench/bench_speculative.py [--dtype float32] [--tokens 200] [--drafts 3]

Workloads: "quote" asks the chat model to repeat a passage of this repository's README
word for word (text that repeats its context: drafts hit); "chat" asks it an open
question (little repeats: drafts seldom exist, and a step without one is a plain step);
"random" continues random token ids (the model's repeats of them, if any).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.messages import AddRequest, SamplingParams  # noqa: E402
from scheduler.model_runner import ModelRunner, load_model  # noqa: E402
from scheduler.stop_strings import load_tokenizer  # noqa: E402


def workloads(tokenizer) -> dict[str, list[int]]:
    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    with open(os.path.join(ROOT, "README.md")) as f:
        passage = f.read().split("\n\n")[1][:1200]
    rng = random.Random(0)
    return {
        "quote": chat("Repeat the following text exactly, word for word:\n\n" + passage),
        "chat": chat("Write a short story about a lighthouse keeper who finds a message in a bottle."),
        "random": [rng.randint(100, 40000) for _ in range(200)],
    }


def decode_rate(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, int, list[int]]:
    """(decode tokens/s after the first token, steps, output ids) of one greedy request."""
    engine.add_request(AddRequest(f"r{time.monotonic_ns()}", prompt,
                                  SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)))
    out, first_at, steps0 = [], None, engine.stats.steps
    while engine.has_work():
        for o in engine.step().outputs:
            out += o.new_token_ids
            if first_at is None and out:
                first_at, steps0, n0 = time.perf_counter(), engine.stats.steps, len(out)
    elapsed = time.perf_counter() - first_at
    return (len(out) - n0) / elapsed, engine.stats.steps - steps0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--drafts", type=int, default=3, help="--speculative-num-draft-tokens")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    base = dict(model=args.model, device="cpu", dtype=args.dtype, kv_cache_tokens=8192, num_threads=args.threads)
    loaded = load_model(EngineConfig(**base))
    engines = {}
    for name, spec in (("plain", None), ("ngram", "ngram")):
        config = EngineConfig(**base, speculative_algorithm=spec, speculative_num_draft_tokens=args.drafts)
        engines[name] = Engine(config, ModelRunner(config, loaded))
        engines[name].generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_new_tokens=8))  # warm-up
    print(f"{args.tokens} greedy tokens per request, one request at a time, {args.drafts} drafts, "
          f"dtype {args.dtype}, {args.threads} threads")
    print(f"{'workload':>8} {'plain tok/s':>12} {'ngram tok/s':>12} {'ratio':>6} {'steps':>11} {'same tokens':>12}")
    for name, prompt in workloads(load_tokenizer(loaded.path)).items():
        plain_rate, plain_steps, plain_out = decode_rate(engines["plain"], prompt, args.tokens)
        spec_rate, spec_steps, spec_out = decode_rate(engines["ngram"], prompt, args.tokens)
        print(f"{name:>8} {plain_rate:>12.1f} {spec_rate:>12.1f} {spec_rate / plain_rate:>5.2f}x "
              f"{plain_steps:>5}/{spec_steps:<5} {str(plain_out == spec_out):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
