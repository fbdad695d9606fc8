# Cython declarations for ledger/summary.py (see indexes.pxd): `phase_mode_counts`, a loop over every side of a
# state, reads each side's phase and mode as C struct members (ledger/structs.pxd).

cimport cython

from kvledger.ledger.structs cimport TransferState


@cython.locals(t=TransferState, by_phase=dict, by_mode=dict, mode=object)
cpdef tuple phase_mode_counts(dict transfers, object compacted_by_phase, object compacted_by_mode)
