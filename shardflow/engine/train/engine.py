"""The training engine: one optimizer step of a sharded model under any (pp, dp, tp).

Every rank of the layout calls ``step`` with its data-parallel replica's share of the step's
batch (all ranks of a replica pass the same share). A step:

1. sums the loss normalizer over the dp group (one all-reduce of one float);
2. splits the share into micro-batches bounded by a token budget (at least one per stage) and
   runs them through the 1F1B pipeline schedule; gradients accumulate in a flat float32 buffer
   whose dp buckets (all-reduced, or reduce-scattered with a sharded optimizer) start during
   the last backward;
3. sums partial tp gradients, and the tied embedding's two copies across stages;
4. computes the global gradient norm (one all-reduce over the layout), clips, and applies
   AdamW to float32 master weights, which are copied back into the (e.g. bf16) model (sharded:
   each replica updates its pieces, then the replicas all-gather the new weights; offloaded: the
   optimizer state streams through the device from host memory).

The loss and its stats come back on the last stage's ranks; gradient norm and learning rate on
every rank. Two host synchronisations per step read the normalizer and the metrics; none
happens per micro-batch: each is built on the host while the device runs the one before, and
its tensors reach the device by copies that queue behind that work (``engine.micro_batches``).
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardflow.config.experiment import OptimConfig
from shardflow.config.files import read_json
from shardflow.data.batch import SequenceBatch
from shardflow.engine.outputs import LM_OUTPUTS, VALUE_OUTPUTS, token_outputs
from shardflow.engine.pipeline import StageLinks, train_1f1b
from shardflow.engine.shared_prompts import plan_micro_batches
from shardflow.engine.train.grad_buffer import GradBuffer
from shardflow.engine.train.grad_sync import (
    global_grad_norm,
    sum_partial_tp_grads,
    sum_tied_embedding_grads,
    tied_across_stages,
)
from shardflow.engine.train.loss_fn import LossFn
from shardflow.engine.train.optimizer import AdamW, lr_at
from shardflow.models.checkpoint import load_tensors, save_tensors
from shardflow.models.transformer import Transformer
from shardflow.parallel import comm
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import EMBED, LM_HEAD, unique_tensors
from shardflow.parallel.world import World

DEFAULT_BUCKET_NUMEL = 1 << 24  # 64 MiB of float32 gradients per dp all-reduce
OPTIMIZER_TENSORS = ("master", "exp_avg", "exp_avg_sq")  # what a checkpoint of the optimizer holds


class TrainEngine:
    def __init__(self, model: Transformer, layout: Layout, world: World, optim: OptimConfig, *,
                 gradient_checkpointing: bool = False, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 shard_optimizer: bool = False, offload_optimizer: bool = False):
        if model.shard.layout != layout or model.shard.rank != world.rank:
            raise ValueError(
                f"the model was built for rank {model.shard.rank} of {model.shard.layout}, "
                f"not rank {world.rank} of {layout}"
            )
        self.model, self.layout, self.world, self.optim = model, layout, world, optim
        self.cfg, self.shard = model.cfg, model.shard
        model.gradient_checkpointing = gradient_checkpointing
        rank = world.rank
        self.tp_group = world.groups.get(layout.tp_group(rank))
        self.dp_group = world.groups.get(layout.dp_group(rank))
        self.pp_group = world.groups.get(layout.pp_group(rank))
        self.layout_group = world.groups.get(layout.ranks)

        params = dict(model.named_parameters())
        assert set(params) == set(self.shard.tensors), set(params) ^ set(self.shard.tensors)
        self.device = next(iter(params.values())).device
        # shard_optimizer (ZeRO-2 style): the gradients are reduce-scattered over the dp group and
        # each replica keeps float32 master weights and AdamW moments of its pieces only; after its
        # update the replicas all-gather the new weights. Tensors whose gradients are fixed up across
        # tp ranks or stages after backward are all-reduced whole (see GradBuffer).
        self.sharded = shard_optimizer and layout.dp > 1
        whole = frozenset(n for n, ts in self.shard.tensors.items() if ts.partial_grad_tp)
        if tied_across_stages(self.cfg, layout):
            whole |= {EMBED, LM_HEAD} & set(params)
        self.grads = GradBuffer(params, self.dp_group, bucket_numel=bucket_numel, device=self.device,
                                shards=layout.dp if self.sharded else 1,
                                shard_index=dist.get_rank(self.dp_group) if self.sharded else 0,
                                whole=whole if self.sharded else frozenset())
        self._params = [params[n] for n in self.grads.names]
        # Where each parameter's owned elements sit in the optimizer's layout, sorted by that place:
        # (first element in the layout, the parameter, its first element, count).
        self._runs = sorted(((at, p, first, count) for n, p in zip(self.grads.names, self._params)
                             for first, at, count in self.grads.spans(n)), key=lambda run: run[0])
        self._run_starts = [r[0] for r in self._runs]
        # offloaded: built in (pinned) host memory, never whole on the device
        master = torch.zeros(self.grads.part.numel(), pin_memory=self.device.type == "cuda") if offload_optimizer \
            else torch.zeros_like(self.grads.part)
        with torch.no_grad():
            for at, param, first, count in self._runs:
                master[at:at + count] = param.reshape(-1)[first:first + count]
        matrices = [n for n in self.grads.names if len(self.shard.tensors[n].full_shape) >= 2]  # weight decay
        decay = [(at, at + count) for n in matrices for _, at, count in self.grads.spans(n)]
        self.optimizer = AdamW(master, decay, optim, offload=offload_optimizer, device=self.device)
        # sharded: the updated weights of the owned pieces in the model's dtype, all-gathered after the update
        self._weight_part = torch.empty(master.numel(), dtype=self._params[0].dtype, device=self.device) \
            if self.sharded else None
        # Gradient elements this rank counts in the global norm: replica 0's when the replicas hold
        # equal reduced gradients, each replica's own pieces when they are sharded.
        counts = self.sharded or self.shard.coord.dp == 0
        unique = unique_tensors(self.cfg, layout, rank) if counts else frozenset()
        self._counted = self.grads.part_views(self.grads.part, [n for n in self.grads.names if n in unique])
        self.step_count = 0  # optimizer updates applied; drives the lr schedule

    # ----- one step ----------------------------------------------------------------------

    def step(self, batch: SequenceBatch, loss_fn: LossFn, *, micro_batch_tokens: int,
             temperature: float = 1.0, share_prompts: bool = False, attention: str = "auto") -> dict[str, float]:
        """Forward, backward and one optimizer update over this replica's share ``batch``.
        ``share_prompts``: the samples of a prompt hold one copy of it (``engine.shared_prompts``;
        the same update, less work), unless the model has sliding-window layers; ``attention``: the
        kernel of such rows (``models.packed_attention``).

        Returns metrics: the loss and the loss's stats summed over micro-batches and replicas
        (on the last stage's ranks only), ``grad_norm`` (before clipping), ``lr``,
        ``num_micro_batches`` and ``model_tokens`` (this replica; tokens the layers ran, padding
        included, a shared prompt once) and ``skipped`` (1.0 when the gradient norm was not finite
        and the update was skipped).
        """
        self._check_batch(batch, temperature)
        # The losses read outputs at response tokens only (loss_mask): the head skips the prompts.
        wanted = "loss_mask" if "loss_mask" in batch.token_fields else None
        # Named ranges (shardflow.*) show a profile where the step's time goes, host and device.
        with record_function("shardflow.plan"):
            _, micro = plan_micro_batches(batch, micro_batch_tokens, self.device, min_micro_batches=self.layout.pp,
                                          outputs_at=wanted,
                                          share_prompts=share_prompts and not self.model.has_sliding_windows,
                                          attention=attention)
        with record_function("shardflow.normalizer"):
            normalizer = self._global_normalizer(loss_fn.normalizer(batch))

        names = VALUE_OUTPUTS if self.cfg.value_head else LM_OUTPUTS
        sums: dict[str, torch.Tensor] = {}  # loss and stats, summed over micro-batches
        model, shard = self.model, self.shard

        def forward_step(i: int, x: torch.Tensor | None) -> torch.Tensor:
            mb = micro[i]
            hidden = model(mb.ids if shard.first_stage else x, mb.positions, packed=mb.packed)  # [B,T,H]
            if not shard.last_stage:
                return hidden
            outputs = token_outputs(model, hidden, mb, names, temperature=temperature,
                                    entropy_grad=loss_fn.entropy_grad)
            loss, stats = loss_fn(outputs, mb.batch, normalizer)
            for key, value in {"loss": loss, **stats}.items():
                value = torch.as_tensor(value, dtype=torch.float32, device=self.device).detach()
                sums[key] = sums[key] + value if key in sums else value
            return loss

        def before_backward(j: int) -> None:
            if j == len(micro) - 1:
                self.grads.begin_final_backward()

        self.grads.zero()
        hidden_size = self.cfg.hidden_size
        shapes = [(*shape, hidden_size) for shape in micro.shapes]
        dtype = next(iter(self.model.parameters())).dtype
        links = StageLinks.of(self.layout, self.world.rank, self.pp_group, shapes, dtype, self.device)
        train_1f1b(links, shard.stage, self.layout.pp, forward_step, before_backward)

        with record_function("shardflow.reduce"):
            self.grads.finish_reduce()  # dp all-reduce, started during the last backward
            # Loss and stats: one all-reduce (sum) over the dp group, on the last stage. After the
            # gradient buckets, so that every replica issues the dp collectives in the same order.
            keys = sorted(sums)
            stats = torch.stack([sums[k] for k in keys]) if keys else torch.zeros(0, device=self.device)
            if keys:
                comm.all_reduce(stats, self.dp_group)
            sum_partial_tp_grads(self.grads, shard, self.tp_group)
            sum_tied_embedding_grads(self.grads, self.cfg, shard, self.layout, self.pp_group)
            self.grads.collect_owned()
            norm = global_grad_norm(self._counted, self.layout_group, self.device)

            # The step's second and last host synchronisation (the first read the normalizer):
            # metrics, and whether the gradient norm is finite.
            values = torch.cat([norm.reshape(1), stats]).tolist()
        grad_norm, stats_values = values[0], values[1:]
        lr = lr_at(self.optim, self.step_count + 1)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            with record_function("shardflow.optimizer"):
                self._update(norm, lr)
        metrics = dict(zip(keys, stats_values))
        metrics.update(grad_norm=grad_norm, lr=lr, num_micro_batches=float(len(micro)), skipped=float(skipped),
                       model_tokens=float(micro.tokens()))
        return metrics

    @torch.no_grad()
    def _update(self, norm: torch.Tensor, lr: float) -> None:
        grad = self.grads.part
        if self.optim.grad_clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, kept on the device (no host sync)
            grad.mul_(torch.clamp(self.optim.grad_clip / (norm + 1e-6), max=1.0))
        self.step_count += 1
        self.optimizer.step(grad, lr, self.step_count, self._store_weights)
        if self.sharded:
            self._set_weights(self._gathered(self._weight_part))

    def _store_weights(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Updated master weights of the optimizer's layout [lo, hi): into the model, or (sharded)
        into the owned pieces that the replicas all-gather."""
        if self.sharded:
            self._weight_part[lo:hi].copy_(values)
            return
        dst, src = [], []
        for at, param, first, count in self._runs[max(0, bisect.bisect_right(self._run_starts, lo) - 1):]:
            if at >= hi:
                break
            a, b = max(at, lo), min(at + count, hi)
            if a < b:
                dst.append(param.view(-1)[first + a - at:first + b - at])
                src.append(values[a - lo:b - lo])
        torch._foreach_copy_(dst, src)

    def _gathered(self, part: torch.Tensor) -> torch.Tensor:
        """The whole flat layout from every replica's pieces of it (collective over dp)."""
        if not self.sharded:
            return part
        return self.grads.unshard(comm.all_gather(part.to(self.device)[None], self.dp_group, dim=0))

    def _set_weights(self, flat: torch.Tensor) -> None:
        """The model's weights from a tensor laid out like the gradient buffer (any device)."""
        for name, param in zip(self.grads.names, self._params):
            a, b = self.grads.slices[name]
            param.view(-1).copy_(flat[a:b])

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's reduced (and clipped) float32 gradients by parameter name, whole (gathered
        over dp when sharded: a collective)."""
        return self._named_views(self._gathered(self.grads.part) if self.sharded else self.grads.flat)

    def _named_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` (laid out like the gradient buffer) by parameter name, shaped like them."""
        return {n: flat[a:b].view(p.shape) for n, p in zip(self.grads.names, self._params)
                for a, b in [self.grads.slices[n]]}

    def optimizer_bytes(self) -> int:
        """Bytes of this rank's optimizer state (master weights and both moments)."""
        return sum(getattr(self.optimizer, k).numel() * 4 for k in OPTIMIZER_TENSORS)

    def _check_batch(self, batch: SequenceBatch, temperature: float) -> None:
        if len(batch) == 0:
            raise ValueError("training step got an empty batch; every data-parallel replica needs "
                             "at least one sequence")
        if "input_ids" not in batch.token_fields:
            raise ValueError(f"training batch lacks token field 'input_ids' (has {sorted(batch.token_fields)})")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")

    def _global_normalizer(self, local: float) -> float:
        total = torch.tensor([float(local)], dtype=torch.float64, device=self.device)
        comm.all_reduce(total, self.dp_group)  # sum over the data-parallel replicas
        value = total.item()
        if not value > 0:
            raise ValueError(f"the loss normalizer summed over replicas is {value}; it must be positive "
                             "(does the step hold any response tokens?)")
        return value

    # ----- state for resume ----------------------------------------------------------------

    def _kind_views(self, kind: str, flat: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """One kind of optimizer state as views shaped like this rank's parameters, of ``flat`` (a
        whole flat layout; default: the optimizer's own, gathered when sharded)."""
        if flat is None:
            if self.optimizer.offload and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the last step's copies out have landed
            flat = self._gathered(getattr(self.optimizer, kind))
        return self._named_views(flat)

    def _state_views(self) -> dict[str, dict[str, torch.Tensor]]:
        return {kind: self._kind_views(kind) for kind in OPTIMIZER_TENSORS}

    @torch.no_grad()
    def save_state(self, path: str | Path) -> None:
        """Write the optimizer's state by tensor name, independent of the layout: each kind
        (``master``, ``exp_avg``, ``exp_avg_sq``) as full float32 tensors under the parameters'
        HF names in ``path/KIND`` (safetensors), the step count in ``path/optimizer.json``. Every
        rank of the layout calls this; one kind is gathered at a time."""
        path = Path(path)
        for kind in OPTIMIZER_TENSORS:
            save_tensors(self._kind_views(kind), self.cfg, self.layout, self.world.rank, path / kind)
        if self.world.rank == self.layout.ranks[0]:
            path.mkdir(parents=True, exist_ok=True)
            (path / "optimizer.json").write_text(json.dumps({"step": self.step_count, "saved_layout": str(self.layout),
                                                             "kinds": list(OPTIMIZER_TENSORS)}, indent=2))

    @torch.no_grad()
    def load_state(self, path: str | Path) -> None:
        """Restore what ``save_state`` wrote under any layout: each rank reads its own slices (a
        checkpoint resharded at load time), and the model's weights are set from the master copy.
        One kind at a time passes through host memory."""
        path = Path(path)
        state = read_json(path / "optimizer.json", "optimizer state")
        for kind in OPTIMIZER_TENSORS:
            flat = torch.zeros(self.grads.flat.numel(), dtype=torch.float32)
            load_tensors(self._kind_views(kind, flat), self.shard, path / kind)
            getattr(self.optimizer, kind).copy_(self.grads.owned_of(flat))
            if kind == "master":
                self._set_weights(flat)
        self.step_count = int(state["step"])

    def close(self) -> None:
        """Detach the engine's gradient hooks from the model."""
        self.grads.close()
