"""A short request arriving while a long prompt prefills: its time to first token with the
long-prefill threshold off and on, side by side in one run (offline engine, real model).

    python bench/bench_long_prefill.py [--long 6000] [--rounds 3] [--dtype float32]

Each round: a `--long`-token prompt is added and one engine step runs (its first chunk),
then an 8-token request arrives; the engine steps until both have their first token. The
short request's TTFT is counted from its arrival, the long one's from the start.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.messages import AddRequest, SamplingParams  # noqa: E402


def one_round(engine: Engine, long_prompt: list[int], short_prompt: list[int], tag: str) -> tuple[float, float, int]:
    """(short TTFT s, long TTFT s, steps) of one round."""
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    engine.add_request(AddRequest(f"long-{tag}", long_prompt, params))
    steps = 0
    t_short = None
    while len(first) < 2:
        for out in engine.step().outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id.split("-")[0], time.perf_counter())
        steps += 1
        if t_short is None:  # after the long prompt's first step: the short one arrives
            t_short = time.perf_counter()
            engine.add_request(AddRequest(f"short-{tag}", short_prompt, params))
    while engine.has_work():
        engine.step()
    return first["short"] - t_short, first["long"] - t0, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--long", type=int, default=6000, help="tokens of the long prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--threshold", type=int, default=None, help="the threshold to compare with 0 (default: the engine's)"
    )
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    for threshold in (0, args.threshold):
        config = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            enable_prefix_caching=False,
            kv_cache_tokens=max(16384, args.long + 1024),
            long_prefill_token_threshold=threshold,
        )
        engine = Engine(config)
        engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
        effective = engine.scheduler.config.long_prefill_token_threshold
        results = []
        for r in range(args.rounds):
            long_prompt = [rng.randint(100, 40000) for _ in range(args.long)]
            short_prompt = [rng.randint(100, 40000) for _ in range(8)]
            results.append(one_round(engine, long_prompt, short_prompt, f"{threshold}{r}"))
        rows.append((effective, engine.scheduler.config.max_num_batched_tokens, results))
        del engine
    print(
        f"a {args.long}-token prompt, then an 8-token one after its first step; {args.rounds} rounds, "
        f"median; device {args.device}, dtype {args.dtype}"
    )
    print(f"{'threshold':>9} {'budget':>7} {'short TTFT s':>13} {'long TTFT s':>12} {'steps':>6}")
    medians = []
    for effective, budget, results in rows:
        short, long_, steps = (statistics.median(x) for x in zip(*results))
        medians.append((short, long_))
        print(f"{effective:>9} {budget:>7} {short:>13.2f} {long_:>12.2f} {steps:>6.0f}")
    (short0, long0), (short1, long1) = medians
    print(f"short TTFT {short0 / short1:.1f}x faster with the threshold; long TTFT x{long1 / long0:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
