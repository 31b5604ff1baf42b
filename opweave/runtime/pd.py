"""Prefill/decode disaggregation at run time: the roles of a rank, the messages between scheduler
leaders, and the sending and receiving of prompts' state (`opweave.runtime.kvtransfer`).

The launcher starts `decode_sets` replica sets of the plan's ranks and `prefill_sets` sets of the
prefill pool's ranks (one colocated TP group each). Every rank of both kinds also joins one KV
process group: decode set k's rank r is `k * decode_world + r`, prefill set j's rank s is
`decode_sets * decode_world + j * prefill_world + s`. The messages between leaders go through
queues the launcher makes:
  - a decode leader admits a request into a row (reserved) and sends `PrefillJob` to a prefill
    set (round-robin), carrying the transfer key (which names that row);
  - the prefill leader's scheduler prefills it as a request ending at its first output; every
    prefill rank sends its share of the slot's state after the round that computed it
    (`Exporter`), and the leader answers `Prefilled` (the first output, whether it ended there)
    once the token is learned; serving, it reports that first token to the server itself;
  - the decode scheduler plans the import step; before that round every decode rank holding the
    row receives its share (`Importer`), and the row decodes from its first output;
  - a decode leader that will send no more jobs (`opweave run`: no request left; serving: the
    server said `Stop`) sends `Drained` to every prefill leader, which stops once all have and
    every job it took is answered, so no decode row waits for an answer that never comes.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch

from opweave.runtime import kvtransfer as KV
from opweave.runtime import pages as P


@dataclasses.dataclass(frozen=True)
class Role:
    """A rank's part in a disaggregated run (picklable: the launcher hands it to the rank)."""

    kind: str                 # "decode" or "prefill"
    replica_set: int          # this set's index among its kind
    decode_sets: int
    prefill_sets: int
    decode_world: int
    prefill_world: int
    leaders: int              # scheduler leaders per decode set
    store_path: str           # the KV group's file store
    timeout_s: float

    @property
    def size(self) -> int:
        return self.decode_sets * self.decode_world + self.prefill_sets * self.prefill_world

    def decode_rank(self, replica_set: int, rank: int) -> int:
        return replica_set * self.decode_world + rank

    def prefill_rank(self, replica_set: int, rank: int) -> int:
        return self.decode_sets * self.decode_world + replica_set * self.prefill_world + rank

    def kv_rank(self, rank: int) -> int:
        return (self.decode_rank if self.kind == "decode" else self.prefill_rank)(self.replica_set, rank)

    def join(self, rank: int):
        """This rank's handle on the KV group (gloo: CPU tensors, point to point)."""
        import torch.distributed as dist

        store = dist.FileStore(self.store_path, self.size)
        store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        return dist.ProcessGroupGloo(dist.PrefixStore("kv", store), self.kv_rank(rank), self.size,
                                     datetime.timedelta(seconds=self.timeout_s))


