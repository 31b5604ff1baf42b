"""Prefill/decode disaggregation: a prompt's state, computed on a prefill rank, sent to the decode
ranks that will hold its row.

A disaggregated plan (plan.json `"prefill": {"mode": "disaggregated", ...}`) serves with two kinds
of replica set: decode sets, the plan's ranks, and prefill sets, a colocated TP group of the
prefill pool's GPUs (the artifact's `prefill_rank_XX` programs, `opweave.compiler.compile`). A
decode scheduler admits a request into a row and reserves it (`Scheduler(prefill_on=...)`); a
prefill set prefills the prompt as a request that ends at its first output. The step computing
that output is marked for export by its transfer key (below) in the control word's second half
(`Transport.aux`), so every prefill rank knows, after that round, which of its slots to send and
where. The decode scheduler then plans an import step for the row (`pages.encode(imported=True)`:
its prompt's positions are taken, nothing is computed), and every decode rank holding that row
receives its share before the round starts; the row goes on from its first output.

What crosses is each stateful operator's state of the slot (`state_parts`): full attention's
keys and values at the prompt's positions (read from and written to the pages through the block
table), a sliding window's ring, Gated-DeltaNet's conv and recurrent state, MLA's latent rows.
TP may differ on the two sides: a state split by heads (or Gated-DeltaNet's packed channels) is
sent head range by head range, each from the first prefill rank holding it (`routes`), so a
decode rank receives exactly its own heads, one message per (prefill rank, decode rank) pair, in
a process group of its own (gloo on CPU ranks). The two sides compute the same routes from the
rank programs, so no size or offset is ever sent.
"""

from __future__ import annotations

import dataclasses

import torch

from opweave.ir.kinds import OpKind
from opweave.ir.tp import Split

# ---------------------------------------------------------------- the transfer key
_TAG_BITS, _ROW_BITS, _MB_BITS, _SET_BITS = 24, 12, 8, 8


def transfer_key(prefill_set: int, decode_set: int, mb: int, row: int, tag: int) -> int:
    """One transfer's key: the prefill set computing it, the decode set, microbatch and row (of
    the microbatch, global) receiving it, and its tag (unique among the transfers in flight
    between two ranks: the scheduler's count, modulo 2^24)."""
    for name, value, bits in (("prefill set", prefill_set, _SET_BITS), ("decode set", decode_set, _SET_BITS),
                              ("microbatch", mb, _MB_BITS), ("row", row, _ROW_BITS)):
        if not 0 <= value < 1 << bits:
            raise ValueError(f"{name} {value} does not fit a KV transfer key")
    tag = tag % (1 << _TAG_BITS)
    return ((((prefill_set << _SET_BITS | decode_set) << _MB_BITS | mb) << _ROW_BITS | row) << _TAG_BITS) | tag


def parse_key(key: int) -> tuple[int, int, int, int, int]:
    """(prefill set, decode set, microbatch, row, tag) of `transfer_key`."""
    tag = key & ((1 << _TAG_BITS) - 1)
    key >>= _TAG_BITS
    row = key & ((1 << _ROW_BITS) - 1)
    key >>= _ROW_BITS
    mb = key & ((1 << _MB_BITS) - 1)
    key >>= _MB_BITS
    return key >> _SET_BITS, key & ((1 << _SET_BITS) - 1), mb, row, tag


# ---------------------------------------------------------------- what a slot's state is
@dataclasses.dataclass(frozen=True)
class Part:
    """One state tensor of one operator, as a slot holds it: `axis` is the dimension TP splits
    (`layout`, over `size` elements; None: every rank holds all of it)."""

    op: int
    attr: int
    axis: int
    size: int
    layout: Split | None


def state_parts(op: int, module, cfg) -> list[Part]:
    """The parts of operator `op`'s state (`module`, on any rank) for the full model config
    `cfg`: a slot's view of attention's k and v is `[positions, heads, head dim]` (heads on axis
    1), Gated-DeltaNet's conv state `[channels, kernel - 1]` (q, k and v channels packed, split by
    heads each) and recurrent state `[heads, dk, dv]`, MLA's latent rows `[positions, R + Dr]`
    (every rank holds all)."""
    kind = module.kind
    if kind in (OpKind.ATTN_FULL, OpKind.ATTN_SLIDING):
        h = cfg.num_kv_heads
        return [Part(op, a, 1, h, Split((h,), (h,))) for a in range(2)]
    if kind == OpKind.ATTN_MLA:
        return [Part(op, 0, 1, module.row, None)]
    if kind == OpKind.ATTN_LINEAR:
        la = cfg.linear_attn
        qk, v = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
        return [Part(op, 0, 0, 2 * qk + v, Split((qk, qk, v), (la.num_key_heads, la.num_key_heads, la.num_value_heads))),
                Part(op, 1, 0, la.num_value_heads, Split((la.num_value_heads,), (la.num_value_heads,)))]
    raise ValueError(f"op {op}: no KV transfer for state of kind {kind}")


