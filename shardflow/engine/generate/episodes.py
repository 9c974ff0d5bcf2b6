"""Multi-turn episodes over one replica's generation engine.

Every episode is one request that keeps its KV between turns (``Request.keep_kv``). When a turn
ends, the episode waits ("pending") while its environment runs elsewhere (``Turns``: on the
replica's holder, in worker processes); decoding goes on for the other episodes meanwhile. The
environments' answers are applied at fixed decode steps, the same on every tp rank of the
replica: every ``sync_every`` steps, and whenever nothing is left to decode. There the holder's
answers (observation tokens, or None when an episode is over) are broadcast to the replica's
ranks (``share``), so that every rank resumes and closes the same episodes at the same step.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from shardflow.engine.generate.engine import GenerationEngine
from shardflow.engine.generate.requests import Request

SYNC_EVERY = 8  # decode steps between looks at the environments' answers

Answers = list[tuple[int, list[int] | None]]  # (request id, the next observation's tokens or None: over)


class Turns(Protocol):
    """The holder's side: ``begin`` an episode, hear that a turn ``ended``, and the ``ready``
    answers (with ``wait``: at least one)."""

    def begin(self, request: Request, row: dict) -> None: ...

    def ended(self, request: Request) -> None: ...

    def ready(self, wait: bool) -> Answers: ...


def run_episodes(engine: GenerationEngine, requests: Sequence[Request], turns: Turns | None,
                 rows: Sequence[dict], *, share: Callable[[Answers | None], Answers],
                 max_output: int, on_finish: Callable[[Request], None] | None = None,
                 sync_every: int = SYNC_EVERY) -> int:
    """Run ``requests`` (this replica's, with their dataset ``rows``) as episodes to their end;
    returns the decode steps taken. ``turns`` is None on the ranks that do not hold the
    environments; ``share`` broadcasts the holder's answers (identity with one rank);
    ``on_finish`` sees each episode once it is over."""
    for r, row in zip(requests, rows):
        r.keep_kv, r.max_output = True, max_output
        if turns is not None:
            turns.begin(r, row)
    pending: dict[int, Request] = {}

    def turn_ended(r: Request) -> None:
        pending[r.request_id] = r
        if turns is not None:
            turns.ended(r)

    engine.submit(requests)
    steps = 0
    while engine.busy or pending:
        runnable = engine.busy and not engine.stalled
        if runnable:
            engine.step(turn_ended)
            steps += 1
        if pending and (not runnable or steps % sync_every == 0):
            answers = share(turns.ready(wait=not runnable) if turns is not None else None)
            for request_id, observation in answers:
                r = pending.pop(request_id)
                if observation is None:
                    engine.close([r])
                    if on_finish is not None:
                        on_finish(r)
                else:
                    r.continue_with(observation)
                    engine.submit([r])
    assert not engine.parked, "an episode ended without closing its slot"
    return steps
