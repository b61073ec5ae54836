"""Batched token sampling (torch ops, any device; on GPUs the rejection rounds run in one
Triton launch instead, ``kernels.triton_filtered_sampling``, so the host never waits).

Every row carries its own parameters, so requests with different settings share a
step; nothing here loops over rows in Python except the seeded rows' uniform draws.

Order of the transforms (as vLLM / SGLang): penalties (repetition, then frequency and
presence), logit bias, the min_new_tokens stop mask, a grammar's token bitmask.
Greedy rows then take the argmax; the others are temperature-scaled and sampled from
the distribution filtered by top-k, top-p and min-p with SGLang's semantics: a token
stays if fewer than k tokens are more likely, the probability mass of the tokens more
likely than it is below top_p (of the whole distribution), and its probability is at
least min_p times the largest; what stays is renormalised. Tokens tied with the k-th
stay, as in vLLM and FlashInfer's threshold filters (a sort-and-cut would pick among them
by position).

No sort: a row draws a token by inverse CDF (one uniform per row, a cumulative sum in
token order) and *accepts* it when it passes the top-k / top-p test, which needs only
the count and mass of more likely tokens. A rejected token is less likely than every
token of the kept set, so the row redraws among the tokens more likely than it; the
kept set is an upper set of the distribution, so the accepted draw follows the
renormalised kept distribution exactly (the FlashInfer rejection scheme). The first draw
is accepted with probability >= top_p, so a row rarely needs more than one or two rounds;
a row rejected once has what min_p and top_k certainly drop zeroed first (``_narrow``).

Seeded rows take their uniforms from their own (CPU) generator, one per round (the GPU
kernel takes ``KERNEL_ROUNDS`` per step: seeded tokens differ between a CPU and a GPU, as
their logits do anyway), and their rounds only depend on their own logits:
given the same logits, a seeded request samples the same tokens whatever else shares its
batch. The model's logits
themselves can differ in the last bits between batch shapes, so over many
tokens a draw near a boundary can land on a neighbouring token with different company.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from . import cpu_kernels
from .util import cdiv

logger = logging.getLogger(__name__)
_xgrammar_kernel_ok = True  # cleared after the first failure of xgrammar's bitmask kernel

MAX_REJECTION_ROUNDS = 32  # then a still-rejected row takes its most likely token (always kept)
KERNEL_ROUNDS = 32  # uniforms per row drawn up front for the Triton kernel (same fallback)
NARROW_TOP_K_MAX = 1024  # a larger top_k is left to the redraws (topk's cost grows with k)
MIN_TEMPERATURE = 1e-5  # temperatures below this sample like greedy (dividing by them overflows)
# A penalised logit stays below this: a tiny repetition penalty (r -> 0 divides positive
# logits by r) must not make +inf, whose softmax is NaN; / MIN_TEMPERATURE stays finite.
MAX_PENALISED_LOGIT = 1e30


@dataclass
class Penalties:
    """Repetition / frequency / presence penalties as sparse indices into the batch's
    flattened ``[N * V]`` logits (row * V + token), built from the rows' token ids.

    ``rep_index`` holds every prompt and output token of the rows with a repetition
    penalty (duplicates allowed: all of them write the same value), ``out_index`` every
    output token of the rows with a frequency or presence penalty (each occurrence adds
    the frequency penalty once; the presence penalty is subtracted once per distinct
    token, again through identical writes).
    """

    rep_index: torch.Tensor | None = None  # [T1] int64
    rep_factor: torch.Tensor | None = None  # [T1] float
    out_index: torch.Tensor | None = None  # [T2] int64
    frequency: torch.Tensor | None = None  # [T2] float
    presence: torch.Tensor | None = None  # [T2] float

    @staticmethod
    def build(
        rows: list[int],
        repetition: list[float],
        frequency: list[float],
        presence: list[float],
        output_tokens: list[torch.Tensor],
        prompt_tokens: list[torch.Tensor],
        vocab: int,
        device,
    ) -> Penalties:
        """Per penalised batch row j: its parameters and CPU int64 token ids. One
        transfer per index tensor; no per-row work on the device."""
        pen = Penalties()
        rep = [j for j, r in enumerate(repetition) if r != 1.0]
        if rep:
            toks = [torch.cat([prompt_tokens[j], output_tokens[j]]) for j in rep]
            pen.rep_index, (pen.rep_factor,) = _flat_index(
                [rows[j] for j in rep], toks, vocab, device, [repetition[j] for j in rep]
            )
        fp = [j for j in range(len(rows)) if frequency[j] != 0.0 or presence[j] != 0.0]
        if fp:
            pen.out_index, (pen.frequency, pen.presence) = _flat_index(
                [rows[j] for j in fp],
                [output_tokens[j] for j in fp],
                vocab,
                device,
                [frequency[j] for j in fp],
                [presence[j] for j in fp],
            )
        return pen


def _flat_index(rows: list[int], tokens: list[torch.Tensor], vocab: int, device, *per_row: list[float]):
    """(row * vocab + token for every token of every row, [per-row values repeated per
    token]) on ``device``."""
    lengths = torch.tensor([t.numel() for t in tokens], dtype=torch.int64)
    ids = torch.cat([t.to(dtype=torch.int64) for t in tokens]) if tokens else torch.empty(0, dtype=torch.int64)
    index = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64) * vocab, lengths) + ids
    values = [torch.repeat_interleave(torch.tensor(v, dtype=torch.float32), lengths).to(device) for v in per_row]
    return index.to(device), values


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [R] float, of the sampling (non-greedy) rows
    top_p: torch.Tensor  # [R] float in (0, 1]
    top_k: torch.Tensor  # [R] int64, vocab size when off
    min_p: torch.Tensor | None = None  # [R] float in [0, 1]; None when no row uses it
    all_greedy: bool = False
    any_top_k: bool = False
    any_top_p: bool = False
    penalties: Penalties | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids -> -inf
    allowed_bitmask: torch.Tensor | None = None  # [N, ceil(V/32)] int32 (grammars); unconstrained rows all -1
    bitmask_rows: list[int] = field(default_factory=list)  # the constrained rows
    # (row among the sampling rows, its CPU generator): seeded rows draw their own uniforms
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)
    random_rows: torch.Tensor | None = None  # batch rows that sample (None: all of them)
    greedy_rows: torch.Tensor | None = None  # the other rows, when random_rows is set
    num_rows: int = 0
    fused_temperature: torch.Tensor | None = None  # [N] (0: greedy) when a temperature is all rows need
    # [R, rounds] uniforms of the sampling rows: draw with the Triton rejection kernel
    # (kernels.triton_filtered_sampling), which needs no host sync between rounds
    uniforms: torch.Tensor | None = None

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole job."""
        return (
            self.all_greedy
            and self.penalties is None
            and self.bias is None
            and self.banned is None
            and self.allowed_bitmask is None
        )

    @staticmethod
    def temperature_only(num_rows: int, fused_temperature: torch.Tensor | None = None) -> SamplingTensors:
        """Rows that are all greedy (no ``fused_temperature``) or only set a temperature
        (``fused_temperature [N]``, 0 for greedy rows: the fused kernel's one input)."""
        none = torch.empty(0)
        return SamplingTensors(
            temperature=none,
            top_p=none,
            top_k=none.long(),
            all_greedy=fused_temperature is None,
            num_rows=0 if fused_temperature is None else num_rows,
            fused_temperature=fused_temperature,
        )

    @staticmethod
    def build(
        temperature: list[float],
        top_p: list[float],
        top_k: list[int],
        device,
        min_p: list[float] | None = None,
        seeded: list[tuple[int, torch.Generator]] = (),
        vocab: int = 2**31 - 1,
        upload=None,
        kernel_generator: torch.Generator | None = None,
        **extra,
    ) -> SamplingTensors:
        """Per-row parameters as lists (temperature < MIN_TEMPERATURE or top_k 1: greedy; top_k <= 0:
        off); ``seeded``: (batch row, CPU generator); ``upload``: host numpy array -> device
        tensor (``scheduler.transfer.HostToDevice``: never waits for the GPU);
        ``kernel_generator``: the device generator, to sample with the Triton rejection
        kernel (GPUs); ``extra``: penalties / bias / banned / allowed_bitmask."""
        upload = upload or (lambda a: torch.from_numpy(a).to(device))
        n = len(temperature)
        rows = [i for i in range(n) if temperature[i] >= MIN_TEMPERATURE and top_k[i] != 1]
        position = {r: j for j, r in enumerate(rows)}
        r = len(rows)
        ks = [top_k[i] if 0 < top_k[i] < vocab else vocab for i in rows]
        ps = [top_p[i] for i in rows]
        any_min_p = min_p is not None and any(min_p[i] > 0.0 for i in rows)
        # Two uploads for everything: the float parameters, then the ints, each field at a
        # multiple of 4 elements (16-byte aligned, as Triton specialises pointers on it).
        seg = cdiv(r, 4) * 4

        def packed(fields: list[list], dtype) -> torch.Tensor:
            flat = np.zeros(seg * (len(fields) - 1) + len(fields[-1]), dtype=dtype)
            for f, values in enumerate(fields):
                flat[f * seg : f * seg + len(values)] = values
            return upload(flat)

        floats = packed(
            [[temperature[i] for i in rows], ps] + ([[min_p[i] for i in rows]] if any_min_p else []), np.float32
        )
        greedy = sorted(set(range(n)) - set(rows)) if r < n else []
        ints = packed([ks] + ([rows, greedy] if r < n else []), np.int64)
        seeded = [(position[i], g) for i, g in seeded if i in position]  # (its row among the sampling rows)
        return SamplingTensors(
            temperature=floats[:r],
            top_p=floats[seg : seg + r],
            top_k=ints[:r],
            min_p=floats[2 * seg : 2 * seg + r] if any_min_p else None,
            all_greedy=not rows,
            any_top_k=any(k < vocab for k in ks),
            any_top_p=any(p < 1.0 for p in ps),
            random_rows=ints[seg : seg + r] if r < n else None,
            greedy_rows=ints[2 * seg :] if r < n else None,
            seeded=seeded,
            num_rows=r,
            uniforms=_kernel_uniforms(r, kernel_generator, seeded, upload) if kernel_generator and r else None,
            **extra,
        )


