#!/usr/bin/env bash
# vLLM 0.33.0 beside the CPU build, for the scheduler contract tests only (scripts/test_vllm033.sh).
#
# 0.33.0 exists only as a CUDA wheel. Its Python scheduler and KV-connector interface run on the CPU,
# but its engine does not, and its torch pin (2.14) would replace the CPU torch 2.13 that the 0.32 CPU
# engine in site-packages needs. So the wheel goes, without its dependencies, into a folder of its own
# (.vllm033/, ignored by git) that only the 0.33 test run puts first on PYTHONPATH; site-packages
# keeps vLLM 0.32 and everything else. The packages of its requirements/common.txt that the scheduler
# imports are already in site-packages (installed for 0.32); nothing is added there.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${KVLEDGER_VLLM033_DIR:-.vllm033}"
VERSION=0.33.0

installed() {
  PYTHONPATH="$TARGET" python -c "import sys, vllm; sys.exit(vllm.__version__ != sys.argv[1])" "$VERSION" >/dev/null 2>&1
}

if ! [ -f "$TARGET/vllm/__init__.py" ] || ! installed; then
  rm -rf "$TARGET"
  python -m pip install -q --disable-pip-version-check --no-deps --target "$TARGET" "vllm==$VERSION"
fi
# What the tests need from it: the scheduler and the connector interface import beside the CPU torch.
PYTHONPATH="$TARGET" VLLM_TARGET_DEVICE=cpu python - "$TARGET" "$VERSION" <<'PY'
import os, sys

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

target, version = sys.argv[1:]
assert vllm.__version__ == version, vllm.__version__
assert os.path.realpath(vllm.__file__).startswith(os.path.realpath(target)), vllm.__file__
PY
