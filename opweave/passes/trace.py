"""torch.fx trace of one decode step -> `OpGraph`.

Steps (each a small function below):
1. build the model on the meta device (no memory, any size) and wrap it in `DecodeStep`;
2. symbolic-trace it with every `OpModule` as a leaf: the graph is then only placeholders,
   one `call_module` per operator, `getitem`s on tuple outputs, and the output;
3. run the graph on meta tensors at batch 1, one token, to size every value (bytes per token);
4. read each operator module's kind, layer, weights and facts into an `Op`;
5. compute the live values across every boundary and keep the legal cut points.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from opweave.errors import OpWeaveError
from opweave.ir.graph import OP_CLASS, CutPoint, Op, OpClass, OpGraph, Weight, verify
from opweave.ir.kinds import OpKind
from opweave.models.model import CausalLM, DecodeStep
from opweave.models.ops import OpModule

SHAPE_CONTEXT = 16
"""Cache length used while sizing values on meta tensors (sizes per token do not depend on it)."""

ATTN_KINDS = (OpKind.ATTN_FULL, OpKind.ATTN_SLIDING, OpKind.ATTN_LINEAR, OpKind.ATTN_MLA)


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, OpModule) or super().is_leaf_module(m, qualname)


def trace_step(model: CausalLM) -> torch.fx.GraphModule:
    """Symbolic trace of one decode step with operator modules as leaves."""
    step = DecodeStep(model)
    try:
        graph = _LeafTracer().trace(step)
    except Exception as e:  # a model.py whose forward is not traceable
        raise OpWeaveError(f"{model.cfg.name}: the decode step is not traceable with torch.fx "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return torch.fx.GraphModule(step, graph)


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class _SizeInterpreter(torch.fx.Interpreter):
    """Runs the graph on meta tensors and records each node's output bytes."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.sizes: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}   # per-token trailing shape of tensor values

    def run_node(self, n: torch.fx.Node):
        out = super().run_node(n)
        self.sizes[n.name] = _nbytes(out)
        if isinstance(out, torch.Tensor) and out.dim() >= 2:
            self.shapes[n.name] = tuple(out.shape[2:])
        return out


def value_sizes(gm: torch.fx.GraphModule, model: CausalLM) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """Bytes of every fx value for one sequence and one token, and the per-token shapes."""
    model.allocate_state(1, SHAPE_CONTEXT, "meta")
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
    positions = torch.zeros(1, 1, dtype=torch.long, device="meta")
    interp = _SizeInterpreter(gm)
    try:
        interp.run(ids, positions)
    except Exception as e:
        raise OpWeaveError(f"{model.cfg.name}: the decode step does not run on meta tensors "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return interp.sizes, interp.shapes


def _value_name(node: torch.fx.Node, op_name: dict[str, str]) -> str:
    """IR name of an fx value: '<op>' for a module output, '<op>[i]' for a tuple element."""
    if node.op == "call_function" and node.target is operator.getitem:
        return f"{_value_name(node.args[0], op_name)}[{node.args[1]}]"
    return op_name.get(node.name, node.name)


def _op_from_node(index: int, node: torch.fx.Node, module: OpModule, inputs: tuple[str, ...],
                  act_bytes: int) -> Op:
    facts = module.facts()
    fmt = module.cfg.weight_format  # a published format (fp8, mxfp4): the bytes as stored

    def dtype(key: str, p) -> str:
        return fmt.dtype if fmt is not None and fmt.converts(key, p.dim()) else str(p.dtype).removeprefix("torch.")

    weights = tuple(
        Weight(name=key, shape=tuple(p.shape), dtype=dtype(key, p), tied=attr in module.tied)
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False)
        for key in (module.tied.get(attr) or module.weight_keys[attr],))
    return Op(
        index=index, name=str(node.target), kind=module.kind, cls=OP_CLASS.get(module.kind, OpClass.LIGHT),
        layer=module.layer, inputs=inputs, weights=weights,
        active_weight_fraction=facts.active_weight_fraction, flops_per_token=facts.flops_per_token,
        flops_per_context_token=facts.flops_per_context_token, act_bytes_per_token=act_bytes,
        state=facts.state, tp_rule=facts.tp_rule, tp_units=facts.tp_units,
        kv_heads=facts.kv_heads,
    )


def _cut_reason(ops: tuple[Op, ...], after: int) -> str | None:
    """Why the boundary after op `after` is a legal cut (None: not one)."""
    left, right = ops[after], ops[after + 1]
    if left.kind in (OpKind.EMBED, OpKind.RESIDUAL):
        return "residual stream"
    if right.kind in ATTN_KINDS:
        return "before core attention"
    if left.kind in ATTN_KINDS:
        return "after core attention"
    return None


def build_graph(model: CausalLM) -> OpGraph:
    """Traces `model`'s decode step into a verified OpGraph."""
    gm = trace_step(model)
    sizes, shapes = value_sizes(gm, model)
    modules = dict(gm.named_modules())
    inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    op_name: dict[str, str] = {}
    ops: list[Op] = []
    producer: dict[str, int] = {}        # value name -> op index (graph inputs: -1)
    value_bytes: dict[str, int] = {}
    value_shape: dict[str, tuple[int, ...]] = {}
    consumers: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            producer[node.name] = -1
        elif node.op == "call_module" and isinstance(modules[node.target], OpModule):
            index = len(ops)
            op_name[node.name] = str(node.target)
            args = [a for a in node.args if a is not None]
            if len(node.kwargs) or not all(isinstance(a, torch.fx.Node) for a in args):
                raise OpWeaveError(f"{model.cfg.name}: operator {node.target} takes a constant or keyword "
                                   "argument; operator modules take only tensors, positionally")
            in_values = tuple(_value_name(a, op_name) for a in args)
            act = sum(sizes[a.name] for a in args if a.op != "placeholder") + sizes[node.name]
            ops.append(_op_from_node(index, node, modules[node.target], in_values, act))
            for a, v in zip(args, in_values):
                value_bytes[v] = sizes[a.name]
                value_shape[v] = shapes.get(a.name, ())
                consumers.setdefault(v, []).append(index)
            producer[str(node.target)] = index
        elif node.op == "call_function" and node.target is operator.getitem:
            continue
        elif node.op == "output":
            continue
        else:
            raise OpWeaveError(f"{model.cfg.name}: compute outside an operator module in the decode step "
                               f"({node.op} {node.target}); build models from opweave.models.ops modules")
    ops_t = tuple(ops)
    cuts = []
    for after in range(len(ops_t) - 1):
        reason = _cut_reason(ops_t, after)
        if reason is None:
            continue
        live = sorted(v for v, users in consumers.items()
                      if producer.get(v.split("[")[0], -1) >= 0 and producer[v.split("[")[0]] <= after
                      and max(users) > after)
        cuts.append(CutPoint(after=after, bytes_per_token=sum(value_bytes[v] for v in live),
                             values=tuple(live), value_shapes=tuple(value_shape[v] for v in live), reason=reason))
    cfg = model.cfg
    graph = OpGraph(model=cfg.name, family=cfg.family, dtype=cfg.dtype, num_layers=cfg.num_layers,
                    layer_types=cfg.layer_types, inputs=inputs, ops=ops_t, cuts=tuple(cuts))
    return verify(graph)
