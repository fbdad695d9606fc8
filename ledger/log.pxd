# Cython declarations for ledger/log.py: see indexes.pxd. `number`, the per-event loop of an append, reads its
# events as C structs (ledger/structs.pxd); `EventLog` is an extension type, its fields C struct members: an
# append on vLLM's step path reads and writes five of them, each a dict lookup on a Python instance.

cimport cython

from kvledger.ledger.structs cimport _Envelope


@cython.locals(envelope=_Envelope, i=Py_ssize_t, found=cython.longlong)
cpdef object number(list batch, long long seq, str source)


cdef class EventLog:
    cdef public str source
    cdef public object lock
    cdef list _events
    cdef object _first_seq
    cdef object _next_seq
    cdef list _listeners
