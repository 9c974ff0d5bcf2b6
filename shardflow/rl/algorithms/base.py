"""What an algorithm is to shardflow: its graph of calls and a preset of the algorithm knobs.

An ``Algorithm`` entry names everything the runtime and the planner need:

- ``graph(config)``: the dataflow graph of one iteration (``rl.graph``), built from the shared
  pieces of ``rl.graphs`` (generation, reward, reference) plus the algorithm's own calls;
- ``preset``: the value of every knob of ``config.experiment.AlgorithmConfig`` the user leaves
  unset (``None``): the advantage estimator (``rl.advantages.ADVANTAGES``), the policy loss
  (``rl.losses.POLICY_LOSSES``), the aggregation, the clip ranges, the KL's placement, ... A
  value may be a function of the experiment's settings;
- ``losses``: per trained model role, the loss its train call optimises;
- ``check(config)``: the algorithm's own rules across settings.

``resolve`` fills the knobs; ``check_knobs`` refuses a knob the resolved algorithm cannot use,
saying why. Both run before any rank starts (``runtime.validate``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch.distributed import ProcessGroup

from shardflow.config.experiment import AlgorithmConfig, ExperimentConfig
from shardflow.data.batch import SequenceBatch
from shardflow.rl.advantages import ADVANTAGES, compute_advantages
from shardflow.rl.graph import Graph
from shardflow.rl.graphs import rollout_calls, train_call
from shardflow.rl.losses import POLICY_LOSSES, actor_loss

LossBuilder = Callable[..., object]  # (resolved settings, kl_coef, *, norm_length) -> a LossFn
SECTIONS = ("kl", "dynamic_sampling", "overlong", "dpo")  # nested knob groups of AlgorithmConfig


# the knobs of PPO's clipped surrogate with the KL as a loss term, shared by most presets
CLIPPED = {"policy_loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2, "kl.in_reward": False,
           "kl.estimator": "k3"}


def _actor_graph(name: str, config: ExperimentConfig) -> Graph:
    calls = rollout_calls(config)
    return Graph(name, (*calls, train_call("actor", calls)))


def actor_graph(name: str) -> Callable[[ExperimentConfig], Graph]:
    """Generate, reward, (reference), train the actor: the graph of every critic-free algorithm
    (a partial, not a closure: the prepared run travels to the ranks pickled)."""
    return functools.partial(_actor_graph, name)


def no_rules(config: ExperimentConfig) -> None:
    """An algorithm without rules of its own."""


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    name: str
    summary: str  # one line for --help-config and the README
    graph: Callable[[ExperimentConfig], Graph]
    preset: Mapping[str, Any]  # "knob" or "section.knob" -> value (or a function of the experiment's settings)
    losses: Mapping[str, LossBuilder] = field(default_factory=lambda: dict(actor=actor_loss))
    # An offline algorithm trains on data rows instead of rollouts: the data fields of each row's
    # completions (``data.response_key``, ...), and what replaces the advantages: a function of
    # the share, the settings and the data-parallel group, returning the share with ``advantages``
    # and the metrics it measured.
    completions: tuple[str, ...] = ()
    offline_estimator: Callable[..., tuple[SequenceBatch, dict[str, float]]] | None = None
    check: Callable[[ExperimentConfig], None] = field(default=no_rules)

    @property
    def online(self) -> bool:
        """Generates its rollouts (else trains on data rows)."""
        return self.offline_estimator is None

    def resolve(self, config: ExperimentConfig) -> ExperimentConfig:
        """``config`` with every unset algorithm knob at this algorithm's preset."""
        algo = config.algorithm
        top, nested = {}, {name: {} for name in SECTIONS}
        for key, value in self.preset.items():
            section, _, knob = key.rpartition(".")
            current = getattr(getattr(algo, section), knob) if section else getattr(algo, knob)
            if current is None:
                value = value(config) if callable(value) else value
                (nested[section] if section else top)[knob] = value
        for section, values in nested.items():
            if values:
                top[section] = dataclasses.replace(getattr(algo, section), **values)
        return dataclasses.replace(config, algorithm=dataclasses.replace(algo, **top))

    def advantages(self, batch: SequenceBatch, algo: AlgorithmConfig, kl_coef: float,
                   group: ProcessGroup | None) -> tuple[SequenceBatch, dict[str, float]]:
        """The share with ``advantages`` (and ``returns`` for GAE), and what the estimate measured."""
        if self.online:
            return compute_advantages(batch, algo, kl_coef=kl_coef, group=group), {}
        return self.offline_estimator(batch, algo, group)

    def loss(self, role: str, algo: AlgorithmConfig, kl_coef: float, *, norm_length: float = 1.0):
        """The loss of ``role``'s train call."""
        if role not in self.losses:
            raise ValueError(f"algorithm {self.name!r} trains {sorted(self.losses)}, not {role!r}")
        return self.losses[role](algo, kl_coef, norm_length=norm_length)


