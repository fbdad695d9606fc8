#!/usr/bin/env bash
# The README's test command: installs what the tests need, starts the services they use, then runs the whole
# suite (ruff, mypy and every benchmark's --quick run included, as tests) on vLLM 0.32 in three pytest-xdist
# workers, and the scheduler contract tests again on vLLM 0.33. KVLEDGER_TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."

export KVLEDGER_TEST_PG_URL="${KVLEDGER_TEST_PG_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}"
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"

bash scripts/ensure_postgres.sh
bash scripts/ensure_chromium.sh
command -v valgrind >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q valgrind; }  # benchmarks/instructions.py

pip_install() { python -m pip install -q --disable-pip-version-check "$@"; }

# The CPU build of torch lies on these machines' disk; asking for it by version takes it.
pip_install "torch==2.13.0" || pip_install torch
bash scripts/install_vllm.sh
bash scripts/install_vllm033.sh
pip_install -e '.[test]'
# NATS with JetStream for the nats:// store's tests: the one at 127.0.0.1:4222 when it answers, else one started here.
export KVLEDGER_TEST_NATS_URL="${KVLEDGER_TEST_NATS_URL:-$(bash scripts/ensure_nats.sh)}"

# Three workers on two cores: the vLLM tests wait on engines starting and on sockets, and a third worker fills
# those waits (the suite ran in 522 s against 542-570 s with two).
WORKERS="${KVLEDGER_TEST_WORKERS:-3}"
# mypy's cache outside the checkout: a fresh clone checks only what changed against it (site-packages included).
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvledger/mypy}"
# worksteal: a worker left idle takes tests queued on the other, so minute-long vLLM tests do not end the run alone.
DIST=(); [ "$WORKERS" != "0" ] && DIST=(--dist worksteal)
# vLLM 0.32 (site-packages, the CPU build): the whole suite, real engines included, on the compiled fold and
# scheduler hooks (`pip install -e .` above built them; a machine without a C compiler runs them interpreted).
# The interpreted build is not run as a second whole suite: tests/ledger/test_both_builds.py and
# tests/connector/test_both_builds.py run both builds side by side and compare them, in this run.
# `huge` (millions of events a test) is left out; `-m huge` among the arguments runs it (the last -m wins).
python -m pytest -n "$WORKERS" ${DIST[@]+"${DIST[@]}"} --durations=15 -m "not huge" "$@"
# vLLM 0.33 (the CUDA wheel's Python scheduler, on this CPU): the scheduler contract and adapter tests.
bash scripts/test_vllm033.sh -q -n "$WORKERS"
