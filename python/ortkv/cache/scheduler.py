"""Continuous batching over a ``PageCache``: ``Scheduler``.

Note [Scheduler]
~~~~~~~~~~~~~~~~
Every sample (one output stream; a request with ``n`` > 1 has n of them after its prefill) has a
history = prompt + generated tokens, and a cache sequence whose length says how much of that history
has K/V in the cache. A step feeds each scheduled sample the next tokens of its history: a decode
feeds the one token sampled last, a prefill feeds a chunk of the prompt (what the prefix cache did
not already hold); the step that feeds a history's last token yields logits, and the caller samples
the next token from them. So a prefill, a decode, and a recompute after preemption are one thing.

``schedule()`` builds one step, all or nothing through ``PageCache.admit`` (Note [Admission]):
  1. every running sample decodes (one token), partly prefilled samples continue, and waiting
     requests are started in arrival order while the step's token budget (``max_step_tokens``),
     ``max_running`` and free sequence slots last (a started request first takes its cached prefix);
  2. when admission refuses for lack of pages, the requests started in this step go back to the
     queue (their sequences removed) and the step is retried; if it still does not fit, the
     running request started last is preempted: its sequences are removed (pages no other sequence
     holds are freed; its full prompt pages stay cached and usually come back as prefix hits) and
     it waits at the head of the queue to be recomputed (vLLM's recompute policy);
  3. a sample whose sequence would outgrow ``max_pages_per_seq`` finishes with reason "length";
  4. a request that cannot fit even alone raises ``CapacityError`` (waiting cannot help it).
``complete(step, sampled)`` marks the step done, appends each sampled token, forks a request's n
samples when its prefill ends (``sampled[seq]`` is then n tokens drawn from the same logits, and the
n sequences share every prompt page), and retires finished samples (eos, max_new_tokens, length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import CacheProtocolError, CapacityError
from .pages import PageCache, Placement


@dataclass
class _Sample:
    history: list                 # prompt + generated
    generated: list = field(default_factory=list)
    seq: int | None = None        # cache sequence id while it has one
    finished: str | None = None   # "eos" | "max_new_tokens" | "length"


@dataclass
class _Request:
    id: int
    prompt: list
    max_new_tokens: int
    n: int
    eos: int | None
    samples: list = field(default_factory=list)
    started: bool = False         # has cache sequences
    forked: bool = False          # n samples exist


@dataclass(frozen=True)
class Row:
    """One row of a step: the sequence, its request and sample, and whether the step ends its
    history (then the caller samples ``draws`` tokens from this row's last logits: n at the end of
    the prefill of a request with n samples, else 1)."""
    seq: int
    request: int
    sample: int
    wants_token: bool
    draws: int = 1


@dataclass
class Step:
    placement: Placement
    rows: list

    @property
    def seq_ids(self) -> tuple:
        return self.placement.seq_ids


@dataclass(frozen=True)
class Event:
    """A token produced for (request, sample); ``finished`` is set on its sample's last token."""
    request: int
    sample: int
    token: int
    finished: str | None = None


