#!/usr/bin/env bash
# GPU check for a session that has an NVIDIA GPU (finishes in well under 5 minutes):
#  1. compiles the Triton kernels for real and checks them against the torch references,
#  2. compiles a tiny plan and runs it on CUDA ranks (NCCL) when enough GPUs are present,
#     else one rank's generated module alone on the GPU,
#  3. prints the achieved memory bandwidth of decode attention and the time per decode step.
# Usage: bash bench/gpu_check.sh   (prints a report; commit it under bench/results/)
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch triton -e '.[test]' >/dev/null 2>&1 || true
echo "== $(date -u) $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python - <<'PY'
import time, torch
from opweave.codegen.kernels import get_backend
assert torch.cuda.is_available(), "no CUDA device"
ref, tri = get_backend("torch"), get_backend("triton")
dev = "cuda"
torch.manual_seed(0)
# 1. kernels vs references (bf16 and fp16)
for dtype in (torch.float16, torch.bfloat16):
    x = torch.randn(64, 4096, device=dev, dtype=dtype); w = torch.randn(4096, device=dev, dtype=dtype)
    torch.testing.assert_close(tri.rms_norm(x, w, 1e-6, True), ref.rms_norm(x, w, 1e-6, True), atol=2e-2, rtol=2e-2)
    B, L, Hq, Hkv, D = 16, 4096, 32, 8, 128
    q = torch.randn(B, Hq, D, device=dev, dtype=dtype)
    k = torch.randn(B, L, Hkv, D, device=dev, dtype=dtype); v = torch.randn_like(k)
    pos = torch.full((B,), L - 1, device=dev, dtype=torch.long)
    for window in (None, 1024):
        torch.testing.assert_close(tri.decode_attention(q, k, v, pos, D ** -0.5, window),
                                   ref.decode_attention(q, k, v, pos, D ** -0.5, window), atol=2e-2, rtol=2e-2)
    logits = torch.randn(B, 151936, device=dev, dtype=dtype)
    assert torch.equal(tri.argmax(logits), ref.argmax(logits))
print("kernels match the torch references (fp16, bf16)")
# 3. decode attention bandwidth: KV bytes read per call / time
dtype = torch.bfloat16
B, L, Hq, Hkv, D = 64, 8192, 32, 8, 128
q = torch.randn(B, Hq, D, device=dev, dtype=dtype)
k = torch.randn(B, L, Hkv, D, device=dev, dtype=dtype); v = torch.randn_like(k)
pos = torch.full((B,), L - 1, device=dev, dtype=torch.long)
for _ in range(3):
    tri.decode_attention(q, k, v, pos, D ** -0.5, None)
torch.cuda.synchronize(); t = time.perf_counter(); n = 20
for _ in range(n):
    tri.decode_attention(q, k, v, pos, D ** -0.5, None)
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / n
print(f"decode attention B={B} L={L} Hq={Hq} Hkv={Hkv} D={D}: {dt*1e3:.3f} ms, "
      f"{2 * k.numel() * k.element_size() / dt / 1e12:.2f} TB/s achieved")
PY
# 2. a tiny plan end to end on the GPU (one rank's module alone; NCCL ranks if >= 2 GPUs)
TMP=$(mktemp -d)
python - "$TMP" <<'PY'
import sys
sys.path.insert(0, "tests")
from hf_fixtures import make_tiny_checkpoint
make_tiny_checkpoint("llama", sys.argv[1] + "/ckpt", num_hidden_layers=3)
PY
opweave compile "$TMP/ckpt" --cluster h100x2 --tpot-slo 50ms --context 256 --templates afd --max-batch 4 -o "$TMP/art" --quiet
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
  time opweave run "$TMP/art" --weights "$TMP/ckpt" --prompt-ids 3,10,20,30 --max-new-tokens 8 --device cuda
fi
python "$TMP/art/rank_00.py"
rm -rf "$TMP"
