from kvledger.ledger import compiled as _compiled

_compiled.install()  # before anything imports the fold: which build of it loads (ledger/compiled.py)
