"""TRL's GRPOTrainer on a prepared workload: seconds per optimizer step (the peer of
``bench/iteration.py``). Run as its own process so that its memory never mixes with ours.

    python bench/trl_grpo.py --workdir DIR --steps 3 --micro-batch 32 --out trl.json

``DIR`` holds ``model/`` (checkpoint + tokenizer), ``prompts.jsonl`` and ``workload.json`` (prompts,
samples per prompt, response length), written by ``bench/iteration.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def constant_reward_spread(prompts, completions, **_) -> list[float]:
    """A reward that varies within groups (so advantages are not all zero) at no cost."""
    return [float(sum(map(ord, c)) % 7) / 6.0 for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, required=True,
                        help="per_device_train_batch_size; it must divide prompts x samples (the accumulation "
                             "steps make up one optimizer step over all of them)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    work = Path(args.workdir)
    workload = json.loads((work / "workload.json").read_text())
    prompts = [json.loads(line)["prompt"] for line in (work / "prompts.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    samples, length = workload["samples_per_prompt"], workload["response_tokens"]
    per_device = args.micro_batch
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=per_device,
        gradient_accumulation_steps=len(prompts) * samples // per_device, num_generations=samples,
        max_completion_length=length, generation_kwargs={"min_new_tokens": length},
        temperature=1.0, beta=0.0, learning_rate=1e-6, max_steps=args.steps, logging_steps=1,
        report_to=[], save_strategy="no", bf16=cuda, use_cpu=not cuda, seed=0, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32},
    )
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=constant_reward_spread, args=config,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    Path(args.out).write_text(json.dumps({"step_seconds": times, "trl_config": {
        "per_device_train_batch_size": per_device, "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "num_generations": samples, "max_completion_length": length}}, indent=2))
    print("TRL step seconds:", ", ".join(f"{t:.2f}" for t in times))


if __name__ == "__main__":
    main()
