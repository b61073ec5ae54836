"""No Triton compile in the middle of serving, checked on the CPU.

Triton compiles a kernel again whenever a launch brings a new combination of constexprs and
argument specialisations: an int argument equal to 1 or divisible by 16, a pointer aligned
to 16 bytes or not. On a GPU each compile costs ~0.1-1 s, and every running request waits
for it. Here every Triton launch of real engine steps is recorded (not run: only the
arguments matter) and its specialisation key computed with Triton's own function, then:

* launches of the same kernel with the same constexprs always have the same key (no value
  that changes with the step leaks into the specialisation), and
* every variant the steps launch was already launched by ``ModelRunner.compile_kernels``,
  the start-up warm-up.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")
libtriton = pytest.importorskip("triton._C.libtriton")
from triton.backends.compiler import BaseBackend  # noqa: E402

from kernels import triton_attention, triton_filtered_sampling, triton_gemv, triton_ops, triton_sampling  # noqa: E402
from scheduler.config import EngineConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.messages import SamplingParams  # noqa: E402
from scheduler.model_runner import ModelRunner, warmup_batches  # noqa: E402
from test_triton_model import tiny_model  # noqa: E402

H100_SMS = 132  # decode split factors as on an H100, so that they vary with the batch


def specialisation_key(kernel, args: tuple) -> tuple:
    """What Triton's launcher keys a compiled variant on, for the positional (runtime) args."""
    unspecialised = set(kernel.kwargs.get("do_not_specialize") or ())
    return tuple(
        libtriton.native_specialize_impl(BaseBackend, arg, False, name not in unspecialised, True)
        for name, arg in zip(kernel.arg_names, args)
    )


class LaunchRecorder:
    """Stands in for the kernels' factories: records ``(kernel, constexprs, key)`` per launch.
    The model's kernels are not run (their outputs stay uninitialised: only the launches
    matter); the sampler's is, so that sampled tokens are real vocabulary ids."""

    def __init__(self, monkeypatch):
        self.variants: list[tuple] = []
        attention, ops, gemv = triton_attention._kernels(), triton_ops._kernels(), triton_gemv._kernel()
        sampler, filtered = triton_sampling._kernel(), triton_filtered_sampling._kernel()
        monkeypatch.setattr(triton_attention, "_kernels", lambda: tuple(map(self._wrap, attention)))
        monkeypatch.setattr(triton_ops, "_kernels", lambda: tuple(map(self._wrap, ops)))
        monkeypatch.setattr(triton_gemv, "_kernel", lambda: self._wrap(gemv))
        monkeypatch.setattr(triton_sampling, "_kernel", lambda: self._wrap(sampler, run=True))
        monkeypatch.setattr(triton_filtered_sampling, "_kernel", lambda: self._wrap(filtered, run=True))

    def _wrap(self, kernel, run: bool = False):
        recorder = self

        class Recorded:
            def __getitem__(self, grid):
                def launch(*args, **constexprs):
                    key = specialisation_key(kernel, args)
                    recorder.variants.append((kernel.fn.__name__, tuple(sorted(constexprs.items())), key))
                    if run:
                        kernel[grid](*args, **constexprs)

                return launch

        return Recorded()

    def take(self) -> set[tuple]:
        out, self.variants = set(self.variants), []
        return out


def test_warmup_batches_cover_each_decode_split_and_both_prefill_tiles():
    batches = warmup_batches(256, num_kv_heads=8, num_sms=H100_SMS)
    decode = [len(b) for b in batches if max(b) == 1]
    assert decode == [1, 9, 17, 33, 66]  # splits 16, 8, 4, 2, 1
    assert [1, 2] in batches and [1, 64] in batches  # short chunks and long chunks
    assert warmup_batches(1, 8, 1) == [[1], [1, 2], [1, 64]]


