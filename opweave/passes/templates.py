"""Stage templates (summary §4, §5.1): where to cut one partition block, and the stages that follow.

Cut sites. Each layer's legal cuts (`OpGraph.cuts` whose `after` falls inside the layer) are named
by site, in token-path order:

    pre_attn    "before core attention"   (q/k/v in)
    post_attn   "after core attention"    (attention output out)
    mid         residual stream after the mixer's residual add (between mixer and FFN)
    end         residual stream after the layer's last op

The residual cut after the embedding belongs to the prologue and the one after the model's last
layer to the epilogue: neither is ever taken (the prologue joins the first stage, the epilogue the
last), so the model's last layer has no `end` site.

Family. A template chooses a set of sites at every block position. Regularity-aware (§5.1): block
positions whose layers have the same `layer_signature` share one site set, so the family is

    product over distinct layer signatures g of 2^|available sites of g|

Gemma-3-27B: 2 signatures (S, F) x 2^4 = 256; Qwen3-Next-80B-A3B: 2 (L, F) x 2^4 = 256;
Llama-3.1, Qwen3-30B-A3B: 1 x 2^4 = 16. Named members: `colocated` (no cut), `afd` (mid + end:
attention half | FFN half), `cad` (pre_attn + post_attn: core attention | rest).

Head layers (`BlockedGraph.num_head_layers`, e.g. DeepSeek-V3's dense first layers) have no
sites: they are never cut and join the first stage with the prologue.

Stages. The template's sites are cut in every block and in the tail layers (block positions
0..r-1); stage i ends at the i-th cut along the token path, so with k cuts per block the stages
of every block with the same slot = i % k have the same op structure (the first carries the
prologue, the last the epilogue, and those ending in tail layers have `block=None`).
"""

from __future__ import annotations

import dataclasses
from itertools import product
from typing import Any, Hashable, Sequence

from opweave.ir.graph import CutPoint, Op, human_bytes
from opweave.passes.blocks import BlockedGraph, layer_signature

SITES = ("pre_attn", "post_attn", "mid", "end")
"""Cut sites of one layer, in token-path order."""

_LETTER = {"full_attention": "F", "sliding_attention": "S", "linear_attention": "L"}
_REASON_SITE = {"before core attention": "pre_attn", "after core attention": "post_attn"}
NAMED = {"colocated": frozenset(), "afd": frozenset({"mid", "end"}), "cad": frozenset({"pre_attn", "post_attn"})}
"""The named templates: the same site set at every block position (where available)."""

