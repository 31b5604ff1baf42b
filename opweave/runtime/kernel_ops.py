"""Operators backed by the kernel library (`opweave.kernels`).

On CUDA the runtime wraps the operators that have kernels so the generated code calls the Triton
kernels; on CPU it keeps the torch operator modules. `OPWEAVE_KERNELS=triton|torch` forces a
backend (with `TRITON_INTERPRET=1`, Triton runs on CPU: that is how the tests check this path).
Paged full attention (`opweave.kernels.paged`) runs the backend's paged kernels, decode and
prefill chunks; a sliding window's ring buffer uses the decode kernel for one-token steps (its
chunks stay on the operator module, whose math is the torch reference kernels); the Gated-DeltaNet
module runs its recurrence with the backend's `gdn_step`.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from opweave.kernels import cpu as CPUK
from opweave.kernels import backend_name, get_backend
from opweave.kernels import paged as PK
from opweave.kernels.paged import PagedKV
from opweave.kernels.reference import cache_write, can_pack_linear, pack_linear
from opweave.ir.kinds import OpKind
from opweave.models.ops import OpModule, paged_attention


def kernel_backend(device: torch.device) -> str:
    """`opweave.kernels.backend_name`: the forced backend, else the device's."""
    return backend_name(device)


class KernelOp(nn.Module):
    """Wraps one operator module: same inputs and outputs, computed by kernels."""

    def __init__(self, op: OpModule, k):
        super().__init__()
        self.op, self.k = op, k
        self.kind = op.kind

    def forward(self, *args, state=None):
        """`state`: a stateful operator's per-sequence state for these rows (see
        `opweave.runtime.state`), passed on to the operator; None for the others."""
        op, k, kind = self.op, self.k, self.kind
        if kind in (OpKind.NORM, OpKind.FINAL_NORM):
            return k.rms_norm(args[0], op.weight, op.cfg.rms_norm_eps, op.cfg.norm_offset)
        if kind == OpKind.QK_NORM:
            q, kk = args
            eps, off = op.cfg.rms_norm_eps, op.cfg.norm_offset
            return k.rms_norm(q, op.q_weight, eps, off), k.rms_norm(kk, op.k_weight, eps, off)
        if kind == OpKind.ROPE:
            q, kk, positions = args
            return k.rope(q, kk, positions, op.inv_freq.float(), op.rot_dim, op.spec.attention_factor)
        if kind == OpKind.ACT:
            return k.gated_act(args[0], args[1], op.cfg.hidden_act)
        if kind == OpKind.MOE_ROUTER and op.cfg.moe.scoring != "softmax":  # DeepSeek-V3's grouped router: torch
            return op(*args)
        if kind == OpKind.ATTN_MLA:  # latent attention: the module around the backend's decode kernel
            return op(*args, kernels=k, state=state)
        if kind == OpKind.MOE_ROUTER:
            weights, ids = k.moe_route(F.linear(args[0], op.weight, getattr(op, "bias", None)), op.cfg.moe.top_k,
                                       op.cfg.moe.norm_topk_prob)
            return weights.to(args[0].dtype), ids
        if kind == OpKind.MOE_EXPERTS:  # (fp8 experts as stored, where held so)
            from opweave.models.ops import experts_silu

            return experts_silu(k, op, *args)
        if kind == OpKind.MOE_EXPERTS_SWIGLU:  # GPT-OSS (its MXFP4 experts as stored, where held so)
            from opweave.models.ops_gpt_oss import experts_swiglu

            return experts_swiglu(k, op, *args)
        if kind == OpKind.SAMPLE:
            return k.argmax(args[0][:, -1, :])
        if kind == OpKind.ATTN_FULL and isinstance(state, PagedKV):  # the backend's paged kernels
            return paged_attention(op, *args, state, kernels=k if hasattr(k, "paged_decode_attention") else PK)
        if kind in (OpKind.ATTN_FULL, OpKind.ATTN_SLIDING) and args[3].shape[1] == 1:
            return self._decode_attention(*args, state=state)
        if kind == OpKind.ATTN_LINEAR:  # the module's conv and gates around the backend's recurrence
            return op(*args, kernels=k, state=state)
        return op(*args) if state is None else op(*args, state=state)

    def _decode_attention(self, q, kk, v, positions, state=None):
        op = self.op
        k_cache, v_cache = (op.k_cache, op.v_cache) if state is None else state
        cache_write(k_cache, v_cache, kk, v, positions)  # ring buffer: position p at slot p % slots
        out = self.k.decode_attention(q[:, 0], k_cache, v_cache, positions[:, 0], op.cfg.attn_scale, op.window,
                                      getattr(op, "sinks", None))
        return out.reshape(positions.shape[0], 1, -1)

    # the wrapped module's attributes (kind, layer, state_attrs, its default state...) read through
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.op, name)