# The model's kernels are recorded, not run, so the sampler reads uninitialised logits (up to
# ~1e38 here): dividing them by the temperature overflows in the interpreter's numpy arithmetic.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("small_batch_gemv", [False, True], ids=["cublas", "small-batch-gemv"])
def test_engine_steps_launch_only_warmed_up_kernel_variants(monkeypatch, small_batch_gemv):
    config = EngineConfig(
        model="random",
        device="cpu",
        kernel_backend="triton",
        kv_cache_tokens=16384,
        max_num_batched_tokens=160,
        max_running_requests=160,
        num_threads=1,
        seed=0,
        small_batch_gemv=small_batch_gemv,
    )
    runner = ModelRunner(config, tiny_model("qwen3"))
    runner.num_sms = runner.backend.num_sms = H100_SMS
    # the GPU's samplers: fused Gumbel-max for temperature-only rows, the rejection kernel
    # for top-k/p, min-p and seeds
    runner.sampler.fused_sampling = True
    recorder = LaunchRecorder(monkeypatch)
    runner.compile_kernels()
    warmed = recorder.take()

    # Many batch shapes. Phase 1: 40 requests whose prompts (1-150 tokens, a third sharing a
    # cached prefix) prefill in chunks (160-token steps) beside running decodes. Phase 2: 150 short
    # prompts at once, whose decode batches shrink from 150 as they reach their lengths,
    # through every split factor (2, 4, 8, 16 with H100_SMS and 2 KV heads).
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(1, 300, (40,), generator=g).tolist()
    phases = [[], []]
    for i in range(40):
        n = int(torch.randint(1, 150, (1,), generator=g))
        prompt = torch.randint(1, 300, (n,), generator=g).tolist()
        phases[0].append((shared + prompt[:50] if i % 3 == 0 else prompt, int(torch.randint(1, 40, (1,), generator=g))))
    for i in range(150):
        prompt = torch.randint(1, 300, (1 + i % 3,), generator=g).tolist()
        phases[1].append((prompt, 12 + i % 40))
    engine = Engine(config, runner)
    # Sampled rows (the fused and filter kernels) in phase 1, under the interpreter most of
    # this test's time; the sampler launches the same variants whatever the projections
    # run on, so with small_batch_gemv (what that run checks: its projection kernels) every
    # row is greedy: the same batch shapes, the sampler's kernels left to the cublas run.
    sampled = 0.0 if small_batch_gemv else 0.7
    for temperature, phase in zip((sampled, 0.0), phases):
        params = [
            SamplingParams(max_new_tokens=m, temperature=temperature * (i % 2), ignore_eos=True)
            for i, (_, m) in enumerate(phase)
        ]
        for i, p in enumerate(params):  # a few filtered and seeded rows (the filter kernel)
            if temperature and i % 8 == 1:
                p.top_p, p.top_k = 0.8, 10
            elif temperature and i % 8 == 3:
                p.min_p, p.seed = 0.1, i
        done = engine.generate([p for p, _ in phase], params)
        assert [len(c.output_ids) for c in done] == [p.max_new_tokens for p in params]
    stepped = recorder.take()

    by_config: dict[tuple, set] = {}
    for name, constexprs, key in stepped:
        by_config.setdefault((name, constexprs), set()).add(key)
    unstable = {cfg: keys for cfg, keys in by_config.items() if len(keys) > 1}
    assert not unstable, f"per-step values change these kernels' specialisation: {unstable}"
    names = {name for name, _, _ in stepped}
    assert {"_unified_attention_kernel", "_combine_splits_kernel", "_qkv_rope_store_kernel"} <= names
    assert {"_gumbel_argmax_kernel", "_filtered_sample_kernel"} <= names or small_batch_gemv
    splits = {dict(c)["NUM_SPLITS"] for n, c, _ in stepped if n == "_unified_attention_kernel"}
    assert {1, 2, 4, 8, 16} <= splits  # prefill/mixed steps and every decode split factor ran
    assert ("_small_batch_linear_kernel" in names) == small_batch_gemv
    missing = stepped - warmed
    assert not missing, f"variants first compiled while serving (not in compile_kernels): {missing}"
