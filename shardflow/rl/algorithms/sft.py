"""Supervised fine-tuning on prompt/response rows: the log-likelihood of the responses (the
prompts take no part in the loss), on the same runtime, plans and checkpoints as RL."""

from __future__ import annotations

from torch.distributed import ProcessGroup

from shardflow.config.experiment import AlgorithmConfig, ExperimentConfig
from shardflow.data.batch import SequenceBatch
from shardflow.rl.advantages import on_response_tokens
from shardflow.rl.algorithms.base import Algorithm
from shardflow.rl.graph import Call, Graph, Kind
from shardflow.rl.losses import likelihood_loss

EXAMPLES = "examples"  # the data source: each row's prompt and completions as sequences


def graph(config: ExperimentConfig) -> Graph:
    return Graph("sft", (Call("actor_train", Kind.TRAIN, "actor", (EXAMPLES,)),), sources=(EXAMPLES,))


def unit_weights(batch: SequenceBatch, algo: AlgorithmConfig,
                 group: ProcessGroup | None) -> tuple[SequenceBatch, dict[str, float]]:
    """Every response token counts once: the loss is the responses' negative log-likelihood."""
    return batch.update({"advantages": on_response_tokens(batch, batch.lengths.new_ones(len(batch)).float())}), {}


SFT = Algorithm(name="sft", summary="supervised fine-tuning: the responses' log-likelihood", graph=graph,
                preset={"loss_agg": "token-mean"}, losses={"actor": likelihood_loss},
                completions=("response_key",), offline_estimator=unit_weights)
