"""One rank: loads its operators and weights, allocates its state, and runs its generated module.

`Runtime` is the object the generated `rank_XX.py` calls (`rt.begin`, `rt.recv`, `rt.send`,
`rt.finish`, `rt.allreduce`, `rt.tp_argmax`). Transfers are point-to-point (gloo on CPU, NCCL on
CUDA): one message per peer and transfer (width, positions, values packed as bytes; a prefill,
wider than a decode step, sends a decode-sized message with its width first); sends are
non-blocking, receives posted ahead (`opweave.runtime.inbox`), all in the plan's global order,
so nothing waits on a coordinator. The replica leader receives and fans out to its TP peers with a group broadcast.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time

import torch
import torch.distributed as dist

from opweave import config
from opweave.ir.program import RankProgram, program_from_json
from opweave.models.config import config_from_hf
from opweave.models.model import DecodeStep, build_model
from opweave.models.ops import NON_FINITE_TOKEN, OpModule, torch_dtype
from opweave.runtime.heartbeat import Phase, report
from opweave.runtime.inbox import Inbox, Slot
from opweave.runtime.kernel_ops import with_kernels
from opweave.runtime.manifest import VerifiedArtifact, load_artifact, load_program_source, rank_files
from opweave.runtime.message import message_bytes, message_width, pack_message, unpack_message
from opweave.runtime.scheduler import Request, Scheduler
from opweave.runtime.shard import materialize
from opweave.runtime.timeline import Timeline


class Runtime:
    def __init__(self, artifact: VerifiedArtifact, program: RankProgram, weights: str, device: str,
                 groups: dict[tuple[int, ...], object], requests: list[Request], trace: bool = False):
        self.program = program
        self.timeline = Timeline() if trace else None  # measured spans (see opweave.runtime.timeline)
        self.device = torch.device(device)
        self.group = groups[program.tp_group] if program.tp > 1 else None
        cfg = config_from_hf(artifact.json("model_config.json"), program.model)
        self.cfg = cfg
        self.dtype = torch_dtype(cfg)
        step = DecodeStep(build_model(cfg, "meta"))
        modules = dict(step.named_modules())
        op_names = artifact.json("ops.json")
        self.modules: dict[int, OpModule] = materialize(
            {i: modules[op_names[i]] for i in program.ops}, weights, program.tp, program.tp_rank, self.device)
        self.ops = with_kernels(self.modules, self.device)  # what the generated code calls
        rows = program.rows[1] - program.rows[0]
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        for i, m in self.modules.items():
            m.allocate_state(program.num_microbatches * rows, program.context, self.device)
            if m.state_attrs:
                self._state[i] = {a: getattr(m, a) for a in m.state_attrs}
        self.rows = rows
        self.scheduler = (Scheduler(requests, program.num_microbatches, rows, program.context, cfg.eos_token_ids)
                          if program.scheduler and program.tp_rank == 0 else None)
        self._pending: list = []   # this round's sends (work, buffer kept alive)
        self._previous: list = []  # the previous round's
        self._stage = {st.stage: st for st in program.stages}  # stage index -> its program
        self._flag = None          # the in-flight "any work left?" all-reduce of the last round
        self._local_tokens: dict[int, torch.Tensor] = {}  # colocated: the last stage returns to itself
        self.round_index = 0
        self.inbox = Inbox(self._receive_slots() if self.is_leader else [])
        self.inbox.start_round(0)

    # ---------------------------------------------------------------- state per microbatch
    def _select(self, mb: int) -> None:
        lo, hi = mb * self.rows, (mb + 1) * self.rows
        for i, tensors in self._state.items():
            for attr, full in tensors.items():
                setattr(self.modules[i], attr, full[lo:hi])

    @property
    def is_leader(self) -> bool:
        return self.program.tp_rank == 0

    def _fanout(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.group is None:
            return tensors
        for t in tensors:
            dist.broadcast(t, src=self.program.tp_group[0], group=self.group)
        return tensors

    def _fanout_shape(self, width: int) -> int:
        if self.group is None:
            return width
        t = torch.tensor([width], dtype=torch.long)
        dist.broadcast(t, src=self.program.tp_group[0], group=self.group)
        return int(t)

    def _receive_slots(self) -> list[Slot]:
        """Every point-to-point receive of one round, in program order (leaders only)."""
        prog, slots = self.program, []
        for st in prog.stages:
            for mb in range(prog.num_microbatches):
                if st.recv is None:
                    if self.scheduler is not None:
                        slots += [Slot(("tok", mb, p.rank), p.rank, p.hi - p.lo, torch.long, from_round=1)
                                  for p in prog.token_sources if p.rank != prog.rank]
                    continue
                per_token = self._per_token_bytes(st.recv)
                slots += [Slot(("act", st.stage, mb, p.rank), p.rank, message_bytes(p.hi - p.lo, 1, per_token),
                               torch.uint8) for p in st.recv.peers]
        return slots

    def _per_token_bytes(self, transfer) -> int:
        """Bytes of a transfer's values per token (positions not included)."""
        return sum(_numel(s) for s in transfer.shapes) * torch.empty(0, dtype=self.dtype).element_size()

    def _mark(self, kind: str, stage: int = -1, mb: int = -1) -> None:
        if self.timeline is not None:
            self.timeline.mark(kind, self.round_index, stage, mb)

    # ---------------------------------------------------------------- generated-code API
    def begin(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0: the new token ids of the previous step come back, the scheduler picks this step's."""
        if self.is_leader:
            if self.round_index > 0:
                self.scheduler.take_tokens(mb, self._recv_tokens(mb))
            ids, positions = self.scheduler.step_inputs(mb)
            width = self._fanout_shape(ids.shape[1])
        else:
            width = self._fanout_shape(0)
            ids = torch.zeros(self.rows, width, dtype=torch.long)
            positions = torch.zeros(self.rows, width, dtype=torch.long)
        ids, positions = self._fanout([ids, positions])
        self._select(mb)
        self._mark("wait", self.program.stages[0].stage, mb)
        return ids.to(self.device), positions.to(self.device)

    def _recv_tokens(self, mb: int) -> torch.Tensor:
        out = torch.zeros(self.rows, dtype=torch.long)
        lo = self.program.rows[0]
        for p in self.program.token_sources:
            if p.rank == self.program.rank:
                part = self._local_tokens.pop(mb)
            else:
                part = self.inbox.take(("tok", mb, p.rank))
                self.inbox.next_from(p.rank)
            out[p.lo - lo:p.hi - lo] = part
        return out

    def recv(self, stage: int, mb: int):
        prog = self.program
        st = self._stage[stage]
        lo = prog.rows[0]
        if self.is_leader:
            parts = []
            per_token = self._per_token_bytes(st.recv)
            for p in st.recv.peers:  # each upstream replica pads its rows to its own width
                n = p.hi - p.lo
                first = self.inbox.take(("act", stage, mb, p.rank))
                w = message_width(first)
                body = first if w == 1 else torch.empty(message_bytes(n, w, per_token), dtype=torch.uint8)
                if w != 1:  # a prefill: the first message held only the width
                    dist.recv(body, src=p.rank)
                self.inbox.next_from(p.rank)
                pos, payload = unpack_message(body, n, w, self.dtype)
                parts.append((p, w, pos, payload))
            width = max(w for _, w, _, _ in parts)
            positions = torch.full((self.rows, width), -1, dtype=torch.long)
            values = [torch.zeros(self.rows, width, *shape, dtype=self.dtype) for shape in st.recv.shapes]
            for p, w, pos, payload in parts:  # left-pad narrower rows: padding has position -1
                a, b = p.lo - lo, p.hi - lo
                positions[a:b, width - w:] = pos
                offset = 0
                for v, shape in zip(values, st.recv.shapes):
                    n = (b - a) * w * _numel(shape)
                    v[a:b, width - w:] = payload[offset:offset + n].view(b - a, w, *shape)
                    offset += n
            self._fanout_shape(width)
        else:
            width = self._fanout_shape(0)
            positions = torch.zeros(self.rows, width, dtype=torch.long)
            values = [torch.zeros(self.rows, width, *shape, dtype=self.dtype) for shape in st.recv.shapes]
        self._fanout([positions, *values])
        values = [self._shard(v, layout) for v, layout in zip(values, st.recv.layouts)]
        self._select(mb)
        self._mark("wait", stage, mb)
        return positions.to(self.device), tuple(v.to(self.device) for v in values)

    # ---------------------------------------------------------------- TP layouts of transferred values
    def _parts(self, layout: str, size: int) -> list[int]:
        return [int(x) for x in layout[len("parts:"):].split(",")] if layout.startswith("parts:") else [size]

    def _shard(self, full: torch.Tensor, layout: str) -> torch.Tensor:
        """This TP rank's block of a full value (see `opweave.passes.lower.value_layout`)."""
        if self.program.tp == 1 or layout == "rep":
            return full
        out, offset = [], 0
        for size in self._parts(layout, full.shape[2]):
            block = size // self.program.tp
            out.append(full.narrow(2, offset + self.program.tp_rank * block, block))
            offset += size
        return torch.cat(out, dim=2).contiguous()

    def _gather(self, local: torch.Tensor, layout: str) -> torch.Tensor:
        """The full value from every TP rank's block (all ranks take part)."""
        if self.program.tp == 1 or layout == "rep":
            return local
        pieces = [torch.empty_like(local) for _ in range(self.program.tp)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        sizes = [s // self.program.tp for s in self._parts(layout, local.shape[2] * self.program.tp)]
        out, offset = [], 0
        for block in sizes:
            out += [p.narrow(2, offset, block) for p in pieces]
            offset += block
        return torch.cat(out, dim=2)

    def send(self, stage: int, mb: int, positions: torch.Tensor, values: tuple[torch.Tensor, ...]) -> None:
        self._mark("compute", stage, mb)
        st = self._stage[stage]
        values = tuple(self._gather(v, layout) for v, layout in zip(values, st.send.layouts))
        if not self.is_leader:
            self._mark("send", stage, mb)
            return
        lo = self.program.rows[0]
        width = positions.shape[1]
        for p in st.send.peers:  # one message: the width, positions and values as bytes
            a, b = p.lo - lo, p.hi - lo
            message = pack_message(width, positions[a:b], [v[a:b] for v in values])
            if width != 1:  # a prefill: the receiver expects a decode-sized message first
                per_token = (message.numel() - message_bytes(b - a, width, 0)) // ((b - a) * width)
                self._isend(torch.cat([message[:8], message.new_zeros(message_bytes(b - a, 1, per_token) - 8)]),
                            p.rank)
            self._isend(message, p.rank)
        self._mark("send", stage, mb)

    def finish(self, mb: int, tokens: torch.Tensor) -> None:
        st = self.program.stages[-1]
        self._mark("compute", st.stage, mb)
        if not self.is_leader:
            self._mark("send", st.stage, mb)
            return
        lo = self.program.rows[0]
        for p in st.returns:
            part = tokens[p.lo - lo:p.hi - lo].contiguous().cpu()
            if p.rank == self.program.rank:
                self._local_tokens[mb] = part
            else:
                self._isend(part, p.rank)
        self._mark("send", st.stage, mb)

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        if dst == self.program.rank:
            raise RuntimeError("a rank never sends to itself: consecutive stages of one owner are merged")
        self._pending.append((dist.isend(tensor, dst=dst), tensor))

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def tp_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sample over a vocabulary split across the TP group (lowest index wins ties):
        one all-gather of each rank's (max logit, global index) per token. A rank whose slice of
        a row is not all finite sends NaN as its maximum, and a row with a NaN maximum from any
        rank gives NON_FINITE_TOKEN (like `ops.Sample`; decided on the device, no host sync)."""
        last = logits[:, -1, :].float()
        best, idx = last.max(dim=-1)
        best = torch.where(torch.isfinite(last).all(dim=-1), best, float("nan"))
        idx = idx + self.program.tp_rank * last.shape[-1]
        mine = torch.stack([best.double(), idx.double()])  # vocabulary ids are exact in float64
        gathered = [torch.empty_like(mine) for _ in range(self.program.tp)]
        dist.all_gather(gathered, mine, group=self.group)
        values = torch.stack([g[0] for g in gathered])
        indices = torch.stack([g[1] for g in gathered]).long()
        winner = values.argmax(dim=0)  # first maximum = lowest vocabulary shard
        ids = indices.gather(0, winner[None])[0]
        return torch.where(values.isnan().any(dim=0), NON_FINITE_TOKEN, ids)

    # ---------------------------------------------------------------- round control
    def end_round(self) -> bool:
        """Completes the previous round's sends (this round's token ids are only received at the
        start of the next round) and answers whether to run another round.

        Whether any scheduler still has work is all-reduced asynchronously and read one round
        later, so the ranks never wait for each other between rounds (a round of idle steps
        follows the last real one)."""
        for work, _ in self._previous:
            work.wait()
        self._previous, self._pending = self._pending, []
        flag = torch.tensor([1 if self.scheduler is not None and self.scheduler.active else 0], dtype=torch.long)
        previous, self._flag = self._flag, (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        if previous is not None:
            previous[0].wait()
        self._mark("sync")
        self.round_index += 1
        more = previous is None or bool(int(previous[1]))
        if more:
            self.inbox.start_round(self.round_index)
        return more

    def drain(self) -> None:
        """After the last round: take the last step's token ids so every send is matched."""
        if self.scheduler is not None:
            for mb in range(self.program.num_microbatches):
                self.scheduler.take_tokens(mb, self._recv_tokens(mb))
        for work, _ in self._previous + self._pending + ([self._flag] if self._flag else []):
            work.wait()
        self._previous, self._pending, self._flag = [], [], None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load_program_module(path: str):
    """A generated module run by hand (`python rank_00.py`): the user executes that file anyway.
    `run_rank` never uses this: it executes the verified bytes (`load_program_source`)."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_rank(artifact: str | VerifiedArtifact, rank: int, weights: str, device: str, requests: list[Request],
             interpret: bool = False, trace: bool = False) -> tuple[list[Request], dict] | None:
    """Runs one rank to completion (torch.distributed already initialised); rank 0 returns the
    outputs and its per-round wall and host (CPU) times, and with `trace` every rank's spans
    (`{"spans": {rank: rows}}`, see opweave.runtime.timeline).

    `artifact` is the folder (its files are then read and checked here) or the files already
    read and checked; either way the rank uses only those checked bytes."""
    if isinstance(artifact, str):
        artifact = load_artifact(artifact, rank_files(rank))
    program = program_from_json(artifact.json(f"rank_{rank:02d}.json"))
    groups = {g: dist.new_group(list(g)) for g in program.tp_groups}  # every rank creates every group
    mine = []
    if program.scheduler:
        k = program.scheduler_leaders.index(program.tp_group[0])
        mine = [r for r in requests if r.index % len(program.scheduler_leaders) == k]
    rt = Runtime(artifact, program, weights, device, groups, mine, trace=trace)
    if interpret:
        from opweave.runtime.interpret import InterpretedProgram

        prog = InterpretedProgram(rt, program)
    else:
        prog = load_program_source(artifact, f"rank_{rank:02d}.py").Program(rt)
    faults = _fault_injection(rank)
    report(Phase.LOADED)
    wall, host = [], []
    with torch.no_grad():
        while True:
            t0, c0 = time.perf_counter(), time.process_time()
            if rt.timeline is not None:
                rt.timeline.restart()
            prog.round()
            wall.append(time.perf_counter() - t0)
            host.append(time.process_time() - c0)
            if rt.round_index == faults.get("kill"):
                os.kill(os.getpid(), 9)
            while rt.round_index == faults.get("stall"):
                time.sleep(3600)
            report(Phase.ROUND, rt.round_index)
            if not rt.end_round():
                break
        rt.drain()
    report(Phase.FINISHED, rt.round_index)
    done = rt.scheduler.done if rt.scheduler is not None else []
    spans = rt.timeline.to_rows() if rt.timeline is not None else None
    gathered = _gather_json({"done": [dataclasses.asdict(r) for r in done], "spans": spans}, rank,
                            program.world_size, rt.device)
    if rank != 0:
        return None
    out = [Request(**r) for part in gathered for r in part["done"]]
    stats = {"round_s": wall, "host_s": host}
    if trace:
        stats["spans"] = {r: part["spans"] for r, part in enumerate(gathered)}
    return sorted(out, key=lambda r: r.index), stats


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


def _fault_injection(rank: int) -> dict[str, int]:
    """Faults for the fault tests (`opweave.config.fault_injection`)."""
    return config.fault_injection(rank)
