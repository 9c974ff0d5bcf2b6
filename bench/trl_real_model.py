"""TRL's GRPOTrainer on the real-model example (the peer of ``bench/real_model.py``): the same model,
training and held-out files, reward and settings, with held-out greedy accuracy every few steps.
Run as its own process so that its memory never mixes with ours.

    python bench/trl_real_model.py --model DIR --steps 40 --eval-every 5 --eval-prompts 100 --out trl.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardflow.examples import smollm2  # noqa: E402
from shardflow.rl.rewards.math_answer import math_score  # noqa: E402


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def math_reward(prompts, completions, answer, **_) -> list[float]:
    """shardflow's math reward of each completion (a conversational completion's text)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [math_score(t, a) for t, a in zip(texts, answer)]


@torch.no_grad()
def greedy_accuracy(model, tokenizer, held_out: list[dict], max_new_tokens: int, batch: int = 64) -> float:
    """pass@1 of greedy responses (left-padded batches), scored by the same reward."""
    was_training = model.training
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    correct = 0.0
    for start in range(0, len(held_out), batch):
        part = held_out[start:start + batch]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                               add_generation_prompt=True) for r in part]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        for r, ids in zip(part, out[:, enc["input_ids"].shape[1]:]):
            correct += math_score(tokenizer.decode(ids, skip_special_tokens=True), r["answer"])
    tokenizer.padding_side = side
    model.train(was_training)
    return correct / len(held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--prompts", type=int, required=True, help="prompts per step")
    parser.add_argument("--samples", type=int, required=True, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                               for r in rows(smollm2.TRAIN_FILE)])
    held_out = rows(smollm2.EVAL_FILE)[:args.eval_prompts]
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_run"), per_device_train_batch_size=args.prompts * args.samples,
        gradient_accumulation_steps=1, num_generations=args.samples, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_steps=args.steps, logging_steps=1, report_to=[],
        save_strategy="no", bf16=cuda, use_cpu=not cuda, seed=0, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},  # fp32 master weights with bf16 autocast, as shardflow trains
    )
    record = {"step_seconds": [], "eval": {}, "eval_seconds": 0.0, "rewards": []}

    class Measure(TrainerCallback):
        def _evaluate(self, step, model):
            start = time.perf_counter()
            record["eval"][step] = greedy_accuracy(model, tokenizer, held_out, args.max_new_tokens)
            record["eval_seconds"] += time.perf_counter() - start
            print(f"TRL step {step}: held-out pass@1 {record['eval'][step]:.3f}", flush=True)

        def on_train_begin(self, args_, state, control, model=None, **_):
            self._evaluate(0, model)

        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args_, state, control, model=None, **_):
            if cuda:
                torch.cuda.synchronize()
            record["step_seconds"].append(time.perf_counter() - self.start)
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                self._evaluate(state.global_step, model)

        def on_log(self, args_, state, control, logs=None, **_):
            if logs and "reward" in logs:
                record["rewards"].append(logs["reward"])

    start = time.perf_counter()
    trainer = GRPOTrainer(model=args.model, reward_funcs=math_reward, args=config, train_dataset=train,
                          processing_class=tokenizer, callbacks=[Measure()])
    trainer.train()
    record["wall_seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
