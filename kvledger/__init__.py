"""kvledger: an event-sourced ledger of KV-cache transfers for vLLM prefill/decode disaggregation.

Installed, the project is this one package: kvledger.ledger (the fold, the store), kvledger.connector (vLLM's
`kv_connector_module_path`), kvledger.api (the audit service), kvledger.cli (the `kvledger` command),
kvledger.proxy and kvledger.migrations (Alembic's scripts). The repository keeps them as top-level folders:
setup.py maps each to its name here for a wheel, and the links beside this file show them under it to Python (a
checkout, an editable install), mypy and Cython.
"""
