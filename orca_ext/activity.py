"""What the engine did lately, for the live dashboard: a bounded record of its recent iterations
(which sequences ran in each, their prefill tokens apart from their decode tokens) and of
sequences arriving and ending.

The engine appends one small tuple per iteration and one per arrival or end, under its own lock;
a reader copies what is newer than its cursors under that lock (``Engine.activity_sample``), a
few times a second. Nothing here runs per token; the records are numbered, so a reader that
falls behind the bounded buffers sees a gap rather than wrong data.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from .batch import SchedulerOutput
from .request import Request

ITERATIONS_KEPT = 512
EVENTS_KEPT = 1024
# A scheduled sequence the record no longer holds: not expected, but the dashboard must never
# stop the engine, so it is classified as if its prompt were empty.
_ENDED = ("", 0, 0.0)


class Iteration(NamedTuple):
    """One batch, from the start of the engine step that launched it to the end of the one that
    applied its result (its outputs built)."""

    number: int
    start: float  # time.time()
    end: float
    # (sequence id, prefill tokens, decode tokens, prompt tokens reused from the prefix cache):
    # a prompt, prompt chunk or recomputation runs prefill tokens; a sampled token, one decode.
    # Padding (request-level batching) counts as prefill.
    entries: tuple[tuple[int, int, int, int], ...]


class Event(NamedTuple):
    """A sequence arrived (``detail``: its prompt tokens) or ended (``detail``: its finish
    reason, "stop", "length" or "abort")."""

    number: int
    time: float
    kind: str  # "arrive" or "end"
    sequence_id: int
    label: str  # the user request id ("<id>/<i>" for the i-th of n > 1 samples)
    detail: int | str
    num_output_tokens: int


@dataclass
class LiveSequence:
    """An unfinished sequence, as the dashboard lists it."""

    sequence_id: int
    label: str
    state: str  # "waiting" (no KV) or "running" (holding KV)
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float


@dataclass
class ActivitySample:
    """What is new since a reader's cursors, plus the unfinished sequences."""

    iterations: list[Iteration]
    events: list[Event]
    live: list[LiveSequence]
    last_iteration: int  # the cursors to pass next time: the newest numbers (-1: none yet)
    last_event: int


class Activity:
    """The engine's bounded activity record; its methods are called under the engine's lock."""

    def __init__(self) -> None:
        self.iterations: deque[Iteration] = deque(maxlen=ITERATIONS_KEPT)
        self.events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self.num_iterations = 0
        self.iteration_seconds = 0.0  # summed over every iteration since start
        self._num_events = 0
        # Unfinished sequences: (label, prompt tokens, arrival time).
        self._live: dict[int, tuple[str, int, float]] = {}
        self._launched: dict[int, tuple[float, tuple[tuple[int, int, int, int], ...]]] = {}

    def arrived(self, sequence_id: int, label: str, num_prompt_tokens: int, now: float) -> None:
        self._live[sequence_id] = (label, num_prompt_tokens, now)
        self._event(now, "arrive", sequence_id, label, num_prompt_tokens, 0)

    def ended(self, request: Request, now: float) -> None:
        """Record the end of a sequence (its finish reason; "abort" if it has none)."""
        label = self._live.pop(request.request_id)[0]
        self._event(now, "end", request.request_id, label, request.finish_reason or "abort",
                    len(request.output_token_ids))

    def launched(self, batch: SchedulerOutput, start: float) -> None:
        """Note a batch handed to the executor in the step that started at ``start``."""
        cached = {new.request_id: len(new.computed_token_ids) for new in batch.new_requests
                  if new.computed_token_ids}
        live = self._live
        entries = []
        for r in batch.requests:
            num = len(r.token_ids)
            if num == 1 and r.num_computed >= live.get(r.request_id, _ENDED)[1]:
                entries.append((r.request_id, 0, 1, 0))
            else:
                entries.append((r.request_id, num + r.num_padding, 0,
                                cached.get(r.request_id, 0)))
        self._launched[batch.batch_id] = (start, tuple(entries))

    def returned(self, batch_id: int, end: float) -> None:
        """Record the iteration of a batch whose result the engine has applied."""
        start, entries = self._launched.pop(batch_id)
        self.iterations.append(Iteration(self.num_iterations, start, end, entries))
        self.num_iterations += 1
        self.iteration_seconds += end - start

    def sample(self, after_iteration: int, after_event: int, waiting: Iterable[Request],
               running: Iterable[Request]) -> ActivitySample:
        """The kept iterations and events numbered above the given ones (-1: all kept), and the
        ``waiting`` and ``running`` sequences."""
        live = [self._live_sequence(r, "waiting") for r in waiting]
        live += [self._live_sequence(r, "running") for r in running]
        return ActivitySample(_newer(self.iterations, after_iteration, self.num_iterations),
                              _newer(self.events, after_event, self._num_events), live,
                              self.num_iterations - 1, self._num_events - 1)

    def _live_sequence(self, request: Request, state: str) -> LiveSequence:
        label, num_prompt_tokens, arrival = self._live[request.request_id]
        return LiveSequence(request.request_id, label, state, num_prompt_tokens,
                            len(request.output_token_ids), arrival)

    def _event(self, now: float, kind: str, sequence_id: int, label: str, detail: int | str,
               num_output_tokens: int) -> None:
        self.events.append(Event(self._num_events, now, kind, sequence_id, label, detail,
                                 num_output_tokens))
        self._num_events += 1


def _newer(records: deque, after: int, count: int) -> list:
    """The records of ``records`` (the newest numbered ``count - 1``) numbered above ``after``."""
    new = min(len(records), count - 1 - after)
    if new <= 0:
        return []
    return list(records)[-new:]
