"""Checkpoint loading: an HF directory (safetensors) or a GGUF file -> (ModelConfig, state dict).

The state dict always uses HF parameter names, so models only know one naming.
GGUF tensors are dequantised to fp32, then cast to the requested dtype, here.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

from .model_config import ModelConfig

# GGUF name (after "blk.N.") -> HF name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that carry no weights for us (rope_freqs is folded into ModelConfig.rope_scaling).
_GGUF_SKIP = {"rope_freqs.weight"}
# llama.cpp's converter permutes q/k only for these architectures (the others already use
# the rotate-half layout llama.cpp calls "neox").
_PERMUTED_ARCHS = {"llama", "mistral"}


def load_checkpoint(
    path: str, dtype: torch.dtype | None = None, tp: tuple[int, int] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, HF-named state dict) from a ``.gguf`` file or an HF model directory.
    ``dtype``: GGUF tensors are dequantised to float32 one at a time and cast to it at once
    (holding them all in float32 would peak at 4x the final bf16 weights). ``tp``: (rank,
    size) of a tensor-parallel rank, which reads and dequantises its slices only."""
    from .tensor_parallel import Shard, check_divisible

    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf(path, dtype, tp)
    if os.path.isdir(path):
        config = ModelConfig.from_hf_dir(path)
        if tp is not None:
            check_divisible(config, tp[1])  # (before reading a weight)
        return config, load_hf_safetensors(path, Shard(config, *tp) if tp is not None else None)
    raise FileNotFoundError(f"not a .gguf file or an HF model directory: {path}")


# -- HF safetensors ---------------------------------------------------------------------
def load_hf_safetensors(path: str, shard=None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, or with ``shard`` (a tensor_parallel.Shard) the part of
    each that one rank keeps, read alone."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state_dict: dict[str, torch.Tensor] = {}
    for name in files:
        if shard is None:
            state_dict.update((_full_name(k), w) for k, w in load_file(os.path.join(path, name)).items())
            continue
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                state_dict[_full_name(key)] = shard.take(_full_name(key), f.get_slice(key)).contiguous()
    return state_dict


def _full_name(key: str) -> str:
    """A base model's checkpoint (``*Model``: embedding models such as e5-mistral) names its
    tensors without the ``model.`` prefix its task models put before them."""
    return key if key.startswith(("model.", "lm_head.", "score.")) else f"model.{key}"


# -- GGUF -------------------------------------------------------------------------------
def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    return None


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp rotates adjacent pairs (2i, 2i+1) while HF Llama rotates (i, i + d/2), so its
    converter reorders each head's output rows from ``[2, d/2]`` to ``[d/2, 2]`` (half-major
    to interleaved). Reading the rows back as ``[d/2, 2]`` and swapping restores HF order.
    Works for weights ``[rows, in]`` and biases ``[rows]``.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GgufSlice:
    """A GGUF tensor read (and dequantised) only where it is indexed: ``t[rows]``,
    ``t[:, cols]`` or ``t[:]``, as a float32 tensor. Quantised rows are runs of blocks, so a
    row range is its rows' bytes, and a column range on block boundaries its bytes of each
    row; any other column range is cut from the whole rows."""

    def __init__(self, tensor):
        import gguf

        self.tensor = tensor
        # ggml lists dims fastest-first; numpy/torch want them slowest-first.
        self.shape = [int(d) for d in reversed(tensor.shape)]
        self.block, self.block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = (index, slice(None)) if not isinstance(index, tuple) else index
        data = self.tensor.data
        if len(self.shape) == 1:
            return self._dequantize(data[rows], [-1])
        data, width = data[rows], self.shape[1]
        start, stop, _ = cols.indices(width)
        if (start, stop) == (0, width):
            return self._dequantize(data, [-1, width])
        if data.dtype != np.uint8:  # unquantised values
            return self._dequantize(data[:, start:stop], [-1, stop - start])
        if start % self.block == 0 and stop % self.block == 0:  # whole blocks: their bytes
            lo, hi = start // self.block * self.block_bytes, stop // self.block * self.block_bytes
            return self._dequantize(data[:, lo:hi], [-1, stop - start])
        return self._dequantize(data, [-1, width])[:, start:stop]

    def _dequantize(self, data: np.ndarray, shape: list[int]) -> torch.Tensor:
        from gguf.quants import dequantize

        out = dequantize(data, self.tensor.tensor_type).reshape(shape)
        # F32 comes back as a read-only view of the memory map: copy so torch may own it.
        return torch.from_numpy(out.astype(np.float32, copy=not out.flags.writeable))


def load_gguf(
    path: str, dtype: torch.dtype | None = None, tp: tuple[int, int] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``tp``: (rank, size): that rank's slices only (tensor_parallel.Shard)."""
    import gguf

    from .tensor_parallel import Shard, check_divisible

    reader = gguf.GGUFReader(path)
    config = ModelConfig.from_gguf(reader)
    shard = None
    if tp is not None:
        check_divisible(config, tp[1])  # (before reading a weight)
        shard = Shard(config, *tp)
    permuted = config.model_type in _PERMUTED_ARCHS
    tensors = reader.tensors
    if len(tensors) > 500:  # only big checkpoints are worth a progress bar
        from tqdm import tqdm

        tensors = tqdm(tensors, desc="dequantising GGUF", unit="tensor")
    state_dict: dict[str, torch.Tensor] = {}
    for t in tensors:
        if t.name in _GGUF_SKIP:
            continue
        name = gguf_to_hf_name(t.name)
        if name is None:
            raise ValueError(f"{path}: unknown GGUF tensor {t.name!r}")
        w = GgufSlice(t)
        w = shard.take(name, w).contiguous() if shard is not None else w[:]
        if permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            # (within each head: the rank's whole heads unpermute alone)
            w = unpermute_rope_rows(w, w.shape[0] // config.head_dim)
        state_dict[name] = w if dtype is None else w.to(dtype)
    return config, state_dict
