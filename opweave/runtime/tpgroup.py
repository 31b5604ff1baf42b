"""One replica's tensor-parallel group, seen from one of its ranks: fan-out, shard and gather of
values by their typed layout (`opweave.ir.tp`), the all-reduce of partial sums, and the greedy
sample over a vocabulary split across the group.

The replica's leader (the group's first rank) does the point-to-point transfers; what it
receives it broadcasts to its peers (`fanout`), and every rank then keeps its own block of each
value (`shard`). Before a send, the group gathers each split value to the leader (`gather`), so
the leader sends whole values. With a group of one, every call returns its input.

The collectives go through `comm`, by default `torch.distributed` itself (its `broadcast`,
`gather`, `all_gather` and `all_reduce` with a `group=`); tests pass a stand-in to run one rank alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from opweave.kernels.reference import NON_FINITE_TOKEN, all_finite
from opweave.kernels.sampling import ban_columns
from opweave.ir.tp import Layout, Split


class TPGroup:
    """The TP group `ranks` (global ranks, leader first) seen from rank `ranks[tp_rank]`."""

    def __init__(self, ranks: tuple[int, ...], tp_rank: int, group=None, comm=dist,
                 device: torch.device | str = "cpu"):
        self.ranks, self.tp_rank, self.tp = tuple(ranks), tp_rank, len(ranks)
        self.group, self.comm = (group if self.tp > 1 else None), comm
        self.device = torch.device(device)  # collectives take tensors on the run device (NCCL: CUDA only)

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    # ---------------------------------------------------------------- fan-out from the leader
    def fanout(self, tensors: list[torch.Tensor], src: int | None = None) -> list[torch.Tensor]:
        """Rank `src`'s `tensors` (a global rank of the group, the leader by default) on every rank
        (the others pass buffers of the same shapes)."""
        if self.tp > 1:
            for t in tensors:
                self.comm.broadcast(t, src=self.ranks[0] if src is None else src, group=self.group)
        return tensors

    # ---------------------------------------------------------------- values by layout
    def shard(self, full: torch.Tensor, layout: Layout, dim: int = 2) -> torch.Tensor:
        """This rank's block of a whole value laid out `layout` on dimension `dim`."""
        if self.tp == 1 or not isinstance(layout, Split):
            return full
        blocks = layout.blocks(self.tp, self.tp_rank)
        return torch.cat([full.narrow(dim, start, length) for start, length in blocks], dim=dim).contiguous()

    def gather(self, local: torch.Tensor, layout: Layout, dim: int = 2, dst: int | None = None
               ) -> torch.Tensor | None:
        """The whole value from every rank's block, on rank `dst` only (a global rank of the group,
        the one that sends it; the leader by default; the others get None): one `gather`, not an
        all-gather to every rank. A replicated unit (a KV head several ranks hold) is taken from
        the first rank holding it."""
        if self.tp == 1 or not isinstance(layout, Split):
            return local
        dst = self.ranks[0] if dst is None else dst
        mine = self.ranks[self.tp_rank] == dst
        pieces = [torch.empty_like(local) for _ in range(self.tp)] if mine else None
        self.comm.gather(local.contiguous(), pieces, dst=dst, group=self.group)
        if not mine:
            return None
        out, offset = [], 0
        for (_, length), ranks in zip(layout.blocks(self.tp, 0), layout.sources(self.tp)):
            out += [pieces[r].narrow(dim, offset, length) for r in ranks]
            offset += length
        return torch.cat(out, dim=dim)

    # ---------------------------------------------------------------- collectives of the ops
    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        """Completes row-parallel partial sums in place."""
        if self.tp > 1:
            self.comm.all_reduce(x, group=self.group)
        return x

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` stacked on a new first dim, in group order (one all-gather)."""
        if self.tp == 1:
            return x[None]
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        self.comm.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def sample(self, logits: torch.Tensor, word: torch.Tensor, position: torch.Tensor,
               eos_ids: tuple[int, ...] = (), walk: bool = True) -> torch.Tensor:
        """Temperature / top-k / top-p / min-p sampling over the vocabulary split across the group,
        each row by its sampling word (`opweave.kernels.sampling`), `eos_ids` banned on rows still
        short of their min_tokens; temperature-0 rows take `argmax`'s answer. `walk` False: every
        row is greedy (the vocabulary walk is skipped; the same ids)."""
        from opweave.kernels.sampling import sample

        last = logits[:, -1, :]
        self.prepare_ban(eos_ids, last.shape[-1], last.device)  # made at start-up (`Runtime`), so a no-op here
        offset = self.tp_rank * last.shape[-1]
        return sample(last, word, position, vocab_offset=offset, gather=self.stack,
                      greedy=lambda _: self.argmax(logits), banned=self._ban, walk=walk)

    def records(self, logits: torch.Tensor, draw, word: torch.Tensor, top: int) -> torch.Tensor:
        """Each row's record (`opweave.kernels.logprobs`): the ids `draw()` samples (`sample`) with
        their log-probabilities (or the word's `target`'s) and the `top` most likely tokens', over
        the vocabulary split across the group (one more all-gather)."""
        from opweave.kernels.logprobs import records
        from opweave.kernels.sampling import FIELDS

        last = logits[:, -1, :]
        target = word[:, FIELDS.index("target")] - 1
        return records(last, draw, target, top, vocab_offset=self.tp_rank * last.shape[-1], gather=self.stack)

    def prepare_ban(self, eos_ids: tuple[int, ...], vocab_slice: int, device) -> None:
        """This rank's columns of the EOS ids `sample` bans, for a vocabulary slice of `vocab_slice`
        ids: made once, at start-up (made in a round, they would be a copy from host data, and
        a server's first sampled round can be a decode round: a one-token prompt)."""
        key = (tuple(eos_ids), self.tp_rank * vocab_slice, vocab_slice)
        if getattr(self, "_ban_key", None) != key:
            self._ban_key, self._ban = key, ban_columns(eos_ids, key[1], vocab_slice, device)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sample over a vocabulary split across the group (lowest index wins ties): one
        all-gather of each rank's (max logit, global index) per token. A rank whose slice of a
        row is not all finite sends NaN as its maximum, and a row with a NaN maximum from any
        rank gives NON_FINITE_TOKEN (like `ops.Sample`; decided on the device, no host sync)."""
        last = logits[:, -1, :].float()
        best, idx = last.max(dim=-1)
        best = torch.where(all_finite(last, best), best, float("nan"))
        idx = idx + self.tp_rank * last.shape[-1]
        mine = torch.stack([best.double(), idx.double()])  # vocabulary ids are exact in float64
        gathered = [mine]
        if self.tp > 1:
            gathered = [torch.empty_like(mine) for _ in range(self.tp)]
            self.comm.all_gather(gathered, mine, group=self.group)
        values = torch.stack([g[0] for g in gathered])
        indices = torch.stack([g[1] for g in gathered]).long()
        winner = values.argmax(dim=0)  # first maximum = lowest vocabulary shard
        ids = indices.gather(0, winner[None])[0]
        return torch.where(values.isnan().any(dim=0), NON_FINITE_TOKEN, ids)
