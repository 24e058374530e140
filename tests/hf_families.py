"""More Hugging Face families as users bring them, built small from tiny configs (no weights downloaded), each as
``(model, batch)``: ``model(**batch)`` returns an output with ``.loss``. Encoder–decoders (BART, Whisper, T5: the
encoder's last hidden state is returned beside the logits and saved by the decoder's cross-attention), a mixture
of experts (Mixtral), a LoRA adapter on Llama (peft: frozen weights, whose linear layers save no input), and
decoders built in bf16 (``model.to(torch.bfloat16)``: Llama, Mistral, Qwen2; their residual stream is saved only as
the fp32 copy their normalisations compute on).

Used by the fit fidelity tests (tests/profiles/test_fit_models.py, test_fit_families.py) and by
bench/fit_families.py; no line of memsched's knows any of them.
"""

import functools

import torch


def bart():
    """BART with dropout 0.1, a batch of 4 × 32 tokens and labels 4 × 16 (the decoder's inputs shifted from them)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                        dropout=0.1, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (4, 32), generator=generator)
    labels = torch.randint(3, 128, (4, 16), generator=generator)
    return BartForConditionalGeneration(config).train(), {"input_ids": ids, "labels": labels}


def whisper():
    """Whisper on 16 mel bins × 64 frames (a convolutional front end halving them), labels 4 × 16, dropout 0.1."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                           max_source_positions=32, max_target_positions=32, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2, decoder_start_token_id=0, dropout=0.1)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(4, 16, 64, generator=generator)
    labels = torch.randint(3, 128, (4, 16), generator=generator)
    return WhisperForConditionalGeneration(config).train(), {"input_features": features, "labels": labels}


def t5():
    """A tiny T5 with labels (the decoder's inputs shifted from them; -100 where a label is padding) and padding
    masks on both sides (without them, Hugging Face skips a mask in eager mode that it builds under a capture, and
    the attention kernels differ in their last bits)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 128, (4, 16), generator=generator)
    labels = torch.randint(2, 128, (4, 12), generator=generator)
    labels[2, 9:] = -100
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, 10:] = 0
    decoder_mask = (labels != -100).long()
    return T5ForConditionalGeneration(config).train(), {"input_ids": ids, "attention_mask": mask, "labels": labels,
                                                        "decoder_attention_mask": decoder_mask}


def mixtral():
    """A tiny Mixtral: 2 layers of 4 experts, 2 per token; a padding mask (see :func:`t5`)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, num_local_experts=4,
                           num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, 12:] = 0
    return MixtralForCausalLM(config).train(), {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def lora():
    """A rank-8 LoRA adapter (peft) on the query and value projections of a 2-layer Llama, dropout 0.1: the base
    weights frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    adapter = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    model = get_peft_model(LlamaForCausalLM(config), adapter)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    return model.train(), {"input_ids": ids, "labels": ids.clone()}


def decoder(kind: str, dtype=torch.bfloat16):
    """A 2-layer ``kind`` (``llama``, ``mistral`` or ``qwen2``) causal LM built in fp32 and converted to ``dtype``, as
    a model loaded with ``torch_dtype=torch.bfloat16`` is; a batch of 4 × 16 tokens with labels."""
    import transformers

    config, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                     "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config)(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                           max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                           pad_token_id=0)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))
    return getattr(transformers, model)(config).to(dtype).train(), {"input_ids": ids, "labels": ids.clone()}


FAMILIES = {"bart": bart, "whisper": whisper, "t5": t5, "mixtral": mixtral, "lora": lora,
            **{f"{kind}-bf16": functools.partial(decoder, kind) for kind in ("llama", "mistral", "qwen2")}}
