"""`python -m kvledger.cli`: the `kvledger` command from a checkout, without the console script."""

from kvledger.cli.app import app

app()
