"""A model directory vLLM can serve without weights or a tokenizer: a Llama config.json.

    python3 scripts/llama_config.py DIR [--layers 32] [--hidden 4096] [--max-positions 8192] ...

The defaults are Llama-3-8B's shape (32 layers, hidden 4096, 32 query heads, 8 KV heads of
128, bf16), so the KV pages and the copies between the GPU and the CPU tier are a real
model's. Serve it with ``load_format="dummy"`` (random weights) and
``skip_tokenizer_init=True`` (prompts given as token ids): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HEAD_DIM = 128


def llama_config(
    layers: int = 32,
    hidden: int = 4096,
    kv_heads: int = 8,
    intermediate: int = 14336,
    vocab: int = 128256,
    max_positions: int = 8192,
) -> dict[str, Any]:
    """Llama config.json contents; heads are ``hidden / 128``, as Llama 3's are."""
    if hidden % HEAD_DIM:
        raise ValueError(f"hidden size {hidden} is not a multiple of the head size {HEAD_DIM}")
    heads = hidden // HEAD_DIM
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": max_positions,
        "vocab_size": vocab,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token."""
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * HEAD_DIM * dtype_bytes


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--max-positions", type=int, default=8192)
    args = parser.parse_args(argv)
    config = llama_config(
        args.layers, args.hidden, args.kv_heads, args.intermediate, max_positions=args.max_positions
    )
    args.directory.mkdir(parents=True, exist_ok=True)
    path = args.directory / "config.json"
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    print(f"{path}: {kv_bytes_per_token(config)} KV bytes per token")
    return path


if __name__ == "__main__":
    main()
