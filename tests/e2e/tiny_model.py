"""A tiny LlamaForCausalLM folder (config.json only) that vLLM runs on CPU with dummy weights, no tokenizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,  # vLLM's CPU attention rejects 16
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

TINY_GEMMA3: dict[str, Any] = {
    # A hybrid model: layer 0 attends over a 32-token sliding window, layer 1 over everything. vLLM's
    # hybrid KV cache manager gives them two KV cache groups (it runs only with a SupportsHMA connector).
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_local_base_freq": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 32,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"],
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}

TINY_GRANITE_HYBRID: dict[str, Any] = {
    # A hybrid Mamba model (Granite 4's architecture): layer 0 is a Mamba2 mixer (conv and SSM state), layer 1
    # full attention. vLLM's CPU backend runs it (two KV cache groups; head_dim 32: the CPU attention needs it).
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "hidden_size": 64,
    "intermediate_size": 128,
    "shared_intermediate_size": 128,
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "layer_types": ["mamba", "attention"],
    "position_embedding_type": "rope",
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}

MAX_MODEL_LEN = 256
BLOCK_SIZE_CPU = 128
"""vLLM's CPU block size: a prompt needs more than one block (>= 130 tokens) for KV to move."""


def write_tiny_model(folder: str | Path, config: dict[str, Any] = TINY_LLAMA) -> Path:
    """Write the config (the tiny Llama unless told) into `folder` (created if missing) and return it; idempotent."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


if __name__ == "__main__":
    print(write_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvledger-tiny-llama"))
