"""GGUF files (llama.cpp's format) as Hugging Face checkpoints that shardflow loads.

``transformers`` reads a GGUF file's config, tokenizer (with its chat template) and weights,
dequantized; ``convert_gguf`` writes them as a plain checkpoint (safetensors, no quantization
config), once: it writes to a temporary directory and renames it, so that a half-written
checkpoint is never taken for a made one. Needs the ``gguf`` and ``accelerate`` packages.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

NEEDED = ("gguf", "accelerate")


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """``gguf_file`` as a Hugging Face checkpoint in ``out_dir`` (kept when already there)."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"converting {gguf_file.name} needs the packages {', '.join(missing)}: "
                         f"pip install {' '.join(missing)}")
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantized already: a plain model
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out_dir)
    return out_dir
