"""What a rank really allocates, measured on the `meta` device (no weights, no GPU).

For one rank program the modules are built exactly as `runtime/worker.py` builds them
(`DecodeStep(build_model(cfg, "meta"))`, then `runtime/shard.materialize` with a reader that
hands out meta tensors: the same TP shards, the same parameters), and then:

    weights      bytes of the distinct storages of the modules' parameters and buffers
    state        `allocate_state(num_microbatches x rows, context)` as the worker calls it
    activations  the peak live bytes while the rank's generated module runs one round on meta
                 tensors (every row feeding `width` tokens), tracked op by op by a dispatch mode
                 that counts each new storage until its last tensor is gone
    buffers      the receives the worker's transport posts (one per peer at a time) and the
                 messages it keeps alive for two rounds (`runtime/message.message_bytes`); they
                 live in host memory (messages are packed and received on the CPU)

`artifact_memory(folder)` gives, per rank of an artifact, these figures next to the planned
ones (`opweave.passes.plan_memory.plan_rank_memory`): what `opweave dump ARTIFACT --what memory`
prints. Ranks that do the same work (TP peers, and the replicas of one owner with as many rows)
are measured once: only their buffers differ, and those are counted per rank.

The round on meta runs every operator as the rank does, but paged attention reads at most
`MEASURED_KEY_BLOCKS` key blocks per row rather than the whole context: its scratch is one key
block at a time (`kernels/blocks.py`), so the peak is the same, and a 128K-context plan's 512
blocks per layer took minutes per rank on meta (`tests/test_memory.py` checks the two agree).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from opweave.cost.memory import CATEGORIES, PAGED_KINDS, MemoryBreakdown
from opweave.ir.plan import PAGE_TOKENS, PREFILL_CHUNK
from opweave.ir.program import RankProgram
from opweave.kernels.blocks import ATTN_KEY_BLOCK
from opweave.passes.plan_memory import SEND_ROUNDS, plan_rank_memory
from opweave.runtime.message import message_bytes
from opweave.runtime.pages import START, encode
from opweave.runtime.state import RankState

META = torch.device("meta")

MEASURED_KEY_BLOCKS = 3
"""Key blocks of `ATTN_KEY_BLOCK` cached tokens each that paged attention reads per row in the
measured round (None: the whole context). A block's scratch is allocated while the previous
block's is still referenced and is released during the next one, so from the second block on
every block peaks alike (one block alone peaks lower): three full blocks reach the peak of the
whole context, in a few hundred ops instead of 512 blocks per layer at 128K."""


class MetaWeights:
    """A weight reader that gives meta tensors of the checkpoint's shapes (wraps the random
    reader `runtime/shard.py` builds, for its full shapes)."""

    def __init__(self, shapes_reader):
        self.inner = shapes_reader

    def has(self, key: str) -> bool:
        return True

    def shape(self, key: str) -> tuple[int, ...]:
        return self.inner.shape(key)

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return torch.empty(tuple(shape if shape is not None else self.inner.shape(key)), device=META)

    def get_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        shape = list(self.inner.shape(key))
        shape[dim] = stop - start
        return torch.empty(shape, device=META)


def build_modules(cfg, op_names: list[str], program: RankProgram) -> dict:
    """The rank's operator modules on meta, built the way the worker builds them (a GPU rank's:
    a quantized checkpoint's matrices held as stored where a kernel computes from them)."""
    from opweave.models.model import DecodeStep, build_model
    from opweave.runtime.shard import materialize, program_ep, program_slots

    modules = dict(DecodeStep(build_model(cfg, "meta")).named_modules())
    return materialize({i: modules[op_names[i]] for i in program.ops}, MetaWeights, program.tp,
                       program.tp_rank, META, experts=program.experts, ep=program_ep(program),
                       slots=program_slots(program), stored=cfg.weight_format)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def weight_bytes(modules: dict) -> int:
    """Bytes of the distinct storages of the modules' parameters and buffers."""
    seen: dict[int, int] = {}
    for m in modules.values():
        for t in list(m.parameters()) + list(m.buffers()):
            seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def allocate_state(modules: dict, program: RankProgram, artifact=None) -> int:
    """Allocates every module's state as the worker does (`RankState.allocate`: full attention in
    pages, as many as `worker.planned_kv_pages` of the artifact's plan gives, without one every
    slot at the full context); returns its bytes (the block table, int32 per slot and page, is a
    buffer: not counted)."""
    from opweave.runtime.worker import planned_kv_pages

    rows = program.rows[1] - program.rows[0]
    pages = None if artifact is None else planned_kv_pages(artifact, modules, rows * program.num_microbatches,
                                                           program.context)
    RankState.allocate(modules, rows, program.num_microbatches, program.context, META, pages=pages)
    return sum(getattr(m, a).untyped_storage().nbytes() for m in modules.values() for a in m.state_attrs)


