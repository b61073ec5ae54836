"""From a scheduled batch's hidden states to sampled tokens (and logprobs).

The model runner calls :meth:`BatchSampler.run` after the forward pass. It

* computes the LM head only on the rows that sample, plus the prompt rows of requests
  that asked for prompt logprobs (in slices, keeping only what they asked for);
* builds the per-row sampling tensors from the requests' parameters: penalties as sparse
  (row, token) indices from per-request token-id buffers (only rows that have penalties;
  cost in the number of tokens, not rows x vocab), sparse logit bias, the min_new_tokens
  stop mask, seeded generators;
* masks grammar-constrained rows with their xgrammar token bitmask (the request feeds
  the sampled token to its matcher when the scheduler records it);
* samples every row in one vectorised pass (kernels.sampling), or takes the plain
  argmax when every row is greedy with nothing to apply (for an fp32 CPU model, from a
  bf16 copy of the LM head and the exact logits of the few tokens that can win);
* computes logprobs (of the raw logits, before any sampling transform), the prompt's and
  the sampled tokens', for the scheduler to record with the tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kernels.sampling import Penalties, SamplingTensors, argmax_rows, sample, token_logprobs

from .request import Request
from .transfer import HostToDevice

if TYPE_CHECKING:
    from .scheduler import ScheduledRequest

logger = logging.getLogger(__name__)
INPUT_LOGPROB_SLICE = 512  # prompt rows per LM-head slice (bounds the [rows, vocab] logits)


class _SamplerState:
    """Per-request state the sampler keeps between steps (in Request.sampler_state)."""

    __slots__ = ("generator", "tokens", "num_tokens", "bias")

    def __init__(self):
        self.generator: torch.Generator | None = None
        self.tokens = torch.empty(0, dtype=torch.int64)  # CPU buffer of token_ids (grown by doubling)
        self.num_tokens = 0
        self.bias: tuple[np.ndarray, np.ndarray] | None = None  # logit_bias as (token ids, values)

    def bias_arrays(self, req: Request) -> tuple[np.ndarray, np.ndarray]:
        """The request's logit_bias as arrays, built once: a bias may name the whole
        vocabulary, and a per-step walk over its entries would cost every request in the step."""
        if self.bias is None:
            bias = req.sampling.logit_bias
            self.bias = (
                np.fromiter(bias.keys(), np.int64, len(bias)),
                np.fromiter(bias.values(), np.float32, len(bias)),
            )
        return self.bias

    def token_buffer(self, req: Request) -> torch.Tensor:
        """``req.token_ids`` as a CPU int64 tensor, updated with the tokens added since the last call."""
        n = req.num_tokens
        if n > self.tokens.numel():
            grown = torch.empty(max(n, 2 * self.tokens.numel(), 64), dtype=torch.int64)
            grown[: self.num_tokens] = self.tokens[: self.num_tokens]
            self.tokens = grown
        if n > self.num_tokens:
            self.tokens[self.num_tokens : n] = torch.tensor(req.token_ids[self.num_tokens : n], dtype=torch.int64)
            self.num_tokens = n
        return self.tokens[:n]


def _state(req: Request) -> _SamplerState:
    if req.sampler_state is None:
        req.sampler_state = _SamplerState()
    return req.sampler_state


class BatchSampler:
    def __init__(
        self,
        lm_head,
        device: torch.device,
        generator: torch.Generator,
        vocab_size: int,
        upload=None,
        fused_sampling: bool = False,
        greedy_head=None,
    ):
        """``lm_head``: hidden rows ``[N, hidden]`` -> logits ``[N, vocab]`` (the model's, through
        the runner's kernel backend); ``greedy_head``: hidden rows -> their argmax tokens
        without the whole head (kernels.screened_greedy), or None."""
        self.lm_head = lm_head
        self.greedy_head = greedy_head
        self.device = device
        self.upload = upload or HostToDevice(device)  # host arrays -> device, never waiting for the GPU
        self.generator = generator
        self.vocab_size = vocab_size
        # Temperature-only batches on GPUs: one fused Gumbel-max pass (kernels.triton_sampling);
        # the others (top-k/p, min-p, seeds) by rejection in one Triton launch that never
        # makes the host wait (kernels.triton_filtered_sampling), so they keep the overlap.
        # (resolve.py decides: the Triton backend on CUDA)
        self.fused_sampling = fused_sampling
        self.seeds = torch.Generator().manual_seed(generator.initial_seed())  # per-step kernel seeds, on the host

    def compile_kernels(self, hidden: torch.Tensor) -> None:
        """Compile the sampling kernels on one row of hidden states before a request waits for them."""
        if self.fused_sampling:
            from kernels.triton_sampling import gumbel_sample

            gumbel_sample(self.lm_head(hidden[:1]), torch.ones(1, device=self.device), 0)
            params = SamplingTensors.build(
                [1.0],
                [0.9],
                [20],
                self.device,
                min_p=[0.1],
                vocab=self.vocab_size,
                upload=self.upload,
                kernel_generator=self.generator,
            )
            sample(self.lm_head(hidden[:1]).float(), params)

    @staticmethod
    def needs_host_tokens(req: Request) -> bool:
        """Does sampling this request's next token read its previous tokens on the host?
        (Then the engine takes a step's tokens before launching the next: no overlap.)
        Everything else this sampler does stays on the device, without waiting for it."""
        return (
            req.grammar is not None  # the next bitmask follows the accepted token
            or req.sampling.has_penalties  # penalties count the output tokens
            or req.output_logprobs is not None  # recorded in step with the tokens
            or req.needs_input_logprobs
        )

    # -- entry point -------------------------------------------------------------------
    def run(
        self,
        scheduled: Iterable[ScheduledRequest],
        hidden: torch.Tensor,
        sample_rows: list[int],
        sampling: list[Request],
    ) -> tuple[torch.Tensor | None, StepLogprobs | None]:
        """One token for each request in ``sampling`` (hidden row ``sample_rows[i]``; the
        hidden rows are those of the ``scheduled`` step's tokens, in order), as a
        device tensor (None when no row samples), and the step's logprobs (None when no
        request asked), which the scheduler records with the tokens. Only logprobs read
        results back here; of a request, only the sampler's own state (seeded generator,
        token buffer) changes."""
        logprobs = StepLogprobs(prompt=self._input_logprobs(scheduled, hidden))
        if not sample_rows:
            return None, logprobs if logprobs.prompt else None
        if len(sample_rows) == hidden.shape[0]:  # every row samples (decode-only steps): no gather
            rows = hidden
        else:
            rows = hidden[self.upload(np.asarray(sample_rows, dtype=np.int64))]
        lp_rows = [i for i, r in enumerate(sampling) if r.output_logprobs is not None]
        params = self.build(sampling)
        if params.plain_greedy and not lp_rows and self.greedy_head is not None:
            tokens = self.greedy_head(rows)
            if tokens is not None:
                return tokens, logprobs if logprobs.prompt else None
        logits = self.lm_head(rows)
        lp_values = logits[lp_rows].float().log_softmax(dim=-1) if lp_rows else None
        if params.plain_greedy:
            tokens = argmax_rows(logits)
        elif params.fused_temperature is not None:
            from kernels.triton_sampling import gumbel_sample

            seed = int(torch.randint(2**31 - 1, (1,), generator=self.seeds))
            tokens = gumbel_sample(logits, params.fused_temperature, seed)
        else:
            tokens = sample(logits.float(), params, self.generator)
        if lp_rows:
            logprobs.output = [None] * len(sampling)
            wanting = [sampling[i] for i in lp_rows]
            ids, widths = self._ids_index(wanting, self.device)
            for i, row in zip(lp_rows, self._logprob_rows(wanting, lp_values, tokens[lp_rows], ids, widths)):
                logprobs.output[i] = row
        return tokens, logprobs if lp_rows or logprobs.prompt else None

    # -- sampling tensors --------------------------------------------------------------
    def build(self, reqs: list[Request]) -> SamplingTensors:
        dev, vocab = self.device, self.vocab_size
        temperature, top_p, top_k, min_p = [], [], [], []
        pen_rows, rep, freq, pres, out_tokens, prompt_tokens = [], [], [], [], [], []
        biased: list[tuple[int, tuple[np.ndarray, np.ndarray]]] = []  # (row, (token ids, values))
        ban_rows = []  # rows whose stop ids min_new_tokens bans
        seeded, grammar_rows = [], []
        any_min_p = False
        for i, req in enumerate(reqs):
            sp = req.sampling
            temperature.append(sp.temperature)
            top_p.append(sp.top_p)
            top_k.append(sp.top_k)
            min_p.append(sp.min_p)
            any_min_p |= sp.min_p > 0.0
            if sp.has_penalties:
                buf = _state(req).token_buffer(req)
                pen_rows.append(i)
                rep.append(sp.repetition_penalty)
                freq.append(sp.frequency_penalty)
                pres.append(sp.presence_penalty)
                out_tokens.append(buf[req.num_prompt_tokens :])
                prompt_tokens.append(buf[: req.num_prompt_tokens])
            if sp.logit_bias:
                biased.append((i, _state(req).bias_arrays(req)))
            if req.num_output_tokens + req.num_pending < sp.min_new_tokens and req.stop_ids:
                ban_rows.append(i)
            if sp.seed is not None and not sp.greedy:
                st = _state(req)
                if st.generator is None:  # on the CPU: a number per round (GPUs: KERNEL_ROUNDS per step)
                    st.generator = torch.Generator()
                    st.generator.manual_seed(sp.seed & 0xFFFF_FFFF_FFFF_FFFF)
                seeded.append((i, st.generator))
            if req.grammar is not None:
                grammar_rows.append(i)
        if not (pen_rows or biased or ban_rows or seeded or grammar_rows or any_min_p):
            # The common cases need no parameter tensors but (fused) the temperatures, copied
            # without waiting for the GPU.
            greedy = [r.sampling.greedy for r in reqs]
            if all(greedy):
                return SamplingTensors.temperature_only(len(reqs))
            if self.fused_sampling and all(
                g or ((k <= 0 or k >= vocab) and p >= 1.0) for g, k, p in zip(greedy, top_k, top_p)
            ):
                temps = np.array([0.0 if g else t for g, t in zip(greedy, temperature)], dtype=np.float32)
                return SamplingTensors.temperature_only(len(reqs), self.upload(temps))
        extra = {}
        if grammar_rows:
            from .grammar import allocate_bitmask, allows_only

            bitmask = allocate_bitmask(len(reqs), vocab)  # all ones: unconstrained rows keep everything
            for i in grammar_rows:
                reqs[i].grammar.fill_next_token_bitmask(bitmask, i)
            extra["allowed_bitmask"] = bitmask.to(dev)
            extra["bitmask_rows"] = grammar_rows
            # A grammar that can only end now wins over min_new_tokens (banning its stop
            # tokens too would leave the row nothing to sample).
            ban_rows = [i for i in ban_rows if reqs[i].grammar is None or not allows_only(bitmask, i, reqs[i].stop_ids)]
        if pen_rows:
            extra["penalties"] = Penalties.build(pen_rows, rep, freq, pres, out_tokens, prompt_tokens, vocab, dev)
        if biased:
            index = self.upload(
                np.stack(
                    [
                        np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, (ids, _) in biased]),
                        np.concatenate([ids for _, (ids, _) in biased]),
                    ]
                )
            )
            extra["bias"] = (index[0], index[1], self.upload(np.concatenate([vals for _, (_, vals) in biased])))
        if ban_rows:
            banned = [(i, tok) for i in ban_rows for tok in reqs[i].stop_ids]  # (row, token) pairs
            index = self.upload(np.array(banned, dtype=np.int64).T)
            extra["banned"] = (index[0], index[1])
        return SamplingTensors.build(
            temperature,
            top_p,
            top_k,
            dev,
            min_p=min_p if any_min_p else None,
            seeded=seeded,
            vocab=vocab,
            upload=self.upload,
            kernel_generator=self.generator if self.fused_sampling else None,
            **extra,
        )

    # -- logprobs ----------------------------------------------------------------------
    @staticmethod
    def _ids_index(reqs: list[Request], device) -> tuple[torch.Tensor | None, list[int]]:
        """token_ids_logprob of every row, padded into one [M, K] index."""
        lists = [r.sampling.token_ids_logprob for r in reqs]
        width = max((len(x) for x in lists), default=0)
        if not width:
            return None, []
        padded = [list(x) + [0] * (width - len(x)) for x in lists]
        return torch.tensor(padded, dtype=torch.int64, device=device), [len(x) for x in lists]

    @staticmethod
    def _logprob_rows(reqs: list[Request], logprobs: torch.Tensor, targets: torch.Tensor, ids=None, widths=()):
        """Per row of log-softmaxed ``logprobs``: (the target's logprob, its request's top
        values and ids, its token_ids_logprob values), read back to the host at once."""
        top_n = max(r.sampling.top_logprobs_num for r in reqs)
        chosen, top_v, top_i, ids_v = token_logprobs(logprobs, targets, top_n, ids)
        chosen = chosen.tolist()
        top_v = top_v.tolist() if top_v is not None else None
        top_i = top_i.tolist() if top_i is not None else None
        ids_v = ids_v.tolist() if ids_v is not None else None
        for j, req in enumerate(reqs):
            k = req.sampling.top_logprobs_num
            yield LogprobRow(
                chosen[j],
                top_v[j][:k] if k else [],
                top_i[j][:k] if k else [],
                ids_v[j][: widths[j]] if ids_v is not None and widths[j] else [],
            )

    def _input_logprobs(
        self, scheduled: Iterable[ScheduledRequest], hidden: torch.Tensor
    ) -> list[tuple[Request, LogprobRow]]:
        """(request, row) of the prompt logprobs of the rows computed this step, in order
        (requests that asked; :meth:`Request.input_logprob_span` says which positions)."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[Request] = []
        offset = 0
        for e in scheduled:
            req, n = e.request, e.num_new_tokens
            if req.input_logprobs is not None:
                start = req.num_computed_tokens
                for p in req.input_logprob_span(n):  # logits at position p give the logprob of token p + 1
                    rows.append(offset + p - start)
                    targets.append(req.token_ids[p + 1])
                    owners.append(req)
            offset += n
        out = []
        for s in range(0, len(rows), INPUT_LOGPROB_SLICE):
            part = slice(s, s + INPUT_LOGPROB_SLICE)
            reqs = owners[part]
            idx = torch.tensor(rows[part], device=self.device)
            logprobs = self.lm_head(hidden[idx]).float().log_softmax(dim=-1)
            target_ids = torch.tensor(targets[part], device=self.device)
            out.extend(zip(reqs, self._logprob_rows(reqs, logprobs, target_ids)))
        return out


class LogprobRow(NamedTuple):
    """One position's logprobs (the fields of ``LogprobLists.append``)."""

    value: float  # of the target token (the sampled one, or the prompt's next)
    top_values: list[float]
    top_ids: list[int]
    ids_values: list[float]  # of the request's token_ids_logprob


@dataclass
class StepLogprobs:
    """A step's logprobs, recorded by the scheduler when it takes the step's tokens."""

    prompt: list[tuple[Request, LogprobRow]] = field(default_factory=list)  # (request, row), in position order
    output: list[LogprobRow | None] | None = None  # per sampling request: its token's row, or None
