"""N-gram speculative decoding against plain decoding, side by side in one run (offline
engine, real model): decode tokens/s after the first token.

    python bench/bench_speculative.py [--dtype float32] [--tokens 200] [--drafts 3] [--batch 32] [--rounds 3]

Engines: plain decoding; n-gram drafts "always" (a request drafts whenever its suffix
matched before); n-gram as the engine runs it (at many rows, only requests that keep
enough of their drafts draft: NgramDrafter.pays).
Workloads, one request at a time: "quote" asks the chat model to repeat a passage of this
repository's README word for word (text that repeats its context: drafts hit); "chat"
asks it an open question (little repeats); "random" continues random token ids (the
model's repeats of them, if any). Then "chat xN": N different open questions at once,
where every rejected draft is a row the batch pays for.
"""

from __future__ import annotations

import argparse
import itertools
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

SUBJECTS = (
    "a lighthouse keeper",
    "a retired pilot",
    "a young baker",
    "a lost robot",
    "a city gardener",
    "a night nurse",
    "a chess champion",
    "a travelling musician",
)
EVENTS = ("finds a message in a bottle", "wins an unexpected prize", "moves to a new town", "meets an old friend")


def chat_prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def workloads(tokenizer) -> dict[str, list[int]]:
    with open(os.path.join(ROOT, "README.md")) as f:
        passage = f.read().split("\n\n")[1][:1200]
    rng = random.Random(0)
    return {
        "quote": chat_prompt(tokenizer, "Repeat the following text exactly, word for word:\n\n" + passage),
        "chat": chat_prompt(
            tokenizer, "Write a short story about a lighthouse keeper who finds a message in a bottle."
        ),
        "random": [rng.randint(100, 40000) for _ in range(200)],
    }


def open_questions(tokenizer, n: int) -> list[list[int]]:
    stories = itertools.islice(itertools.product(SUBJECTS, EVENTS), n)
    return [chat_prompt(tokenizer, f"Write a short story about {who} who {what}.") for who, what in stories]


def decode_rate(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, int, list[list[int]]]:
    """(decode tokens/s from the first token on, steps, output ids) of greedy requests
    submitted together."""
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(
            AddRequest(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True))
        )
    out = {rid: [] for rid in ids}
    first_at = None
    while engine.has_work():
        for o in engine.step().outputs:
            out[o.request_id] += o.new_token_ids
            if first_at is None:
                first_at, steps0, n0 = time.perf_counter(), engine.stats.steps, sum(map(len, out.values()))
    elapsed = time.perf_counter() - first_at
    return (sum(map(len, out.values())) - n0) / elapsed, engine.stats.steps - steps0, list(out.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--drafts", type=int, default=3, help="--speculative-num-draft-tokens")
    ap.add_argument("--batch", type=int, default=32, help="open questions at once in the last workload (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each workload, the engines' order rotated each round; the median is shown "
        "(an engine run second measured 2-4%% faster than run first, either way round)",
    )
    args = ap.parse_args()
    base = dict(
        model=args.model,
        device="cpu",
        dtype=args.dtype,
        kv_cache_tokens=max(8192, 400 * args.batch),
        num_threads=args.threads,
    )
    loaded = load_model(EngineConfig(**base))
    engines = {}
    for name, spec in (("plain", None), ("ngram always", "ngram"), ("ngram", "ngram")):
        config = EngineConfig(**base, speculative_algorithm=spec, speculative_num_draft_tokens=args.drafts)
        engines[name] = Engine(config, ModelRunner(config, loaded))
        if name == "ngram always":
            engines[name].scheduler.drafter.doubling_rows = None
        engines[name].generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_new_tokens=8))  # warm-up
    tokenizer = load_tokenizer(loaded.path)
    runs = {name: [prompt] for name, prompt in workloads(tokenizer).items()}
    if args.batch:
        runs[f"chat x{args.batch}"] = open_questions(tokenizer, args.batch)
    print(
        f"{args.tokens} greedy tokens per request, {args.drafts} drafts, dtype {args.dtype}, {args.threads} threads;"
        " decode tok/s (ratio to plain) and steps"
    )
    print(f"{'workload':>9} " + " ".join(f"{name:>22}" for name in engines) + f" {'same tokens':>12}")
    for name, prompts in runs.items():
        rounds = {engine: [] for engine in engines}
        for r in range(args.rounds):
            order = list(engines)[r % len(engines) :] + list(engines)[: r % len(engines)]
            for engine in order:
                rounds[engine].append(decode_rate(engines[engine], prompts, args.tokens))
        results = {engine: sorted(runs_, key=lambda run: run[0])[len(runs_) // 2] for engine, runs_ in rounds.items()}
        plain_rate = results["plain"][0]
        cells = [f"{rate:8.1f} ({rate / plain_rate:4.2f}x) {steps:5d}" for rate, steps, _ in results.values()]
        same = all(out == results["plain"][2] for _, _, out in results.values())
        print(f"{name:>9} " + " ".join(f"{c:>22}" for c in cells) + f" {str(same):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
