#!/usr/bin/env bash
# Every CUDA check and GPU figure of the [gpu] issue in one call, for a machine with a CUDA device and a Python
# holding torch (CUDA), triton, numpy, click, pyyaml, safetensors, prometheus-client and pytest (the lent H200's
# image has them all: no install, the repo runs from PYTHONPATH). Run from the repo root:
#   bash benchmarks/device_checks.sh [OUTDIR]          (PYTHON=... to choose the interpreter; default python3)
# 1. pytest -m gpu: the Triton router == the torch reference on CUDA; hooks never sync
#    (torch.cuda.set_sync_debug_mode("error")); counts inside a replayed CUDA graph == a recomputation;
#    layer times from CUDA events; [vllm-gpu]: the vLLM capture path recorded in a CUDA graph and replayed counts
#    exactly (tests/test_vllm_graph.py); [fleet]: two expert-parallel ranks computing on CUDA equal the single-process
#    model (EPLB's weight moves included), and `demo --world-size 2 --device cuda` at deepseek-v3-shape serves on
#    the GPU(s) with NCCL (one GPU per rank) or gloo through host memory (ranks sharing one), counting every token
#    once.
# 2. benchmarks/router_kernel.py --quick: fused kernel vs torch router, T = 1..16384, E = 8..256, k = 2, 8.
# 3. benchmarks/decode_step.py --quick: capture cost on the decode step, eager and CUDA graph, Mixtral- and
#    DeepSeek-V3-shaped layers.
# 4. benchmarks/overhead.py --device cuda: the hook cost per step on the runtime's eager path.
# Each part is bounded by `timeout` (at most 9.5 minutes in all); sized to finish in about 7 on an H200.
set -u -o pipefail
out=${1:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
rc=0
"$py" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" || exit 2
timeout 240 "$py" -m pytest -rs -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_vllm_graph.py 2>&1 | tee "$out/gpu-tests.txt" || rc=1
timeout 100 "$py" benchmarks/router_kernel.py --quick --out "$out/router_kernel.json" || rc=1
timeout 130 "$py" benchmarks/decode_step.py --quick --out "$out/decode_step.json" || rc=1
timeout 90 "$py" benchmarks/overhead.py --device cuda --rounds 3 --out "$out/overhead-cuda.json" || rc=1
exit $rc
