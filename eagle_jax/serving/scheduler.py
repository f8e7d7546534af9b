"""Which request sits in which row of the batch: the queue, the slots, admission,
prefill chunks and batch-bucket changes. Host bookkeeping only: it decides, the
executor moves the rows.

The live batch is a state whose rows are slots. A bucket change (more requests than
rows, or few enough to fit a smaller bucket for ``hysteresis`` steps) gathers the live
rows into a state of the new size; within a bucket, requests join and leave in place.

A seated request first prefills: its prompt goes in chunks of the compiled prompt
lengths (``chunk_plan``) into a state of its own (a ``PrefillJob``, with the requests
seated beside it that share its plan), at most ``prefill_token_budget`` tokens per
engine step while other requests decode, so a long prompt delays them by one chunk per
step rather than its whole prefill. After its last chunk the job's rows move into the
batch and decode from the next step.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Callable

from eagle_jax.errors import InputError
from eagle_jax.serving.requests import Request


def chunk_plan(length: int, chunks: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk lengths (from the increasing compiled ``chunks``) that prefill a prompt
    of ``length`` tokens, in order: the largest chunk that fits the rest while the rest
    does not end in one chunk padded by less than the smallest chunk. Every chunk but
    the last is full, and the last pads by less than ``chunks[0]``.

    >>> chunk_plan(300, (64, 128, 256)), chunk_plan(200, (64, 128, 256)), chunk_plan(1, (64, 256))
    ((256, 64), (256,), (64,))
    """
    if length < 1:
        raise ValueError(f"a prompt of {length} tokens")
    out, rest = [], length
    while True:
        tail = [c for c in chunks if rest <= c < rest + chunks[0]]
        if tail:
            return tuple(out) + (tail[0],)
        c = max(c for c in chunks if c <= rest)  # exists: rest > chunks[0] here
        out.append(c)
        rest -= c


class PrefillJob:
    """Requests seated together whose prompts share one chunk plan, prefilled chunk by
    chunk into a state of their own (the executor holds it) before they join the batch."""

    def __init__(self, plan: tuple[int, ...], requests: list[Request]):
        self.plan, self.requests = plan, requests
        self.chunk = 0  # chunks launched
        self.state = None  # the job's rows on the device (the executor's; None before the first chunk)
        self.samp = None  # their sampling arrays on the device

    @property
    def start(self) -> int:
        """Prompt position of the next chunk."""
        return sum(self.plan[: self.chunk])

    @property
    def next_tokens(self) -> int:
        """Padded tokens of the next chunk, all rows."""
        return self.plan[self.chunk] * len(self.requests)