@dataclasses.dataclass(frozen=True)
class PrefillJob:
    """A decode leader -> a prefill leader: prefill this prompt, then send its state by `key`."""

    id: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    sampling_word: tuple[int, ...]
    ignore_eos: bool
    min_tokens: int
    prompt_logprobs: bool
    key: int                  # `kvtransfer.transfer_key`
    decode_set: int
    leader: int               # the decode leader's index in its set


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A prefill leader -> the decode leader: request `id`'s first output, and whether its state
    was sent (`sent`); `finish_reason` when it ended there ("stop", "length", "error")."""

    id: int
    token: int | None
    sent: bool
    finish_reason: str | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Drained:
    """A decode leader sends no more jobs."""


def _receiver_ops(program, modules) -> list[int]:
    return sorted(i for i in program.ops if getattr(modules.get(i), "state_attrs", ()))


class Exporter:
    """A prefill rank's sends: after each round, the state of every row the round marked (its
    transfer key in the control word) to the decode ranks that will hold it."""

    def __init__(self, role: Role, program, modules: dict, state, cfg, decode_programs: list, group):
        self.role, self.program, self.modules, self.state, self.cfg = role, program, modules, state, cfg
        self.decode_programs, self.group = decode_programs, group
        self.lengths = [0] * (program.num_microbatches * (program.rows[1] - program.rows[0]))
        self.sent: list = []      # (work, buffer) until complete
        self._routes: dict[int, list] = {}  # decode rank -> this rank's segments for it
        self.exported: set[int] = set()     # keys sent (the leader answers with them)

    def observe(self, values) -> None:
        """A round's control-word values (before it runs): each slot's positions (for a rank
        without a page pool, whose prompts never start on a cached prefix)."""
        lo, rows = self.program.rows[0], self.program.rows[1] - self.program.rows[0]
        for mb, row_values in enumerate(values):
            for r in range(rows):
                v = row_values[lo + r]
                if v and P.decode(v)[1] >= P.RELEASE:
                    self.lengths[mb * rows + r] = 0
                self.lengths[mb * rows + r] += P.held_tokens(v) if v else 0

    def _segments(self, d) -> list:
        if d.rank not in self._routes:
            parts = [p for op in _receiver_ops(d, self.modules) for p in KV.state_parts(op, self.modules[op], self.cfg)]
            self._routes[d.rank] = KV.routes(parts, self.program.tp, d.tp, d.tp_rank).get(self.program.tp_rank, [])
        return self._routes[d.rank]

    def after_round(self, aux) -> None:
        """After a round ran: send the marked rows' state (asynchronously; completed later)."""
        self.sent = [(w, b) for w, b in self.sent if not w.is_completed()]
        lo, rows = self.program.rows[0], self.program.rows[1] - self.program.rows[0]
        for mb, keys in enumerate(aux):
            for r in range(rows):
                if not keys[lo + r]:
                    continue
                key = keys[lo + r] - 1
                _, dset, dmb, drow, tag = KV.parse_key(key)
                slot = mb * rows + r
                # the page pool knows a prompt started on a cached prefix (its pages held, not computed)
                length = self.state.pool.lengths[slot] if self.state.pool is not None else self.lengths[slot]
                for d in self.decode_programs:
                    if not d.rows[0] <= drow < d.rows[1] or not _receiver_ops(d, self.modules):
                        continue
                    segments = self._segments(d)
                    if not segments:
                        continue
                    data = KV.pack(self.modules, segments, self.state, slot, length)
                    work = self.group.send([data], self.role.decode_rank(dset, d.rank), tag)
                    self.sent.append((work, data))
                self.exported.add(key)

    def drain(self) -> None:
        for work, _ in self.sent:
            work.wait()
        self.sent = []


class Importer:
    """A decode rank's receives: before a round, the state of every row it imports."""

    def __init__(self, role: Role, program, modules: dict, state, cfg, prefill_tp: int, group):
        self.role, self.program, self.modules, self.state, self.group = role, program, modules, state, group
        parts = [p for op in _receiver_ops(program, modules) for p in KV.state_parts(op, modules[op], cfg)]
        self.routes = KV.routes(parts, prefill_tp, program.tp, program.tp_rank) if parts else {}

    def before_round(self, values, aux) -> None:
        """The round's agreed values, after the pages were applied: receive the imported rows'."""
        if not self.routes:
            return
        lo, rows = self.program.rows[0], self.program.rows[1] - self.program.rows[0]
        for mb, row_values in enumerate(values):
            for r in range(rows):
                length = P.imported(row_values[lo + r])
                if not length:
                    continue
                pset, _, _, _, tag = KV.parse_key(aux[mb][lo + r] - 1)
                slot = mb * rows + r
                messages = []
                for s in sorted(self.routes):
                    segments = self.routes[s]
                    data = torch.empty(KV.message_bytes(self.modules, segments, self.state, slot, length),
                                       dtype=torch.uint8)
                    self.group.recv([data], self.role.prefill_rank(pset, s), tag).wait()
                    messages.append((segments, data))
                KV.unpack(self.modules, messages, self.state, slot, length)


@dataclasses.dataclass
class Queues:
    """The leaders' inboxes of a disaggregated run (multiprocessing queues)."""

    decode: tuple[tuple[object, ...], ...]  # per decode set, per scheduler leader: `Prefilled`
    prefill: tuple[object, ...]             # per prefill set: `PrefillJob`, `Drained`


@dataclasses.dataclass
class PDRank:
    """What a rank of a disaggregated run is given: its role, the queues, one decode set's rank
    programs (JSON: a prefill rank sends to them) and the prefill sets' TP degree."""

    role: Role
    queues: Queues
    decode_programs: tuple
    prefill_tp: int


def receive(inbox, wait_s: float = 0.0) -> list:
    """Every message waiting; with `wait_s`, waits that long for the first one."""
    import queue

    out = []
    try:
        if wait_s > 0:
            out.append(inbox.get(timeout=wait_s))
        while True:
            out.append(inbox.get_nowait())
    except queue.Empty:
        return out


def ends_at_first(req, token: int, eos, context: int) -> str | None:
    """How a request whose first output is `token` ends there ("stop", "length"), or None."""
    if token in req.stop_ids or (token in eos and not req.ignore_eos):
        if req.min_tokens <= 1:
            return "stop"
    if req.max_new_tokens <= 1 or len(req.prompt) + 1 >= context:
        return "length"
    return None


