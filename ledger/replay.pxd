# Cython declarations for ledger/replay.py (see indexes.pxd): a chunk is folded in one C loop that calls
# the compiled fold's `apply` as a C method and reads each event's ts from its envelope
# (ledger/structs.pxd) as a C double.

cimport cython

from kvledger.ledger.advice cimport LatencyRecorder
from kvledger.ledger.fold cimport Fold
from kvledger.ledger.structs cimport _Envelope


@cython.locals(fold=Fold, first=_Envelope, envelope=_Envelope, ts=double, newest=double)
cdef double _fold_chunk(object state, list chunk, list decided) except? -1.0

@cython.locals(fold=Fold, sides_of=dict, k=Py_ssize_t)
cpdef fold_indexed(object state, list chunk, list decided, list caused, list claimed)

cdef _observe(LatencyRecorder latencies, list decided, dict sides_of)