def _kernel_uniforms(n: int, generator: torch.Generator, seeded, upload) -> torch.Tensor:
    """[n, KERNEL_ROUNDS] uniforms on the generator's device; a seeded row's (row, generator)
    come from its own generator (a fixed KERNEL_ROUNDS per step, whatever its rounds need),
    in one upload."""
    u = torch.rand(n, KERNEL_ROUNDS, device=generator.device, generator=generator)
    if seeded:
        # (row, its uniforms) in one float32 array: row indices < 2**24 are exact
        host = np.stack([np.concatenate([[j], torch.rand(KERNEL_ROUNDS, generator=g).numpy()]) for j, g in seeded])
        packed = upload(host.astype(np.float32))
        u.index_copy_(0, packed[:, 0].long(), packed[:, 1:])
    return u


# -- logit transforms (in place on float32 [N, V]) -------------------------------------------


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    """Repetition (tokens seen in prompt or output: positive logits / r, negative * r),
    then frequency (- f * count) and presence (- p once) over the output tokens."""
    flat = logits.view(-1)
    if pen.rep_index is not None:
        v = flat[pen.rep_index]
        flat[pen.rep_index] = torch.where(
            v > 0, (v / pen.rep_factor).clamp_(max=MAX_PENALISED_LOGIT), v * pen.rep_factor
        )
    if pen.out_index is not None:
        flat.index_add_(0, pen.out_index, -pen.frequency)
        flat[pen.out_index] = flat[pen.out_index] - pen.presence


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Tokens whose bit is 0 in the int32 bitmask [N, ceil(V/32)] go to -inf (only in
    ``rows`` when given). xgrammar's kernel when it is installed, else torch."""
    global _xgrammar_kernel_ok
    if _xgrammar_kernel_ok and logits.device.type in ("cpu", "cuda"):
        try:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
            return
        except Exception as e:  # noqa: BLE001  (no xgrammar, or no kernel for this setup)
            _xgrammar_kernel_ok = False
            logger.warning("xgrammar's bitmask kernel is unavailable (%s); using the torch path", e)
    _apply_bitmask_torch(logits, bitmask, rows)


