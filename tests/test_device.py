"""Device correctness without a GPU: a rank's tensors all live on its run device.

The `meta` device stands in for a GPU: a rank materialised there from a real checkpoint must hold
no tensor on the CPU (a host tensor on a CUDA rank is exactly the bug: weights read from the
checkpoint replacing the device parameters instead of being copied into them). Loading still
reads every tensor, so these tests also cover each family's loading path (fused and per-expert
MoE weights, the tied LM head, TP shards through `ShardReader`).
"""

import multiprocessing.process
from types import SimpleNamespace

import pytest
import torch

from opweave.errors import OpWeaveError
from opweave.models import ops
from opweave.models.checkpoint import CheckpointReader
from opweave.models.model import DecodeStep, build_model
from opweave.models.registry import resolve
from opweave.runtime import launch
from opweave.runtime.scheduler import Request
from opweave.runtime.shard import check_placement, materialize, module_tensors, on_device
from opweave.runtime.state import RankState
from opweave.kernels.sampling import WORD

META = torch.device("meta")
FAMILIES = ("llama", "gemma3", "qwen3_moe", "qwen3_next")


class CountingReader:
    """A checkpoint reader that counts the tensors handed out (so a test knows loading ran)."""

    def __init__(self, inner):
        self.inner, self.keys = inner, set()

    def has(self, key):
        return self.inner.has(key)

    def shape(self, key):
        return self.inner.shape(key)

    def get(self, key, shape=None):
        self.keys.add(key)
        return self.inner.get(key, shape)

    def get_slice(self, key, dim, start, stop):
        self.keys.add(key)
        return self.inner.get_slice(key, dim, start, stop)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    """(checkpoint folder, config) per family: the TP-table tests' checkpoints (shared per session)."""
    from test_tp_table import wide

    out = {}
    for family in FAMILIES:
        folder = tiny_checkpoint(family, **wide(family))
        out[family] = (folder, resolve(folder).cfg)
    return out


def _rank(checkpoint, tp: int, rank: int, device=META, reader_box: list | None = None):
    """Every op of the model as TP rank `rank` of `tp` materialises it on `device`, loaded."""
    folder, cfg = checkpoint
    named = [(n, m) for n, m in DecodeStep(build_model(cfg, "meta")).named_modules() if isinstance(m, ops.OpModule)]
    names = [n for n, _ in named]

    def reader(_shapes):
        r = CountingReader(CheckpointReader(folder))
        if reader_box is not None:
            reader_box.append(r)
        return r

    modules = materialize({i: m for i, (_, m) in enumerate(named)}, reader, tp, rank, device,
                          load=True, names=names, who=f"rank {rank}")
    return modules, names


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_loaded_rank_holds_nothing_on_the_host(checkpoints, family, tp, rank):
    readers = []
    modules, names = _rank(checkpoints[family], tp, rank, reader_box=readers)
    state = RankState.allocate(modules, rows=2, num_microbatches=2, context=16, device=META)
    check_placement(modules, META, names, f"rank {rank}")
    tensors = [(names[i], what, n, t) for i, m in modules.items() for sub in m.modules()
               for what, n, t in module_tensors(sub)]
    assert {what for _, what, _, _ in tensors} >= {"weight", "state"}
    on_host = [(op, n) for op, _, n, t in tensors if t.device.type != "meta"]
    assert on_host == []
    assert state.ops  # attention (and Gated-DeltaNet) state was allocated, on the device
    # loading really ran: every checkpoint tensor an op names was read (experts per expert or fused)
    wanted = {m.tied.get(a) or k for m in modules.values() for a, k in {**m.weight_keys, **m.tied}.items()}
    read = readers[0].keys
    missing = {k for k in wanted if k not in read and not k.endswith(("gate_up_proj", "down_proj"))}
    assert not missing
    if family == "gemma3":  # a tied LM head: its weight is the embedding's block, on the device
        head = next(m for m in modules.values() if m.kind == ops.OpKind.LM_HEAD)
        assert head.tied and head.weight.device == META


def test_loading_copies_into_the_parameters(checkpoints):
    """On the CPU the loaded values are the checkpoint's, and the parameters keep their storage."""
    folder, cfg = checkpoints["qwen3_moe"]
    named = dict(DecodeStep(build_model(cfg, "cpu")).named_modules())
    experts = next(m for m in named.values() if isinstance(m, ops.MoEExperts))
    before = experts.gate_up.data_ptr()
    experts.load_weights(CheckpointReader(folder))
    assert experts.gate_up.data_ptr() == before
    reader = CheckpointReader(folder)
    i = cfg.moe.intermediate_size
    if reader.has(experts.weight_keys["gate_up"]):
        expected = reader.get(experts.weight_keys["gate_up"])[1, i:]
    else:
        expected = reader.get(f"{experts.prefix}1.up_proj.weight")
    assert torch.equal(experts.gate_up[1, i:], expected.to(experts.gate_up.dtype))


