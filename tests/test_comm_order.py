"""Each transfer point of a round is one grouped call (`batch_isend_irecv`: one NCCL group) with
its peers in ascending rank order, and both ends of every pair agree on the order and size of
their messages. Checked with a spy standing in for torch.distributed, on the `meta` device (so
receives are grouped as on CUDA), over every rank of multi-replica plans."""

import json
import os
import types

import pytest
import torch

from opweave.ir.program import program_from_json
from opweave.runtime.transport import Transport
from opweave.kernels.sampling import WORD
from test_runtime import compile_pinned

META = torch.device("meta")


class Work:
    def wait(self):
        return True


class Spy:
    """Records every grouped call of one rank: [(kind, peer, bytes)] per call."""

    def __init__(self):
        self.calls: list[list[tuple[str, int, int]]] = []
        self.token_sends_last_round: dict[int, int] = {}  # peer -> token-id messages sent in round 1
        self.round = 0

    def comm(self):
        spy = self

        def isend(tensor, dst):
            raise AssertionError("a send outside a grouped call")

        def irecv(tensor, src):
            raise AssertionError("a receive outside a grouped call (meta runs are not pre-posted)")

        def batch_isend_irecv(ops):
            spy.calls.append([(op.op, op.peer, op.tensor.numel() * op.tensor.element_size()) for op in ops])
            for op in ops:  # token ids are int64 tensors; activation messages are bytes
                if op.op == "send" and op.tensor.dtype == torch.long and spy.round == 1:
                    spy.token_sends_last_round[op.peer] = spy.token_sends_last_round.get(op.peer, 0) + 1
            return [Work() for _ in ops]

        def p2p(op, tensor, peer):
            return types.SimpleNamespace(op="send" if op is isend else "recv", tensor=tensor, peer=peer)

        return types.SimpleNamespace(isend=isend, irecv=irecv, recv=None, batch_isend_irecv=batch_isend_irecv,
                                     P2POp=p2p, all_reduce=lambda *a, **k: Work())


def two_rounds(program, spy) -> None:
    """Rounds 0 and 1 of one rank's transfers in program order (what the generated module calls):
    the token ids a round samples are received at the start of the next. Round 0 is ragged (row i
    of microbatch 0 feeds i mod 3 tokens; microbatch 1 idles, so no rank runs it), round 1 decodes."""
    t = Transport(program, torch.float32, tokens_back=program.scheduler, device=META, comm=spy.comm())
    b, m = program.microbatch_size, program.num_microbatches
    ragged = tuple(i % 3 for i in range(b))
    rounds = [(ragged,) + ((0,) * b,) * (m - 1), ((1,) * b,) * m]
    for r, counts in enumerate(rounds):
        spy.round = r
        t.start_round(r, counts)
        one_round(program, t, r)


def one_round(program, t, r) -> None:
    rows = program.rows[1] - program.rows[0]
    me = program.rank
    leader = program.scheduler and program.tp_rank == 0
    for i, st in enumerate(program.stages):
        for mb in range(program.num_microbatches):
            if i == 0 and leader and r > 0 and t.was_live(mb):  # what `Runtime.begin` / `live` take
                t.recv_tokens(mb)
            if not t.live(mb):
                continue
            tokens = t.layouts[mb].tokens
            if st.recv is not None and st.recv_port == me:
                positions, _, values = t.recv_values(st, mb)
                assert positions.shape == (1, tokens) and all(v.shape[:2] == (1, tokens) for v in values)
            if st.send is not None and st.send_port == me:
                positions = torch.zeros(1, tokens, dtype=torch.long, device=META)
                t.send_values(st, mb, positions, torch.zeros(rows, WORD, dtype=torch.long, device=META),
                              [torch.zeros(1, tokens, *s, device=META) for s in st.send.shapes])
            if st.returns and st.send_port == me:
                t.send_tokens(st, mb, torch.zeros(rows, dtype=torch.long, device=META))


@pytest.mark.parametrize("plan", ["cad", "opweave", "afd"])
@pytest.mark.slow
def test_grouped_calls_match_on_both_ends(tiny_checkpoint, tmp_path, plan):
    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path / "art")
    compile_pinned(folder, plan, art)
    spies = {}
    for name in sorted(n for n in os.listdir(art) if n.startswith("rank_") and n.endswith(".json")):
        with open(os.path.join(art, name)) as f:
            program = program_from_json(json.load(f))
        spies[program.rank] = Spy()
        two_rounds(program, spies[program.rank])
    fan = 0
    for rank, spy in spies.items():
        for call in spy.calls:
            kinds, peers = {k for k, _, _ in call}, [p for _, p, _ in call]
            assert len(kinds) == 1 and peers == sorted(set(peers)), (rank, call)  # one kind, ascending, distinct
            fan = max(fan, len(call))
    for a in spies:  # every pair: a's sends to b are b's receives from a, in order and size (round
        for b in spies:  # 1's token ids are received in round 2, not run here)
            sent = [n for call in spies[a].calls for k, p, n in call if k == "send" and p == b]
            received = [n for call in spies[b].calls for k, p, n in call if k == "recv" and p == a]
            assert sent[:len(received)] == received, (a, b, sent, received)
            assert len(sent) - len(received) == spies[a].token_sends_last_round.get(b, 0), (a, b)
    assert sum(len(s.calls) for s in spies.values()) > 0
    if plan == "cad":
        assert fan == 2  # the attention owner's two replicas: one group of two sends / receives
    ports = {p for spy in spies.values() for call in spy.calls for _, p, _ in call}
    assert len(ports) > len({r for r in spies if r == 0}), ports  # not only the leaders take transfers