KERNEL_KINDS = (OpKind.NORM, OpKind.FINAL_NORM, OpKind.QK_NORM, OpKind.ROPE, OpKind.ACT, OpKind.MOE_ROUTER,
                OpKind.MOE_EXPERTS, OpKind.MOE_EXPERTS_SWIGLU, OpKind.SAMPLE, OpKind.ATTN_FULL, OpKind.ATTN_SLIDING, OpKind.ATTN_LINEAR,
                OpKind.ATTN_MLA)


def device_kernels(device: torch.device):
    """The kernel backend module the runtime uses on `device` (resolved once per rank): on a CPU
    rank of the torch backend, `opweave.kernels.cpu` (its C kernels where they apply, the torch
    reference for the rest)."""
    name = kernel_backend(device)
    if name == "torch" and device.type == "cpu":
        return CPUK
    return get_backend(name)


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor, kernels
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm op `norm` of the sum in one kernel (`add_rms_norm` of the
    backend module `kernels`): (sum, normed), exactly what the two ops give on the torch backend."""
    normed, summed = kernels.add_rms_norm(x, residual, norm.weight, norm.cfg.rms_norm_eps, norm.cfg.norm_offset)
    return summed, normed


def pack_cpu_gemms(ops: dict[int, OpModule], device: torch.device) -> int:
    """On the CPU's torch backend, each operator's `linear_weights` in oneDNN's packed layout
    (`reference.pack_linear`, as vLLM's CPU backend packs its weights): the same bytes, faster
    decode GEMMs; those of one input (`fuse_weights`: q/k/v, gate/up) as one GEMM (`_fuse`).
    A weight another module shares (a tied LM head) stays as it is. Returns how many weights
    were packed (0 elsewhere, or without oneDNN)."""
    if device.type != "cpu" or kernel_backend(device) != "torch" or not can_pack_linear():
        return 0
    shared: dict[int, int] = {}  # by storage: a TP shard of a tied weight is a view at an offset
    for m in ops.values():
        for p in m.parameters(recurse=False):
            key = p.untyped_storage().data_ptr()
            shared[key] = shared.get(key, 0) + 1
    dtypes = (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
    packed = 0
    for m in ops.values():
        packed += _fuse(m, dtypes, shared)
        for name in m.linear_weights:
            w = m._parameters.get(name)
            if (w is None or w.dim() != 2 or w.dtype not in dtypes or w.is_meta
                    or shared.get(w.untyped_storage().data_ptr(), 0) > 1):
                continue
            try:
                weight = pack_linear(w)
            except RuntimeError:  # this CPU lacks what oneDNN needs for the dtype: keep it dense
                continue
            del m._parameters[name]
            m.register_buffer(name, weight, persistent=False)
            packed += 1
    return packed


def _fuse(m: OpModule, dtypes: tuple, shared: dict[int, int]) -> int:
    """An operator's `fuse_weights` (GEMMs of one input: q/k/v, gate/up) as one packed GEMM: their
    rows stacked into `fused_weight` (and their biases into `fused_bias`); each is left as a meta
    tensor of its shape, so the module's bytes stay what the plan counted. Returns how many weights
    it took (0: none, when any of them cannot be packed)."""
    ws = [m._parameters.get(name) for name in m.fuse_weights]
    if not ws or any(w is None or w.dim() != 2 or w.dtype not in dtypes or w.is_meta or w.dtype != ws[0].dtype
                     or w.shape[1] != ws[0].shape[1] or shared.get(w.untyped_storage().data_ptr(), 0) > 1
                     for w in ws):
        return 0
    biases = [getattr(m, name, None) for name in m.fuse_biases]
    if any(b is not None for b in biases) and any(b is None for b in biases):
        return 0
    try:
        weight = pack_linear(torch.cat([w.detach() for w in ws]))
    except RuntimeError:  # this CPU lacks what oneDNN needs for the dtype: keep them apart
        return 0
    if biases and biases[0] is not None:
        m.fused_bias = torch.cat([b.detach() for b in biases])
    for name, w in zip(m.fuse_weights, ws):
        del m._parameters[name]
        m.register_buffer(name, torch.empty(w.shape, dtype=w.dtype, device="meta"), persistent=False)
    m.fused_weight = weight
    return len(ws)


def with_kernels(ops: dict[int, OpModule], device: torch.device) -> dict[int, nn.Module]:
    """The rank's operators, those with kernels wrapped when the backend is not plain torch."""
    if kernel_backend(device) == "torch":
        return ops
    k = device_kernels(device)
    return {i: KernelOp(m, k) if m.kind in KERNEL_KINDS else m for i, m in ops.items()}
