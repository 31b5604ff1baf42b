"""One rank: loads its operators and weights, allocates its state, and runs its generated module.

`Runtime` is the façade the generated `rank_XX.py` calls (`rt.begin`, `rt.recv`, `rt.send`,
`rt.finish`, `rt.allreduce`, `rt.tp_argmax`, `rt.ops`, `rt.state_views`); the interpreter
(`opweave.runtime.interpret`) calls the same. It composes the parts, each one responsibility:
  - `opweave.runtime.transport`: point-to-point sends and pre-posted receives of the replica's
    leader, message packing, the token ids back to the scheduler, the end of a round;
  - `opweave.runtime.tpgroup`: the TP group's fan-out from the leader, shard and gather of values
    by their typed layout, all-reduce, the vocabulary-split argmax;
  - `opweave.runtime.state`: the per-sequence state of the stateful ops, allocated once, a view
    per microbatch that the generated code passes to the op (`state=`);
  - `opweave.runtime.scheduler` (requests, on the leader of a replica with the embedding) and
    `opweave.runtime.timeline` (measured spans, when traced).
`run_rank` runs one rank to completion: its round loop, with the hooks around each round (times,
the no-host-sync check, a server's round reports, injected faults, progress) in `_Rounds`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from opweave import config
from opweave.ir.kinds import OpKind
from opweave.ir.plan import plan_from_json
from opweave.ir.program import RankProgram, program_from_json
from opweave.ir.tp import EXPERT_KINDS, share
from opweave.models.hf_config import config_from_hf
from opweave.models.model import DecodeStep, build_model
from opweave.models.ops import OpModule, torch_dtype
from opweave.runtime.graphs import RoundRunner
from opweave.runtime.channel import (IDLE_WAIT_S, ROUND_REPORT_S, Add, Cancel, Ready, RoundReport, ServeQueues, Stop,
                                     TokenEvent)
from opweave.runtime import heartbeat
from opweave.runtime.heartbeat import DeviceBeats, Phase, pulse, report
from opweave.runtime.inputs import RowInputs, TokenCopies
from opweave.runtime.hugepages import back_with_huge_pages
from opweave.runtime.kernel_ops import add_norm, device_kernels, pack_cpu_gemms, with_kernels
from opweave.runtime.layout import Layout, Packed
from opweave.artifact import VerifiedArtifact, load_artifact, load_program_source, rank_files
from opweave.kernels.logprobs import bare, record_width
from opweave.kernels.sampling import WORD, bad_word
from opweave.runtime.scheduler import Request, Scheduler
from opweave.runtime.shard import check_placement, materialize, program_copies, program_ep, program_slots
from opweave.runtime.state import RankState, StateView
from opweave.runtime.syncguard import NoHostSync
from opweave.runtime.timeline import Timeline
from opweave.runtime.tpgroup import TPGroup
from opweave.runtime.transport import Transport


class Runtime:
    """What the generated module of one rank calls: a round is, per stage and microbatch,
    `begin` or `recv`, the ops, then `send` or `finish`; `end_round` between rounds.

    A round carries each microbatch's packed tokens (`opweave.runtime.layout`): the stateful ops
    and the LM head are wrapped (`Packed`) to see rows, the others see a flat batch of tokens; a
    microbatch no row feeds is skipped (`live`). Nothing in a round reads a tensor on the host:
    the round's layout is agreed before it starts, the token ids stay on the device
    (`opweave.runtime.inputs`), and the host work of the scheduler (learning tokens, planning,
    writing the next round's inputs) happens between rounds (`end_round`)."""

    def __init__(self, artifact: VerifiedArtifact, program: RankProgram, weights: str, device: str,
                 groups: dict[tuple[int, ...], object], requests: list[Request], trace: bool = False,
                 comm=dist, serve: ServeQueues | None = None, replica_set: int = 0,
                 prefill_budget: int | None = None, prefix_cache: bool = True, kv_pages: int | None = None,
                 max_logprobs: int | None = None, pd: "PDRank | None" = None):
        """With `serve` (a server's queues), the rank serves: it samples each row by its sampling
        word, and a scheduler leader takes its requests from its inbox in `replica_set` between
        rounds and reports every token learned and every end to the outbox (`Ready` once loaded).
        `prefill_budget`: prompt tokens per round and microbatch (default: the program's
        `prefill_chunk`; the launcher checks it against the plan's memory). `prefix_cache`: prompts
        start on the cached KV pages of earlier ones where the model and plan allow it
        (`prefix_reuse`). `kv_pages`: the pages of each replica's KV pool (default: the plan's,
        `planned_kv_pages`: every slot at the planned context, or sized for the plan's workload;
        fewer: the scheduler admits by free pages and preempts, and every rank
        holding the replica's KV keeps a pool of that size; the launcher checks the plan allows it,
        `checks.check_kv_pages`). `max_logprobs` (serving): the top log-probabilities a request may
        ask for, which sizes the records the last stage returns (`opweave.kernels.logprobs`; None:
        token ids alone, and a request asking for log-probabilities fails). `pd`: this rank's part
        in a prefill/decode disaggregated run (`opweave.runtime.pd`)."""
        self.program = program
        self.timeline = Timeline() if trace else None  # measured spans (see opweave.runtime.timeline)
        self.device = torch.device(device)
        cfg = dataclasses.replace(config_from_hf(artifact.json("model_config.json"), program.model),
                                  kv_cache_dtype=program.kv_cache_dtype)  # the plan's KV cache dtype
        self.cfg = cfg
        check_kv_cache_dtype(cfg, self.device)
        self.dtype = torch_dtype(cfg)
        step = DecodeStep(build_model(cfg, "meta"))
        modules = dict(step.named_modules())
        op_names = artifact.json("ops.json")
        self.modules: dict[int, OpModule] = materialize(
            {i: modules[op_names[i]] for i in program.ops}, weights, program.tp, program.tp_rank, self.device,
            names=op_names, who=f"rank {program.rank}", experts=program.experts,
            ep=program_ep(program), slots=program_slots(program))
        self.ops = _packed(with_kernels(self.modules, self.device), self.modules, lambda: self.layouts[self._mb])
        copies = program_copies(program, cfg)  # layer -> its placement, where the group keeps copies
        if program.ep_group:  # "dp": the routed experts see the expert group's tokens (`runtime/dpexperts.py`)
            from opweave.runtime.dpexperts import DispatchExperts, GroupExperts

            counts, index = (lambda: self.transport.counts[self._mb]), program.ep_group.index(program.rank)
            for i, module in self.modules.items():
                if module.kind in EXPERT_KINDS and program.ep_dispatch == "alltoall":
                    self.ops[i] = DispatchExperts(self.ops[i], groups[program.ep_group], program.ep_rows, index,
                                                  counts, program.ep_group, comm, copies.get(module.layer),
                                                  program.ep_nodes)
                elif module.kind in EXPERT_KINDS:
                    self.ops[i] = GroupExperts(self.ops[i], groups[program.ep_group], program.ep_rows, index,
                                               counts, comm, copies.get(module.layer))
        elif copies:  # an "ep" TP group keeping copies: each rank runs its copies' pairs
            from opweave.runtime.dpexperts import CopiedExperts

            for i, module in self.modules.items():
                if module.kind in EXPERT_KINDS and module.layer in copies:
                    self.ops[i] = CopiedExperts(self.ops[i], copies[module.layer])
        self._progress_setup(program.rank)
        self.kernels = device_kernels(self.device)  # the backend of the fused ops the runtime calls itself
        self.rows = program.rows[1] - program.rows[0]
        m = program.num_microbatches
        if kv_pages is None:
            kv_pages = planned_kv_pages(artifact, modules, self.rows * m, program.context)
        self.state = RankState.allocate(self.modules, self.rows, m, program.context, self.device, pages=kv_pages)
        check_placement(self.modules, self.device, op_names, f"rank {program.rank}")  # weights and state
        pack_cpu_gemms(self.modules, self.device)  # CPU: GEMM weights in oneDNN's layout
        self.huge_pages = back_with_huge_pages() if self.device.type == "cpu" else None  # ... in 2 MiB pages
        self.scheduler = None
        self.pd, self.exporter, self.importer = pd, None, None
        decoding = pd is not None and pd.role.kind == "decode"
        if program.scheduler and program.tp_rank == 0:
            self.scheduler = Scheduler(requests, m, self.rows, program.context, cfg.eos_token_ids,
                                       prefill_budget or program.prefill_chunk,
                                       prefix_cache=(prefix_cache and prefix_reuse(artifact, modules) is None
                                                     and not decoding),  # a decode set prefills nothing
                                       buckets=self.device.type == "cuda",  # few decode layouts: few graphs
                                       pages=kv_pages,
                                       prefill_on=(lambda *a: self.pd_leader.prefill_on(*a)) if decoding else None)
        if pd is not None:
            self._join_pd(pd, artifact)
        self.tp = TPGroup(program.tp_group, program.tp_rank, groups[program.tp_group] if program.tp > 1 else None,
                          comm=comm, device=self.device)
        self.max_logprobs = max_logprobs if serve is not None else None
        self.width = record_width(self.max_logprobs)  # int64s per row the last stage returns
        self.transport = Transport(program, self.dtype, tokens_back=self.scheduler is not None, device=self.device,
                                   comm=comm, width=self.width)
        self._stage = {st.stage: st for st in program.stages}  # stage index -> its program
        self._buffers: dict[tuple, torch.Tensor] = {}  # a TP peer's receive buffers, reused
        if self.scheduler is not None:
            self.inputs = RowInputs(self.rows, m, self.device)
            self.copies = TokenCopies(self.rows, m, self.device, self.width)
        self.words: list = [None] * m  # this round's rows' sampling words per microbatch (`opweave.kernels.sampling`)
        self.sampling = serve is not None  # a server samples by each row's word; `opweave run` is greedy
        if self.sampling and any(op.kind == OpKind.LM_HEAD for op in self.modules.values()):
            self.tp.prepare_ban(tuple(cfg.eos_token_ids), share(cfg.vocab_size, program.tp), self.device)
        self._sampler = next((i for i, op in self.modules.items() if op.kind == OpKind.SAMPLE), None)
        self.round_index = 0
        self.channel = None      # serving: this scheduler leader's queues
        if serve is not None and self.scheduler is not None:
            self.channel = serve.channel(replica_set, program.scheduler_leaders.index(program.rank))
            self.scheduler.on_event = self._send_event  # each token learned and each end, as it happens
        if self.prefill_rank and self.scheduler is not None:
            self.scheduler.on_event = self.pd_leader.prefill_event  # a job's first token: to its decode leader
        self.stopping = False
        first = [self._ahead() for _ in range(2)]
        self._start_round(0, self.transport.agree([v for v, _ in first], [a for _, a in first])[0])
        if self.channel is not None:
            self.channel.send(Ready())

    # ---------------------------------------------------------------- prefill/decode disaggregation
    def _join_pd(self, pd, artifact: VerifiedArtifact) -> None:
        """Joins the KV group; a prefill rank sends states after rounds, a decode rank receives
        them before (`opweave.runtime.pd`)."""
        from opweave.runtime import pd as PD

        group = pd.role.join(self.program.rank)
        full = config_from_hf(artifact.json("model_config.json"), self.program.model)
        if pd.role.kind == "prefill":
            decode = [program_from_json(p) for p in pd.decode_programs]
            self.exporter = PD.Exporter(pd.role, self.program, self.modules, self.state, full, decode, group)
        else:
            self.importer = PD.Importer(pd.role, self.program, self.modules, self.state, full, pd.prefill_tp, group)
        self.pd_leader = PD.Leader(self, pd) if self.scheduler is not None else None

    @property
    def prefill_rank(self) -> bool:
        """A rank of a prefill set of a disaggregated run (`opweave.runtime.pd`)."""
        return self.pd is not None and self.pd.role.kind == "prefill"

    @property
    def is_leader(self) -> bool:
        return self.program.tp_rank == 0

    def _send_event(self, req: Request, token: int | None, reason: str | None, logprob=None) -> None:
        prompt = None
        plain = lambda lp: None if lp is None else (lp.logprob, lp.top)  # noqa: E731  (a message holds plain values)
        if req.prompt_logprobs and token is not None and len(req.output) == 1:  # with the first output
            prompt = tuple(plain(req.prompt_lp.get(i)) for i in range(1, len(req.prompt)))
        self.channel.send(TokenEvent(req.index, token, reason, req.error, plain(logprob), prompt))

    def _serve_io(self) -> None:
        """Between rounds: take the server's messages (an idle leader waits a little for one)."""
        self.scheduler.done.clear()  # reported as they ended: a server keeps no history
        idle = not self.scheduler.active and not self.stopping and not self.prefill_rank  # (that one: on its jobs)
        for message in self.channel.receive(IDLE_WAIT_S if idle else 0.0):
            if isinstance(message, Add):
                self._admit(message)
            elif isinstance(message, Cancel):
                self.scheduler.cancel(message.id)
            elif isinstance(message, Stop):  # end every request now; the ranks stop once all agree
                self.stopping = True
                for req in list(self.scheduler.queue) + self.scheduler.running():
                    self.scheduler.cancel(req.index)

    def _admit(self, add: Add) -> None:
        req = Request(index=add.id, prompt=list(add.prompt_ids), max_new_tokens=add.max_new_tokens,
                      stop_ids=tuple(add.stop_ids), sampling=tuple(add.sampling_word), ignore_eos=add.ignore_eos,
                      min_tokens=add.min_tokens, prompt_logprobs=add.prompt_logprobs)
        error = bad_word(req.sampling, self.max_logprobs)
        if error is None and req.prompt_logprobs and self.max_logprobs is None:
            error = "prompt log-probabilities asked; this run reports none"
        if error is None:
            self.scheduler.add(req)
        else:  # this request fails alone; the rank and the other rows carry on
            self.channel.send(TokenEvent(add.id, None, "error", error))

    @property
    def has_work(self) -> bool:
        """What this rank puts in the control word: its scheduler has work (a server's always,
        until it is told to stop)."""
        if self.scheduler is None:
            return False
        if self.prefill_rank:  # until every decode leader sends no more jobs
            return self.scheduler.active or not self.pd_leader.all_drained
        return self.scheduler.active or (self.channel is not None and not self.stopping)

    @property
    def layouts(self) -> tuple[Layout, ...]:
        """This round's packed layout of this replica's rows, per microbatch (every rank agrees)."""
        return self.transport.layouts

    @property
    def decode_round(self) -> bool:
        """Every microbatch of this round that runs decodes: one token per row or none."""
        return any(self.transport.live(mb) for mb in range(self.program.num_microbatches)) and all(
            layout.decode_only for layout in self.layouts)

    @property
    def round_key(self) -> tuple:
        """What a captured decode round depends on: the rows each microbatch computes."""
        return tuple((layout.counts, layout.pad, layout.sampled, layout.logprobs) for layout in self.layouts)

    def round_tokens(self) -> tuple[int, int]:
        """(token positions computed, real tokens) of this round on a scheduler leader's rows; (0, 0)
        elsewhere (each replica's leader counts its own rows once)."""
        if self.scheduler is None:
            return 0, 0
        live = [layout for mb, layout in enumerate(self.layouts) if self.transport.live(mb)]
        return sum(layout.tokens for layout in live), sum(layout.real for layout in live)

    def cache_stats(self) -> tuple[int, int, float, int]:
        """A scheduler leader's prefix lookups so far (prompt tokens looked up, found cached), the
        share of its replica's KV pages sequences hold, and its preemptions so far; zeros elsewhere."""
        if self.scheduler is None:
            return 0, 0, 0.0, 0
        pool, prefix = self.scheduler.pool, self.scheduler.prefix
        held = 1.0 - pool.available / pool.pages if pool.pages else 0.0
        queried, hit = (prefix.queried, prefix.hit) if prefix is not None else (0, 0)
        return queried, hit, held, self.scheduler.preemptions

    def live(self, stage: int, mb: int) -> bool:
        """Whether microbatch `mb` runs this round (the generated code skips it otherwise). A
        skipped microbatch that ran last round still takes its token ids back, at stage 0."""
        if self.transport.live(mb):
            return True
        if (self.scheduler is not None and stage == self.program.stages[0].stage and self.round_index
                and self.transport.was_live(mb)):
            self.copies.stage(mb, self.transport.recv_tokens(mb))
        return False

    def _ahead(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """The control-word values per row of the round the scheduler plans now, on every row of
        each microbatch (zeros outside this replica's rows; all zeros without a scheduler), and
        their transfer keys (`Transport.complete_round`)."""
        b, (lo, hi) = self.program.microbatch_size, self.program.rows
        if self.scheduler is None:
            zeros = ((0,) * b,) * self.program.num_microbatches
            return zeros, zeros
        values = tuple((0,) * lo + v + (0,) * (b - hi) for v in self.scheduler.plan_round())
        return values, tuple((0,) * lo + a + (0,) * (b - hi) for a in self.scheduler.last_aux)

    def _mark(self, kind: str, stage: int = -1, mb: int = -1) -> None:
        if self.timeline is not None:
            self.timeline.mark(kind, self.round_index, stage, mb)

    def _buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A TP peer's buffer for what its leader broadcasts, made once per key and shape and
        reused whenever the shape comes again (a decode round of the same rows)."""
        buf = self._buffers.get((key, shape))
        if buf is None:
            if len(self._buffers) >= 512:
                self._buffers.pop(next(iter(self._buffers)))
            buf = self._buffers[(key, shape)] = torch.zeros(shape, dtype=dtype, device=self.device)
        return buf

    # ---------------------------------------------------------------- generated-code API
    def state_views(self, op: int) -> tuple[StateView, ...]:
        """The per-sequence state of stateful op `op`, one view per microbatch (`opweave.runtime.state`)."""
        return self.state.views(op)

    def begin(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0: this step's packed token ids and positions [1, T]; the previous step's sampled
        ids arrive on the device and feed the decoding rows (`opweave.runtime.inputs`)."""
        tokens_n = self.layouts[mb].tokens
        if self.is_leader:
            was_live = self.round_index and self.transport.was_live(mb)
            tokens = self.transport.recv_tokens(mb) if was_live else self.transport.no_tokens(mb)
            self.copies.stage(mb, tokens)  # the host learns them a round later
            ids, positions = self.inputs.ids(mb, tokens)
            word = self.inputs.words[mb]
        else:
            ids = self._buffer(("ids", mb), (1, tokens_n), torch.long)
            positions = self._buffer(("pos", mb), (1, tokens_n), torch.long)
            word = self._buffer(("word", mb), (self.rows, 1, WORD), torch.long)[:, 0]
        ids, positions, word = self.tp.fanout([ids, positions, word])
        self.words[mb] = word
        self._mark("wait", self.program.stages[0].stage, mb)
        self._step_done(mb)
        return ids, positions

    def recv(self, stage: int, mb: int):
        """A stage's inputs: positions and this TP rank's block of each received value."""
        st = self._stage[stage]
        tokens_n = self.layouts[mb].tokens
        if st.recv_port == self.program.rank:  # this cut's port receives, then fans out
            positions, word, values = self.transport.recv_values(st, mb)
        else:
            positions = self._buffer(("pos", stage, mb), (1, tokens_n), torch.long)
            word = self._buffer(("word", stage, mb), (self.rows, 1, WORD), torch.long)[:, 0]
            values = [self._buffer(("val", stage, mb, i), (1, tokens_n, *shape), self.dtype)
                      for i, shape in enumerate(st.recv.shapes)]
        self.tp.fanout([positions, word, *values], src=st.recv_port)
        self.words[mb] = word
        values = [self.tp.shard(v, layout) for v, layout in zip(values, st.recv.layouts)]
        self._mark("wait", stage, mb)
        self._step_done(mb)
        return positions, tuple(values)

    def send(self, stage: int, mb: int, positions: torch.Tensor, values: tuple[torch.Tensor, ...]) -> None:
        """A stage's outputs, whole (gathered over the TP group), to the next owner's replicas."""
        self._mark("compute", stage, mb)
        st = self._stage[stage]
        values = tuple(self.tp.gather(v, layout, dst=st.send_port) for v, layout in zip(values, st.send.layouts))
        if st.send_port == self.program.rank:
            self.transport.send_values(st, mb, positions, self.words[mb], values)
        self._mark("send", stage, mb)
        self._step_done(mb)

    def finish(self, mb: int, tokens: torch.Tensor) -> None:
        """The last stage: the new token ids back to the schedulers, on the device."""
        st = self.program.stages[-1]
        self._mark("compute", st.stage, mb)
        if st.send_port == self.program.rank:  # every TP rank holds the sampled ids; the port sends them
            self.transport.send_tokens(st, mb, tokens)
        self._mark("send", st.stage, mb)
        self._step_done(mb)

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.allreduce(x)
        pulse()  # the group's peers reached it too
        return out

    def add_norm(self, norm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add fused with the RMSNorm of its sum: (sum, normed) (`kernel_ops.add_norm`)."""
        out = add_norm(norm, x, residual, self.kernels)
        self._op_done()  # an operator, like the calls of `ops`
        return out

    # ---------------------------------------------------------------- progress (heartbeat.py)
    def _progress_setup(self, rank: int) -> None:
        """Work in progress for the launcher's stall watch: `heartbeat.pulse` after every operator
        call (`ops` wrapped in `_Counted`), each stage's receive and send; on CUDA also device
        events at those points (`DeviceBeats`; per operator only in rounds that are not decode
        rounds, never while a round is captured). Only in a rank started with a heartbeat, or with
        OPWEAVE_FAULT_SLOW_OP (each operator call of a prefill step sleeps first)."""
        self._mb = 0                 # the microbatch the generated code is in (begin / recv)
        self.capturing = False       # a CUDA graph capture is recording the round (`graphs.RoundRunner`)
        self.mark_ops = False        # device events per operator (set per round by `_Rounds.run`)
        self._slow = config.fault_slow_op(rank)
        self._device_beats = (DeviceBeats(torch.cuda.Event)
                              if self.device.type == "cuda" and heartbeat.installed() else None)
        if heartbeat.installed() or self._slow:
            self.ops = {i: _Counted(op, self._op_done, self._slow_op if self._slow else None)
                        for i, op in self.ops.items()}

    def _op_done(self) -> None:
        pulse()
        if self.mark_ops and self._device_beats is not None and not self.capturing:
            self._device_beats.mark()

    def _step_done(self, mb: int) -> None:
        """A stage's inputs arrived or its outputs left (microbatch `mb`)."""
        self._mb = mb
        pulse()
        if self._device_beats is not None and not self.capturing:
            self._device_beats.mark()

    def device_done(self) -> None:
        """After a replayed round (enqueued whole): a device event its completion pulses."""
        if self._device_beats is not None:
            self._device_beats.mark()

    def _slow_op(self) -> None:
        if not self.layouts[self._mb].decode_only:
            time.sleep(self._slow)

    def tp_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sample over the vocabulary split across the TP group (`TPGroup.argmax`)."""
        return self.tp.argmax(logits)

    def sample(self, mb: int, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The last stage's sampler: each row's record [rows, width] (its new token id first,
        `opweave.kernels.logprobs`) from the logits [rows, 1, V/tp] of its last token (the LM head
        took it, `Packed`). A server samples every row by its sampling word (temperature, top_p,
        seed at the row's last position: greedy at temperature 0; `TPGroup.sample`), walking the
        vocabulary only when a row of the microbatch draws at a positive temperature
        (`Layout.sampled`, agreed by every rank: greedy rows take the argmax alone), and computes
        log-probabilities only when a row reports them (`Layout.logprobs`); a run without sampling
        words is greedy (`argmax`, split over the group or the kernel backend's)."""
        if self.sampling:
            layout = self.layouts[mb]
            last = positions[0].index_select(0, layout.last(positions.device))
            draw = lambda: self.tp.sample(logits, self.words[mb], last, tuple(self.cfg.eos_token_ids),  # noqa: E731
                                          walk=layout.sampled)
            if layout.logprobs and self.max_logprobs is not None:
                return self.tp.records(logits, draw, self.words[mb], self.max_logprobs)
            return bare(draw(), self.width)
        if self.program.tp > 1:
            return bare(self.tp.argmax(logits), self.width)
        return bare(self.ops[self._sampler](logits), self.width)

    # ---------------------------------------------------------------- between rounds
    def _start_round(self, round_index: int, counts: tuple[tuple[int, ...], ...]) -> None:
        """The round's agreed layout; a scheduler leader takes its plan and writes its inputs."""
        self.transport.start_round(round_index, counts)
        for layout in self.layouts:  # its index tensors, made here rather than in the round
            layout.prepare(self.device)
        self.state.apply_round(self.transport.values, self.program.rows[0])  # pages, as every rank does
        if self.exporter is not None:
            self.exporter.observe(self.transport.values)
        if self.importer is not None:  # imported rows' state, before the round reads it
            self.importer.before_round(self.transport.values, self.transport.aux)
        if self.scheduler is not None:
            for mb in range(self.program.num_microbatches):
                plan = self.scheduler.take(round_index, mb)
                if self.transport.live(mb):
                    self.inputs.prepare(mb, plan, self.layouts[mb])

    def end_round(self) -> bool:
        """Ends a round and answers whether to run another. The scheduler learns the tokens
        sampled two rounds ago and plans the round after next; the control word
        (`Transport.complete_round`) is one round late, so a round of idle steps follows the
        last real one."""
        r = self.round_index
        if self.exporter is not None:  # the state of the rows this round prefilled to the end
            self.exporter.after_round(self.transport.aux)
        if self.channel is not None:
            self._serve_io()
        if self.pd is not None and self.scheduler is not None:
            self.pd_leader.io()
        if self.scheduler is not None:
            self.copies.round_done(r)
            lag = self.copies.LAG  # the copies of round r - 1 hold the tokens sampled in round r - 2
            if r >= lag:
                for mb, (ids, records) in enumerate(self.copies.read(r - lag + 1)):
                    self.scheduler.learn(r - lag, mb, ids, records if self.width > 1 else None)
        more, counts = self.transport.complete_round(self.has_work, *self._ahead())
        self._mark("sync")
        self.round_index += 1
        if more:
            self._start_round(self.round_index, counts)
        return more

    def drain(self) -> None:
        """After the last round: take the last step's token ids so every send is matched."""
        if self.scheduler is not None:
            for mb in range(self.program.num_microbatches):
                if self.transport.live(mb):  # it ran in the last round: its token ids came back
                    self.transport.recv_tokens(mb)
        self.transport.drain()
        if self.exporter is not None:
            self.exporter.drain()


def _packed(ops: dict, modules: dict[int, OpModule], layout) -> dict:
    """The operators as a packed round calls them: stateful ones and the LM head wrapped in
    `Packed` (`layout()`: the current microbatch's layout), the others as they are."""
    out = {}
    for i, op in ops.items():
        kind = modules[i].kind
        if getattr(modules[i], "state_attrs", ()) or kind == OpKind.LM_HEAD:
            op = Packed(op, layout, last=kind == OpKind.LM_HEAD)
        out[i] = op
    return out


def check_kv_cache_dtype(cfg, device: torch.device) -> None:
    """Refuses, at load, an fp8 KV cache on a GPU without float8 conversions (compile refuses such
    a cluster; an artifact can still be run on another machine than planned)."""
    from opweave.errors import OpWeaveError
    from opweave.kernels.targets import FP8_CAPABILITY

    if cfg.kv_cache_dtype == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < FP8_CAPABILITY:
            raise OpWeaveError(f"the plan keeps its KV cache in fp8, which needs compute capability "
                               f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later; this GPU has "
                               f"{capability[0]}.{capability[1]}")


def prefix_reuse(artifact: VerifiedArtifact, modules: dict) -> str | None:
    """Why prompts cannot share cached KV pages under this artifact's plan (None: they can):
    every stateful layer of the model must be paged full attention, and every rank holding state
    must hold exactly one scheduling replica's rows (`opweave.runtime.prefix`). `modules`: the
    model's operator modules by name (on meta)."""
    unpaged = sorted({type(m).__name__ for m in modules.values()
                      if getattr(m, "state_attrs", ()) and not getattr(m, "paged", False)})
    if unpaged:
        return f"the model keeps state outside pages ({', '.join(unpaged)})"
    return split_pools(artifact, modules)


def planned_kv_pages(artifact: VerifiedArtifact, modules: dict, slots: int, context: int) -> int | None:
    """The KV pool the plan planned for a rank of `slots` slots: sized for its workload
    (`ir.workload.kv_pool_pages`) where the plan has one and the scheduler's copy of the pool is
    every KV rank's (`split_pools`); None (every slot at the full context) otherwise."""
    from opweave.ir.plan import PAGE_TOKENS
    from opweave.ir.workload import Workload, kv_pool_pages

    plan = artifact.json("plan.json")
    workload = Workload.from_json(plan.get("workload")) if isinstance(plan, dict) else None
    if workload is None or split_pools(artifact, modules) is not None:
        return None
    return kv_pool_pages(slots, context, workload, PAGE_TOKENS)


def split_pools(artifact: VerifiedArtifact, modules: dict) -> str | None:
    """Why the scheduler's copy of the page pool is not every KV rank's (None: it is): some owner
    holding state serves rows that are not exactly one scheduling replica's (CAD's core attention
    over two replicas under one scheduler), so its pools hold other slots."""
    plan = plan_from_json(artifact.json("plan.json"))
    names = artifact.json("ops.json")
    first = plan.owners[plan.stages[0].owner].replicas
    split = sorted({st.owner for st in plan.stages if plan.owners[st.owner].replicas != first and any(
        getattr(modules[names[i]], "state_attrs", ()) for i in range(st.first_op, st.last_op + 1))})
    if split:
        return f"owners {split} hold KV for rows that are not one scheduling replica's"
    return None


def load_program_module(path: str):
    """A generated module run by hand (`python rank_00.py`): the user executes that file anyway.
    `run_rank` never uses this: it executes the verified bytes (`load_program_source`)."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_rank(artifact: str | VerifiedArtifact, rank: int, weights: str, device: str, requests: list[Request],
             interpret: bool = False, trace: bool = False, serve: ServeQueues | None = None, replica_set: int = 0,
             prefill_budget: int | None = None, prefix_cache: bool = True,
             kv_pages: int | None = None, max_logprobs: int | None = None, pd=None
             ) -> tuple[list[Request], dict] | None:
    """Runs one rank to completion (torch.distributed already initialised); rank 0 returns the
    outputs and its per-round wall and host (CPU) times, and with `trace` every rank's spans
    (`{"spans": {rank: rows}}`, see opweave.runtime.timeline).

    `artifact` is the folder (its files are then read and checked here) or the files already
    read and checked; either way the rank uses only those checked bytes. With `serve`
    (`channel.ServeQueues`), a scheduler leader takes its requests from its inbox while rounds run
    and reports tokens and ends to the outbox; the ranks run until the server says stop. `pd`: the
    rank's part in a prefill/decode disaggregated run (`opweave.runtime.pd.PDRank`; `artifact`
    is then the prefill pool's view for a prefill rank)."""
    if isinstance(artifact, str):
        artifact = load_artifact(artifact, rank_files(rank))
    program = program_from_json(artifact.json(f"rank_{rank:02d}.json"))
    groups = {g: dist.new_group(list(g)) for g in program.tp_groups + program.ep_groups}  # every rank: every group
    rt = Runtime(artifact, program, weights, device, groups, _my_requests(program, requests), trace=trace,
                 serve=serve, replica_set=replica_set, prefill_budget=prefill_budget, prefix_cache=prefix_cache,
                 kv_pages=kv_pages, max_logprobs=max_logprobs, pd=pd)
    reports = RoundReports(serve.outbox, replica_set, rank) if serve is not None else None
    runner = RoundRunner(rt, _round_program(rt, artifact, rank, interpret), who=f"rank {rank}")
    rounds = _Rounds(rt, runner, rank, reports)
    report(Phase.LOADED)
    with torch.no_grad():
        while True:
            rounds.run()
            rounds.after()
            more = rt.end_round()
            rounds.ended()
            if not more:
                break
        rt.drain()
    report(Phase.FINISHED, rt.round_index)
    return _outputs(rt, runner, rounds, rank, trace)


def _my_requests(program: RankProgram, requests: list[Request]) -> list[Request]:
    """The requests of this rank's scheduler: dealt round-robin over the scheduler leaders."""
    if not program.scheduler:
        return []
    k = program.scheduler_leaders.index(program.tp_group[0])
    return [r for r in requests if r.index % len(program.scheduler_leaders) == k]


def _round_program(rt: Runtime, artifact: VerifiedArtifact, rank: int, interpret: bool):
    """What runs a round: the generated module, executed from its checked bytes, or the interpreter."""
    if interpret:
        from opweave.runtime.interpret import InterpretedProgram

        return InterpretedProgram(rt, rt.program)
    return load_program_source(artifact, f"rank_{rank:02d}.py").Program(rt)


class _Rounds:
    """The hooks around each round of `run_rank`: its wall and host times, the no-host-sync check
    of decode rounds (OPWEAVE_CHECK_SYNC), a serving rank's round reports, the injected faults
    (OPWEAVE_FAULT_*: `opweave.config.fault_injection`) and the progress report the launcher's
    stall watch reads."""

    KEEP = 1000  # a server runs for days: it keeps the recent rounds' times only

    def __init__(self, rt: Runtime, runner: RoundRunner, rank: int, reports: RoundReports | None):
        self.rt, self.runner, self.rank, self.reports = rt, runner, rank, reports
        self.faults = config.fault_injection(rank, prefill=rt.prefill_rank)
        self.check = config.check_sync()
        self.checked = 0  # decode rounds run under the check
        self.wall: list[float] = []
        self.host: list[float] = []

    def run(self) -> None:
        """One round; with the check, a decode round after the first runs under `NoHostSync`."""
        rt = self.rt
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        if rt.timeline is not None:
            rt.timeline.restart()
        rt.mark_ops = not rt.decode_round  # device events per op in the long rounds (CUDA)
        if self.check and rt.decode_round and rt.round_index > 0:
            with NoHostSync(f"rank {self.rank}, round {rt.round_index} (decode)"):
                self.runner.round()
            self.checked += 1
        else:
            self.runner.round()
        if self.reports is not None:  # what the round computed, read before `end_round` plans the next
            live = any(rt.transport.live(mb) for mb in range(rt.program.num_microbatches))
            self._report = (live, rt.round_tokens())

    def ended(self) -> None:
        """After `end_round`: the round's wall and host times, from its start to the end of its
        `end_round` (where the host waits for the tokens the device sampled: on a GPU the round's
        kernels run asynchronously, so the launches alone would time only the host)."""
        wall, host = time.perf_counter() - self._t0, time.process_time() - self._c0
        self.wall.append(wall)
        self.host.append(host)
        if self.reports is not None:
            live, tokens = self._report
            self.reports.add(wall if live else None, *tokens, cache=self.rt.cache_stats())
            self.wall, self.host = self.wall[-self.KEEP:], self.host[-self.KEEP:]

    def after(self) -> None:
        """After a round: the faults injected at it, then the progress report."""
        self._inject(self.rt.round_index)
        report(Phase.ROUND, self.rt.round_index)

    def _inject(self, round_index: int) -> None:
        if round_index == self.faults.get("kill"):
            os.kill(os.getpid(), 9)
        while round_index == self.faults.get("stall"):
            time.sleep(3600)
        if round_index == self.faults.get("raise"):
            raise RuntimeError(f"fault injected after round {round_index} (OPWEAVE_FAULT_RAISE)")


def _outputs(rt: Runtime, runner: RoundRunner, rounds: _Rounds, rank: int, trace: bool
             ) -> tuple[list[Request], dict] | None:
    """Every rank's ended requests, spans and counters gathered at rank 0, which returns the
    outputs and the stats; the other ranks return None."""
    done = rt.scheduler.done if rt.scheduler is not None else []
    spans = rt.timeline.to_rows() if rt.timeline is not None else None
    gathered = _gather_json({"done": [dataclasses.asdict(r) for r in done], "spans": spans, "checked": rounds.checked,
                             "graphs": runner.stats, "cache": rt.cache_stats(),
                             "huge_pages": dataclasses.asdict(rt.huge_pages) if rt.huge_pages else None},
                            rank, rt.program.world_size, rt.device)
    if rank != 0:
        return None
    out = [Request(**r) for part in gathered for r in part["done"]]
    stats = {"round_s": rounds.wall, "host_s": rounds.host, "checked_rounds": [part["checked"] for part in gathered],
             "graphs": [part["graphs"] for part in gathered],
             "prefix_cache": {"queried": sum(p["cache"][0] for p in gathered), "hit": sum(p["cache"][1] for p in gathered)},
             "preemptions": sum(p["cache"][3] for p in gathered),
             "huge_pages": [part["huge_pages"] for part in gathered]}
    if trace:
        stats["spans"] = {r: part["spans"] for r, part in enumerate(gathered)}
    return sorted(out, key=lambda r: r.index), stats


class _Counted:
    """An operator as the generated code calls it (`rt.ops[i]`): the call, then `done()` (a
    heartbeat pulse: progress inside a round). `slow()` (OPWEAVE_FAULT_SLOW_OP) runs before the
    call. Every attribute reads through to the operator (`rt.add_norm` reads a norm's weight)."""

    __slots__ = ("op", "_done", "_slow")

    def __init__(self, op, done: Callable[[], None], slow: Callable[[], None] | None = None):
        self.op, self._done, self._slow = op, done, slow

    def __call__(self, *args, **kwargs):
        if self._slow is not None:
            self._slow()
        out = self.op(*args, **kwargs)
        self._done()
        return out

    def __getattr__(self, name):
        return getattr(self.op, name)


class RoundReports:
    """A serving rank's round times to the server's outbox (`channel.RoundReport`), batched at most
    every `ROUND_REPORT_S` (a message per round would cost each round a queue put)."""

    def __init__(self, outbox, replica_set: int, rank: int):
        self.outbox, self.replica_set, self.rank = outbox, replica_set, rank
        self._pending: list[float] = []
        self._computed = self._used = 0  # token positions computed / real tokens, since the last report
        self._reported = (0, 0, 0)  # prefix tokens looked up / found, preemptions, as of the last report
        self._last = time.monotonic()

    def add(self, seconds: float | None, computed: int = 0, used: int = 0,
            cache: tuple[int, int, float, int] = (0, 0, 0.0, 0)) -> None:
        """One round: its wall time (None: an idle round, which computed nothing and is not a
        round time), tokens computed and used, and `cache`: the leader's prefix lookups so far
        (tokens looked up, found), the KV pages' share held now and its preemptions so far."""
        if seconds is not None:
            self._pending.append(seconds)
        self._computed += computed
        self._used += used
        now = time.monotonic()
        if now - self._last >= ROUND_REPORT_S:
            queried, hit, usage, preempted = cache
            self.outbox.put(RoundReport(self.replica_set, self.rank, tuple(self._pending), self._computed, self._used,
                                        queried - self._reported[0], hit - self._reported[1], usage,
                                        preempted - self._reported[2]))
            self._pending, self._last, self._computed, self._used = [], now, 0, 0
            self._reported = (queried, hit, preempted)


def _gather_json(value, rank: int, world: int, device: torch.device) -> list | None:
    """Every rank's `value` at rank 0 (None elsewhere), sent as JSON bytes in uint8 tensors: no
    pickle crosses ranks. The sizes are all-gathered first, then each rank's bytes padded to the
    largest are gathered."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, parts, dst=0)
    if rank != 0:
        return None
    return [json.loads(bytes(p[:int(n)].cpu().numpy())) for p, n in zip(parts, sizes)]