def held(part: Part, tp: int, rank: int) -> list[int]:
    """The indices (of the whole axis) that rank `rank` of a TP group of `tp` holds, in its order."""
    if part.layout is None or tp == 1:
        return list(range(part.size))
    return [i for start, length in part.layout.blocks(tp, rank) for i in range(start, start + length)]


Segment = tuple[Part, int, int, int]  # (part, offset on the sender's axis, offset on the receiver's, length)


def routes(parts: list[Part], send_tp: int, recv_tp: int, recv_rank: int) -> dict[int, list[Segment]]:
    """Per sending TP rank, what it sends rank `recv_rank` of the receiving group: runs of the
    receiver's indices, each from the first sending rank holding it, in `parts` order."""
    out: dict[int, list[Segment]] = {}
    for part in parts:
        where: dict[int, tuple[int, int]] = {}  # whole index -> (first sender holding it, its offset there)
        for s in range(send_tp):
            for offset, i in enumerate(held(part, send_tp, s)):
                where.setdefault(i, (s, offset))
        run = None  # (sender, sender offset, receiver offset, length)
        for dst, i in enumerate(held(part, recv_tp, recv_rank)):
            s, src = where[i]
            if run is not None and run[0] == s and run[1] + run[3] == src:
                run = (s, run[1], run[2], run[3] + 1)
                continue
            if run is not None:
                out.setdefault(run[0], []).append((part, run[1], run[2], run[3]))
            run = (s, src, dst, 1)
        if run is not None:
            out.setdefault(run[0], []).append((part, run[1], run[2], run[3]))
    return out


# ---------------------------------------------------------------- a slot's state on a rank
def _positions(pool, slot: int, length: int, device) -> torch.Tensor:
    """Flat indices into a page pool `[pages + 1, page tokens, ...]` of a slot's first `length` positions."""
    p = pool.page_tokens
    table = torch.tensor(pool.tables[slot][:-(-length // p)], dtype=torch.long)
    pos = torch.arange(length)
    return (table[pos // p] * p + pos % p).to(device)


def read_slot(module, part: Part, state, slot: int, length: int) -> torch.Tensor:
    """Operator state `part` of `slot` (its first `length` positions where paged), as a tensor."""
    t = getattr(module, module.state_attrs[part.attr])
    if getattr(module, "paged", False) and state.pool is not None:
        return t.view(-1, *t.shape[2:]).index_select(0, _positions(state.pool, slot, length, t.device))
    return t[slot]


def write_slot(module, part: Part, state, slot: int, length: int, value: torch.Tensor) -> None:
    t = getattr(module, module.state_attrs[part.attr])
    if getattr(module, "paged", False) and state.pool is not None:
        t.view(-1, *t.shape[2:]).index_copy_(0, _positions(state.pool, slot, length, t.device), value)
    else:
        t[slot].copy_(value)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).cpu()


def pack(modules: dict, segments: list[Segment], state, slot: int, length: int) -> torch.Tensor:
    """A sender's message: its segments' slices of `slot`'s state, as bytes."""
    views = {}
    pieces = []
    for part, src, _, n in segments:
        key = (part.op, part.attr)
        if key not in views:
            views[key] = read_slot(modules[part.op], part, state, slot, length)
        pieces.append(_bytes(views[key].narrow(part.axis, src, n)))
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def message_bytes(modules: dict, segments: list[Segment], state, slot: int, length: int) -> int:
    """The size of `pack`'s message, from the receiver's own tensors (their shapes and dtypes)."""
    total = 0
    for part, _, _, n in segments:
        shape = list(_slot_shape(modules[part.op], part, state, length))
        shape[part.axis] = n
        total += torch.Size(shape).numel() * getattr(modules[part.op], modules[part.op].state_attrs[part.attr]).element_size()
    return total


def _slot_shape(module, part: Part, state, length: int) -> tuple[int, ...]:
    t = getattr(module, module.state_attrs[part.attr])
    if getattr(module, "paged", False) and state.pool is not None:
        return (length, *t.shape[2:])
    return tuple(t.shape[1:])


def unpack(modules: dict, messages: list[tuple[list[Segment], torch.Tensor]], state, slot: int, length: int) -> None:
    """Writes the received messages (each with its segments) into `slot`'s state."""
    staged: dict[tuple[int, int], torch.Tensor] = {}
    for segments, data in messages:
        at = 0
        for part, _, dst, n in segments:
            module = modules[part.op]
            key = (part.op, part.attr)
            t = getattr(module, module.state_attrs[part.attr])
            if key not in staged:
                staged[key] = torch.empty(_slot_shape(module, part, state, length), dtype=t.dtype)
            view = staged[key].narrow(part.axis, dst, n)
            size = view.numel() * t.element_size()
            view.copy_(data[at:at + size].view(t.dtype).view(view.shape))
            at += size
    for (op, attr), value in staged.items():
        module = modules[op]
        write_slot(module, Part(op, attr, 0, 0, None), state, slot, length,
                   value.to(getattr(module, module.state_attrs[attr]).device))
