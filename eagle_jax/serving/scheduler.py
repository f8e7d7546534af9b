"""Which request sits in which row of the batch: the queue, the slots, admission and
batch-bucket changes. Host bookkeeping only: it decides, the executor moves the rows.

The live batch is a state whose rows are slots. A bucket change (more requests than
rows, or few enough to fit a smaller bucket for ``hysteresis`` steps) gathers the live
rows into a state of the new size; within a bucket, requests join and leave in place.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Callable

from eagle_jax.errors import InputError
from eagle_jax.serving.requests import Request


class Scheduler:
    """The engine's requests and slots.

    Args:
      batch_buckets: the compiled batch sizes, increasing; the first is the initial one.
      prompt_buckets: the compiled prompt lengths, increasing.
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

    def prompt_bucket_for(self, n: int) -> int:
        return next(b for b in self.prompt_buckets if b >= n)

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
        smaller = self.bucket_for(max(self.live, 1))
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

    def admit(self, prefill_batch: Callable[[int, int], int]) -> list[tuple[int, list[tuple[Request, int]]]]:
        """Seat queued requests in free rows (grow first: ``grow_to``); returns the prefill calls to make, as
        (prompt bucket, [(request, row)]): requests admitted together share one call per
        prompt bucket, ``prefill_batch(bucket, n)`` of them at a time (what compiled)."""
        free = [i for i, r in enumerate(self.slots) if r is None]
        admitted: list[tuple[Request, int]] = []
        while self.queue and free:
            req = self.queue.popleft()
            if not req.done:
                row = free.pop(0)
                self.slots[row] = req
                admitted.append((req, row))
        by_bucket: dict[int, list[tuple[Request, int]]] = collections.defaultdict(list)
        for req, row in admitted:
            by_bucket[self.prompt_bucket_for(len(req.prompt))].append((req, row))
        calls = []
        for p_len, group in by_bucket.items():
            while group:
                n = prefill_batch(p_len, len(group))
                calls.append((p_len, group[:n]))
                group = group[n:]
        return calls
