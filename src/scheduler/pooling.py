"""Embedding and classification models: which pooling a checkpoint asks for
(:func:`detect_pooling`), and the :class:`Pooler` that turns a step's hidden states into the
vector of each request whose prompt it finished.

An embedding daemon runs every request as prefill only: its prompt goes through the
continuous batch in chunks like any other, and when the last chunk is computed the request's
rows are pooled (its last token, the mean of all tokens, or the first), scored by a
classifier's head or L2-normalised, and sent back in place of tokens.
"""

from __future__ import annotations

import json
import os

import msgspec
import torch

from .model_config import ModelConfig

POOLING_METHODS = ("last", "mean", "cls")
# sentence-transformers' Pooling config flags -> our method (the ones left out are refused)
_ST_POOLING_FLAGS = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_UNSUPPORTED_FLAGS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_ST_MODE_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}  # a string pooling_mode


class PoolingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How an embedding daemon turns a prompt into its vector."""

    method: str  # "last" | "mean" | "cls": which hidden rows (after the final norm) are pooled
    normalize: bool  # L2-normalise the pooled vector
    labels: tuple[str, ...] = ()  # a classifier's: its vector is the score head's logits, one per label
    source: str = ""  # what chose it (logged)

    @property
    def classifies(self) -> bool:
        return bool(self.labels)

    @property
    def reads_every_row(self) -> bool:
        """Mean and CLS pooling need hidden states of prompt rows a prefix-cache hit would skip."""
        return self.method != "last"

    def describe(self) -> str:
        what = f"classification into {len(self.labels)} labels" if self.classifies else "embedding"
        norm = ", L2-normalised" if self.normalize else ""
        return f"{what}: {self.method}-token pooling{norm} ({self.source})"


def detect_pooling(path: str, config: ModelConfig, is_embedding: bool) -> PoolingSpec | None:
    """The pooling the checkpoint at ``path`` asks for, or None for a generation model.

    A ``*ForSequenceClassification`` architecture is a classifier (its ``score`` head over the
    last token, as HF's); a sentence-transformers layout (``modules.json`` with a Pooling
    module) says its pooling and whether it normalises; a bare ``*Model`` (e5-mistral's
    ``MistralModel``) and any decoder under ``--is-embedding`` pool the last token and
    normalise it (the Qwen3-Embedding, gte-Qwen2 and e5-mistral convention, and SGLang's)."""
    if config.head == "score":
        return PoolingSpec(method="last", normalize=False, labels=config.labels, source=config.architecture)
    modules = os.path.join(path, "modules.json") if os.path.isdir(path) else None
    if modules is not None and os.path.isfile(modules):
        spec = _sentence_transformers_pooling(path, modules)
        if spec is not None:
            return spec
    if config.head == "none":
        return PoolingSpec(method="last", normalize=True, source=f"{config.architecture}, a base model")
    if is_embedding:
        return PoolingSpec(method="last", normalize=True, source="--is-embedding")
    return None


def _sentence_transformers_pooling(path: str, modules_path: str) -> PoolingSpec | None:
    """From ``modules.json`` and its Pooling module's ``config.json``; None without a Pooling
    module. Modules this engine cannot run (Dense projections, other poolings) are refused
    rather than left out, which would give different vectors."""
    with open(modules_path) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown:
        raise NotImplementedError(
            f"{modules_path} lists sentence-transformers modules this server cannot run: {', '.join(unknown)} "
            "(supported: Transformer, Pooling, Normalize)"
        )
    pooling = kinds.get("Pooling")
    if pooling is None:
        return None
    config_path = os.path.join(path, pooling.get("path", ""), "config.json")
    with open(config_path) as f:
        cfg = json.load(f)
    if not cfg.get("include_prompt", True):
        raise NotImplementedError(f"{config_path}: include_prompt false is not supported")
    methods = [method for flag, method in _ST_POOLING_FLAGS.items() if cfg.get(flag)]
    if isinstance(cfg.get("pooling_mode"), str):
        mode = cfg["pooling_mode"]
        if mode not in _ST_MODE_NAMES:
            raise NotImplementedError(
                f"{config_path}: pooling_mode {mode!r} is not supported (have lasttoken, mean, cls)"
            )
        methods = [_ST_MODE_NAMES[mode]]
    unsupported = [flag for flag in _ST_UNSUPPORTED_FLAGS if cfg.get(flag)]
    if unsupported or len(methods) != 1:
        asked = ", ".join(unsupported + [m for m in methods]) or "none"
        raise NotImplementedError(
            f"{config_path}: exactly one of last-token, mean or CLS pooling is supported (it asks for {asked})"
        )
    return PoolingSpec(method=methods[0], normalize="Normalize" in kinds, source="sentence-transformers modules.json")


class Pooler:
    """Per step: accumulates what mean pooling needs of each prompt chunk and, for each request
    whose whole prompt the step computes, makes its vector. ``score``: a classifier's head
    (hidden rows -> logits)."""

    def __init__(self, spec: PoolingSpec, score=None):
        self.spec = spec
        self.score = score

    def pool(self, batch, hidden: torch.Tensor) -> list[tuple]:
        """``[(request, vector as a list of floats)]`` for the requests the step finishes, read
        before the scheduler counts the step's tokens as computed."""
        method = self.spec.method
        finished, rows = [], []
        offset = 0
        for e in batch:
            req, n = e.request, e.num_new_tokens
            start = req.num_computed_tokens
            chunk = hidden[offset : offset + n]
            offset += n
            if method == "mean":  # (a recomputed prompt, after a preemption, starts over at 0)
                total = chunk.sum(0, dtype=torch.float32)
                req.pool_state = total if start == 0 else req.pool_state + total
            elif method == "cls" and start == 0:
                req.pool_state = chunk[0].float()
            if start + n < req.num_tokens:
                continue
            finished.append(req)
            if method == "last":
                rows.append(chunk[-1].float())
            elif method == "mean":
                rows.append(req.pool_state / req.num_tokens)
            else:
                rows.append(req.pool_state)
        if not finished:
            return []
        vectors = torch.stack(rows)  # float32
        if self.score is not None:  # (in the model's dtype, as its other projections)
            vectors = self.score(vectors.to(hidden.dtype)).float()
        if self.spec.normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        return list(zip(finished, vectors.cpu().tolist()))