def test_a_weight_left_on_the_host_is_a_one_line_error(checkpoints, monkeypatch):
    def load_on_host(self, reader):  # the bug: the read host tensor replaces the device parameter
        for attr, key in self.weight_keys.items():
            value = reader.get(key, tuple(getattr(self, attr).shape))
            setattr(self, attr, torch.nn.Parameter(value, requires_grad=False))

    monkeypatch.setattr(ops.OpModule, "load_weights", load_on_host)
    with pytest.raises(OpWeaveError) as e:
        _rank(checkpoints["llama"], 2, 1)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("rank 1: op model.embed weight 'weight' is on cpu")
    assert message.endswith("the run device is meta")


def test_state_on_the_wrong_device_is_named(checkpoints):
    modules, names = _rank(checkpoints["llama"], 1, 0)
    attention = next(i for i, m in modules.items() if m.state_attrs)
    modules[attention].allocate_state(2, 16, "cpu")  # as if allocate_state ignored its device
    with pytest.raises(OpWeaveError, match=rf"^rank 2: op {names[attention]} state 'k_cache' is on cpu, "
                                           r"the run device is meta$"):
        check_placement(modules, META, names, "rank 2")


def test_a_buffer_on_the_wrong_device_is_named():
    module = torch.nn.Module()
    module.register_buffer("scratch", torch.zeros(1))
    check_placement({0: module}, "cpu")
    with pytest.raises(OpWeaveError, match=r"^op 0 buffer 'scratch' is on cpu, the run device is meta$"):
        check_placement({0: module}, "meta")


def test_a_device_without_an_index_means_any_of_its_kind():
    def at(device):
        return SimpleNamespace(device=torch.device(device))

    assert on_device(at("cuda:1"), torch.device("cuda"))
    assert on_device(at("cuda:1"), torch.device("cuda:1"))
    assert not on_device(at("cuda:1"), torch.device("cuda:0"))
    assert not on_device(at("cpu"), torch.device("cuda"))


# ------------------------------------------------------------------ starting CUDA ranks
@pytest.fixture(scope="module")
def artifact(tiny_checkpoint, tmp_path_factory):
    from test_runtime import compile_pinned

    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path_factory.mktemp("device") / "art")
    compile_pinned(folder, "afd", art)  # three ranks
    return folder, art


def test_cpu_runs_fork_and_cuda_runs_spawn():
    assert launch.start_method("cpu") == "fork"
    assert launch.start_method("cuda") == "spawn"
    assert launch.start_method("cpu", threads=2) == "spawn"  # OpenMP is not fork-safe past one thread
    assert launch.rank_start_method("cpu", 1, 4) == "fork" and launch.rank_start_method("cpu", 3, 1) == "spawn"


def test_a_rank_of_several_threads_runs_after_the_launcher_used_its_thread_pool(artifact):
    """A rank forked from a process whose OpenMP pool was active would hang at its first parallel
    region; ranks of more than one thread are spawned, and the run ends with its tokens."""
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    (a @ a).sum()  # the pool is started here
    folder, art = artifact
    requests = (Request(index=0, prompt=[5, 6, 7], max_new_tokens=2),)
    out = launch.run(launch.RunConfig(art, folder, "cpu", requests, threads=2, stall_timeout_s=60))
    assert len(out[0].output) == 2 and out[0].error is None


class _Started(Exception):
    pass


def test_a_cuda_run_starts_its_ranks_before_anything_initialises_cuda(artifact, monkeypatch):
    """The launcher counts devices through NVML (`torch.cuda.device_count` before CUDA is
    initialised) and spawns the ranks; no initialising call happens in the launcher first."""
    folder, art = artifact
    calls = []
    for name, value in (("init", None), ("_lazy_init", None), ("is_available", True), ("current_device", 0),
                        ("set_device", None), ("synchronize", None), ("get_device_properties", None)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, _v=value, **k: calls.append(_n) or _v)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: calls.append("_cuda_getDeviceCount") or 3,
                        raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # NVML's answer: three GPUs
    started = []

    def start(process):
        started.append((process._start_method, list(calls)))
        raise _Started

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    cfg = launch.RunConfig(art, folder, "cuda", (Request(index=0, prompt=[1, 2, 3], max_new_tokens=2),))
    with pytest.raises(_Started):
        launch.run(cfg)
    assert started == [("spawn", [])]


def test_too_few_cuda_devices_is_one_line(artifact, monkeypatch):
    folder, art = artifact
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = launch.RunConfig(art, folder, "cuda", (Request(index=0, prompt=[1, 2, 3], max_new_tokens=2),))
    with pytest.raises(OpWeaveError, match=r"^the plan has 3 ranks but this machine has 2 CUDA device\(s\);"):
        launch.run(cfg)


