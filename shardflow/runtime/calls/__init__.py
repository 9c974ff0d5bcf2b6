"""The call kinds of the dataflow graph, one runner each in ``CALL_KINDS``.

A runner takes a ``CallContext`` (the call, its layout, this rank's model and inputs) and returns
the call's outputs on this rank (on its holders; None elsewhere). The driver does the rest the
same way for every kind: the model's reallocation into the call's layout before, the outputs'
redistribution to the calls that read them after. Adding a kind is one ``rl.graph.Kind`` value,
one runner module here and one entry below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardflow.data.batch import SequenceBatch
from shardflow.rl.graph import Kind
from shardflow.runtime.calls.context import CallContext
from shardflow.runtime.calls.function import run_function
from shardflow.runtime.calls.generate import run_generate
from shardflow.runtime.calls.inference import run_inference
from shardflow.runtime.calls.train import run_train


@dataclass(frozen=True)
class CallKind:
    run: Callable[[CallContext], SequenceBatch | None]
    # False: plain Python at the holders of the call's input (no model, nothing redistributed in)
    uses_model: bool = True


CALL_KINDS: dict[Kind, CallKind] = {
    Kind.GENERATE: CallKind(run_generate),
    Kind.INFERENCE: CallKind(run_inference),
    Kind.TRAIN: CallKind(run_train),
    Kind.FUNCTION: CallKind(run_function, uses_model=False),
}