class Scheduler:
    def __init__(self, cache: PageCache, max_step_tokens: int = 2048, max_running: int | None = None):
        if max_step_tokens < 1:
            raise CacheProtocolError(f"Scheduler: max_step_tokens must be >= 1, got {max_step_tokens}")
        self.cache = cache
        self.max_step_tokens = int(max_step_tokens)
        self.max_running = int(max_running or cache.max_sequences)
        self._requests: dict[int, _Request] = {}
        self.waiting: list[int] = []      # request ids, head first
        self.running: list[int] = []      # request ids in the order they started
        self._next_req = 0
        self._step: Step | None = None
        self.preemptions = 0
        self.prefill_tokens = 0           # tokens fed that were not decode tokens
        self.reused_tokens = 0            # prompt tokens found in the prefix cache
        self.steps = 0

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_new_tokens: int, n: int = 1,
               eos_token_id: int | None = None) -> int:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise CacheProtocolError("submit: empty prompt; a request needs at least one token")
        if max_new_tokens < 1 or n < 1:
            raise CacheProtocolError(f"submit: max_new_tokens {max_new_tokens} and n {n} must be >= 1")
        if n > self.cache.max_sequences:
            raise CacheProtocolError(f"submit: n={n} samples but the cache has {self.cache.max_sequences} "
                                     "sequence slots (max_sequences)")
        rid = self._next_req
        self._next_req += 1
        self._requests[rid] = _Request(rid, prompt, int(max_new_tokens), int(n), eos_token_id,
                                       [_Sample(list(prompt))])
        self.waiting.append(rid)
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def result(self, rid: int) -> list[list[int]]:
        """Generated tokens of each sample of request ``rid`` so far."""
        return [list(s.generated) for s in self._requests[rid].samples]

    def finish_reasons(self, rid: int) -> list:
        return [s.finished for s in self._requests[rid].samples]

    # -- internals ---------------------------------------------------------------------------------
    def _seq_id(self) -> int:
        return self.cache.fresh_id()

    def _live(self, req: _Request) -> list:
        return [s for s in req.samples if s.finished is None]

    def _drop(self, req: _Request) -> None:
        """Remove the request's sequences; its samples keep their histories (to be recomputed)."""
        for s in req.samples:
            if s.seq is not None:
                self.cache.remove(s.seq)
                s.seq = None
        req.started = False

    def _start(self, req: _Request) -> int:
        """Give the request's live samples cache sequences; returns the tokens found cached."""
        reused = 0
        for s in self._live(req):
            sid = self._seq_id()
            reused += self.cache.new_sequence(sid, s.history)
            s.seq = sid
        req.started = True
        return reused

    def _rows(self, reqs: list, budget: int) -> tuple[list, list, int, int]:
        """Entries for admit, Rows, budget left, prefill tokens among them."""
        entries, rows, prefill = [], [], 0
        for req in reqs:
            for i, s in enumerate(req.samples):
                if s.finished is not None or budget <= 0:
                    continue
                have = self.cache.length(s.seq)
                todo = len(s.history) - have
                k = min(todo, budget)
                entries.append((s.seq, np.asarray(s.history[have:have + k], np.int64)))
                rows.append(Row(s.seq, req.id, i, k == todo, req.n if req.n > 1 and not req.forked else 1))
                if not (todo == 1 and s.generated):
                    prefill += k
                budget -= k
        return entries, rows, budget, prefill

    def _reserved_slots(self) -> int:
        return sum(self._requests[r].n - 1 for r in self.running if not self._requests[r].forked)

    def schedule(self) -> Step | None:
        """The next step (Note [Scheduler]), admitted; None when there is nothing to run."""
        if self._step is not None:
            raise CacheProtocolError("schedule: the previous step is not completed; call complete(step, sampled)")
        new_limit = None          # how many waiting requests this step may start (None: as many as fit)
        while True:
            running = [self._requests[r] for r in self.running]
            entries, rows, budget, prefill = self._rows(running, self.max_step_tokens)
            started, reused = [], 0
            slots = self.cache.free_slots - self._reserved_slots()
            for rid in self.waiting:
                req = self._requests[rid]
                need = len(self._live(req)) if req.forked else req.n
                if (budget <= 0 or len(self.running) + len(started) >= self.max_running or need > slots
                        or (new_limit is not None and len(started) >= new_limit)):
                    break
                reused += self._start(req)
                slots -= need
                started.append(req)
                e, r, budget, p = self._rows([req], budget)
                entries, rows, prefill = entries + e, rows + r, prefill + p
            if not entries:
                for req in started:
                    self._drop(req)
                return None
            owners = {row.seq: (self._requests[row.request], row.sample) for row in rows}
            placement = self.cache.admit(entries)
            if placement:
                for req in started:
                    self.waiting.remove(req.id)
                    self.running.append(req.id)
                self.prefill_tokens += prefill
                self.reused_tokens += reused
                self.steps += 1
                self._step = Step(placement, rows)
                return self._step
            for req in started:
                self._drop(req)
            if placement.kind == "sequence_full":
                req, i = owners[placement.seq]
                self._finish(req, req.samples[i], "length")
                continue
            if started and self.running:
                new_limit = 0             # the running requests first; the new ones wait
                continue
            if len(started) > 1:
                new_limit = 1             # nothing running: try the head of the queue alone
                continue
            if started or len(self.running) == 1:
                req = started[0] if started else self._requests[self.running[0]]
                raise CapacityError(
                    f"scheduler: request {req.id} ({len(req.prompt)} prompt tokens, n={req.n}) does not fit "
                    f"in the page store even with nothing else running ({placement.reason}); raise the "
                    "store's budget or shorten the request", requested=placement.pages_needed)
            victim = self._requests[self.running.pop()]
            self._drop(victim)
            self.waiting.insert(0, victim.id)
            self.preemptions += 1
            new_limit = 0

    def complete(self, step: Step, sampled: Mapping) -> list[Event]:
        """The step ran: ``sampled[seq]`` is the token drawn for each row with ``wants_token`` (a list
        of n tokens for a request whose prefill this step ended, n > 1). Returns the new tokens."""
        if step is not self._step:
            raise CacheProtocolError("complete: this is not the step scheduled last (or it was completed)")
        for row in step.rows:
            if not row.wants_token:
                continue
            if row.seq not in sampled:
                raise CacheProtocolError(f"complete: no sampled token for sequence {row.seq} (request "
                                         f"{row.request}), whose history this step ended")
            req = self._requests[row.request]
            if req.n > 1 and not req.forked:
                got = np.asarray(sampled[row.seq]).reshape(-1)
                if got.size != req.n:
                    raise CacheProtocolError(f"complete: request {req.id} ends its prefill with n={req.n} "
                                             f"samples; sampled[{row.seq}] must hold {req.n} tokens, got {got.size}")
        self.cache.done(step.placement)
        self._step = None
        events: list[Event] = []
        for row in step.rows:
            if not row.wants_token:
                continue
            req = self._requests[row.request]
            val = np.asarray(sampled[row.seq]).reshape(-1)
            if req.n > 1 and not req.forked:
                parent = req.samples[0]
                for _ in range(1, req.n):
                    s = _Sample(list(parent.history))
                    s.seq = self._seq_id()
                    self.cache.fork(parent.seq, s.seq)
                    req.samples.append(s)
                req.forked = True
                for i in range(req.n):
                    self._append(req, i, int(val[i]), events)
            else:
                if val.size != 1:
                    raise CacheProtocolError(f"complete: sampled[{row.seq}] must be one token, got {val.size}")
                self._append(req, row.sample, int(val[0]), events)
        return events

    def _append(self, req: _Request, i: int, tok: int, events: list) -> None:
        s = req.samples[i]
        s.generated.append(tok)
        s.history.append(tok)
        why = None
        if req.eos is not None and tok == req.eos:
            why = "eos"
        elif len(s.generated) >= req.max_new_tokens:
            why = "max_new_tokens"
        events.append(Event(req.id, i, tok, why))
        if why:
            self._finish(req, s, why)

    def _finish(self, req: _Request, s: _Sample, why: str) -> None:
        s.finished = why
        if s.seq is not None:
            self.cache.remove(s.seq)
            s.seq = None
        if not self._live(req):
            if req.id in self.running:
                self.running.remove(req.id)
            if req.id in self.waiting:
                self.waiting.remove(req.id)

    def stream(self, forward: Callable[[Step], Mapping]) -> Iterator[Event]:
        """Run until every submitted request finished: ``forward(step)`` runs the model on the step
        and returns ``sampled`` for ``complete``; yields every token as it is produced."""
        while self.has_work:
            step = self.schedule()
            if step is None:
                return
            yield from self.complete(step, forward(step))