@pytest.mark.slow
def test_spawned_ranks_run_a_plan(artifact, monkeypatch):
    """What a CUDA run does to start its ranks (spawn: arguments pickled, a fresh interpreter),
    exercised on the CPU: the tokens are those of a forked run."""
    folder, art = artifact
    requests = (Request(index=0, prompt=[5, 6, 7], max_new_tokens=3),)
    forked = launch.run(launch.RunConfig(art, folder, "cpu", requests))
    monkeypatch.setattr(launch, "start_method", lambda device, threads=1: "spawn")
    spawned = launch.run(launch.RunConfig(art, folder, "cpu", requests))
    assert [r.output for r in spawned] == [r.output for r in forked]
    assert len(forked[0].output) == 3


def _spy_process_group(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    def init_process_group(backend, *, device_id=None, **kw):  # torch's keyword, as torch names it
        if device_id is not None:
            kw["device_id"] = device_id
        calls.append((backend, kw))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return calls


def test_a_cuda_rank_creates_its_nccl_communicator_eagerly_on_its_gpu(monkeypatch):
    import inspect

    import torch.distributed as dist

    has_device_id = "device_id" in inspect.signature(dist.init_process_group).parameters
    calls = _spy_process_group(monkeypatch)
    store = object()
    launch.join_process_group("cuda", 30.0, 2, store=store, rank=1, world=3)
    assert calls[0] == ("set_device", 2)  # the rank's GPU is selected before NCCL starts
    backend, kwargs = calls[1]
    assert backend == "nccl" and kwargs["store"] is store and (kwargs["rank"], kwargs["world_size"]) == (1, 3)
    assert kwargs["timeout"].total_seconds() == 30.0
    assert has_device_id  # this torch binds the group to the device: eager communicator creation
    assert kwargs["device_id"] == torch.device("cuda", 2)


def test_a_cpu_rank_joins_gloo_without_touching_cuda(monkeypatch):
    calls = _spy_process_group(monkeypatch)
    launch.join_process_group("cpu", 30.0, None)  # torchrun's environment: no store
    assert calls == [("gloo", {"timeout": calls[0][1]["timeout"]})]


# ------------------------------------------------------------------ transfers on the run device
class _Work:
    def wait(self):
        return True


def test_every_transfer_uses_buffers_on_the_run_device(artifact):
    """Each rank's transport, on the `meta` device, sends, receives and all-reduces only
    tensors on that device (spies stand in for torch.distributed): no host buffer reaches NCCL."""
    import json
    import os

    import types

    from opweave.ir.program import program_from_json
    from opweave.runtime import transport

    seen = []

    def spy(name, result=None):
        def call(tensor, *args, **kwargs):
            seen.append((name, tensor.device.type))
            return _Work() if result is None else result
        return call

    def grouped(ops):
        for op in ops:
            seen.append((op.op, op.tensor.device.type))
        return [_Work() for _ in ops]

    comm = types.SimpleNamespace(isend="isend", irecv="irecv", recv=spy("recv", result=0),
                                 all_reduce=spy("all_reduce"), batch_isend_irecv=grouped,
                                 P2POp=lambda op, tensor, peer: types.SimpleNamespace(op=op, tensor=tensor))
    _, art = artifact
    ranks = sorted(n for n in os.listdir(art) if n.startswith("rank_") and n.endswith(".json"))
    for name in ranks:
        with open(os.path.join(art, name)) as f:
            program = program_from_json(json.load(f))
        b, m = program.microbatch_size, program.num_microbatches
        rows = program.rows[1] - program.rows[0]
        for width in (1, 3):  # a decode step, and a prefill (3 tokens a row)
            t = transport.Transport(program, torch.float32, tokens_back=program.scheduler, device=META, comm=comm)
            counts = ((width,) * b,) * m
            t.start_round(0, counts)
            t.start_round(1, counts)
            for st in program.stages:  # a cut's port (a TP rank, in turn) does its transfers
                if st.recv is not None and st.recv_port == program.rank:
                    positions, _, values = t.recv_values(st, 0)
                    assert positions.device == META and all(v.device == META for v in values)
                    assert positions.shape == (1, rows * width)
                positions = torch.zeros(1, rows * width, dtype=torch.long, device=META)
                if st.send is not None and st.send_port == program.rank:
                    t.send_values(st, 0, positions, torch.zeros(rows, WORD, dtype=torch.long, device=META),
                                  [torch.zeros(1, rows * width, *s, device=META) for s in st.send.shapes])
                if st.returns and st.send_port == program.rank:
                    t.send_tokens(st, 0, torch.zeros(rows, dtype=torch.long, device=META))
            if program.scheduler and program.tp_rank == 0:
                assert t.recv_tokens(0).device == META
            t.complete_round(True, counts)
    kinds = {name for name, _ in seen}
    assert {"isend", "irecv", "all_reduce"} <= kinds
    assert [s for s in seen if s[1] != "meta"] == []