class Leader:
    """A scheduler leader's side of a disaggregated run (`Runtime.pd_leader`): a decode leader
    sends jobs and takes `Prefilled` answers, a prefill leader takes jobs and answers them."""

    def __init__(self, rt, pd: PDRank):
        self.rt, self.pd, self.role = rt, pd, pd.role
        program = rt.program
        self.index = program.scheduler_leaders.index(program.rank) if program.rank in program.scheduler_leaders else 0
        self.jobs: dict[int, object] = {}  # prefill: local index -> its job; decode: request id -> its key
        self.first: dict[int, int] = {}    # prefill: local index -> its first output
        self.count, self.drained, self.told = 0, 0, False

    @property
    def all_drained(self) -> bool:
        return self.drained >= self.role.decode_sets * self.role.leaders

    def prefill_on(self, req, mb: int, row: int) -> None:
        """Decode leader: `req` took row `row` of microbatch `mb`; a prefill set computes it."""
        j = self.count % self.role.prefill_sets
        key = KV.transfer_key(j, self.role.replica_set, mb, self.rt.program.rows[0] + row,
                              self.count * self.role.leaders + self.index)
        self.count += 1
        self.jobs[req.index] = key
        self.pd.queues.prefill[j].put(PrefillJob(
            req.index, tuple(req.prompt), req.max_new_tokens, tuple(req.stop_ids), tuple(req.sampling),
            req.ignore_eos, req.min_tokens, req.prompt_logprobs, key, self.role.replica_set, self.index))

    def prefill_event(self, req, token: int | None, reason: str | None, logprob=None) -> None:
        """Prefill leader: a token or an end its scheduler learned for a job's request."""
        from opweave.runtime.channel import TokenEvent

        rt, job = self.rt, self.jobs[req.index]
        if token is not None:
            self.first[req.index] = token
            if rt.channel is not None:  # the server streams the first token now
                rt._send_event(dataclasses.replace(req, index=job.id), token, None, logprob)
            return
        token = self.first.pop(req.index, None)
        error = None
        if reason == "cancelled":
            finish = reason
        elif reason == "error" or token is None:
            finish, error = "error", req.error or "no first output"
        else:  # it ends here ("length": its last prefill step) only if its first output ends it
            finish = ends_at_first(req, token, rt.scheduler.eos, rt.program.context)
        sent = req.transfer - 1 in rt.exporter.exported
        self.pd.queues.decode[job.decode_set][job.leader].put(Prefilled(job.id, token, sent, finish, error))
        if finish is not None and rt.channel is not None:
            rt.channel.send(TokenEvent(job.id, None, finish, error))
        del self.jobs[req.index]

    def io(self) -> None:
        """Between rounds: jobs in (prefill), answers in (decode)."""
        from opweave.runtime.scheduler import Request

        from opweave.runtime.channel import IDLE_WAIT_S

        rt = self.rt
        if self.role.kind == "prefill":  # an idle prefill leader waits a little for a job
            wait = IDLE_WAIT_S if not rt.scheduler.active and not rt.stopping else 0.0
            for message in receive(self.pd.queues.prefill[self.role.replica_set], wait):
                if isinstance(message, Drained):
                    self.drained += 1
                    continue
                if rt.stopping:  # the server stops: nothing more is prefilled (nothing sent)
                    self.pd.queues.decode[message.decode_set][message.leader].put(
                        Prefilled(message.id, None, False, "cancelled"))
                    continue
                local, self.count = self.count, self.count + 1
                self.jobs[local] = message
                rt.scheduler.add(Request(
                    index=local, prompt=list(message.prompt_ids), max_new_tokens=message.max_new_tokens,
                    stop_ids=message.stop_ids, sampling=message.sampling_word, ignore_eos=message.ignore_eos,
                    min_tokens=message.min_tokens, prompt_logprobs=message.prompt_logprobs, transfer=message.key + 1))
            return
        # rows waiting for their prefill and nothing else to run: wait a little for an answer
        wait = IDLE_WAIT_S if rt.scheduler.only_waiting else 0.0
        for message in receive(self.pd.queues.decode[self.role.replica_set][self.index], wait):
            key = self.jobs.pop(message.id)
            rt.scheduler.prefilled(message.id, message.token, key if message.sent else None,
                                   message.finish_reason, message.error)
        # no more jobs from this leader: `opweave run` with nothing left, or a server stopping (its
        # requests are cancelled; a waiting row is freed once its job is answered)
        if not self.told and (rt.stopping if rt.channel is not None else not rt.scheduler.active):
            self.told = True
            for inbox in self.pd.queues.prefill:
                inbox.put(Drained())
