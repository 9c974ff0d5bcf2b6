"""Multi-turn episodes over one replica's generation engine.

Every episode is one request that keeps its KV between turns (``Request.keep_kv``). When a turn
ends, the episode waits ("pending") while its environment runs elsewhere (``Turns``: on the
replica's holder, in worker processes); decoding goes on for the other episodes meanwhile. The
environments' answers are applied at fixed decode steps, the same on every tp rank of the
replica: every ``sync_every`` steps, and whenever nothing is left to decode. There the holder's
answers (observation tokens, or None when an episode is over) are broadcast to the replica's
ranks (``share``), so that every rank resumes and closes the same episodes at the same step.

Which answers are ready at a look depends on how fast the environments ran; with ``reproducible``
a look waits for every episode pending there, so that the steps where episodes resume depend on
the tokens alone and a seed repeats its run exactly (slow environments then hold decoding up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Protocol, Sequence

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


@dataclass
class Episodes:
    """What a generation needs to run its requests as episodes: the environments' side (None
    on a rank that does not hold them), each request's dataset row by request id, and the
    episode's output limit (``Request.max_output``)."""

    turns: Turns | None
    rows: dict[int, dict]
    max_output: int
    reproducible: bool = False  # each look at the answers waits for every pending episode

    def start(self, requests: Sequence[Request]) -> None:
        """Mark ``requests`` as episodes (each rank) and open their environments (the holder)."""
        for r in requests:
            r.keep_kv, r.max_output = True, self.max_output
            if self.turns is not None:
                self.turns.begin(r, self.rows[r.request_id])


def collect_answers(turns: Turns, waiting_for: Collection[int], *, wait: bool, every: bool) -> Answers:
    """The holder's answers at one look: those ready (with ``wait``: at least one), or with
    ``every`` one for each episode of ``waiting_for``, however long they take. In request id
    order, so that which worker answered first changes nothing that follows."""
    answers = turns.ready(wait=wait)
    if every:
        missing = set(waiting_for) - {request_id for request_id, _ in answers}
        while missing:
            more = turns.ready(wait=True)
            missing -= {request_id for request_id, _ in more}
            answers += more
    return sorted(answers, key=lambda answer: answer[0])


def apply_answers(engine: GenerationEngine, pending: dict[int, Request], answers: Answers,
                  on_finish: Callable[[Request], None] | None = None) -> None:
    """Resume (next turn) or close (over) the pending episodes the answers are about; answers
    about episodes this rank does not hold are skipped. A closed episode that is parked here
    frees its slot (after an adaptive switch it is not: its KV was dropped)."""
    for request_id, observation in answers:
        r = pending.pop(request_id, None)
        if r is None:
            continue
        if observation is None:
            if engine.parked.get(request_id) is r:
                engine.close([r])
            if on_finish is not None:
                on_finish(r)
        else:
            r.continue_with(observation)
            engine.submit([r])


def run_episodes(engine: GenerationEngine, requests: Sequence[Request], turns: Turns | None,
                 rows: Sequence[dict], *, share: Callable[[Answers | None], Answers],
                 max_output: int, on_finish: Callable[[Request], None] | None = None,
                 sync_every: int = SYNC_EVERY, reproducible: bool = False) -> int:
    """Run ``requests`` (this replica's, with their dataset ``rows``) as episodes to their end;
    returns the decode steps taken. ``turns`` is None on the ranks that do not hold the
    environments; ``share`` broadcasts the holder's answers (identity with one rank);
    ``on_finish`` sees each episode once it is over; ``reproducible``: see the module's note."""
    Episodes(turns, {r.request_id: row for r, row in zip(requests, rows)}, max_output).start(requests)
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
            mine = None
            if turns is not None:
                mine = collect_answers(turns, pending, wait=not runnable, every=reproducible)
            answers = share(mine)
            apply_answers(engine, pending, answers, on_finish)
    assert not engine.parked, "an episode ended without closing its slot"
    return steps
