"""Checks of `opweave run`'s inputs made before any rank starts.

A rank that fails on bad input fails after its peers have started, loaded weights and joined the
process group; the same fault found here costs nothing and names the file and line concerned:

- prompts (`check_token_ids`, `check_max_new_tokens`, `parse_prompt_ids`, `check_vocabulary`;
  a prompts file's lines are read by `opweave.runtime.run_io`): token ids are a non-empty list of
  whole numbers (JSON `true` is not one, although Python counts it an int; `1.0` is not one
  either) that fit int64 and lie in the model's vocabulary, and `max_new_tokens` a positive whole
  number;
- the checkpoint (`check_checkpoint`): its own `config.json` describes the model the artifact was
  compiled for (a checkpoint with an extra layer or another `rms_norm_eps` would otherwise run
  with the artifact's figures and give wrong tokens without a word), and its weight files open
  (regular files, safetensors, a readable shard index).
"""

from __future__ import annotations

import dataclasses
import json
import os

from opweave.artifact import VerifiedArtifact, load_artifact
from opweave.errors import OpWeaveError
from opweave.models.checkpoint import CheckpointReader, require_regular_file
from opweave.models.config import ModelConfig
from opweave.models.hf_config import config_from_hf
from opweave.runtime.scheduler import Request

MAX_TOKEN_ID = 2 ** 63 - 1
"""Token ids travel as int64 tensors."""

MAX_PROMPT_LINE_BYTES = 16 << 20
"""A prompts-file line longer than this is refused: a 128k-token prompt is about 1 MB of JSON, and
a file with no line breaks (`--prompts /dev/zero`) must not be read into memory whole."""

NOT_COMPARED = ("name", "dtype", "eos_token_ids", "max_position_embeddings")
"""ModelConfig fields a checkpoint may differ in from the artifact's model_config.json: the
display name; the dtype (weights are cast to the artifact's); the stop ids and the trained
context, which do not change what a step computes (the artifact's govern the run)."""

HF_NAMES = {
    "model_type": "model_type", "vocab_size": "vocab_size", "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
    "sliding_window": "sliding_window", "hidden_act": "hidden_act", "layer_types": "layer_types",
    "tie_word_embeddings": "tie_word_embeddings", "attn_scale": "attention scale (query_pre_attn_scalar)",
    "mlp_types": "MoE layers (decoder_sparse_step, mlp_only_layers)", "moe.num_experts": "num_experts",
    "moe.top_k": "num_experts_per_tok", "moe.intermediate_size": "moe_intermediate_size",
    "moe.norm_topk_prob": "norm_topk_prob", "moe.shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "linear_attn.num_key_heads": "linear_num_key_heads", "linear_attn.num_value_heads": "linear_num_value_heads",
    "linear_attn.key_head_dim": "linear_key_head_dim", "linear_attn.value_head_dim": "linear_value_head_dim",
    "linear_attn.conv_kernel_dim": "linear_conv_kernel_dim",
}
"""Config fields as config.json names them, for messages (others are shown by their path)."""


def check_inputs(cfg, artifact: VerifiedArtifact | None = None) -> None:
    """Every check of a `RunConfig` that needs the artifact: prompts in the vocabulary, and the
    checkpoint (unless the weights are random) matching the compiled model. `artifact`: the
    artifact's files already read and checked (else its model config is read here, checked).

    Raises:
        OpWeaveError: the first problem, naming the file (and line or field) concerned.
    """
    model = artifact_model_config(artifact if artifact is not None else cfg.artifact)
    check_vocabulary(cfg.requests, model.vocab_size)
    if getattr(cfg, "prefill_budget", None) is not None:
        check_prefill_budget(cfg.prefill_budget, artifact if artifact is not None else cfg.artifact)
    if getattr(cfg, "kv_pages", None) is not None:
        check_kv_pages(cfg.kv_pages, artifact if artifact is not None else cfg.artifact)
    if cfg.weights != "random":
        check_checkpoint(cfg.weights, model)
        check_weight_format(cfg.weights, cfg.device)


def check_weight_format(folder: str, device: str) -> None:
    """A published fp8 / MXFP4 checkpoint (`quantization_config`) runs on CPU ranks (read
    dequantized) and on the Triton kernels (held as stored, `models.stored`); before any rank
    starts, a CUDA run is refused in one line where a rank could not hold it as planned: on the
    torch kernels (dequantized, above the planned memory), or where an operator's converted
    matrices have no kernel over the stored format (`OpModule.hold_stored`, on the meta device)."""
    if device != "cuda":
        return
    import torch

    from opweave.models.model import DecodeStep, build_model
    from opweave.models.ops import OpModule
    from opweave.runtime.shard import stored_format

    path = os.path.join(folder, "config.json")
    cfg = config_from_hf(_read_json(path, "checkpoint config"), "checkpoint", where=f"--weights {path}")
    fmt = stored_format(folder, cfg, torch.device("cuda"))
    if fmt is None:
        return
    try:
        for module in DecodeStep(build_model(cfg, "meta")).modules():
            if isinstance(module, OpModule):
                module.hold_stored(fmt)
    except OpWeaveError as e:
        raise OpWeaveError(f"--weights {folder}: {e}") from None


