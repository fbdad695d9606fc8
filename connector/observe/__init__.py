"""Observe mode: LedgerConnector wraps another KV connector (NIXL, MoRIIO, Mooncake, ...) and records what it does.

Reading order: `config.py` (the `observe` key), `keys.py` (which params name a
transfer, per connector), `recorder.py` (vLLM-free: calls in, events out),
`adapter.py` (the vLLM-facing wrapper: delegates every call, then records),
`names.py` (the stats payload's parts). `LedgerConnector.__new__` builds the
adapter when the extra config has `observe`.
"""
