"""Request scheduling on an embedding-owner replica: its rows of every microbatch are slots.

The scheduler plans rounds ahead and learns the sampled tokens late, so that a decode round
needs nothing from the host:
  - `plan()` plans the next round: per microbatch, what each row feeds (`RowStep`) and so how
    many tokens (`StepPlan.counts`: the round's packed layout, `opweave.runtime.layout`). A free
    slot (the lowest first) takes the next request of this replica's queue. Decoding rows feed
    one token each: the token the last stage sampled, which stays on the device
    (`opweave.runtime.inputs`); positions are known ahead (one more per step), so the plan knows
    them without any token. Prompts are prefilled in chunks under a token budget per round and
    microbatch (`prefill_chunk`, a planned figure carried by the rank program,
    `opweave.ir.plan.PREFILL_CHUNK` by default), decode first: the prefilling rows share the
    budget in the order they were admitted, so a new request costs the decoding rows only its
    own chunk's compute, and a row admitted while the budget is spent waits (idle) for the next
    round. The token sampled after a chunk that is not the prompt's last is not an output.
  - `learn(round, mb, tokens)` takes the tokens a round sampled, some rounds later (the runtime
    copies them to the host asynchronously): outputs are appended in order, and a request ends on
    an EOS id, at `max_new_tokens`, when its sequence fills the planned context, or when the
    sampler marked its row NON_FINITE_TOKEN (its logits held a NaN or an infinity: the request
    ends with an error naming the output token and the other rows carry on).
Ends that are known ahead (`max_new_tokens`, the context) stop the planning at once, so the slot
takes the next request in the next planned round; an EOS is learned late: steps already planned
for the request are cancelled (the row idles) and those already run are dropped.

KV pages (`opweave.runtime.pages`): the scheduler keeps the replica's page pool as every rank will
(each planned round applied as it is planned), so it knows the pages a round takes before any rank
runs it. A request is admitted only while the pool has the pages of its whole prompt and first
output (the head of the queue waits otherwise). When a round's rows need more pages than the pool
has, the newest request of the microbatch is preempted (vLLM's recompute policy): its pages are
dropped in that round, its steps not yet started idle, and once the outputs of its steps already
run are learned it goes back to the head of the queue, to prefill its prompt and those outputs
again (their pages may still be cached: prefix reuse finds them) and go on from its next output.
Sampling draws by (seed, position), so a preempted request's tokens are the ones it would have had.

Serving (`opweave serve`) adds requests while rounds run (`add`), cancels them (`cancel`: the
slot frees within a round), ends them on a request's own stop ids too, and reports each learned
token and each end through `on_event(request, token, finish_reason, logprobs)`.

Log-probabilities (`opweave.kernels.logprobs`): a request whose sampling word asks for them gets,
with each output token, the token's log-probability and the top ones (`Logprob`). One that asks
for its prompt's too (`prompt_logprobs`, the API's `echo` with `logprobs`) is fed one prompt token
per round, each step's `target` the prompt token after it, so the last stage reports that token's
log-probability given the tokens before it (the LM head sees each row's last token only); it
takes no cached prefix, since every position must be computed.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from opweave.errors import OpWeaveError
from opweave.ir.plan import PREFILL_CHUNK
from opweave.models.ops import NON_FINITE_TOKEN
from opweave.kernels.logprobs import decode as decode_record
from opweave.kernels.sampling import FIELDS, GREEDY, top_logprobs
from opweave.runtime import pages as P
from opweave.runtime.pages import PagePool
from opweave.runtime.prefix import PrefixCache, page_keys

TEMPERATURE = FIELDS.index("temperature")


@dataclasses.dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    error: str | None = None
    source: str = ""  # where the prompt came from, for messages ("--prompts p.jsonl: line 3")
    stop_ids: tuple[int, ...] = ()  # ids that end this request besides the model's EOS ids
    finish_reason: str | None = None  # "stop" (an EOS or stop id), "length", "cancelled", "error"
    sampling: tuple[int, ...] = GREEDY  # its row's sampling word (`opweave.kernels.sampling.encode`)
    ignore_eos: bool = False  # the model's EOS ids do not end it
    min_tokens: int = 0       # no EOS or stop id ends it before this many outputs (the sampler bans EOS)
    prompt_logprobs: bool = False  # report each prompt token's log-probability (fed a token a round)
    prompt_lp: dict = dataclasses.field(default_factory=dict)  # prompt index -> its `Logprob`
    transfer: int = 0  # prefill/decode disaggregation, prefill side: its KV transfer's key + 1 (0: none)
    local: bool = False  # decode side: prefilled here, not on a prefill rank (after a preemption)

    @property
    def top_logprobs(self) -> int | None:
        """The top log-probabilities each output reports (None: it reports none)."""
        return top_logprobs(self.sampling)

    @property
    def prompt_pending(self) -> bool:
        """Prompt log-probabilities are asked and not all learned yet."""
        return self.prompt_logprobs and len(self.prompt_lp) < len(self.prompt) - 1


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's log-probability and the most likely tokens' (id, log-probability), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class RowStep:
    """What one row does in one round: idle (`request` None), feed host tokens (a prompt chunk,
    `tokens`), or decode (no `tokens`: the token sampled last round, on the device)."""

    request: Request | None = None
    tokens: tuple[int, ...] = ()
    first: int = -1        # position of the first token fed
    output: bool = False   # the step samples an output token of `request`
    last: bool = False     # ... its last one, known ahead (max_new_tokens or the context)
    pad: int = 0           # idle, but the round was agreed with this many tokens here (a request
                           # that ended after its step was planned): padding tokens, position -1
    event: int = P.NONE    # the row's page event this round (`opweave.runtime.pages`)
    fills: tuple[int, ...] = ()  # prompt pages this step fills that a later prompt may share
    bucket: bool = False   # `pad` is a free row's padding token filling a decode round to its bucket
    target: int = -1       # the prompt token after this step's, whose log-probability it reports
    imported: int = 0      # positions whose state arrives from a prefill rank this round (nothing computed)
    key: int = 0           # the row's KV transfer key + 1 (`opweave.runtime.kvtransfer`), 0: none

    @property
    def idle(self) -> bool:
        return self.request is None

    @property
    def decode(self) -> bool:
        return self.request is not None and not self.tokens

    @property
    def sampled(self) -> bool:
        """The step draws an output token at a positive temperature (the sampler's vocabulary walk)."""
        return self.output and self.request.sampling[TEMPERATURE] > 0

    @property
    def logprobs(self) -> bool:
        """The step reports a log-probability: its prompt target's, or its output's."""
        return self.request is not None and (
            self.target >= 0 or (self.output and self.request.top_logprobs is not None))


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One microbatch's rows in one round."""

    rows: tuple[RowStep, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        """Tokens per row this round (0 idle, 1 decoding, a prompt chunk's length)."""
        return tuple(s.pad if s.idle else 0 if s.imported else len(s.tokens) or 1 for s in self.rows)

    @property
    def values(self) -> tuple[int, ...]:
        """Per row, its tokens and page event as the control word carries them (`pages.encode`)."""
        return tuple(P.encode(s.imported, s.event, imported=True) if s.imported else
                     P.encode(c, s.event, s.bucket, s.sampled, s.logprobs) for c, s in zip(self.counts, self.rows))

    @property
    def aux(self) -> tuple[int, ...]:
        """Per row, its KV transfer key + 1 (0: none), beside `values` in the control word."""
        return tuple(s.key for s in self.rows)


def bucketed(steps: list[RowStep]) -> list[RowStep]:
    """A decode round's rows filled to the next bucket (1, 2, 4, ... rows, at most all): the free
    rows below it feed one padding token each (`RowStep.bucket`: they take no page). A round with a
    prompt chunk, or no decoding row, is left as it is."""
    if any(len(s.tokens) > 0 for s in steps) or not any(s.decode for s in steps):
        return steps
    live = max(i for i, s in enumerate(steps) if not s.idle or s.pad) + 1
    bucket = min(len(steps), 1 << (live - 1).bit_length())
    return [RowStep(pad=1, event=s.event, bucket=True) if i < bucket and s.idle and not s.pad else s
            for i, s in enumerate(steps)]


@dataclasses.dataclass
class _Row:
    request: Request | None = None  # the request being planned on this row
    position: int = 0                # next position to feed
    pending: list[int] = dataclasses.field(default_factory=list)  # prompt tokens not yet planned
    planned: int = 0                 # output steps planned for the request
    admitted: int = 0                # admission order (prefilling rows share the budget in it)
    event: int = P.NONE              # page event of the row's next planned step
    release: bool = False            # its last request left: drop its pages in the next round
    keys: list[int] = dataclasses.field(default_factory=list)  # the prompt's page keys (prefix reuse)
    fed: list[int] = dataclasses.field(default_factory=list)   # what the row prefills: the prompt (and,
                                                               # after a preemption, the outputs so far)
    waiting: bool = False            # reserved for a request being prefilled on a prefill rank
    key: int = 0                     # ... whose state arrived there: its transfer key + 1, until imported


class Scheduler:
    def __init__(self, requests: list[Request], num_microbatches: int, rows: int, context: int,
                 eos_ids: tuple[int, ...], prefill_chunk: int = PREFILL_CHUNK, on_event=None,
                 prefix_cache: bool = False, buckets: bool = False, pages: int | None = None,
                 prefill_on=None):
        """`prefix_cache`: start prompts on the cached pages of earlier ones (`opweave.runtime.prefix`;
        the caller checks the model and plan allow it). `buckets`: a decode round of a microbatch
        computes its first 1, 2, 4, 8, ... rows (up to its rows), free rows below its last live
        one feeding a padding token, so few layouts recur (a CUDA graph each). `pages`: the KV
        pages of the replica's pool (default: every slot at the full context, so none is ever
        short; fewer: admission by free pages and preemption).

        `prefill_on(request, mb, row)` (prefill/decode disaggregation, decode side): a request
        admitted into a row is prefilled elsewhere; the row waits, reserved, until `prefilled`
        says its state has been sent, then a step imports it (`RowStep.imported`) and the row
        goes on from its first output. A request with a `transfer` key (prefill side) ends at its
        first output, the step that computes it marked for export."""
        if prefill_chunk < 1:
            raise OpWeaveError(f"prefill chunk must be at least 1 token, got {prefill_chunk}")
        # the pages of this replica's slots as every rank holding them will (`opweave.runtime.pages`)
        self.pool = PagePool.for_context(num_microbatches * rows, context, pages=pages)
        self.prefix = PrefixCache(self.pool) if prefix_cache else None
        self._started = 0  # rounds whose steps have started (taken): their pages are written
        self.buckets = buckets
        self.queue = deque(requests)
        self.prefill_chunk = prefill_chunk
        self.num_microbatches, self.rows = num_microbatches, rows
        self._rows = [[_Row() for _ in range(rows)] for _ in range(num_microbatches)]
        self.context = context
        self.eos = set(eos_ids)
        self.done: list[Request] = []
        self.planned_rounds = 0                        # rounds planned so far
        self._plans: dict[tuple[int, int], StepPlan] = {}    # (round, mb) -> plan, until taken
        self._outputs: dict[tuple[int, int], StepPlan] = {}  # (round, mb) -> plan, until learned
        self._open: set[int] = set()                   # requests with outputs still to learn
        self._finished: set[int] = set()
        self._admissions = 0
        self._preempted: dict[int, Request] = {}  # preempted, waiting for outputs in flight before requeueing
        self.preemptions = 0
        self._reserved = 0  # pages the requests admitted in the round being planned will need
        self.on_event = on_event  # (request, token or None, finish reason or None, Logprob or None), as learned
        self.prefill_on = prefill_on

    @property
    def active(self) -> bool:
        """Work left: requests queued, being planned, with outputs still to learn, or rows waiting
        for a prefill rank's state (it is on its way)."""
        return bool(self.queue) or bool(self._open) or any(row.waiting for rows in self._rows for row in rows)

    @property
    def only_waiting(self) -> bool:
        """Rows wait for a prefill rank's state and nothing else is left to plan or learn."""
        rows = [row for mb in self._rows for row in mb]
        return (any(row.waiting and not row.key for row in rows) and not self.queue and not self._outputs
                and all(row.request is None or (row.waiting and not row.key) for row in rows))

    def _fed(self, req: Request) -> list[int]:
        """What a request prefills when admitted: its prompt, and the outputs it had when preempted."""
        return list(req.prompt) + list(req.output)

    def _fits(self, req: Request) -> bool:
        """Whether the pool has the pages of `req`'s prefill and first output now (beside the
        requests admitted earlier in the round being planned)."""
        return P.pages_for(len(req.prompt) + len(req.output) + 1, self.pool.page_tokens) <= \
            self.pool.available - self._reserved

    # ---------------------------------------------------------------- planning
    def _admit(self, row: _Row, mb: int = 0, r: int = 0) -> None:
        while self.queue and row.request is None:
            req = self.queue[0]
            need = P.pages_for(len(req.prompt) + len(req.output) + 1, self.pool.page_tokens)
            if req.prompt and len(req.prompt) < self.context and need <= self.pool.pages and not self._fits(req):
                return  # the head of the queue waits for pages
            self.queue.popleft()
            if not req.prompt:
                req.error = "empty prompt"
            elif len(req.prompt) >= self.context:
                req.error = f"prompt of {len(req.prompt)} tokens does not fit the planned context of {self.context}"
            elif need > self.pool.pages:
                req.error = (f"prompt of {len(req.prompt)} tokens needs {need} KV pages of {self.pool.page_tokens} "
                             f"tokens; the pool has {self.pool.pages}")
            else:
                fed = self._fed(req)
                self._reserved += need
                if self.prefill_on is not None and not req.local:  # prefilled on a prefill rank meanwhile
                    row.request, row.waiting, row.position, row.pending, row.planned = req, True, 0, [], 0
                    row.fed, row.keys = fed, []
                    row.event, row.release = (P.RELEASE if row.release else P.NONE), False
                    self._admissions += 1
                    row.admitted = self._admissions
                    self._open.add(req.index)
                    self.prefill_on(req, mb, r)
                    return
                row.request, row.position, row.pending, row.planned = req, 0, fed, len(req.output)
                row.fed = list(fed)
                row.event, row.release = P.START, False
                if self.prefix is not None:
                    row.keys = page_keys(fed, self.pool.page_tokens)
                if self.prefix is not None and not req.prompt_pending:
                    found, last = self.prefix.lookup(row.keys, fed, self._started)
                    if found:
                        row.event = P.SHARED + last
                        row.position = found * self.pool.page_tokens
                        row.pending = fed[row.position:]
                self._admissions += 1
                row.admitted = self._admissions
                self._open.add(req.index)
                return
            req.finish_reason = "error"
            self.done.append(req)
            self._report(req, None, "error")

    def _step(self, row: _Row, budget: int) -> RowStep:
        """Row `row`'s step this round, feeding at most `budget` prompt tokens (0: a prefilling
        row waits, idle)."""
        req = row.request
        event, row.event = row.event, P.NONE
        target = -1
        if req is None or (row.waiting and not row.key):  # idle, or waiting for its prefill
            return RowStep(event=event)
        if row.waiting:  # its prompt's state arrives this round: nothing is computed
            key, row.key, row.waiting = row.key, 0, False
            if req.finish_reason is not None:  # it ended at its first output: the state is taken and dropped
                row.request, row.release = None, True
            return RowStep(req, imported=len(req.prompt), event=P.START, key=key)
        if row.pending:
            if budget <= 0:  # waits (idle); a new request's page event goes out now all the same
                return RowStep(event=event)
            chunk, row.pending = row.pending[:budget], row.pending[budget:]
            first, output = row.position, not row.pending
            row.position += len(chunk)
            if req.prompt_pending and row.position < len(req.prompt):
                target = req.prompt[row.position]
        else:
            chunk, first, output = [], row.position, True
            row.position += 1
        last = False
        if output:
            row.planned += 1
            # a prefill rank: its first output ends it there, and its state goes to a decode rank
            last = row.planned >= req.max_new_tokens or row.position >= self.context or req.transfer > 0
            if last:
                row.request = None  # the slot takes the next request in the next planned round
                row.release = True
        return RowStep(req, tuple(chunk), first, output, last, event=event, target=target,
                       key=req.transfer if output else 0)

    def _plan_rows(self, mb: int) -> StepPlan:
        """One microbatch's round: free rows admit (while the pool has their pages), decoding rows
        step, then the prefilling rows (in admission order) share the prefill budget; while the
        rows need more pages than the pool has, the newest request is preempted."""
        rows = self._rows[mb]
        self._reserved = 0
        for r, row in enumerate(rows):
            if row.request is None:
                self._admit(row, mb, r)
            if row.request is None and row.release:  # ended, and no request takes the row
                row.event, row.release = P.RELEASE, False
        steps: list[RowStep | None] = [None] * len(rows)
        prefilling = []
        for i, row in enumerate(rows):
            if row.request is not None and row.pending and not row.waiting:
                prefilling.append(i)
            else:
                steps[i] = self._step(row, 0)
        budget = self.prefill_chunk
        for i in sorted(prefilling, key=lambda i: rows[i].admitted):
            take = min(budget, 1 if rows[i].request.prompt_pending else len(rows[i].pending))
            steps[i] = self._step(rows[i], take)
            budget -= take
        while self._short(mb, steps):  # the newest request goes back to the queue
            newest = max((i for i, s in enumerate(steps) if s.request is not None), key=lambda i: rows[i].admitted)
            steps[newest] = self._preempt(mb, newest, steps[newest])
        if self.buckets:
            steps = bucketed(steps)
        return StepPlan(tuple(steps))

    def _short(self, mb: int, steps: list[RowStep]) -> bool:
        """Whether the round's rows of microbatch `mb` need more pages than the pool has, as
        `PagePool.apply_rows` would apply them: page events first (dropped pages come back, a
        shared chain's cached pages are held), then every row's new positions."""
        available, width, p = self.pool.available, self.pool.width, self.pool.page_tokens
        held = {}  # slot -> (pages it holds after the event, its positions)
        for r, s in enumerate(steps):
            slot = mb * self.rows + r
            table = self.pool.tables[slot]
            if s.event >= P.RELEASE:
                available += sum(1 for page in table if self.pool.refs[page] == 1)
                held[slot] = (0, 0)
            if s.event >= P.SHARED:
                chain = self.pool.chain(s.event - P.SHARED)
                available -= sum(1 for page in chain if page in self.pool.cached)
                held[slot] = (len(chain), len(chain) * p)
        need = 0
        for r, (c, s) in enumerate(zip(StepPlan(tuple(steps)).counts, steps)):
            slot = mb * self.rows + r
            pages, length = held.get(slot, (len(self.pool.tables[slot]), self.pool.lengths[slot]))
            c = s.imported or c
            if c and not s.bucket:
                need += max(0, min(P.pages_for(length + c, p), width) - pages)
        return need > available

    def _preempt(self, mb: int, r: int, step: RowStep) -> RowStep:
        """Row `r`'s request leaves the row (its pages dropped this round) to be computed again
        later; answers the row's step this round."""
        row = self._rows[mb][r]
        req = step.request
        slot = mb * self.rows + r
        row.request, row.pending, row.release, row.keys, row.fed = None, [], False, [], []
        self.preemptions += 1
        if step.event == P.START or step.event >= P.SHARED:  # admitted this round: back to the queue's head
            req.local = req.local or bool(step.imported)  # its prefilled state is not taken: prefill it here
            self.queue.appendleft(req)
            return RowStep(event=P.RELEASE if self.pool.tables[slot] else P.NONE)
        self._preempted[req.index] = req
        req.local = True  # its imported state is dropped: it prefills here when it comes back
        self._void(req)
        self._requeue(req)
        return RowStep(event=P.RELEASE)

    def _void(self, req: Request) -> None:
        """Planned steps of `req` that have not started idle (their agreed tokens are padding); the
        outputs of those that did are still learned."""
        for key, plan in list(self._plans.items()):
            if any(s.request is req for s in plan.rows):
                for s in plan.rows:
                    if s.request is req and self.prefix is not None:
                        self.prefix.forget(s.fills)  # never written
                voided = StepPlan(tuple(RowStep(pad=len(s.tokens) or 1, event=s.event)
                                        if s.request is req else s for s in plan.rows))
                self._plans[key] = voided
                if key in self._outputs:
                    self._outputs[key] = voided

    def _requeue(self, req: Request) -> None:
        """A preempted request whose outputs in flight are all learned goes back to the queue's head."""
        if req.index not in self._preempted:
            return
        if req.index in self._finished:  # it ended (a stop id) on an output learned since
            del self._preempted[req.index]
            return
        if any(s.request is req and s.output for plan in self._outputs.values() for s in plan.rows):
            return
        del self._preempted[req.index]
        self.queue.appendleft(req)

    def plan(self) -> tuple[tuple[int, ...], ...]:
        """Plans round `planned_rounds` (then advances it); its tokens per row, per microbatch."""
        return tuple(tuple(P.decode(v)[0] for v in mb) for mb in self.plan_round())

    def plan_round(self) -> tuple[tuple[int, ...], ...]:
        """Plans round `planned_rounds` (then advances it); per microbatch, each row's tokens and
        page event as the control word carries them (`opweave.runtime.pages.encode`)."""
        r = self.planned_rounds
        values, aux = [], []
        for mb in range(self.num_microbatches):
            plan = self._plan_rows(mb)
            plan = self._pages(mb, plan, r)
            self._plans[(r, mb)] = plan
            if any(s.output or s.target >= 0 for s in plan.rows):
                self._outputs[(r, mb)] = plan
            values.append(plan.values)
            aux.append(plan.aux)
        self.planned_rounds += 1
        self.last_aux = tuple(aux)
        return tuple(values)

    def _pages(self, mb: int, plan: StepPlan, round_index: int) -> StepPlan:
        """Applies the round's rows to the scheduler's copy of the pool, as every rank will; with
        prefix reuse, keys the prompt pages the round fills (the steps carry them, `RowStep.fills`)."""
        steps = list(plan.rows)
        self.pool.apply_rows([(mb * self.rows + r, P.held_tokens(v), P.decode(v)[1])
                              for r, v in enumerate(plan.values) if v])
        for r, step in enumerate(steps):
            slot = mb * self.rows + r
            if self.prefix is not None and step.tokens:
                fills = self.prefix.register(self.pool.tables[slot], self._rows[mb][r].keys, self._rows[mb][r].fed,
                                             step.first, step.first + len(step.tokens), round_index)
                if fills:
                    steps[r] = dataclasses.replace(step, fills=fills)
        return StepPlan(tuple(steps))

    def take(self, round_index: int, mb: int) -> StepPlan:
        """The plan of microbatch `mb` in round `round_index`, as the round runs (once)."""
        self._started = max(self._started, round_index + 1)  # it runs to the end: its pages are written
        return self._plans.pop((round_index, mb))

    # ---------------------------------------------------------------- learning the tokens
    def learn(self, round_index: int, mb: int, tokens, records=None) -> None:
        """The token ids (a sequence of ints, one per row) microbatch `mb` sampled in round
        `round_index`, and with log-probabilities their records (one per row: int lists or the rows
        of a host tensor, `opweave.kernels.logprobs`; only the rows that report one are read)."""
        plan = self._outputs.pop((round_index, mb), None)
        if plan is None:
            return
        for r, (step, token) in enumerate(zip(plan.rows, tokens)):
            req = step.request
            if req is None or req.index in self._finished:
                continue
            if step.target >= 0 and records is not None:
                req.prompt_lp[step.first + len(step.tokens)] = self._logprob(records[r], req.top_logprobs or 0)
            if not step.output:
                continue
            if token == NON_FINITE_TOKEN:
                req.error = f"non-finite logits at output token {len(req.output) + 1}"
                self._finish(req, "error")
                continue
            req.output.append(int(token))
            lp = None
            if req.top_logprobs is not None and records is not None:
                lp = self._logprob(records[r], req.top_logprobs)
            self._report(req, int(token), None, lp)
            if self._stops(req, int(token)):
                self._finish(req, "stop")
            elif step.last:
                self._finish(req, "length")
        for req in list(self._preempted.values()):
            self._requeue(req)

    def prefilled(self, index: int, token: int | None, key: int | None, finish_reason: str | None = None,
                  error: str | None = None) -> None:
        """Request `index`, waiting in its row, was prefilled on a prefill rank: its first output
        `token`, its state sent with transfer `key` (None: nothing was sent).
        The next planned round imports the state; a request that ended there (`finish_reason`:
        "stop", "length", "error" with `error`) is over once its state is taken."""
        for rows in self._rows:
            for row in rows:
                req = row.request
                if req is None or req.index != index or not row.waiting:
                    continue
                if token is not None and req.finish_reason is None:
                    req.output.append(int(token))  # reported by the prefill rank, which learned it
                row.planned = len(req.output)
                row.position, row.pending = len(req.prompt), list(req.output)
                if finish_reason is not None and req.finish_reason is None:
                    req.error = error
                    self._finish(req, finish_reason, report=False)
                    row.request = req  # still reserved: the state is taken, then dropped
                if key is None:  # nothing to import: the row is free
                    row.request, row.waiting, row.release = None, False, True
                else:
                    row.key = key + 1
                return

    # ---------------------------------------------------------------- serving
    def add(self, req: Request) -> None:
        """A new request, admitted into the next free slot of a round not yet planned."""
        self.queue.append(req)

    def cancel(self, index: int) -> None:
        """Ends request `index` (queued or running): its planned steps idle, its slot is free for
        the next round planned; outputs of steps already run are dropped. Unknown or ended: nothing."""
        for req in self.queue:
            if req.index == index:
                self.queue.remove(req)
                req.finish_reason = "cancelled"
                self.done.append(req)
                self._report(req, None, "cancelled")
                return
        for rows in self._rows:
            for row in rows:
                if row.request is not None and row.request.index == index:
                    self._finish(row.request, "cancelled")
                    return
        if index in self._preempted:  # preempted, outputs in flight
            self._finish(self._preempted.pop(index), "cancelled")
            return
        for plan in self._outputs.values():  # planning done, outputs still to learn
            for step in plan.rows:
                if step.request is not None and step.request.index == index and index not in self._finished:
                    self._finish(step.request, "cancelled")
                    return

    def running(self) -> list[Request]:
        """Requests admitted and not yet ended."""
        found = {s.request.index: s.request for plan in list(self._plans.values()) + list(self._outputs.values())
                 for s in plan.rows if s.request is not None and s.request.index in self._open}
        found.update({row.request.index: row.request for rows in self._rows for row in rows if row.request})
        found.update(self._preempted)
        return list(found.values())

    def _stops(self, req: Request, token: int) -> bool:
        """Whether output `token` (already appended) ends `req` with "stop"."""
        if len(req.output) < req.min_tokens:
            return False
        return (token in self.eos and not req.ignore_eos) or token in req.stop_ids

    def _logprob(self, record: list[int], top: int) -> Logprob:
        """A record's log-probabilities, with the first `top` of the top ones it holds."""
        record = record.tolist() if hasattr(record, "tolist") else record
        logprob, best = decode_record(record, (len(record) - 2) // 2)
        return Logprob(logprob, best[:top])

    def _report(self, req: Request, token: int | None, reason: str | None, logprobs: Logprob | None = None) -> None:
        if self.on_event is not None:
            self.on_event(req, token, reason, logprobs)

    def _finish(self, req: Request, reason: str, report: bool = True) -> None:
        req.finish_reason = reason
        if report:
            self._report(req, None, reason)
        self._finished.add(req.index)
        self._open.discard(req.index)
        self.done.append(req)
        for rows in self._rows:  # stop planning it (a row waiting for its prefill stays reserved)
            for row in rows:
                if row.request is req and not row.waiting:
                    row.request, row.pending, row.release = None, [], True
        for key, plan in list(self._plans.items()):  # planned steps not yet run: the row idles, its
            if any(s.request is req for s in plan.rows):  # agreed tokens become padding
                for s in plan.rows:
                    if s.request is req and self.prefix is not None:
                        self.prefix.forget(s.fills)  # never written
                self._plans[key] = StepPlan(tuple(RowStep(pad=len(s.tokens) or 1, event=s.event)
                                                  if s.request is req else s for s in plan.rows))  # held: as agreed
