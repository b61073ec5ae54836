"""Runs in the peer's own virtualenv (bench/.vllm-venv): vLLM offline on jobs of token-id prompts.

    .vllm-venv/bin/python bench/vllm_run.py SPEC.json OUT.json

SPEC: {"model": HF dir, "dtype": ..., "max_num_seqs": ..., "max_model_len": ...,
       "speculative": null or {"method": "ngram", ...}, "runner": "generate" (default) | "pooling",
       "jobs": [{"key": ..., "prompts": [[ids]], "out_lens": [n]}]}
OUT:  {"version": vLLM's, "jobs": {key: {"wall_s": ..., "per_request": [[first, last, n]]}}}
with first and last token times in seconds after the job's t0 (all its requests submitted
at once). They are vLLM's engine-core step timestamps (RequestOutput.metrics, kept when log
stats are on): when each step's tokens were sampled, as our engine's token times are.
With runner "pooling" each job embeds its prompts (``LLM.embed``; no out_lens) and gives
{"wall_s": ..., "embeddings": [[floats]]} instead.

The caller sets the VLLM_CPU_* environment. Imports nothing of the project: this is another
interpreter with its own torch and transformers.
"""

from __future__ import annotations

import json
import sys
import time


def run_job(llm, job: dict) -> dict:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, min_tokens=n, max_tokens=n, detokenize=False)
        for n in job["out_lens"]
    ]
    llm.reset_prefix_cache()  # each job starts cold, as each of our runs starts a fresh engine
    t0 = time.monotonic()  # (the engine core's timestamps are time.monotonic() in its process)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.monotonic() - t0
    per_request = []
    for out, n in zip(outputs, job["out_lens"]):
        m = out.metrics
        got = len(out.outputs[0].token_ids)
        if got != n:
            raise RuntimeError(f"request {out.request_id}: {got} tokens, expected {n}")
        if m is None or not m.first_token_ts:
            raise RuntimeError("vLLM returned no request metrics (log stats off?)")
        per_request.append([m.first_token_ts - t0, m.last_token_ts - t0, got])
    return {"wall_s": wall, "per_request": per_request}


def run_embed_job(llm, job: dict) -> dict:
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.reset_prefix_cache()
    t0 = time.monotonic()
    outputs = llm.embed(prompts, use_tqdm=False)
    wall = time.monotonic() - t0
    return {"wall_s": wall, "embeddings": [list(out.outputs.embedding) for out in outputs]}


def main() -> int:
    import vllm
    from vllm import LLM

    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    kwargs = {}
    if spec.get("speculative"):
        kwargs["speculative_config"] = spec["speculative"]
    pooling = spec.get("runner") == "pooling"
    if pooling:
        kwargs["runner"] = "pooling"
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    run = run_embed_job if pooling else run_job
    run(llm, {"prompts": [[1, 2, 3, 4]], "out_lens": [4]})  # warm-up
    results = {}
    for job in spec["jobs"]:
        results[job["key"]] = run(llm, job)
        print(f"vllm_run: {job['key']} done in {results[job['key']]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    with open(out_path, "w") as f:
        json.dump({"version": vllm.__version__, "jobs": results}, f)
    return 0


if __name__ == "__main__":  # vLLM spawns processes that import this module
    sys.exit(main())
