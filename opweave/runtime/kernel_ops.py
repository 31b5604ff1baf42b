"""Operators backed by the kernel library (`opweave.codegen.kernels`).

On CUDA the runtime wraps the operators that have kernels so the generated code calls the Triton
kernels; on CPU it keeps the torch operator modules. `OPWEAVE_KERNELS=triton|torch` forces a
backend (with `TRITON_INTERPRET=1`, Triton runs on CPU: that is how the tests check this path).
Decode attention uses the kernel for one-token steps; prefill steps (several tokens) and the
Gated-DeltaNet recurrence stay on the operator module.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from opweave import config
from opweave.codegen.kernels import get_backend
from opweave.ir.kinds import OpKind
from opweave.models.ops import OpModule


def kernel_backend(device: torch.device) -> str:
    forced = config.kernels_forced()
    if forced:
        return forced
    return "triton" if device.type == "cuda" else "torch"


class KernelOp(nn.Module):
    """Wraps one operator module: same inputs and outputs, computed by kernels."""

    def __init__(self, op: OpModule, k):
        super().__init__()
        self.op, self.k = op, k
        self.kind = op.kind

    def forward(self, *args):
        op, k, kind = self.op, self.k, self.kind
        if kind in (OpKind.NORM, OpKind.FINAL_NORM):
            return k.rms_norm(args[0], op.weight, op.cfg.rms_norm_eps, op.cfg.norm_offset)
        if kind == OpKind.QK_NORM:
            q, kk = args
            eps, off = op.cfg.rms_norm_eps, op.cfg.norm_offset
            return k.rms_norm(q, op.q_weight, eps, off), k.rms_norm(kk, op.k_weight, eps, off)
        if kind == OpKind.ROPE:
            q, kk, positions = args
            return k.rope(q, kk, positions, op.inv_freq.float(), op.rot_dim)
        if kind == OpKind.ACT:
            return k.gated_act(args[0], args[1], op.cfg.hidden_act)
        if kind == OpKind.MOE_ROUTER:
            weights, ids = k.moe_route(F.linear(args[0], op.weight), op.cfg.moe.top_k, op.cfg.moe.norm_topk_prob)
            return weights.to(args[0].dtype), ids
        if kind == OpKind.MOE_EXPERTS:
            return k.moe_experts(args[0], args[1], args[2], op.gate_up, op.down)
        if kind == OpKind.SAMPLE:
            return k.argmax(args[0][:, -1, :])
        if kind in (OpKind.ATTN_FULL, OpKind.ATTN_SLIDING) and args[3].shape[1] == 1:
            return self._decode_attention(*args)
        return op(*args)

    def _decode_attention(self, q, kk, v, positions):
        op = self.op
        b = positions.shape[0]
        max_len = op.k_cache.shape[1] - 1
        rows = torch.arange(b, device=q.device)[:, None]
        slots = torch.where(positions >= 0, positions, max_len)
        op.k_cache[rows, slots] = kk
        op.v_cache[rows, slots] = v
        out = self.k.decode_attention(q[:, 0], op.k_cache[:, :max_len], op.v_cache[:, :max_len], positions[:, 0],
                                      op.cfg.attn_scale, op.window)
        return out.reshape(b, 1, -1)

    # the runtime switches microbatch state on the wrapped module
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.op, name)


KERNEL_KINDS = (OpKind.NORM, OpKind.FINAL_NORM, OpKind.QK_NORM, OpKind.ROPE, OpKind.ACT, OpKind.MOE_ROUTER,
                OpKind.MOE_EXPERTS, OpKind.SAMPLE, OpKind.ATTN_FULL, OpKind.ATTN_SLIDING)


def with_kernels(ops: dict[int, OpModule], device: torch.device) -> dict[int, nn.Module]:
    """The rank's operators, those with kernels wrapped when the backend is not plain torch."""
    backend = kernel_backend(device)
    if backend == "torch":
        return ops
    k = get_backend(backend)
    return {i: KernelOp(m, k) if m.kind in KERNEL_KINDS else m for i, m in ops.items()}
