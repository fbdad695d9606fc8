# Cython declarations for ledger/partition.py (see indexes.pxd): `rising_groups`, a store append's loop over
# every event it publishes, reads each event's envelope as a C struct (ledger/structs.pxd) and its dicts as
# C dicts.

cimport cython

from kvledger.ledger.structs cimport _Envelope


@cython.locals(envelope=_Envelope, groups=dict, last=dict, of_transfer=dict, members=list, key=tuple,
               partition=Py_ssize_t)
cpdef object rising_groups(list events, Py_ssize_t partitions, dict above)