def _apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
    idx = torch.tensor(rows, device=logits.device) if rows is not None else None
    mask = bitmask[idx] if idx is not None else bitmask
    vocab = logits.shape[1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().view(mask.shape[0], -1)[:, :vocab]
    if idx is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def _uniforms(n: int, device, generator, seeded: list[tuple[int, torch.Generator]], rows=None) -> torch.Tensor:
    """One U[0, 1) per row; seeded rows (by their index in the full sampling set, mapped
    through ``rows`` when only some rows draw) from their own generators."""
    u = torch.rand(n, device=device, generator=generator)
    if seeded:
        if rows is None:
            picks = seeded
        else:
            where = {r: j for j, r in enumerate(rows)}
            picks = [(where[i], g) for i, g in seeded if i in where]
        if picks:
            idx = torch.tensor([j for j, _ in picks], dtype=torch.int64)
            vals = torch.cat([torch.rand(1, generator=g) for _, g in picks])
            u[idx.to(device)] = vals.to(device)
    return u


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in token order: the token whose cumulative-weight interval holds u * total."""
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


def sample_filtered(
    weights: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_w: torch.Tensor | None,
    generator: torch.Generator | None,
    seeded: list[tuple[int, torch.Generator]],
) -> torch.Tensor:
    """Sample rows of unnormalised ``weights [R, V]`` (>= 0, the row maximum 1) keeping
    only tokens with fewer than ``top_k`` more likely ones, less than ``top_p`` of the mass
    more likely than them, and a weight of at least ``min_w``; by rejection (module doc).
    ``None``: that filter is off for every row."""
    n = weights.shape[0]
    tokens = _draw(weights, _uniforms(n, weights.device, generator, seeded))
    if top_k is None and top_p is None and min_w is None:
        return tokens
    p_mass = top_p * weights.sum(dim=-1) if top_p is not None else None
    active = torch.arange(n, device=weights.device)
    w = weights
    for round_ in range(MAX_REJECTION_ROUNDS):
        w_tok = w.gather(1, tokens[active].unsqueeze(1))
        rejected = w_tok.squeeze(1) < min_w if min_w is not None else torch.zeros_like(active, dtype=torch.bool)
        above = None
        if top_k is not None or top_p is not None:
            excess = (w - w_tok).clamp_(min=0.0)  # > 0 exactly for the tokens more likely than the draw
            surplus = excess.sum(dim=-1) if p_mass is not None else None
            above = excess.sign_()  # 1.0 where more likely
            count = above.sum(dim=-1)
            if top_k is not None:
                rejected |= count >= top_k
            if p_mass is not None:  # the mass above: surplus plus w_tok for each of them
                rejected |= surplus + w_tok.squeeze(1) * count >= p_mass
        if not bool(rejected.any()):
            return tokens
        # redraw the rejected rows among the tokens more likely than their rejected one
        keep = rejected.nonzero().squeeze(1)
        active = active[keep]
        w = w[keep] * (above[keep] if above is not None else (w[keep] > w_tok[keep]))
        top_k = top_k[keep] if top_k is not None else None
        p_mass = p_mass[keep] if p_mass is not None else None
        min_w = min_w[keep] if min_w is not None else None
        if round_ == 0:
            w = _narrow(w, top_k, min_w)
        rows = active.tolist()
        tokens[active] = _draw(w, _uniforms(len(rows), weights.device, generator, seeded, rows))
    # still rejected after every round: the most likely token always passes the filters
    tokens[active] = argmax_rows(w)
    return tokens


def _narrow(w: torch.Tensor, top_k: torch.Tensor | None, min_w: torch.Tensor | None) -> torch.Tensor:
    """Zero the weights the filters drop for certain: those below ``min_w`` and, by one
    topk, those below each row's k-th largest. Left to halving redraws alone, a small
    top_k over a flat distribution (a high temperature) takes log2(vocab / k) rounds.
    Exact: what is zeroed is less likely than every kept token, so the counts and masses
    above the kept ones do not change."""
    if min_w is not None:
        w.masked_fill_(w < min_w.unsqueeze(1), 0.0)
    if top_k is not None:
        limited = top_k < w.shape[1]
        k = int(top_k.masked_fill(~limited, 0).max())
        if 0 < k <= NARROW_TOP_K_MAX:
            kth = w.topk(k, dim=-1).values.gather(1, top_k.clamp(max=k).sub(1).unsqueeze(1))
            w.masked_fill_(w < kth.masked_fill_(~limited.unsqueeze(1), 0.0), 0.0)
    return w


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum (the first on ties): on the CPU a native pass
    (csrc/row_argmax.c); elsewhere max(dim), which beats argmax."""
    if x.is_cpu:
        native = cpu_kernels.row_argmax(x)
        if native is not None:
            return native
    return x.max(dim=-1).indices


def sample(logits: torch.Tensor, params: SamplingTensors, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of float32 ``logits [N, vocab]`` (modified in place);
    returns int64 ``[N]``."""
    if params.penalties is not None:
        apply_penalties(logits, params.penalties)
    if params.bias is not None:
        rows, cols, vals = params.bias
        logits.index_put_((rows, cols), vals, accumulate=True)
    if params.banned is not None:
        rows, cols = params.banned
        logits.index_put_((rows, cols), logits.new_full((), float("-inf")))  # (no host copy)
    if params.allowed_bitmask is not None:
        apply_bitmask(logits, params.allowed_bitmask, params.bitmask_rows or None)
    if params.all_greedy:
        return argmax_rows(logits)

    rows_idx = params.random_rows
    sub = logits.index_select(0, rows_idx) if rows_idx is not None else logits
    # weights relative to the row's most likely token (which therefore weighs 1)
    weights = sub.sub_(sub.amax(dim=-1, keepdim=True)).div_(params.temperature.unsqueeze(1)).exp_()
    if params.uniforms is not None:  # every round on the device: no host sync
        from .triton_filtered_sampling import filtered_sample

        min_w = params.min_p if params.min_p is not None else torch.zeros_like(params.top_p)
        sampled = filtered_sample(weights, params.top_k, params.top_p, min_w, params.uniforms)
    else:
        sampled = sample_filtered(
            weights,
            params.top_k if params.any_top_k else None,
            params.top_p if params.any_top_p else None,
            params.min_p,
            generator,
            params.seeded,
        )
    if rows_idx is None:
        return sampled
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    tokens[params.greedy_rows] = argmax_rows(logits.index_select(0, params.greedy_rows))
    return tokens.index_copy_(0, rows_idx, sampled)


# -- logprobs ----------------------------------------------------------------------------------


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, top_n: int, ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """From log-softmaxed rows ``[M, V]``: the logprob of ``token_ids [M]``, the ``top_n``
    best (values, ids) and the logprobs at ``ids [M, K]`` (padded per row)."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    top_v = top_i = None
    if top_n > 0:
        top_v, top_i = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)
    ids_v = logprobs.gather(1, ids) if ids is not None else None
    return chosen, top_v, top_i, ids_v
