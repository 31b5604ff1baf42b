"""`python rank_XX.py`: benchmark one generated rank module alone.

Its operators get deterministic random weights; receives return zeros of the planned shapes,
sends and token returns go nowhere, TP collectives are skipped (one process), so the figure is
this rank's compute and Python dispatch per decode round for the planned batch. On CUDA the
round is also captured once as a CUDA graph and replayed, and both times are printed. The rank's
program, the model config and the op names are read from the artifact checked against its
manifest; the module itself is the file run (`python rank_XX.py`), as its user edits it.
"""

from __future__ import annotations

import os
import dataclasses
import statistics
import sys
import time

import torch

from opweave.artifact import VerifiedArtifact, load_artifact
from opweave.ir.program import program_from_json
from opweave.ir.tp import split_on
from opweave.models.hf_config import config_from_hf
from opweave.models.model import DecodeStep, build_model
from opweave.models.ops import torch_dtype
from opweave.runtime.shard import materialize, program_ep, program_slots
from opweave.runtime.pages import START, encode
from opweave.runtime.state import RankState


class _LoneRuntime:
    def __init__(self, artifact: VerifiedArtifact, program, width: int, device: torch.device):
        cfg = dataclasses.replace(config_from_hf(artifact.json("model_config.json"), program.model),
                                  kv_cache_dtype=program.kv_cache_dtype)
        names = artifact.json("ops.json")
        modules = dict(DecodeStep(build_model(cfg, "meta")).named_modules())
        self.ops = materialize({i: modules[names[i]] for i in program.ops}, "random", program.tp, program.tp_rank,
                               device, experts=program.experts, ep=program_ep(program),
                               slots=program_slots(program))
        self.rows = program.rows[1] - program.rows[0]
        self.state = RankState.allocate(self.ops, self.rows, program.num_microbatches, program.context, device)
        if self.state.pool is not None:  # every slot holds the whole context's pages: a round reads what it plans
            full = ((encode(program.context, START),) * self.rows,) * program.num_microbatches
            self.state.apply_round(full, 0)
        self.program, self.width, self.dtype, self.device = program, width, torch_dtype(cfg), device
        self._stage = {st.stage: st for st in program.stages}
        self.positions = torch.zeros(self.rows, width, dtype=torch.long, device=device)  # static: graph-safe
        self.ids = torch.zeros(self.rows, width, dtype=torch.long, device=device)
        from opweave.kernels.sampling import encode as sampling_word

        # the sampler's words per microbatch (temperature 1, top_p 0.9), made before any round: a
        # tensor made from host data inside the round could not be captured as a CUDA graph
        self.words = [torch.tensor([sampling_word(1.0, 0.9, mb)] * self.rows, dtype=torch.long, device=device)
                      for mb in range(program.num_microbatches)]

    def _positions(self):
        return self.positions

    def state_views(self, op):
        return self.state.views(op)

    def live(self, stage, mb) -> bool:
        """Every microbatch runs (rows x width tokens: the planned bound)."""
        return True

    def begin(self, mb):
        return self.ids, self.positions

    def recv(self, stage, mb):
        st = self._stage[stage]
        tp = self.program.tp
        vals = []
        for shape, layout in zip(st.recv.shapes, st.recv.layouts):
            shape = split_on(0, shape, layout, tp) if shape else shape
            vals.append(torch.zeros(self.rows, self.width, *shape, dtype=self.dtype, device=self.device))
        return self._positions(), tuple(vals)

    def send(self, *args):
        pass

    def finish(self, *args):
        pass

    def allreduce(self, x):
        return x

    def add_norm(self, norm, x, residual):
        from opweave.runtime.kernel_ops import add_norm, device_kernels

        return add_norm(norm, x, residual, device_kernels(self.device))

    def sample(self, mb, logits, positions):
        """The server's sampler on this rank's slice (temperature 1, top_p 0.9): its cost is timed."""
        from opweave.kernels.sampling import sample

        return sample(logits[:, -1], self.words[mb], positions[:, -1])


def load_alone(module_path: str, device: torch.device):
    """(runtime, program) of one generated rank module with no peers (see the module docstring)."""
    from opweave.runtime.worker import load_program_module

    folder = os.path.dirname(os.path.abspath(module_path))
    name = os.path.splitext(os.path.basename(module_path))[0]
    artifact = load_artifact(folder, [name + ".json", "model_config.json", "ops.json"])
    program = program_from_json(artifact.json(name + ".json"))
    rt = _LoneRuntime(artifact, program, width=1, device=device)
    return rt, load_program_module(module_path).Program(rt)


def main(module_path: str, rounds: int = 20) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rt, prog = load_alone(module_path, device)
    program, name = rt.program, os.path.splitext(os.path.basename(module_path))[0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        times = []
        for i in range(rounds + 3):
            rt.positions.fill_(i)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= 3:  # warm-up rounds excluded
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with torch.no_grad():
        eager = timed(prog.round)
        line = (f"{name} on {device.type}: {len(program.ops)} ops, {program.num_microbatches} microbatch(es) of "
                f"{rt.rows} rows: median {eager * 1e3:.3f} ms per decode round over {rounds} rounds")
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # capture once, replay per round
                prog.round()
            line += f"; as a CUDA graph {timed(graph.replay) * 1e3:.3f} ms"
    print(line)


if __name__ == "__main__":
    main(sys.argv[1])
