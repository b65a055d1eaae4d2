"""Llama, Mistral, Qwen2 and T5 from small transformers configs (random init, no downloads), with their inputs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
PAD = torch.ones(2, 16, dtype=torch.long)
PAD[1, 11:] = 0


def llama(use_cache: bool | None = False):
    cfg = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1)
    if use_cache is not None:  # None: the config's default (a DynamicCache in every forward)
        cfg["use_cache"] = use_cache
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, sliding_window=8))


def qwen2():
    """Sliding-window attention in the layers from ``max_window_layers`` on, full attention below: two masks."""
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, use_sliding_window=True,
        sliding_window=8, max_window_layers=1))


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0))


# name -> (build, model keywords, whether a forward returns a cache)
MODELS = {
    "llama": (llama, dict(input_ids=IDS, labels=IDS), False),
    "llama_cache": (lambda: llama(None), dict(input_ids=IDS, labels=IDS), True),
    "mistral": (mistral, dict(input_ids=IDS, attention_mask=PAD, labels=IDS), True),
    "qwen2": (qwen2, dict(input_ids=IDS, attention_mask=PAD, labels=IDS), True),
    "t5": (t5, dict(input_ids=IDS, attention_mask=PAD, labels=IDS[:, :8].contiguous()), True),
}
