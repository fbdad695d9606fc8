"""The `kvledger` command line: offline replay and audit of incident logs, the store, the service."""

from __future__ import annotations

import typer

from kvledger.cli.db import db_app
from kvledger.cli.demo import demo_command
from kvledger.cli.export import export_command
from kvledger.cli.proxy import proxy
from kvledger.cli.replay import audit_command, replay_command, timeline_command
from kvledger.cli.serve import serve

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__, pretty_exceptions_enable=False)
app.command("demo")(demo_command)
app.command("replay")(replay_command)
app.command("audit")(audit_command)
app.command("timeline")(timeline_command)
app.command("export")(export_command)
app.command("serve")(serve)
app.command("proxy")(proxy)
app.add_typer(db_app, name="db")


@app.callback()
def main() -> None:
    """kvledger: an event-sourced ledger of KV-cache transfers for vLLM P/D disaggregation."""


if __name__ == "__main__":  # `python -m kvledger.cli.app` (or `python -m kvledger.cli`): the command from a checkout
    app()
