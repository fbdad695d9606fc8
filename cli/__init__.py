"""The `kvledger` command line: the Typer app (app.py) and one module per command; wiring only."""
