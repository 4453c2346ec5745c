"""The tiny model of tests/tiny.py as a GGUF file (float32, ~0.5 MB): what a server converts at its first start,
in a second instead of the default model's tens of seconds.

Written as llama.cpp writes a Llama: the byte-level BPE tokenizer as `tokenizer.ggml.model = "gpt2"` (its
tokens, merges and token types, the specials as control tokens), the chat template, and the weights under GGUF's
tensor names with q and k permuted for GGML's rotary layout (transformers' GGUF loader permutes them back).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from tests.tiny import build_model, build_tokenizer

LAYER_TENSORS = {  # GGUF name in block i -> transformers name in layer i
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def save_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """Write the tiny Llama (seeded by `seed`) and its tokenizer to the GGUF file `path`; returns `path`."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"), seed=seed)
    config = model.config
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    serialized = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().__getitem__)
    merges = [" ".join(m) if isinstance(m, list) else m for m in serialized["merges"]]
    specials = set(tokenizer.all_special_tokens) | set(tokenizer.added_tokens_encoder)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    weights = {name: t.to(torch.float32).numpy() for name, t in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        for ours, theirs in LAYER_TENSORS.items():
            weight = weights[f"model.layers.{i}.{theirs}.weight"]
            if ours in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if ours == "attn_q" else config.num_key_value_heads
                weight = _rotary_permuted(weight, heads)
            writer.add_tensor(f"blk.{i}.{ours}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rotary_permuted(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `permute` of a q or k projection: each head's rows from halves to interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
