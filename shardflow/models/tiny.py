"""Tiny random Hugging Face checkpoints and a character tokenizer, built locally.

Tests, examples and the demo use these instead of downloading anything: the checkpoints are made
with ``transformers`` config classes and ``save_pretrained``, so they are real HF checkpoints and
``transformers`` is an independent reference for them.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# family -> (transformers config class name, config values that make the family distinct)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "mistral": ("MistralConfig", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
}


def char_tokenizer():
    """A character-level fast tokenizer: the specials, then printable ASCII, one id each."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_hf_config(family: str = "llama", *, value_head: bool = False, **overrides: Any):
    """A small transformers config of the family (``llama3`` = Llama with llama3 rope scaling)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(FAMILIES)}")
    class_name, extra = FAMILIES[family]
    kwargs: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    if value_head:
        kwargs["num_labels"] = 1
    config = getattr(transformers, class_name)(**kwargs)
    kind = "ForSequenceClassification" if value_head else "ForCausalLM"
    config.architectures = [class_name.removesuffix("Config") + kind]
    return config


def make_tiny_checkpoint(path: str | Path, family: str = "llama", *, seed: int = 0, value_head: bool = False,
                         with_tokenizer: bool = True, max_shard_size: str | None = None,
                         **overrides: Any) -> Path:
    """Write a random tiny checkpoint (float32) to ``path``; returns the path."""
    path = Path(path)
    config = tiny_hf_config(family, value_head=value_head, **overrides)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSequenceClassification if value_head else transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than HF's 0.02 init so that layers visibly matter in tests
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if with_tokenizer:
        char_tokenizer().save_pretrained(path)
    return path