FAMILIES = ("all", *NAMED)
MAX_TEMPLATES = 1 << 16
"""`enumerate_templates` refuses larger families (a model without regular layers: 16^L)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Template:
    name: str                                # colocated | afd | cad | e.g. "S:pre_attn+post_attn|F:mid+end"
    family: str                              # colocated | afd | cad | general
    sites: tuple[frozenset[str], ...]        # per block position (layer 0..period-1): chosen cut sites

    @property
    def num_cuts_per_block(self) -> int:
        return sum(len(s) for s in self.sites)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    index: int                 # position along the token path (0 holds the prologue)
    first: int                 # first op index (inclusive)
    last: int                  # last op index (inclusive)
    slot: int                  # index % stages_per_block: equal slots, equal op structure
    block: int | None          # block of the cut that ends this stage (None: tail or last stage)
    layers: tuple[int, ...]    # layers it touches
    out_bytes_per_token: int   # bytes per token crossing the cut that ends it (0 for the last stage)
    signature: tuple           # (per-op keys, has_prologue, has_epilogue): equal => same cost

    @property
    def has_prologue(self) -> bool:
        return self.signature[1]

    @property
    def has_epilogue(self) -> bool:
        return self.signature[2]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    template: Template
    stages: tuple[Stage, ...]
    stages_per_block: int      # template.num_cuts_per_block (1 for colocated)
    blocked: BlockedGraph = dataclasses.field(compare=False, repr=False)   # the IR the stages index


# ---------------------------------------------------------------- sites


def _layer_ops(bg: BlockedGraph) -> list[list[Op]]:
    layers: list[list[Op]] = [[] for _ in range(bg.graph.num_layers)]
    for op in bg.graph.ops:
        if op.layer is not None:
            layers[op.layer].append(op)
    return layers


def layer_cut_sites(bg: BlockedGraph) -> tuple[dict[str, CutPoint], ...]:
    """Per layer: site -> the legal cut there (the model's last layer has no `end`).

    Raises ValueError on a layer with two cuts of one site (an unsupported layer structure).
    """
    layers = _layer_ops(bg)
    owner = {op.index: op.layer for ops in layers for op in ops}
    last_op = {i: ops[-1].index for i, ops in enumerate(layers)}
    out: list[dict[str, CutPoint]] = [{} for _ in layers]
    for cut in bg.graph.cuts:
        layer = owner.get(cut.after)
        if layer is None or cut.after == bg.epilogue.first - 1 or layer < bg.num_head_layers:
            continue   # after the embedding (prologue), in a head layer or before the epilogue: never cut
        if cut.reason in _REASON_SITE:
            site = _REASON_SITE[cut.reason]
        else:
            site = "end" if cut.after == last_op[layer] else "mid"
        if site in out[layer]:
            raise ValueError(f"{bg.graph.model}: layer {layer} has two '{site}' cuts "
                             f"(after ops {out[layer][site].after} and {cut.after})")
        out[layer][site] = cut
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SignatureGroup:
    label: str                     # "S", "F", "L" (with the first position appended if ambiguous)
    positions: tuple[int, ...]     # block positions with this layer signature
    sites: tuple[str, ...]         # available sites (in SITES order)


def signature_groups(bg: BlockedGraph) -> tuple[SignatureGroup, ...]:
    """Block positions grouped by layer signature, with the sites available to each group."""
    layers = _layer_ops(bg)
    cut_sites = layer_cut_sites(bg)
    by_sig: dict[Hashable, list[int]] = {}
    for pos in range(bg.period):
        by_sig.setdefault(layer_signature(layers[bg.num_head_layers + pos]), []).append(pos)
    letters = [_LETTER.get(bg.pattern[ps[0]], bg.pattern[ps[0]]) for ps in by_sig.values()]
    groups = []
    for letter, positions in zip(letters, by_sig.values()):
        label = letter if letters.count(letter) == 1 else f"{letter}{positions[0]}"
        have = {s for layer in range(bg.graph.num_layers) if bg.block_position(layer) in positions
                for s in cut_sites[layer]}
        groups.append(SignatureGroup(label=label, positions=tuple(positions), sites=tuple(s for s in SITES if s in have)))
    return tuple(groups)


# ---------------------------------------------------------------- templates


def _subsets(sites: tuple[str, ...]) -> list[frozenset[str]]:
    return [frozenset(s for s, keep in zip(sites, mask) if keep) for mask in product((0, 1), repeat=len(sites))]


def _sites_text(sites: frozenset[str]) -> str:
    return "+".join(s for s in SITES if s in sites) or "-"


def _template(groups: Sequence[SignatureGroup], choice: Sequence[frozenset[str]], period: int) -> Template:
    sites: list[frozenset[str]] = [frozenset()] * period
    for group, chosen in zip(groups, choice):
        for pos in group.positions:
            sites[pos] = chosen
    for name, named in NAMED.items():
        if all(chosen == named & set(g.sites) for g, chosen in zip(groups, choice)):
            return Template(name=name, family=name, sites=tuple(sites))
    name = "|".join(f"{g.label}:{_sites_text(chosen)}" for g, chosen in zip(groups, choice))
    return Template(name=name, family="general", sites=tuple(sites))


def _order(t: Template) -> tuple:
    return (t.family != "colocated", t.num_cuts_per_block, t.name)


def enumerate_templates(bg: BlockedGraph, family: str = "all") -> tuple[Template, ...]:
    """The regularity-aware template family, or one named template, in a deterministic order.

    Args:
        family: "all" (every template; includes the named ones), "colocated", "afd" or "cad".
    Returns:
        colocated first, then by cuts per block, then by name.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown template family {family!r}; choose one of {', '.join(FAMILIES)}")
    groups = signature_groups(bg)
    if family != "all":
        return (_template(groups, [NAMED[family] & set(g.sites) for g in groups], bg.period),)
    size = 1
    for g in groups:
        size *= 2 ** len(g.sites)
    if size > MAX_TEMPLATES:
        raise ValueError(f"{bg.graph.model}: {size} templates (> {MAX_TEMPLATES}); the layers are too irregular")
    choices = product(*(_subsets(g.sites) for g in groups))
    return tuple(sorted((_template(groups, c, bg.period) for c in choices), key=_order))


def template_by_name(bg: BlockedGraph, name: str) -> Template:
    """A template from its name: colocated | afd | cad | "S:pre_attn+post_attn|F:mid+end"."""
    if name in NAMED:
        return enumerate_templates(bg, name)[0]
    groups = signature_groups(bg)
    chosen: dict[str, frozenset[str]] = {}
    for part in name.split("|"):
        label, _, text = part.partition(":")
        sites = frozenset() if text == "-" else frozenset(text.split("+"))
        group = next((g for g in groups if g.label == label), None)
        if group is None or not sites <= set(group.sites) or label in chosen:
            labels = ", ".join(f"{g.label} ({'+'.join(g.sites)})" for g in groups)
            raise ValueError(f"template {name!r}: bad part {part!r}; groups and their sites: {labels}")
        chosen[label] = sites
    if set(chosen) != {g.label for g in groups}:
        raise ValueError(f"template {name!r} must name every group: {', '.join(g.label for g in groups)}")
    return _template(groups, [chosen[g.label] for g in groups], bg.period)


# ---------------------------------------------------------------- stages


def template_cuts(bg: BlockedGraph, template: Template) -> tuple[CutPoint, ...]:
    """The cuts a template takes, in token-path order (every block and the tail layers)."""
    if len(template.sites) != bg.period:
        raise ValueError(f"template {template.name} has {len(template.sites)} positions, period is {bg.period}")
    cuts = [cut for layer, sites in enumerate(layer_cut_sites(bg)) if layer >= bg.num_head_layers
            for site, cut in sites.items() if site in template.sites[bg.block_position(layer)]]
    return tuple(sorted(cuts, key=lambda c: c.after))


def _stage_signature(bg: BlockedGraph, first: int, last: int) -> tuple:
    ops = bg.graph.ops[first:last + 1]
    return (layer_signature(ops), first <= bg.prologue.last, last >= bg.epilogue.first)


def build_stages(bg: BlockedGraph, template: Template) -> StagePlan:
    """Cuts every block (and the tail) with `template`; stages may span layer and block boundaries."""
    cuts = template_cuts(bg, template)
    per_block = max(template.num_cuts_per_block, 1)
    block_ops_end = bg.blocks[-1].last if bg.blocks else -1
    ops = bg.graph.ops
    bounds = [(c.after, c) for c in cuts] + [(len(ops) - 1, None)]
    stages, first = [], 0
    for index, (last, cut) in enumerate(bounds):
        block = None
        if cut is not None and cut.after <= block_ops_end:
            block = (ops[cut.after].layer - bg.num_head_layers) // bg.period
        layers = tuple(sorted({op.layer for op in ops[first:last + 1] if op.layer is not None}))
        stages.append(Stage(index=index, first=first, last=last, slot=index % per_block, block=block,
                            layers=layers, out_bytes_per_token=cut.bytes_per_token if cut else 0,
                            signature=_stage_signature(bg, first, last)))
        first = last + 1
    return StagePlan(template=template, stages=tuple(stages), stages_per_block=per_block, blocked=bg)


# ---------------------------------------------------------------- printing and JSON


def _tail_layers(bg: BlockedGraph) -> set[int]:
    return set(range(bg.num_head_layers + bg.num_blocks * bg.period, bg.graph.num_layers))


def _representative(plan: StagePlan, slot: int) -> Stage:
    """An interior stage of the slot (neither prologue nor epilogue, ending inside a block)."""
    candidates = [s for s in plan.stages if s.slot == slot]
    interior = [s for s in candidates if s.block is not None and not s.has_prologue and not s.has_epilogue]
    return (interior or candidates)[0]


def _layers_text(layers: Sequence[int]) -> str:
    if not layers:
        return "no layer"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"


def _span(stages: Sequence[Stage]) -> str:
    return ", ".join(str(s.index) for s in stages) or "-"


def format_stages(plan: StagePlan) -> str:
    """Readable stage plan: one representative stage per slot and where the special stages are."""
    bg = plan.blocked
    t, ops = plan.template, bg.graph.ops
    groups = "; ".join(f"{g.label} (positions {','.join(map(str, g.positions))}): "
                       f"{_sites_text(t.sites[g.positions[0]])}" for g in signature_groups(bg))
    lines = [f"Stages of {bg.graph.model} with template {t.name} ({t.family}): {len(plan.stages)} stage(s), "
             f"{plan.stages_per_block} per block",
             f"  sites: {groups}"]
    slots = sorted({s.slot for s in plan.stages})
    for slot in slots:
        s = _representative(plan, slot)
        kinds = " ".join(op.kind.value for op in ops[s.first:s.last + 1])
        where = f"stage {s.index}, {_layers_text(s.layers)}"
        lines.append(f"  slot {slot} ({where}, {s.last - s.first + 1} ops, out {human_bytes(s.out_bytes_per_token)}"
                     f"/tok): {kinds}")
    tail = _tail_layers(bg)
    lines.append(f"  prologue: stage {_span([s for s in plan.stages if s.has_prologue])}; "
                 f"epilogue: stage {_span([s for s in plan.stages if s.has_epilogue])}; "
                 f"tail layers: stage(s) {_span([s for s in plan.stages if tail & set(s.layers)])}")
    distinct = len({s.signature for s in plan.stages})
    lines.append(f"  distinct stage signatures: {distinct}")
    return "\n".join(lines)


def stages_to_json(plan: StagePlan) -> dict[str, Any]:
    """JSON-ready plan; `signature_class` numbers distinct stage signatures by first appearance."""
    classes: dict[Hashable, int] = {}
    stages = []
    for s in plan.stages:
        stages.append({
            "index": s.index, "first": s.first, "last": s.last, "slot": s.slot, "block": s.block,
            "layers": list(s.layers), "out_bytes_per_token": s.out_bytes_per_token,
            "has_prologue": s.has_prologue, "has_epilogue": s.has_epilogue,
            "signature_class": classes.setdefault(s.signature, len(classes)),
        })
    t = plan.template
    return {
        "template": {"name": t.name, "family": t.family,
                     "sites": [[x for x in SITES if x in s] for s in t.sites]},
        "stages_per_block": plan.stages_per_block,
        "num_stages": len(plan.stages),
        "stages": stages,
    }
