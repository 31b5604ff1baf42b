"""A model defined in Python: `opweave dump examples/tiny_gemma3.py --what blocks`.

`build_model()` returns an opweave `CausalLM` built from OpWeave's operator modules; here a small
Gemma-3-style configuration (12 layers: two blocks of 5 sliding-window + 1 global layer) on the
meta device, which is enough for tracing, planning and cost analysis.
"""

from opweave.models.hf_config import config_from_hf
from opweave.models.model import build_model as _build

CONFIG = {
    "model_type": "gemma3_text", "torch_dtype": "bfloat16",
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 12,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "sliding_window": 512,
    "query_pre_attn_scalar": 128, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
}


def build_model():
    return _build(config_from_hf(CONFIG, "tiny-gemma3"), device="meta")