class Scheduler:
    """The engine's requests and slots.

    Args:
      batch_buckets: the compiled batch sizes, increasing; the first is the initial one.
      prompt_buckets: the compiled prompt lengths (prefill chunks), increasing.
      max_batch: requests decoded at once (more wait in the queue).
      hysteresis: steps a smaller bucket must suffice before the batch shrinks to it.
    """

    def __init__(self, batch_buckets: tuple[int, ...], prompt_buckets: tuple[int, ...], max_batch: int, hysteresis: int):
        self.batch_buckets, self.prompt_buckets = batch_buckets, prompt_buckets
        self.max_batch, self.hysteresis = max_batch, hysteresis
        self.requests: dict[Any, Request] = {}  # every request not yet popped, by id
        self.queue: collections.deque[Request] = collections.deque()  # waiting for a slot, in arrival order
        self.slots: list[Request | None] = [None] * batch_buckets[0]  # row -> its request (None: free)
        self._ids = itertools.count()
        self._shrink_wait = 0
        self.prefilling: collections.deque[PrefillJob] = collections.deque()  # seated, in admission order

    # -- requests

    def new_id(self, requested=None):
        rid = requested if requested is not None else next(self._ids)
        if rid in self.requests:
            raise InputError(f"request id {rid!r} is already in use")
        return rid

    def add(self, req: Request) -> None:
        self.requests[req.id] = req
        self.queue.append(req)

    def get(self, request_id) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise InputError(f"no request {request_id!r}")
        return req

    def has_unfinished(self) -> bool:
        return any(not r.done for r in self.requests.values())

    def pop_finished(self) -> list[Request]:
        """Finished requests whose rows are free, removed from the engine."""
        seated = {r.id for r in self.slots if r is not None}
        done = [r for r in self.requests.values() if r.done and r.id not in seated]
        for r in done:
            del self.requests[r.id]
        return done

    # -- slots

    @property
    def live(self) -> int:
        return sum(r is not None for r in self.slots)

    def free_finished(self) -> bool:
        """Free the rows of finished requests; whether any row changed."""
        changed = False
        for i, r in enumerate(self.slots):
            if r is not None and r.done:
                self.slots[i] = None
                changed = True
        return changed

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.batch_buckets if b >= n)

    def grow_to(self) -> int | None:
        """The bucket the queue needs now, if larger than the current one."""
        while self.queue and self.queue[0].done:  # cancelled while queued
            self.queue.popleft()
        if not self.queue:
            return None
        want = self.bucket_for(min(self.live + len(self.queue), self.max_batch))
        return want if want > len(self.slots) else None

    def shrink_to(self) -> int | None:
        """A smaller bucket that has held every live request for ``hysteresis`` steps
        with nothing queued (counted per call: call once a step)."""
        # Not below a prefilling job's rows: they join the batch in one insert.
        smaller = self.bucket_for(max([self.live, 1] + [len(j.requests) for j in self.prefilling]))
        if smaller < len(self.slots) and not self.queue:
            self._shrink_wait += 1
            if self._shrink_wait >= self.hysteresis:
                self._shrink_wait = 0
                return smaller
        else:
            self._shrink_wait = 0
        return None

    def resize(self, new_b: int) -> list[int]:
        """Pack the live rows first into ``new_b`` rows; returns, per new row, the old row
        it comes from (padding rows copy row 0: they are free slots)."""
        live = [i for i, r in enumerate(self.slots) if r is not None]
        self.slots = [self.slots[i] for i in live] + [None] * (new_b - len(live))
        return (live + [0] * (new_b - len(live)))[:new_b]

    def decoding_rows(self) -> list[Request | None]:
        """The slots as a step sees them: requests still prefilling are not in the batch
        state yet (None, like free rows)."""
        return [r if r is not None and r.decoding else None for r in self.slots]

    @property
    def decoding(self) -> int:
        return sum(r is not None and r.decoding and not r.done for r in self.slots)

    def admit(self, prefill_batch: Callable[[int, int], int]) -> list[PrefillJob]:
        """Seat queued requests in free rows (grow first: ``grow_to``) and queue their
        prefill jobs (also returned): requests seated together that share a chunk plan
        form one job, ``prefill_batch(largest chunk, n)`` of them at a time (what compiled)."""
        free = [i for i, r in enumerate(self.slots) if r is None]
        admitted: list[Request] = []
        while self.queue and free:
            req = self.queue.popleft()
            if not req.done:
                self.slots[free.pop(0)] = req
                admitted.append(req)
        by_plan: dict[tuple[int, ...], list[Request]] = collections.defaultdict(list)
        for req in admitted:
            by_plan[chunk_plan(len(req.prompt), self.prompt_buckets)].append(req)
        jobs = []
        for plan, group in by_plan.items():
            while group:
                n = prefill_batch(max(plan), len(group))
                jobs.append(PrefillJob(plan, group[:n]))
                group = group[n:]
        self.prefilling.extend(jobs)
        return jobs

    def row_of(self, req: Request) -> int | None:
        """``req``'s row now (rows move on a bucket change), or None if it left."""
        for i, r in enumerate(self.slots):
            if r is req:
                return i
        return None