def buffer_bytes(program: RankProgram, dtype: torch.dtype, width: int) -> int:
    """A rank's message buffers on the run device, for the cuts it is the port of: a
    decode-sized receive buffer for every receive of a round (the worker's own slot list; reused
    every round), in a step of `width` tokens per row the widest receive of each peer (one in
    flight per peer), and the sends of two rounds (token ids back included)."""
    from opweave.runtime.transport import Transport

    transport = Transport.__new__(Transport)  # its sizing only: no inbox, no process group
    transport.program, transport.dtype, transport.tokens_back = program, dtype, \
        program.scheduler and program.tp_rank == 0  # as the worker: only the leader runs the scheduler
    transport.width = 1  # token ids alone, as `opweave run`; a server's log-probability records
    # (`--max-logprobs N`) hold 2 + 2N int64s a row instead: 336 bytes a row at N = 20, unplanned
    static, wide = 0, {}
    for slot in transport.receive_slots():
        element = torch.empty(0, dtype=slot.dtype).element_size()
        size = (slot.numel + slot.fixed) * element
        static += size
        if width > 1 and slot.scales:
            wide[slot.peer] = max(wide.get(slot.peer, 0), (slot.numel * width + slot.fixed) * element)
    sent = 0
    for st in program.stages:
        if st.send_port != program.rank:
            continue
        if st.send is not None:
            per_token = transport.per_token_bytes(st.send)
            for p in st.send.peers:
                sent += message_bytes(p.hi - p.lo, (p.hi - p.lo) * width, per_token)
        sent += sum((p.hi - p.lo) * 8 for p in st.returns if p.rank != program.rank)
    return static + sum(wide.values()) + SEND_ROUNDS * program.num_microbatches * sent


