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
`run_rank` runs one rank to completion.
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
from opweave.models.ops import OpModule, torch_dtype
from opweave.runtime.heartbeat import Phase, report
from opweave.runtime.kernel_ops import with_kernels
from opweave.runtime.manifest import VerifiedArtifact, load_artifact, load_program_source, rank_files
from opweave.runtime.scheduler import Request, Scheduler
from opweave.runtime.shard import check_placement, materialize
from opweave.runtime.state import RankState, StateView
from opweave.runtime.timeline import Timeline
from opweave.runtime.tpgroup import TPGroup
from opweave.runtime.transport import Transport


class Runtime:
    """What the generated module of one rank calls: a round is, per stage and microbatch,
    `begin` or `recv`, the ops, then `send` or `finish`; `end_round` between rounds."""

    def __init__(self, artifact: VerifiedArtifact, program: RankProgram, weights: str, device: str,
                 groups: dict[tuple[int, ...], object], requests: list[Request], trace: bool = False):
        self.program = program
        self.timeline = Timeline() if trace else None  # measured spans (see opweave.runtime.timeline)
        self.device = torch.device(device)
        cfg = config_from_hf(artifact.json("model_config.json"), program.model)
        self.cfg = cfg
        self.dtype = torch_dtype(cfg)
        step = DecodeStep(build_model(cfg, "meta"))
        modules = dict(step.named_modules())
        op_names = artifact.json("ops.json")
        self.modules: dict[int, OpModule] = materialize(
            {i: modules[op_names[i]] for i in program.ops}, weights, program.tp, program.tp_rank, self.device,
            names=op_names, who=f"rank {program.rank}")
        self.ops = with_kernels(self.modules, self.device)  # what the generated code calls
        self.rows = program.rows[1] - program.rows[0]
        self.state = RankState.allocate(self.modules, self.rows, program.num_microbatches, program.context,
                                        self.device)
        check_placement(self.modules, self.device, op_names, f"rank {program.rank}")  # weights and state
        self.scheduler = (Scheduler(requests, program.num_microbatches, self.rows, program.context,
                                    cfg.eos_token_ids, program.prefill_chunk)
                          if program.scheduler and program.tp_rank == 0 else None)
        self.tp = TPGroup(program.tp_group, program.tp_rank, groups[program.tp_group] if program.tp > 1 else None,
                          device=self.device)
        self.transport = Transport(program, self.dtype, tokens_back=self.scheduler is not None, device=self.device)
        self._stage = {st.stage: st for st in program.stages}  # stage index -> its program
        self.round_index = 0

    @property
    def is_leader(self) -> bool:
        return self.program.tp_rank == 0

    def _mark(self, kind: str, stage: int = -1, mb: int = -1) -> None:
        if self.timeline is not None:
            self.timeline.mark(kind, self.round_index, stage, mb)

    # ---------------------------------------------------------------- generated-code API
    def state_views(self, op: int) -> tuple[StateView, ...]:
        """The per-sequence state of stateful op `op`, one view per microbatch (`opweave.runtime.state`)."""
        return self.state.views(op)

    def begin(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0: the new token ids of the previous step come back, the scheduler picks this step's."""
        if self.is_leader:
            if self.round_index > 0:
                self.scheduler.take_tokens(mb, self.transport.recv_tokens(mb))
            ids, positions = self.scheduler.step_inputs(mb)
            ids, positions = ids.to(self.device), positions.to(self.device)
            width = self.tp.fanout_width(ids.shape[1])
        else:
            width = self.tp.fanout_width(0)
            ids = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
            positions = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
        ids, positions = self.tp.fanout([ids, positions])
        self._mark("wait", self.program.stages[0].stage, mb)
        return ids.to(self.device), positions.to(self.device)

    def recv(self, stage: int, mb: int):
        """A stage's inputs: positions and this TP rank's block of each received value."""
        st = self._stage[stage]
        if self.is_leader:
            positions, values = self.transport.recv_values(st, mb)
            self.tp.fanout_width(positions.shape[1])
        else:
            width = self.tp.fanout_width(0)
            positions = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
            values = [torch.zeros(self.rows, width, *shape, dtype=self.dtype, device=self.device)
                      for shape in st.recv.shapes]
        self.tp.fanout([positions, *values])
        values = [self.tp.shard(v, layout) for v, layout in zip(values, st.recv.layouts)]
        self._mark("wait", stage, mb)
        return positions.to(self.device), tuple(v.to(self.device) for v in values)

    def send(self, stage: int, mb: int, positions: torch.Tensor, values: tuple[torch.Tensor, ...]) -> None:
        """A stage's outputs, whole (gathered over the TP group), to the next owner's replicas."""
        self._mark("compute", stage, mb)
        st = self._stage[stage]
        values = tuple(self.tp.gather(v, layout) for v, layout in zip(values, st.send.layouts))
        if self.is_leader:
            self.transport.send_values(st, positions, values)
        self._mark("send", stage, mb)

    def finish(self, mb: int, tokens: torch.Tensor) -> None:
        """The last stage: the new token ids back to the schedulers."""
        st = self.program.stages[-1]
        self._mark("compute", st.stage, mb)
        if self.is_leader:
            self.transport.send_tokens(st, mb, tokens)
        self._mark("send", st.stage, mb)

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.allreduce(x)

    def tp_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sample over the vocabulary split across the TP group (`TPGroup.argmax`)."""
        return self.tp.argmax(logits)

    # ---------------------------------------------------------------- round control
    def end_round(self) -> bool:
        """Ends a round and answers whether to run another (`Transport.complete_round`: the
        answer is one round late, so a round of idle steps follows the last real one)."""
        more = self.transport.complete_round(self.scheduler is not None and self.scheduler.active)
        self._mark("sync")
        self.round_index += 1
        if more:
            self.transport.start_round(self.round_index)
        return more

    def drain(self) -> None:
        """After the last round: take the last step's token ids so every send is matched."""
        if self.scheduler is not None:
            for mb in range(self.program.num_microbatches):
                self.scheduler.take_tokens(mb, self.transport.recv_tokens(mb))
        self.transport.drain()


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