def check_prefill_budget(budget: int, artifact: str | VerifiedArtifact) -> None:
    """`--prefill-budget`: at most the prompt tokens per microbatch the plan sized its activations
    for (a microbatch's rows times the plan's prefill chunk, `passes/plan_memory.py`)."""
    from opweave.ir.program import program_from_json

    if not isinstance(artifact, VerifiedArtifact) or "rank_00.json" not in artifact.files:
        artifact = load_artifact(artifact if isinstance(artifact, str) else artifact.folder, ["rank_00.json"])
    program = program_from_json(artifact.json("rank_00.json"))
    bound = program.microbatch_size * program.prefill_chunk
    if budget > bound:
        raise OpWeaveError(f"--prefill-budget {budget} exceeds what the plan's memory holds: {program.microbatch_size} "
                           f"rows x its prefill chunk of {program.prefill_chunk} = {bound} prompt tokens per "
                           f"microbatch (compile with a larger --prefill-chunk)")


def check_kv_pages(pages: int, artifact: str | VerifiedArtifact) -> None:
    """`--kv-pages`: at most what the plan's memory holds (every slot of a replica at the planned
    context), and only where the scheduler's copy of the pool is every KV rank's
    (`worker.split_pools`)."""
    from opweave.ir.plan import PAGE_TOKENS
    from opweave.ir.program import program_from_json
    from opweave.models.model import DecodeStep, build_model
    from opweave.runtime.pages import pages_for
    from opweave.runtime.worker import split_pools

    if not isinstance(artifact, VerifiedArtifact) or not {"rank_00.json", "plan.json", "ops.json"} <= set(artifact.files):
        folder = artifact if isinstance(artifact, str) else artifact.folder
        artifact = load_artifact(folder, ["rank_00.json", "plan.json", "ops.json", "model_config.json"])
    program = program_from_json(artifact.json("rank_00.json"))
    bound = program.num_microbatches * program.microbatch_size * pages_for(program.context, PAGE_TOKENS)
    if pages > bound:
        raise OpWeaveError(f"--kv-pages {pages} exceeds what the plan's memory holds: {program.num_microbatches} x "
                           f"{program.microbatch_size} slots x {pages_for(program.context, PAGE_TOKENS)} pages of "
                           f"{PAGE_TOKENS} tokens (the context {program.context}) = {bound} pages")
    from opweave.models.hf_config import config_from_hf

    cfg = dataclasses.replace(config_from_hf(artifact.json("model_config.json"), program.model),
                              kv_cache_dtype=program.kv_cache_dtype)
    modules = dict(DecodeStep(build_model(cfg, "meta")).named_modules())
    why = split_pools(artifact, modules)
    if why is not None:
        raise OpWeaveError(f"--kv-pages: not under this plan ({why})")


def _read_json(path: str, what: str):
    require_regular_file(path, what)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise OpWeaveError(f"{path}: cannot read the {what} ({e.strerror})") from None
    except (ValueError, RecursionError) as e:  # truncated, not JSON, not UTF-8
        raise OpWeaveError(f"{path}: the {what} is not valid JSON ({str(e).splitlines()[0]})") from None


def artifact_model_config(artifact: str | VerifiedArtifact) -> ModelConfig:
    """The artifact's model_config.json (from the folder, checked against its manifest, or from
    the files already checked)."""
    if isinstance(artifact, str):
        artifact = load_artifact(artifact, ["model_config.json"])
    path = os.path.join(artifact.folder, "model_config.json")
    return config_from_hf(artifact.json("model_config.json"), "artifact", where=path)


# ---------------------------------------------------------------- the checkpoint


def check_checkpoint(folder: str, model: ModelConfig) -> None:
    """The checkpoint's config.json describes `model` (see NOT_COMPARED), and its weight files
    are regular safetensors files (a shard index, when present, readable and complete)."""
    path = os.path.join(folder, "config.json")
    if not os.path.lexists(path):
        raise OpWeaveError(f"--weights {folder}: no config.json (a checkpoint's config is compared with the "
                           "artifact's before the run)")
    theirs = config_from_hf(_read_json(path, "checkpoint config"), "checkpoint", where=f"--weights {path}")
    mismatch = first_difference(theirs, model)
    if mismatch:
        field, have, want = mismatch
        raise OpWeaveError(f"--weights {folder}: config.json has {field} {_show(have)}, "
                           f"the artifact was compiled for {_show(want)}")
    CheckpointReader(folder)  # every weight file checked and its header read, by name