# ---------------------------------------------------------------- activations


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of storages created under it while a tensor of theirs is alive; `peak`
    is the largest total. Storages that existed before (weights, state) are never counted."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known = known
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.size.pop(key)
            del self.refs[key]

    def track(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in self.known:
            return
        if key not in self.refs:
            self.size[key] = t.untyped_storage().nbytes()
            self.refs[key] = 0
            self.live += self.size[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def _local_shape(shape: tuple[int, ...], layout, tp: int) -> tuple[int, ...]:
    """Per-token shape of a transferred value on one TP rank: its typed layout's local size of the
    first per-token dimension (`opweave.ir.tp`: replicated, or split with KV heads replicated
    beyond their count)."""
    if tp == 1 or not shape:
        return tuple(shape)
    return (layout.local_size(shape[0], tp), *shape[1:])


class MetaRuntime:
    """The façade the generated module calls, allocating on meta what the worker allocates on the
    device: the step's ids and positions, received values (this rank's shard), the gathered full
    values of a send; all-reduces in place; no communication."""

    def __init__(self, program: RankProgram, ops: dict, dtype: torch.dtype, width: int, pages: int | None = None):
        self.program, self.ops, self.dtype, self.width = program, ops, dtype, width
        self.rows = program.rows[1] - program.rows[0]
        self._stage = {st.stage: st for st in program.stages}
        self.state = RankState(ops, self.rows, program.num_microbatches, program.context, META,
                               pages=pages)  # views on meta
        if self.state.pool is not None:  # every slot as full as the pool holds, up to MEASURED_KEY_BLOCKS blocks
            per_slot = self.state.pool.pages // max(1, self.rows * program.num_microbatches) * PAGE_TOKENS
            held = min(program.context, per_slot)
            if MEASURED_KEY_BLOCKS is not None:  # the same peak as the whole context (see MEASURED_KEY_BLOCKS)
                held = min(held, MEASURED_KEY_BLOCKS * ATTN_KEY_BLOCK)
            full = ((encode(held, START),) * self.rows,) * program.num_microbatches
            self.state.apply_round(full, 0)

    def state_views(self, op: int):
        """The op's state, one view per microbatch (as the worker passes it)."""
        return self.state.views(op)

    def live(self, stage, mb) -> bool:
        """Every microbatch runs (rows x width tokens: the planned bound)."""
        return True

    def begin(self, mb: int):
        shape = (self.rows, self.width)
        return torch.zeros(shape, dtype=torch.long, device=META), torch.zeros(shape, dtype=torch.long, device=META)

    def recv(self, stage: int, mb: int):
        st = self._stage[stage]
        positions = torch.zeros(self.rows, self.width, dtype=torch.long, device=META)
        values = tuple(torch.zeros(self.rows, self.width, *_local_shape(s, layout, self.program.tp),
                                   dtype=self.dtype, device=META) for s, layout in zip(st.recv.shapes, st.recv.layouts))
        return positions, values

    def send(self, stage: int, mb: int, positions, values) -> None:
        st = self._stage[stage]
        gathered = [torch.empty(self.rows, self.width, *s, dtype=self.dtype, device=META)
                    for s, layout, v in zip(st.send.shapes, st.send.layouts, values)
                    if _local_shape(s, layout, self.program.tp) != tuple(s)]
        del gathered

    def finish(self, mb: int, tokens) -> None:
        return None

    def allreduce(self, x):
        return x

    def add_norm(self, norm, x, residual):
        from opweave.kernels import reference
        from opweave.runtime.kernel_ops import add_norm

        return add_norm(norm, x, residual, reference)

    def sample(self, mb: int, logits, positions):
        """The server's sampler on this rank's slice (the larger of its two paths: greedy is one max)."""
        from opweave.kernels.sampling import WORD, encode, sample

        words = torch.tensor([encode(1.0, 0.9, 0)], dtype=torch.long, device=META).expand(self.rows, WORD)
        return sample(logits[:, -1], words, positions[:, -1])


def activation_peak(modules: dict, program: RankProgram, program_class, dtype: torch.dtype, width: int,
                    pages: int | None = None) -> int:
    """Peak live bytes of one round of the generated `Program` on meta (state already allocated,
    its KV pool of `pages` pages)."""
    known = set()
    for m in modules.values():
        for t in list(m.parameters()) + list(m.buffers()) + [getattr(m, a) for a in m.state_attrs]:
            known.add(_storage_key(t))
    rt = MetaRuntime(program, modules, dtype, width, pages)
    prog = program_class(rt)
    tracker = LiveBytes(known)
    with torch.no_grad(), tracker:
        prog.round()
        del prog
    return tracker.peak


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankMemory:
    rank: int
    owner: int
    gpu: str
    tp: int
    planned: MemoryBreakdown
    allocated: MemoryBreakdown
    kv_pages: tuple[int, int] = (0, 0)  # KV pages per full-attention layer: planned, allocated (no null page)
    prefill: bool = False  # a rank of a disaggregated plan's prefill sets (`prefill_rank_XX`)

    def to_json(self) -> dict:
        return {"rank": self.rank, "prefill": self.prefill, "owner": self.owner, "gpu": self.gpu, "tp": self.tp,
                "planned": self.planned.to_json(), "allocated": self.allocated.to_json(),
                "kv_pages": {"planned": self.kv_pages[0], "allocated": self.kv_pages[1], "page_tokens": PAGE_TOKENS}}


def planned_pages(plan, graph, owner: int, replica: int) -> int:
    """The KV pages each paged layer (full attention, MLA) of a rank of (owner, replica) holds in
    the plan: slots x ceil(context / PAGE_TOKENS), or for a plan with a workload whose pools follow
    the scheduler's the workload-sized pool (`ir.workload.kv_pool_pages`); 0 where the owner runs
    none."""
    from opweave.passes.plan_memory import kv_pool, owner_ops

    if not any(op.kind in PAGED_KINDS for op in owner_ops(plan, graph, owner)):
        return 0
    return kv_pool(plan, graph, owner, replica)


def allocated_pages(modules: dict) -> int:
    """The pages of the paged modules' pools as allocated (the null page not counted)."""
    pools = {getattr(m, m.state_attrs[0]).shape[0] - 1 for m in modules.values() if m.paged and m.state_attrs}
    if len(pools) > 1:
        raise RuntimeError(f"full-attention layers of one rank hold different page counts: {sorted(pools)}")
    return pools.pop() if pools else 0


def measure_rank(cfg, op_names: list[str], program: RankProgram, program_class=None,
                 width: int = PREFILL_CHUNK, same_as: tuple[MemoryBreakdown, int] | None = None,
                 artifact=None) -> tuple[MemoryBreakdown, int]:
    """The allocated breakdown of one rank (activations 0 without the generated `Program` class)
    and the KV pages of its full-attention layers' pools (`allocated_pages`).

    `same_as`: what a rank doing the same work measured (a TP peer, or a replica of the same
    owner with as many rows: `same_work`): only the buffers, which depend on the rank's cuts and
    on whether it leads its group, are measured again. `artifact`: the loaded artifact whose
    plan sizes the KV pool (`allocate_state`)."""
    from opweave.models.ops import torch_dtype

    cfg = dataclasses.replace(cfg, kv_cache_dtype=program.kv_cache_dtype)  # the plan's KV cache dtype
    dtype = torch_dtype(cfg)
    buffers = buffer_bytes(program, dtype, width)
    if same_as is not None:
        return dataclasses.replace(same_as[0], buffers=buffers), same_as[1]
    modules = build_modules(cfg, op_names, program)
    weights = weight_bytes(modules)
    state = allocate_state(modules, program, artifact)
    pages = allocated_pages(modules) or None
    activations = activation_peak(modules, program, program_class, dtype, width, pages) if program_class else 0
    return MemoryBreakdown(weights=weights, state=state, activations=activations, buffers=buffers), \
        allocated_pages(modules)


def same_work(program: RankProgram) -> tuple:
    """What decides a rank's measured weights, state, activations and KV pages: its owner's ops
    and layouts, its rows, microbatches and context. Ranks alike in this (TP peers, the replicas of
    one owner with as many rows) allocate alike; only their buffers differ."""
    return (program.owner, program.tp, program.experts, tuple(program.ops), program.rows[1] - program.rows[0],
            program.num_microbatches, program.context, program.prefill_chunk)


def artifact_memory(folder: str, activations: bool = True, progress=None) -> list[RankMemory]:
    """Per rank of an artifact: planned and allocated bytes by category, for steps of the
    program's prefill chunk (at most the context) tokens per row. The modules of each kind of rank
    (`same_work`) are built and run once; `progress` gets a line per step (rank 0 of a large model
    takes seconds, the model's trace several). A disaggregated plan's prefill ranks follow, measured
    against their own plan (`prefill_plan.json`)."""
    from opweave.artifact import load_artifact

    out = _artifact_memory(folder, "", activations, progress)
    if load_artifact(folder, ["plan.json"]).has("prefill_rank_00.json"):
        out += _artifact_memory(folder, "prefill_", activations, progress)
    return out


def _artifact_memory(folder: str, prefix: str, activations: bool, progress) -> list[RankMemory]:
    from opweave.ir.plan import plan_from_json
    from opweave.ir.program import program_from_json
    from opweave.passes.trace import build_graph
    from opweave.models.hf_config import config_from_hf
    from opweave.models.model import build_model
    from opweave.artifact import load_artifact, load_program_source, rank_files

    say = progress or (lambda message: None)
    def files(names: list[str]):  # `prefix` + NAME read and checked, as NAME
        shared = ("model_config.json", "ops.json")
        return load_artifact(folder, [n if n in shared else prefix + n for n in names]).view(prefix) if prefix \
            else load_artifact(folder, names)

    probe = files(["plan.json", "model_config.json", "ops.json"])
    plan = plan_from_json(probe.json("plan.json"))
    cfg = dataclasses.replace(config_from_hf(probe.json("model_config.json"), plan.model),
                              kv_cache_dtype=plan.kv_cache_dtype)
    op_names = probe.json("ops.json")
    say(f"tracing {plan.model}'s decode step on meta (the planned figures' graph)")
    graph = build_graph(build_model(cfg, "meta"))
    out, measured = [], {}
    world = program_from_json(files(rank_files(0)).json("rank_00.json")).world_size
    who = "prefill rank" if prefix else "rank"
    for rank in range(world):
        art = files(rank_files(rank))
        program = program_from_json(art.json(f"rank_{rank:02d}.json"))
        width = min(program.prefill_chunk, program.context)
        key = same_work(program)
        if key in measured:
            say(f"{who} {rank} of {world}: as {who} {measured[key][0]} (same owner, ops and rows), buffers measured")
            allocated, pages = measure_rank(cfg, op_names, program, None, width, same_as=measured[key][1:])
        else:
            say(f"{who} {rank} of {world}: building owner o{program.owner}'s {len(program.ops)} ops on meta"
                + (" and running a round" if activations else ""))
            cls = load_program_source(art, f"rank_{rank:02d}.py").Program if activations else None
            allocated, pages = measure_rank(cfg, op_names, program, cls, width, artifact=probe)
            measured[key] = (rank, allocated, pages)
        out.append(RankMemory(rank=rank, owner=program.owner, gpu=plan.owners[program.owner].gpu, tp=program.tp,
                              planned=plan_rank_memory(plan, graph, program.owner, program.replica,
                                                       program.tp_rank, width),
                              allocated=allocated,
                              kv_pages=(planned_pages(plan, graph, program.owner, program.replica), pages),
                              prefill=bool(prefix)))
    return out


def format_memory(ranks: list[RankMemory]) -> str:
    """One table per rank: planned and allocated bytes per category and their ratio (on_gpu:
    weights + state + activations; buffers are host memory)."""
    lines = []
    for r in ranks:
        lines.append(f"{'prefill rank' if r.prefill else 'rank'} {r.rank}: owner o{r.owner} {r.gpu} tp{r.tp}")
        lines.append(f"  {'':12} {'planned':>12} {'allocated':>12} {'alloc/plan':>10}")
        for c in CATEGORIES + ("on_gpu", "total"):
            p, a = getattr(r.planned, c), getattr(r.allocated, c)
            ratio = f"{a / p:.3f}" if p else ("-" if not a else "inf")
            lines.append(f"  {c:12} {_gb(p):>12} {_gb(a):>12} {ratio:>10}")
        if any(r.kv_pages):
            lines.append(f"  {'KV pages':12} {r.kv_pages[0]:>12} {r.kv_pages[1]:>12}   "
                         f"per paged layer, {PAGE_TOKENS} positions each (+1 null page)")
    return "\n".join(lines)


def _gb(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.2f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{n:.0f} B"


def unbounded_cluster(gpu: str = "h100", count: int = 8):
    """A cluster of `count` GPUs of the catalog's type `gpu` with memory that never binds: plans
    that would not fit a real GPU can still be lowered and measured (bench/memory.py, tests)."""
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster

    catalog = load_catalog()
    catalog = {**catalog, gpu: dataclasses.replace(catalog[gpu], memory_bytes=1e18)}
    return parse_cluster(f"{gpu}x{count}", catalog)


def pinned_memory(fe, template: str, owners: list[tuple], batch: int, microbatches: int,
                  context: int, activations: bool = True, ranks: list[int] | None = None) -> list[RankMemory]:
    """Planned and allocated bytes of each rank of a pinned plan on an `unbounded_cluster`
    (`ranks`: only these; activations measured by running the rendered rank module on meta)."""
    import types

    from opweave.codegen.render import render_rank
    from opweave.compiler.pinned import pinned_plan
    from opweave.passes.lower import lower

    count = sum(o[1] * o[2] for o in owners)
    plan = pinned_plan(fe, unbounded_cluster(owners[0][0], max(8, count)), template, owners, batch=batch,
                       microbatches=microbatches, context=context).plan
    programs = lower(plan, fe.graph, fe.blocks.period, fe.blocks.num_blocks, "",
                     fe.blocks.num_head_layers)
    names = [op.name for op in fe.graph.ops]
    out = []
    for program in programs:
        if ranks is not None and program.rank not in ranks:
            continue
        cls = None
        if activations:
            module = types.ModuleType(f"rank_{program.rank:02d}")
            exec(compile(render_rank(program, names, plan.template, plan.num_stages), module.__name__, "exec"),
                 module.__dict__)
            cls = module.Program
        width = min(program.prefill_chunk, program.context)
        allocated, pages = measure_rank(fe.source.cfg, names, program, cls, width)
        out.append(RankMemory(rank=program.rank, owner=program.owner, gpu=plan.owners[program.owner].gpu,
                              tp=program.tp,
                              planned=plan_rank_memory(plan, fe.graph, program.owner, program.replica,
                                                       program.tp_rank, width),
                              allocated=allocated,
                              kv_pages=(planned_pages(plan, fe.graph, program.owner, program.replica), pages)))
    return out
