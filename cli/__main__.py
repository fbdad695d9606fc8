"""`python -m cli`: the `kvledger` command from a checkout, without the console script."""

from cli.app import app

app()
