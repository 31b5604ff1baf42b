"""When a rank captures its decode round and replays it (`opweave.runtime.graphs`), checked on CPU
with a stand-in for the CUDA graph; the capture itself needs a GPU (bench/gpu_check.py)."""

import types

import pytest
import torch

from opweave.runtime import graphs
from opweave.runtime.graphs import RoundRunner
from opweave.runtime.launch import RunConfig, run_detailed
from test_runtime import LAYERS, NEW_TOKENS, compile_pinned, reference, requests


class FakeRank:
    def __init__(self, device="cuda"):
        self.device, self.timeline, self.decode_round = torch.device(device), None, False
        self.transport = types.SimpleNamespace(_pending=["send of the previous round"])
        self.rounds = 0

    def round(self):  # the generated module's round
        self.rounds += 1
        self.transport._pending.append(f"send {self.rounds}")


def runner_over(kinds, capture):
    rank = FakeRank()
    runner = RoundRunner(rank, rank, capture=capture)
    for decode in kinds:
        rank.decode_round = decode
        runner.round()
    return rank, runner


def test_the_second_decode_round_is_captured_then_every_decode_round_replays():
    captured, replayed = [], []

    def capture(fn):
        captured.append(fn)
        return lambda: replayed.append(1)

    rank, runner = runner_over([False, True, True, True, False, True], capture)
    assert len(captured) == 1 and captured[0] == rank.round   # captured once, at the second decode round
    assert runner.stats == {"replays": 3, "eager": 3, "eager_reason": None}
    assert rank.rounds == 3 and len(replayed) == 3  # prefill, warm-up, prefill eager; the rest replayed
    assert rank.transport._pending[0] == "send of the previous round"


def test_a_failed_capture_leaves_the_rank_eager_with_the_reason(capsys):
    def capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    rank, runner = runner_over([True] * 5, capture)
    assert runner.stats["replays"] == 0 and rank.rounds == 5
    assert runner.stats["eager_reason"] == "capture failed: RuntimeError: operation not permitted when stream is capturing"
    assert capsys.readouterr().err.count("decode rounds run eagerly") == 1


def test_cpu_runs_and_the_flag_stay_eager(monkeypatch):
    rank = FakeRank("cpu")
    assert RoundRunner(rank, rank).reason == "no CUDA graphs on cpu"
    monkeypatch.setenv("OPWEAVE_CUDA_GRAPHS", "0")
    assert RoundRunner(FakeRank(), FakeRank()).reason == "OPWEAVE_CUDA_GRAPHS=0"


@pytest.mark.parametrize("family,plan", [("llama", "afd"), ("qwen3_next", "cad")])
@pytest.mark.slow
def test_replayed_rounds_keep_token_parity(tiny_checkpoint, tmp_path, monkeypatch, family, plan):
    """Every rank of a real multi-rank run takes the graph path (a stand-in capture whose replay
    runs the round): tokens unchanged, every rank replays its decode rounds."""
    monkeypatch.setattr(graphs, "supported", lambda device: None)
    monkeypatch.setattr(graphs, "cuda_capture", lambda fn: fn)
    folder = tiny_checkpoint(family, num_hidden_layers=LAYERS[family])
    out = str(tmp_path / "art")
    compile_pinned(folder, plan, out)
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests(),
                                            timeout_s=300))
    assert [tuple(r.output) for r in outputs] == list(reference(folder))
    assert all(g["replays"] >= NEW_TOKENS - 3 and g["eager_reason"] is None for g in stats["graphs"]), stats["graphs"]
