"""Operator modules: one `nn.Module` per IR op kind (`OpKind`).

Every module here is a torch.fx leaf: the tracer records one `call_module` node per operator and
the IR builder reads the module's `kind`, `layer`, weights (`weight_keys`: parameter -> checkpoint
key) and cost facts (`facts()`). The containers in `opweave.models.model` only wire these together.

Shapes: activations are [B, T, ...] (batch, tokens this step); `positions` is [B, T] int64 with
-1 marking a padding slot (no state is written for it).
Numerics follow Hugging Face transformers (RMSNorm in float32, softmax in float32). The math is
written once, in the kernel library's torch reference (`opweave.kernels.reference`): the
modules hold weights and state and call it. The Gated-DeltaNet operators live in
`opweave.models.ops_linear`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from opweave.kernels import cpu as CPUK
from opweave.kernels import reference as K
from opweave.kernels.paged import PagedKV
from opweave.kernels.reference import NON_FINITE_TOKEN  # noqa: F401  (re-exported)
from opweave.errors import OpWeaveError
from opweave.ir.facts import OpFacts, StateSpec
from opweave.ir.kinds import OpKind, TPRule
from opweave.models.config import ModelConfig, RopeSpec
from opweave.models.stored import hold

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    return _DTYPES[cfg.dtype]


def kv_torch_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype attention caches its keys and values in (`ModelConfig.kv_cache_dtype`)."""
    return torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8" else torch_dtype(cfg)


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def load_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copies a tensor read from a checkpoint (on the host) into `param` in place: the parameter
    keeps its device and dtype (a CUDA module gets its weights on the GPU, not a host tensor)."""
    if tuple(value.shape) != tuple(param.shape):
        raise AssertionError(f"loading a {tuple(value.shape)} tensor into a {tuple(param.shape)} parameter")
    with torch.no_grad():
        param.copy_(value)


class OpModule(nn.Module):
    """Base of all operator modules.

    Subclasses set `kind`, create their parameters (named by attribute, mapped to checkpoint keys
    in `weight_keys`), implement `forward` and `facts`.
    """

    kind: OpKind
    state_attrs: tuple[str, ...] = ()  # per-sequence state tensors, batch-major (set by allocate_state)
    paged = False  # keeps its state in KV pages (`allocate_pages`, `opweave.runtime.pages`), not per slot
    linear_weights: tuple[str, ...] = ()  # 2-D weights read only through `K.linear` (packable on CPU)
    # `linear_weights` that take the same input, as one GEMM where the runtime fuses them (CPU:
    # `kernel_ops.pack_cpu_gemms` sets `fused_weight`, their rows stacked, and `fused_bias`)
    fuse_weights: tuple[str, ...] = ()
    fuse_biases: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, layer: int | None):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.weight_keys: dict[str, str] = {}
        self.tied: dict[str, str] = {}  # parameter -> checkpoint key it shares storage with
        self.register_buffer("fused_weight", None, persistent=False)  # see `fuse_weights`
        self.register_buffer("fused_bias", None, persistent=False)

    def fused_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The `fuse_weights` GEMMs of `x` as one (`fused_weight`), split back into theirs (views)."""
        sizes = [getattr(self, name).shape[0] for name in self.fuse_weights]
        return K.linear(x, self.fused_weight, self.fused_bias).split(sizes, dim=-1)

    def _param(self, attr: str, key: str, *shape: int) -> None:
        setattr(self, attr, nn.Parameter(torch.empty(*shape, dtype=torch_dtype(self.cfg)), requires_grad=False))
        self.weight_keys[attr] = key

    def facts(self) -> OpFacts:
        """Every operator module states its cost facts (the IR copies them onto its `Op`)."""
        raise TypeError(f"operator module {type(self).__name__} must define facts()")

    def weight_numel(self) -> int:
        return sum(p.numel() for name, p in self.named_parameters() if name not in self.tied)

    def load_weights(self, reader) -> None:
        """Copies this op's tensors from a `CheckpointReader` (reads only these keys) into its
        parameters, where they already are (the run device): never replaces them. A matrix held
        as stored (`hold_stored`) reads its stored values and scales."""
        for attr in self.weight_keys:
            self.load_attr(reader, attr)

    def load_attr(self, reader, attr: str) -> None:
        """Loads one of this op's tensors: dense, or as stored where it is held so (`hold_stored`)."""
        key = self.weight_keys[attr]
        if attr in self.held_stored:
            self.load_stored(attr, reader.get_stored(key))
            return
        param = getattr(self, attr)
        load_into(param, reader.get(key, tuple(param.shape)))

    # matrices held as a quantized checkpoint stores them (`opweave.models.stored`)
    stored_methods: tuple[str, ...] = ()  # the formats this module's own matrices are computed from, stored
    # 2-D weights read only through `K.linear`, which computes from stored fp8 (`kernels.stored`)
    stored_linear_weights: tuple[str, ...] = ()

    @property
    def held_stored(self) -> tuple[str, ...]:
        """The parameters held as stored (`hold_stored`): each is two buffers, P_values, P_scales."""
        return getattr(self, "_held_stored", ())

    def hold_stored(self, fmt, strict: bool = True) -> None:
        """On the meta device, before materialising: holds every matrix the checkpoint's format
        `fmt` (`ModelConfig.weight_format`) converts as stored (`models.stored.hold`). A module
        that has such matrices and cannot compute from them (`stored_methods`) is a one-line
        error (`strict`), else keeps them dense."""
        converted = [attr for attr, key in self.weight_keys.items()
                     if attr not in self.tied and fmt.converts(key, getattr(self, attr).dim())]
        if not converted:
            return
        dense = [attr for attr in converted if fmt.method not in self.stored_methods
                 and not (fmt.method == "fp8" and attr in self.stored_linear_weights)]
        if dense:
            if not strict:
                return
            raise OpWeaveError(f"{self.cfg.name}: {self.kind.value} '{self.weight_keys[dense[0]]}' is stored "
                               f"{fmt.method} (quantization_config) and the Triton kernels compute it from dense "
                               "weights only: run on --device cpu (read dequantized), or dequantize the checkpoint")
        for attr in converted:
            hold(self, attr, fmt.method, linear=attr in self.stored_linear_weights)
        self._held_stored = tuple(converted)
        self.stored = fmt.method

    stored: str | None = None  # the format of `held_stored` ("fp8" | "mxfp4")

    def load_stored(self, attr: str, stored: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copies a stored matrix (values, scales) into `attr`_values / `attr`_scales."""
        from opweave.models.stored import SCALES, VALUES

        load_into(getattr(self, attr + VALUES), stored[0])
        load_into(getattr(self, attr + SCALES), stored[1])

    def allocate_state(self, batch: int, max_len: int, device) -> None:
        """Allocates per-sequence state for `batch` slots and `max_len` positions (default: none)."""

    def init_buffers(self) -> None:
        """Recomputes derived buffers after the module is materialised from the meta device."""


def _gemm_facts(op: OpModule, rule: TPRule, units: int) -> OpFacts:
    return OpFacts(flops_per_token=2 * op.weight_numel(), tp_rule=rule, tp_units=units)


class Embed(OpModule):
    kind = OpKind.EMBED

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, None)
        self._param("weight", "model.embed_tokens.weight", cfg.vocab_size, cfg.hidden_size)
        # sqrt(hidden) rounded to the model dtype, as a Python number: no tensor made from host data
        # in the step (a CUDA graph could not capture it)
        self.scale = (float(torch.tensor(cfg.hidden_size ** 0.5, dtype=torch_dtype(cfg), device="cpu"))
                      if cfg.embed_scale else None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.weight)
        if self.scale is not None:
            x = x * self.scale
        return x

    def facts(self) -> OpFacts:
        # a lookup reads one row per token: weights are resident but barely read; every TP rank
        # holds the whole table (opweave.ir.tp)
        return OpFacts(flops_per_token=0, tp_rule=TPRule.REPLICATE, tp_units=self.cfg.vocab_size,
                       active_weight_fraction=1.0)


rms_norm = K.rms_norm


class RMSNorm(OpModule):
    """RMSNorm on the residual stream; `name` is the checkpoint sub-key (e.g. input_layernorm)."""

    kind = OpKind.NORM

    def __init__(self, cfg: ModelConfig, layer: int | None, key: str):
        super().__init__(cfg, layer)
        self.name = key.rsplit(".", 2)[-2] if key.endswith(".weight") else key
        self._param("weight", key, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return CPUK.rms_norm(x, self.weight, self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def facts(self) -> OpFacts:
        return OpFacts(flops_per_token=4 * self.cfg.hidden_size)


class FinalNorm(RMSNorm):
    kind = OpKind.FINAL_NORM

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, None, "model.norm.weight")


class QKVProj(OpModule):
    """q/k/v projections; with `attn_output_gate` q_proj also yields the output gate; with
    `qkv_bias` (Qwen2) each projection adds its bias (`q_proj.bias`…, split by heads like the
    weights' rows).

    Returns (q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D], gate [B,T,Hq*D] or None)."""

    kind = OpKind.QKV_PROJ
    linear_weights = fuse_weights = stored_linear_weights = ("q_weight", "k_weight", "v_weight")
    fuse_biases = ("q_bias", "k_bias", "v_bias")

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        p = layer_prefix(layer) + "self_attn."
        q_out = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
        kv_out = cfg.num_kv_heads * cfg.head_dim
        self._param("q_weight", p + "q_proj.weight", q_out, cfg.hidden_size)
        self._param("k_weight", p + "k_proj.weight", kv_out, cfg.hidden_size)
        self._param("v_weight", p + "v_proj.weight", kv_out, cfg.hidden_size)
        if cfg.qkv_bias:
            self._param("q_bias", p + "q_proj.bias", q_out)
            self._param("k_bias", p + "k_proj.bias", kv_out)
            self._param("v_bias", p + "v_proj.bias", kv_out)
        else:
            self.q_bias = self.k_bias = self.v_bias = None

    def forward(self, x: torch.Tensor):
        cfg = self.cfg
        b, t, _ = x.shape
        if self.fused_weight is not None:
            q, k, v = self.fused_outputs(x)
        else:
            q, k, v = (K.linear(x, self.q_weight, self.q_bias), K.linear(x, self.k_weight, self.k_bias),
                       K.linear(x, self.v_weight, self.v_bias))
        gate = None
        if cfg.attn_output_gate:  # per head: [q (D) | gate (D)]
            q, gate = q.view(b, t, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, t, cfg.num_heads * cfg.head_dim)
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v, gate

    def facts(self) -> OpFacts:
        # two FLOPs per weight of the matrices, one per output for a bias
        flops = 2 * sum(w.numel() for w in (self.q_weight, self.k_weight, self.v_weight))
        flops += sum(b.numel() for b in (self.q_bias, self.k_bias, self.v_bias) if b is not None)
        return OpFacts(flops_per_token=flops, tp_rule=TPRule.HEADS, tp_units=self.cfg.num_heads,
                       kv_heads=self.cfg.num_kv_heads)


class QKNorm(OpModule):
    """Per-head RMSNorm of q and k (before RoPE)."""

    kind = OpKind.QK_NORM

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        p = layer_prefix(layer) + "self_attn."
        self._param("q_weight", p + "q_norm.weight", cfg.head_dim)
        self._param("k_weight", p + "k_norm.weight", cfg.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor):
        eps, off = self.cfg.rms_norm_eps, self.cfg.norm_offset
        return CPUK.rms_norm(q, self.q_weight, eps, off), CPUK.rms_norm(k, self.k_weight, eps, off)

    def facts(self) -> OpFacts:
        c = self.cfg
        return OpFacts(flops_per_token=4 * (c.num_heads + c.num_kv_heads) * c.head_dim,
                       tp_rule=TPRule.HEADS, tp_units=c.num_heads, kv_heads=c.num_kv_heads)


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the rotated part of the head (default, linear, llama3 and yarn rope)."""
    dim = int(head_dim * spec.partial_rotary_factor)
    inv = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if spec.rope_type == "linear":
        inv = inv / spec.factor
    elif spec.rope_type == "llama3":
        old = spec.original_max_position_embeddings
        low_wavelen = old / spec.low_freq_factor
        high_wavelen = old / spec.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
        smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif spec.rope_type == "yarn":
        inv = _yarn_inv_freq(spec, dim, inv)
    return inv


def _yarn_inv_freq(spec: RopeSpec, dim: int, inv: torch.Tensor) -> torch.Tensor:
    """YaRN: dims that turn fewer than `beta_slow` times over the original context are
    interpolated (inv / factor), those turning more than `beta_fast` times kept, a linear ramp
    between (the correction range, rounded outwards to whole dims with `truncate`)."""
    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return dim * math.log(spec.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(spec.theta))

    low, high = dim_of(spec.beta_fast), dim_of(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp: a step
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv / spec.factor * (1 - extrapolate) + inv * extrapolate


class Rope(OpModule):
    """Rotary embedding on q and k at `positions`; partial rotary rotates the first part only;
    cos and sin are scaled by the spec's `attention_factor` (YaRN)."""

    kind = OpKind.ROPE

    def __init__(self, cfg: ModelConfig, layer: int, spec: RopeSpec):
        super().__init__(cfg, layer)
        self.spec = spec
        self.rot_dim = int(cfg.head_dim * spec.partial_rotary_factor)
        self.register_buffer("inv_freq", rope_inv_freq(spec, cfg.head_dim), persistent=False)

    def init_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.spec, self.cfg.head_dim).to(self.inv_freq.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        return CPUK.rope(q, k, positions, self.inv_freq.float(), self.rot_dim, self.spec.attention_factor)

    def facts(self) -> OpFacts:
        c = self.cfg
        return OpFacts(flops_per_token=3 * (c.num_heads + c.num_kv_heads) * self.rot_dim,
                       tp_rule=TPRule.HEADS, tp_units=c.num_heads, kv_heads=c.num_kv_heads)


class Attention(OpModule):
    """Softmax attention over a per-slot KV cache (full, or a sliding-window ring buffer).

    The cache of a sequence slot holds `slots` positions, position p at slot p % slots: the whole
    context for full attention, min(context, window) for a sliding window (exactly the planner's
    `StateSpec.bytes_at(context)`). A one-token step writes its k/v, then attends the cache
    (`decode_attention`); a step of several tokens (a prefill chunk) attends the cache and itself
    in key blocks (`chunk_attention`), then writes its newest keys. Padding (position -1) writes
    nothing; which position a slot holds follows from the sequence's positions, so a reused slot
    never shows a previous request's keys."""

    state_attrs = ("k_cache", "v_cache")

    def __init__(self, cfg: ModelConfig, layer: int, window: int | None):
        super().__init__(cfg, layer)
        self.window = window
        self.kind = OpKind.ATTN_SLIDING if window else OpKind.ATTN_FULL
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def cache_slots(self, context: int) -> int:
        """Positions the cache of one sequence holds at planned `context`."""
        return min(context, self.window) if self.window else context

    def allocate_state(self, batch: int, max_len: int, device) -> None:
        c = self.cfg
        shape = (batch, self.cache_slots(max_len), c.num_kv_heads, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=kv_torch_dtype(c), device=device)
        self.v_cache = torch.zeros(shape, dtype=kv_torch_dtype(c), device=device)

    @property
    def paged(self) -> bool:
        """Full attention keeps its cache in pages (`allocate_pages`); a sliding window keeps its
        ring buffer per slot, bounded by the window."""
        return not self.window

    def allocate_pages(self, pages: int, page_tokens: int, device) -> None:
        """The layer's page pools, `[pages + 1, page_tokens, Hkv, D]`: the last is the null page
        (`opweave.kernels.paged`)."""
        c = self.cfg
        shape = (pages + 1, page_tokens, c.num_kv_heads, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=kv_torch_dtype(c), device=device)
        self.v_cache = torch.zeros(shape, dtype=kv_torch_dtype(c), device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                state: tuple[torch.Tensor, torch.Tensor] | PagedKV | None = None):
        """`state`: the (k cache, v cache) of these rows (the runtime passes a microbatch's
        view), or their pages (`PagedKV`); by default the module's own caches."""
        if isinstance(state, PagedKV):
            return paged_attention(self, q, k, v, positions, state)
        c = self.cfg
        b, t = positions.shape
        k_cache, v_cache = (self.k_cache, self.v_cache) if state is None else state
        if t == 1:
            K.cache_write(k_cache, v_cache, k, v, positions)
            out = K.decode_attention(q[:, 0], k_cache, v_cache, positions[:, 0], c.attn_scale, self.window)
        else:
            out = K.chunk_attention(q, k, v, k_cache, v_cache, positions, c.attn_scale, self.window)
            K.cache_write(k_cache, v_cache, k, v, positions)
        return out.reshape(b, t, c.num_heads * c.head_dim)

    def facts(self) -> OpFacts:
        c = self.cfg
        kv_bytes = 2 * c.num_kv_heads * c.head_dim * c.kv_dtype_bytes
        return OpFacts(
            flops_per_token=0,
            flops_per_context_token=4 * c.num_heads * c.head_dim,  # q·k and p·v
            state=StateSpec(bytes_per_token=kv_bytes, max_tokens=self.window, max_shards=c.num_kv_heads),
            tp_rule=TPRule.HEADS, tp_units=c.num_heads, kv_heads=c.num_kv_heads,
        )


def paged_attention(op: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    kv: PagedKV, kernels=CPUK) -> torch.Tensor:
    """Full attention `op` over its paged cache `kv` (`opweave.kernels.paged`; `kernels`: the module
    of the paged kernels, the Triton ones on CUDA, by default `opweave.kernels.cpu`: its C kernels on
    CPU tensors, the torch reference elsewhere): a one-token step writes, then attends; a chunk
    attends the cache and itself, then writes (a row's first chunk, where `kernels` has
    `causal_attention`, attends itself alone: nothing is cached before it). `op.sinks`, where the
    layer has them (GPT-OSS)."""
    c = op.cfg
    b, t = positions.shape
    sinks = getattr(op, "sinks", None)
    if t == 1:
        kernels.paged_cache_write(kv.k_pages, kv.v_pages, kv.table, k, v, positions)
        out = kernels.paged_decode_attention(q[:, 0], kv.k_pages, kv.v_pages, kv.table, positions[:, 0],
                                             c.attn_scale, kv.span, sinks)
    else:
        if sinks is None and b == 1 and kv.first_chunk(t) and hasattr(kernels, "causal_attention"):
            out = kernels.causal_attention(q, k, v, c.attn_scale)  # a prompt's first chunk: itself only
        else:
            out = kernels.paged_chunk_attention(q, k, v, kv.k_pages, kv.v_pages, kv.table, positions, c.attn_scale,
                                                kv.chunk_span, sinks)
        kernels.paged_cache_write(kv.k_pages, kv.v_pages, kv.table, k, v, positions)
    return out.reshape(b, t, c.num_heads * c.head_dim)


class OProj(OpModule):
    """Output projection of an attention (or Gated-DeltaNet) block, gated by sigmoid(gate) if given."""

    kind = OpKind.O_PROJ
    linear_weights = stored_linear_weights = ("weight",)

    def __init__(self, cfg: ModelConfig, layer: int, key: str, in_features: int):
        super().__init__(cfg, layer)
        self._param("weight", key, cfg.hidden_size, in_features)

    def forward(self, o: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return K.linear(o, self.weight)

    def facts(self) -> OpFacts:
        return _gemm_facts(self, TPRule.ROW, self.weight.shape[1])


class Residual(OpModule):
    kind = OpKind.RESIDUAL

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return x + residual

    def facts(self) -> OpFacts:
        return OpFacts(flops_per_token=self.cfg.hidden_size)


class MLPGateUp(OpModule):
    """Fused gate/up projection of a dense gated MLP: returns (gate, up)."""

    kind = OpKind.MLP_GATE_UP
    linear_weights = fuse_weights = stored_linear_weights = ("gate_weight", "up_weight")

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        p = layer_prefix(layer) + "mlp."
        self._param("gate_weight", p + "gate_proj.weight", cfg.intermediate_size, cfg.hidden_size)
        self._param("up_weight", p + "up_proj.weight", cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor):
        if self.fused_weight is not None:
            return self.fused_outputs(x)
        return K.linear(x, self.gate_weight), K.linear(x, self.up_weight)

    def facts(self) -> OpFacts:
        return _gemm_facts(self, TPRule.COLUMN, self.cfg.intermediate_size)


activation = K.activation


class Act(OpModule):
    """act(gate) * up."""

    kind = OpKind.ACT

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return CPUK.gated_act(gate, up, self.cfg.hidden_act)

    def facts(self) -> OpFacts:
        return OpFacts(flops_per_token=8 * self.cfg.intermediate_size, tp_rule=TPRule.COLUMN,
                       tp_units=self.cfg.intermediate_size)


class MLPDown(OpModule):
    kind = OpKind.MLP_DOWN
    linear_weights = stored_linear_weights = ("weight",)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self._param("weight", layer_prefix(layer) + "mlp.down_proj.weight", cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return K.linear(h, self.weight)

    def facts(self) -> OpFacts:
        return _gemm_facts(self, TPRule.ROW, self.cfg.intermediate_size)


class MoERouter(OpModule):
    """Router: softmax over expert logits (float32), top-k, optional renormalisation.

    Returns (weights [B,T,k] in model dtype, expert ids [B,T,k])."""

    kind = OpKind.MOE_ROUTER

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self._param("weight", layer_prefix(layer) + "mlp.gate.weight", cfg.moe.num_experts, cfg.hidden_size)

    def forward(self, x: torch.Tensor):
        weights, ids = K.moe_route(F.linear(x, self.weight), self.cfg.moe.top_k, self.cfg.moe.norm_topk_prob)
        return weights.to(x.dtype), ids

    def facts(self) -> OpFacts:
        return OpFacts(flops_per_token=2 * self.weight_numel() + 4 * self.cfg.moe.num_experts)


class RoutedExperts(OpModule):
    """Base of the routed-expert modules: the block of experts the module holds.

    A module holds experts [first_expert, first_expert + num_local_experts) of the model's E (its
    weights' leading dimension is num_local_experts): all of them (first 0, count E) unless built
    as an expert-parallel shard (`experts=(first, count)`, `opweave.runtime.shard.rebuild`). Its
    inputs carry global expert ids; `local_ids` maps them to its own, every pair routed elsewhere
    to the sentinel num_local_experts, which the kernels drop (`reference.local_expert_ids`).

    Built with `slots` (global expert ids, one per slot: a GPU of an expert group holding copies,
    `opweave.ir.experts.placement`), it holds those experts in that order and its inputs carry
    slot ids already (its caller, `opweave.runtime.dpexperts`, picks which copy runs a pair)."""

    def __init__(self, cfg: ModelConfig, layer: int, experts: tuple[int, int] | None = None,
                 slots: tuple[int, ...] | None = None):
        super().__init__(cfg, layer)
        if slots is not None:
            if not slots or min(slots) < 0 or max(slots) >= cfg.moe.num_experts or len(set(slots)) != len(slots):
                raise ValueError(f"expert slots {slots}: distinct ids of the model's {cfg.moe.num_experts}")
            self.slots, self.first_expert, self.num_local_experts = tuple(slots), 0, len(slots)
            return
        first, count = (0, cfg.moe.num_experts) if experts is None else experts
        if first < 0 or count < 1 or first + count > cfg.moe.num_experts:
            raise ValueError(f"experts [{first}, {first + count}) outside the model's {cfg.moe.num_experts}")
        self.first_expert, self.num_local_experts = first, count
        self.slots = None

    @property
    def expert_ids(self) -> tuple[int, ...]:
        """The global id of the expert each slot holds."""
        return self.slots if self.slots is not None else tuple(range(self.first_expert,
                                                                     self.first_expert + self.num_local_experts))

    @property
    def is_expert_shard(self) -> bool:
        """Whether the module holds only some of the model's experts."""
        return self.num_local_experts != self.cfg.moe.num_experts or self.slots is not None

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids [..., k] -> this module's (the sentinel for experts it does not hold);
        slot ids as given when built with `slots`."""
        if not self.is_expert_shard or self.slots is not None:
            return ids
        return K.local_expert_ids(ids, self.first_expert, self.num_local_experts)


class MoEExperts(RoutedExperts):
    """Routed experts: sum_k w_k * down_k(silu(gate_k x) * up_k x).

    Stored fused like transformers v5 (`gate_up_proj` [E, 2I, H], gate rows first; `down_proj`
    [E, H, I]); per-expert checkpoints (`experts.{e}.gate_proj.weight` …) are stacked on load
    (an expert-parallel shard reads its own experts' only).
    The compute gathers the k selected experts per token, so shapes never depend on the routing."""

    kind = OpKind.MOE_EXPERTS
    stored_methods = ("fp8",)  # DeepSeek-V3's and Kimi-K2's experts, held as stored on the Triton path

    def __init__(self, cfg: ModelConfig, layer: int, experts: tuple[int, int] | None = None,
                 slots: tuple[int, ...] | None = None):
        super().__init__(cfg, layer, experts, slots)
        m, p = cfg.moe, layer_prefix(layer) + "mlp.experts."
        self.prefix = p
        e = self.num_local_experts
        self._param("gate_up", p + "gate_up_proj", e, 2 * m.intermediate_size, cfg.hidden_size)
        self._param("down", p + "down_proj", e, cfg.hidden_size, m.intermediate_size)

    def hold_stored(self, fmt, strict: bool = True) -> None:
        """As `OpModule.hold_stored`; stored fp8 `gate_up`'s scales are the gate's block rows then
        the up's (`kernels moe_experts_fp8`): 2 ceil(I / 128) rows, not ceil(2 I / 128)."""
        super().hold_stored(fmt, strict)
        if self.stored == "fp8":
            e, two_i, h = self.gate_up_values.shape
            rows, cols = -(-(two_i // 2) // 128), -(-h // 128)
            self.register_buffer("gate_up_scales", torch.empty(e, 2 * rows, cols, device=self.gate_up_values.device))

    def load_weights(self, reader) -> None:
        m, p = self.cfg.moe, self.prefix
        i, h = m.intermediate_size, self.cfg.hidden_size
        if reader.has(self.weight_keys["gate_up"]):
            if self.stored and i % 128:
                raise OpWeaveError(f"{self.cfg.name}: '{self.weight_keys['gate_up']}' is stored fused with {i} "
                                   "channels a matrix: its gate and up fp8 blocks mix (not a multiple of 128)")
            return super().load_weights(reader)
        for local, e in enumerate(self.expert_ids):  # each expert straight into its rows (gate rows first)
            if self.stored:
                self._load_stored_expert(local, [reader.get_stored(f"{p}{e}.{name}_proj.weight")
                                                 for name in ("gate", "up", "down")])
                continue
            load_into(self.gate_up[local, :i], reader.get(f"{p}{e}.gate_proj.weight", (i, h)))
            load_into(self.gate_up[local, i:], reader.get(f"{p}{e}.up_proj.weight", (i, h)))
            load_into(self.down[local], reader.get(f"{p}{e}.down_proj.weight", (h, i)))

    def _load_stored_expert(self, local: int, parts) -> None:
        """One expert's stored gate, up and down (values, scales) into its slot's rows."""
        (gv, gs), (uv, us), (dv, ds) = parts
        i, rows = gv.shape[0], gs.shape[0]
        load_into(self.gate_up_values[local, :i], gv)
        load_into(self.gate_up_values[local, i:], uv)
        load_into(self.gate_up_scales[local, :rows], gs)
        load_into(self.gate_up_scales[local, rows:], us)
        load_into(self.down_values[local], dv)
        load_into(self.down_scales[local], ds)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts_silu(K, self, x, weights, ids)

    def facts(self) -> OpFacts:
        m = self.cfg.moe
        active = m.top_k / m.num_experts
        return OpFacts(flops_per_token=int(2 * self.weight_numel() * active), tp_rule=TPRule.EXPERT_FFN,
                       tp_units=m.intermediate_size, active_weight_fraction=active)


def experts_silu(k, op: MoEExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`op`'s experts on kernel backend `k`: from its dense weights, or from its fp8 values and block
    scales where it holds them as stored (`OpModule.hold_stored`)."""
    if op.stored == "fp8":
        return k.moe_experts_fp8(x, weights, op.local_ids(ids), op.gate_up_values, op.gate_up_scales,
                                 op.down_values, op.down_scales)
    return k.moe_experts(x, weights, op.local_ids(ids), op.gate_up, op.down)


class SharedExpert(OpModule):
    """Always-on expert scaled by sigmoid(shared_expert_gate(x)), added to the routed output."""

    kind = OpKind.SHARED_EXPERT

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        i, h = cfg.moe.shared_expert_intermediate_size, cfg.hidden_size
        p = layer_prefix(layer) + "mlp."
        self._param("gate_weight", p + "shared_expert.gate_proj.weight", i, h)
        self._param("up_weight", p + "shared_expert.up_proj.weight", i, h)
        self._param("down_weight", p + "shared_expert.down_proj.weight", h, i)
        self._param("gate_scale", p + "shared_expert_gate.weight", 1, h)

    def forward(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        h = K.gated_act(F.linear(x, self.gate_weight), F.linear(x, self.up_weight), "silu")
        return routed + torch.sigmoid(F.linear(x, self.gate_scale)) * F.linear(h, self.down_weight)

    def facts(self) -> OpFacts:
        return _gemm_facts(self, TPRule.EXPERT_FFN, self.cfg.moe.shared_expert_intermediate_size)


class LMHead(OpModule):
    kind = OpKind.LM_HEAD
    linear_weights = ("weight",)

    def __init__(self, cfg: ModelConfig, embed: Embed):
        super().__init__(cfg, None)
        if cfg.tie_word_embeddings:
            self.weight = embed.weight  # shared storage: counted once, under the embedding
            self.tied["weight"] = embed.weight_keys["weight"]
        else:
            self._param("weight", "lm_head.weight", cfg.vocab_size, cfg.hidden_size)

    def load_weights(self, reader) -> None:
        key = self.tied.get("weight") or self.weight_keys["weight"]
        load_into(self.weight, reader.get(key, tuple(self.weight.shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.linear(x, self.weight)

    def facts(self) -> OpFacts:
        return OpFacts(flops_per_token=2 * self.weight.numel(), tp_rule=TPRule.VOCAB,
                       tp_units=self.cfg.vocab_size)


class Sample(OpModule):
    """Greedy sampling: argmax of the last position's logits -> next token ids [B]
    (NON_FINITE_TOKEN for a row whose logits are not all finite)."""

    kind = OpKind.SAMPLE

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, None)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return K.argmax(logits[:, -1, :])

    def facts(self) -> OpFacts:
        return OpFacts(flops_per_token=self.cfg.vocab_size, tp_rule=TPRule.VOCAB, tp_units=self.cfg.vocab_size)
