"""A tiny seeded Llama (float64, CPU) with a byte-level BPE tokenizer and a ChatML template, saved to disk."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from server.models.loader import ModelSpec

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Sessions keep their cache between turns.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9.",
    "Numbers 0123456789 and symbols !?.,;:()[]{} appear in text. Hello world, hello kvserve.",
    "Emoji \U0001f600 and CJK \u4e2d\u6587 are split into several byte tokens by a byte-level tokenizer.",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, eos_id: int, seed: int = 0, **shape: int) -> LlamaForCausalLM:
    """The tiny Llama in float64; `shape` overrides its sizes (hidden_size=256, num_attention_heads=4: head size 64)."""
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2} | shape
    config = LlamaConfig(
        vocab_size=vocab_size,
        num_hidden_layers=2,
        max_position_embeddings=4096,
        initializer_range=0.2,  # spread logits apart so greedy picks are never near-ties
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
        **sizes,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def save_tiny(directory: Path) -> ModelSpec:
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return ModelSpec(id="tiny", source=str(directory), dtype="float64", device="cpu", max_context=4096)