def _fields(value, prefix: str = "") -> dict[str, object]:
    """A config flattened to dotted paths (nested specs and per-layer-type rope dicts)."""
    if dataclasses.is_dataclass(value):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, dict):
        items = sorted(value.items())
    else:
        return {prefix: value}
    out: dict[str, object] = {}
    for name, item in items:
        if not prefix and name in NOT_COMPARED:
            continue
        out.update(_fields(item, f"{prefix}{name}.") if dataclasses.is_dataclass(item) or isinstance(item, dict)
                   else {f"{prefix}{name}": item})
    return out


def first_difference(theirs: ModelConfig, ours: ModelConfig) -> tuple[str, object, object] | None:
    """(field as config.json names it, checkpoint's value, artifact's value) of the first field in
    which the two configs differ, or None."""
    a, b = _fields(theirs), _fields(ours)
    for key in list(b) + [k for k in a if k not in b]:
        if a.get(key) != b.get(key):
            return _label(key), a.get(key), b.get(key)
    return None


def _label(path: str) -> str:
    if path in HF_NAMES:
        return HF_NAMES[path]
    if path.startswith("rope."):  # rope.<layer type>.<field>
        _, layer_type, field = path.split(".", 2)
        return f"rope {'rope_theta' if field == 'theta' else field} ({layer_type} layers)"
    return path


def _show(value) -> str:
    if isinstance(value, tuple) and len(value) > 8:
        return f"[{', '.join(map(repr, value[:8]))}, ...] ({len(value)} entries)"
    return "none" if value is None else repr(value) if isinstance(value, str) else str(value)


# ---------------------------------------------------------------- prompts


def _kind(value) -> str:
    """What a JSON value is, in words."""
    names = ((bool, "a boolean"), (int, "an integer"), (float, "a floating-point number"), (str, "a string"),
             (list, "a list"), (dict, "an object"))
    return next((name for t, name in names if isinstance(value, t)), "null")


def check_token_ids(ids, where: str, field: str = "prompt_ids") -> list[int]:
    """`ids` as a list of token ids: whole numbers (not booleans, not floats) in [0, 2**63);
    `field` names the list in messages."""
    if not isinstance(ids, list):
        raise OpWeaveError(f"{where}: {field} must be a list of token ids, got {_kind(ids)}")
    if not ids:
        raise OpWeaveError(f"{where}: {field} is empty")
    for i, x in enumerate(ids):
        if type(x) is not int:  # type(True) is bool: a boolean is refused
            raise OpWeaveError(f"{where}: {field}[{i}] is {_kind(x)} ({json.dumps(x)[:40]}), not a token id")
        if not 0 <= x <= MAX_TOKEN_ID:
            raise OpWeaveError(f"{where}: {field}[{i}] = {x} is not a token id "
                               f"({'negative' if x < 0 else 'does not fit int64'})")
    return ids


def check_max_new_tokens(value, where: str) -> int:
    if type(value) is not int or value <= 0:  # type(True) is bool: a boolean is refused
        raise OpWeaveError(f"{where}: max_new_tokens must be a positive whole number, got {json.dumps(value)[:40]}")
    return value


def parse_prompt_ids(text: str, max_new_tokens: int) -> Request:
    """`--prompt-ids 1,2,3` as a Request (index 0), with the prompts file's rules."""
    ids = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        try:
            ids.append(int(piece))
        except ValueError:
            raise OpWeaveError(f"--prompt-ids: {piece[:40]!r} is not a whole number (give ids like 1,2,3)") from None
    if not ids:
        raise OpWeaveError("--prompt-ids: no token ids (give ids like 1,2,3)")
    return Request(index=0, prompt=check_token_ids(ids, "--prompt-ids", field="ids"),
                   max_new_tokens=max_new_tokens, source="--prompt-ids")


def check_vocabulary(requests, vocab_size: int) -> None:
    """Every prompt id below the artifact model's vocabulary size."""
    for r in requests:
        bad = next((x for x in r.prompt if not 0 <= x < vocab_size), None)
        if bad is not None:
            raise OpWeaveError(f"{r.source or f'request {r.index}'}: token id {bad} is outside the model's "
                               f"vocabulary (0 to {vocab_size - 1})")
