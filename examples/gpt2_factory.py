"""An unmodified Hugging Face GPT-2 (tied embeddings, dropout) from a small config, with a padding mask and
labels, as a factory for ``memsched train examples/gpt2_factory.py:build --budget 50%``: memsched finds the
stages itself. No weights are downloaded."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build(batch: int = 8, sequence: int = 128):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=sequence,
                        bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, config.vocab_size, (batch, sequence))
    mask = torch.ones(batch, sequence, dtype=torch.long)
    mask[0, sequence // 2:] = 0  # the first sequence is padded
    return GPT2LMHeadModel(config).train(), {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
