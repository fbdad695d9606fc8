# Cython declarations for ledger/log.py: see indexes.pxd. Only `number`, the per-event loop of an append,
# is declared: its events are read as C structs (ledger/structs.pxd); `EventLog` stays a Python class.

cimport cython

from ledger.structs cimport _Envelope


@cython.locals(envelope=_Envelope, i=Py_ssize_t)
cpdef object number(list batch, object seq, object source)
