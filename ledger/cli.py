"""The `kvledger` command line: offline replay and audit of incident logs."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


@app.callback()
def main() -> None:
    """kvledger: an event-sourced ledger of KV-cache transfers for vLLM P/D disaggregation."""