def _users(registry: Mapping[str, Any], knob: str, knobs_of: Callable[[Any], tuple[str, ...]]) -> list[str]:
    return [name for name, entry in registry.items() if knob in knobs_of(entry)]


def check_knobs(algorithm: Algorithm, user: AlgorithmConfig, config: ExperimentConfig, graph: Graph) -> None:
    """Refuse what the resolved algorithm (``config.algorithm``) cannot use, saying why: a knob
    its estimator or loss does not read, an estimator whose inputs its graph lacks, a group
    estimator with one sample per prompt."""
    algo, name = config.algorithm, algorithm.name
    online_knobs = ("advantage", "policy_loss", "clip_low", "clip_high", "dual_clip", "value_clip",
                    "gamma", "lam", "whiten_advantages", "group_std_normalize")
    if name != "dpo":
        for knob in ("beta", "label_smoothing", "loss"):
            if getattr(user.dpo, knob) is not None:
                raise ValueError(f"algorithm.dpo.{knob} is set, but algorithm {name} is not dpo")
    if not algorithm.online:
        rollout_knobs = [f"algorithm.{k}" for k in online_knobs if getattr(user, k) is not None]
        rollout_knobs += [f"algorithm.{s}.{k}" for s, k in (("dynamic_sampling", "enabled"), ("overlong", "buffer"),
                                                             ("overlong", "filter"), ("kl", "in_reward"))
                          if getattr(getattr(user, s), k) is not None]
        if user.kl.coef > 0 or user.kl.target > 0:
            rollout_knobs.append("algorithm.kl")
        if rollout_knobs:
            raise ValueError(f"{rollout_knobs[0]} has no use in algorithm {name}, which trains on data rows "
                             "(no rollouts, rewards or advantages)")
        return
    for knob, registry in (("advantage", ADVANTAGES), ("policy_loss", POLICY_LOSSES)):
        if getattr(algo, knob) not in registry:
            raise ValueError(f"algorithm.{knob} must be one of {', '.join(registry)}; got {getattr(algo, knob)!r}")
    estimator = ADVANTAGES[algo.advantage]
    all_estimator_knobs = {k for e in ADVANTAGES.values() for k in e.knobs}
    for knob in sorted(all_estimator_knobs - set(estimator.knobs)):
        if getattr(user, knob) is not None:
            raise ValueError(f"algorithm.{knob} is set, but algorithm {name}'s advantage estimator "
                             f"({algo.advantage}) does not use it (it is read by: "
                             f"{', '.join(_users(ADVANTAGES, knob, lambda e: e.knobs))})")
    all_loss_knobs = {k for knobs in POLICY_LOSSES.values() for k in knobs}
    for knob in sorted(all_loss_knobs - set(POLICY_LOSSES[algo.policy_loss])):
        if getattr(user, knob) is not None:
            raise ValueError(f"algorithm.{knob} is set, but the policy loss {algo.policy_loss} does not use it "
                             f"(it is read by: {', '.join(_users(POLICY_LOSSES, knob, lambda k: k))})")
    produced = {key for call in graph.calls for key in call.outputs}
    if estimator.needs and estimator.needs not in produced:
        owner = {"values": "a critic (algorithm.name=ppo)", "baseline_rewards": "ReMax's greedy baseline "
                 "(algorithm.name=remax)"}[estimator.needs]
        raise ValueError(f"algorithm.advantage={algo.advantage} needs {owner}; algorithm {name}'s graph has none")
    groups = estimator.groups or algo.dynamic_sampling.enabled
    if groups and config.generation.samples_per_prompt < 2:
        what = f"algorithm.advantage={algo.advantage}" if estimator.groups else "algorithm.dynamic_sampling"
        raise ValueError(f"{what} compares the samples of a prompt: generation.samples_per_prompt must be at "
                         f"least 2, got {config.generation.samples_per_prompt}")
    if algo.overlong.buffer and algo.overlong.buffer >= config.generation.max_new_tokens:
        raise ValueError(f"algorithm.overlong.buffer ({algo.overlong.buffer}) must be less than "
                         f"generation.max_new_tokens ({config.generation.max_new_tokens})")
