"""Build the tiny test model for CPU vLLM: a random-weight Llama plus a locally trained tokenizer.

Runs fully offline (no hub access). The model is deliberately minimal but shaped so vLLM's
CPU attention accepts it (head_dim 32 is the smallest supported head size):

    2 layers, hidden 128, intermediate 256, 4 attention heads, 2 KV heads (head_dim 32),
    vocab ~1024, bf16, about 0.56 M parameters.

KV bytes per token = layers * kv_heads * head_dim * 2 (K and V) * 2 bytes = 512.

Usage: python make_tiny_model.py OUTDIR
This script must not download anything and must stay deterministic (fixed seed).
"""

from __future__ import annotations

import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def _training_text() -> list[str]:
    """A few kilobytes of varied English and digits, generated locally."""
    sentences = [
        "Prefill computes the key and value cache for the whole prompt in one pass.",
        "Decode produces one token per step and reads the cache that prefill wrote.",
        "The quick brown fox jumps over the lazy dog while the cat sleeps.",
        "Hello world, this is a tiny model used to test disaggregated serving on a CPU.",
        "Requests, tokens, blocks, leases and transfers are counted by the server.",
        "Simple is better than complex, and readability counts more than cleverness.",
    ]
    text = [" ".join(sentences) for _ in range(25)]
    text.append(" ".join(str(n) for n in range(3000)))
    text.append(" ".join(chr(c) for c in range(33, 127)) * 10)
    return text


def build_tokenizer(out: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    return hf_tok


def build_model(out: str, tok: PreTrainedTokenizerFast) -> int:
    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: make_tiny_model.py OUTDIR", file=sys.stderr)
        return 2
    out = argv[1]
    os.makedirs(out, exist_ok=True)
    tok = build_tokenizer(out)
    params = build_model(out, tok)
    print(f"tiny model in {out}: vocab {len(tok)}, {params} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
