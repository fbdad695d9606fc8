#!/usr/bin/env bash
# The scheduler contract tests (tests/e2e/test_scheduler_*.py: vLLM's real Scheduler driving
# LedgerConnector) and the adapter tests (tests/connector/test_*adapter.py: vLLM's factory and types,
# two engines' workers over tcp) and observe mode's scheduler-side tests on vLLM 0.33.0, from .vllm033/ (scripts/install_vllm033.sh) put first
# on PYTHONPATH.
# The main run covers vLLM 0.32 (site-packages); 0.33's engine does not run on the CPU, so its
# end-to-end tests are not run here. KVLEDGER_EXPECT_VLLM makes every test fail if another vLLM loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${KVLEDGER_VLLM033_DIR:-.vllm033}"
if ! [ -f "$TARGET/vllm/__init__.py" ]; then
  echo "vLLM 0.33.0 is not installed in $TARGET: run scripts/install_vllm033.sh" >&2
  exit 2
fi
export PYTHONPATH="$(realpath "$TARGET")${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 KVLEDGER_EXPECT_VLLM=0.33.0
echo "== scheduler contract and adapter tests on vLLM $KVLEDGER_EXPECT_VLLM ($TARGET) =="
exec python -m pytest -p no:cacheprovider tests/e2e/test_scheduler_*.py tests/connector/test_*adapter.py \
  tests/e2e/test_observe_nixl.py tests/e2e/test_observe_mooncake.py tests/e2e/test_observe_delegation.py \
  tests/e2e/test_observe_prom.py "$@"
