"""Which build of the scheduler hooks runs: their modules compiled by Cython, or the same files interpreted.

What vLLM's step runs of the connector (request_finished, build_connector_meta, update_connector_output:
parsing the params, the request index, the maps, the scheduler core) is plain Python that setup.py also
compiles, as it compiles the fold, and ledger/compiled.py's finder decides which build loads by the same
rules (`KVLEDGER_INTERPRETED=1`, a source edited since the build, a module that did not compile: then
all four from their sources). They read no Struct as a C struct, so they load compiled whatever msgspec's
layout, and apart from the fold: either can run compiled with the other interpreted.
"""

from __future__ import annotations

from typing import Final

from kvledger.ledger.compiled import CompiledGroup
from kvledger.ledger.compiled import compiled as group_compiled
from kvledger.ledger.compiled import install as install_group

HOOK_MODULES: Final = (
    "kvledger.connector.params",
    "kvledger.connector.index",
    "kvledger.connector.maps",
    "kvledger.connector.scheduler",
)
"""The modules setup.py compiles as HOOK_SOURCES, in import order."""

HOOKS: Final = CompiledGroup(HOOK_MODULES)


def compiled() -> bool:
    """Whether every hook module that runs here is the compiled one."""
    return group_compiled(HOOKS)


def install() -> None:
    """The finder for HOOK_MODULES, first on `sys.meta_path` (once): connector/__init__.py calls it."""
    install_group(HOOKS)
