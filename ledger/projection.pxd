# Cython declarations for ledger/projection.py (see indexes.pxd): the service's loop calls the compiled
# fold's `apply`, the latency recorder's `observe` and the series' `observe` as C methods, and reads each
# event's envelope (ledger/structs.pxd) and a map's request id as C struct fields.

cimport cython

from kvledger.ledger.advice cimport LatencyRecorder
from kvledger.ledger.fold cimport Fold
from kvledger.ledger.series cimport HoldingSeries
from kvledger.ledger.structs cimport _Envelope, Map


@cython.locals(
    fold=Fold, envelope=_Envelope, mapped=Map, transfers=dict, held=dict, failed=list, key=tuple, keys=tuple,
    sides=Py_ssize_t, row=tuple,
)
cpdef list fold_rows(
    object state, list rows, dict by_kind, dict last_ts, list order, dict by_request, HoldingSeries holding,
    LatencyRecorder latency, object on_release,
)
