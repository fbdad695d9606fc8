#!/usr/bin/env bash
# The README's test command: installs what the tests need, starts the services
# they use, then runs the whole suite (ruff and mypy included, as tests).
set -euo pipefail
cd "$(dirname "$0")/.."

export KVLEDGER_TEST_PG_URL="${KVLEDGER_TEST_PG_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}"

bash scripts/ensure_postgres.sh

# The CPU build of torch lies on these machines' disk; asking for it by version takes it.
python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
python -m pip install -q -e '.[test]'

python -m pytest "$@"
