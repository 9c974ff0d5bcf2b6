"""The real-model example's model, SmolLM2-135M-Instruct converted from its package's GGUF file:
shardflow's greedy generation against transformers' on it under dp and tp layouts. Skipped when
the model package is not installed (``pip install -e '.[examples]'``)."""

from __future__ import annotations

import pytest
from gen_helpers import hf_greedy
from test_generation import merged

from shardflow.examples import smollm2

pytestmark = pytest.mark.skipif(any(__import__("importlib").util.find_spec(m) is None
                                    for m in (smollm2.MODEL_PACKAGE, "gguf", "accelerate")),
                                reason="the real-model example's packages are not installed")

# 9 query and 3 KV heads: tp = 3 splits them, and dp = 2 replicas of it
LAYOUTS = ["d2p1t1@0-1", "d1p1t3@2-4", "d2p1t3@0-5"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return smollm2.model_checkpoint(tmp_path_factory.mktemp("cache"))


def test_greedy_generation_matches_transformers_under_dp_and_tp(pool, model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = [r["prompt"] for r in smollm2.problems()[1][:4]]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"] for q in questions]
    eos = tokenizer.eos_token_id
    expected = [hf_greedy(str(model), p, NEW_TOKENS, eos=eos) for p in ids]
    params = [dict(max_new_tokens=NEW_TOKENS, temperature=0.0)] * len(ids)
    got = merged(pool, str(model), LAYOUTS, ids, params, 1, dict(max_seq_len=256, max_batch_size=8))
    assert set(got) == set(LAYOUTS)
    for layout, results in got.items():
        assert [out for out, _, _ in results] == expected, layout
    assert any(len(e) == NEW_TOKENS for e in expected)  # real text, not an immediate end


def test_the_converted_checkpoint_is_a_plain_llama(model):
    import json

    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert smollm2.model_checkpoint(model.parent.parent) == model  # converted once, then found
