# Cython declarations for ledger/advice.py (see indexes.pxd): the latency histograms a replay feeds with
# every release are extension types, their counters C fields and `add_in` a C method (a bucket is made a
# Python int once per release: it keys three histograms).

cimport cython
cimport libc.math as math

from kvledger.ledger.structs cimport TransferState as Side


cdef double _MIN_S, _LOG_RATIO

cdef Py_ssize_t _bucket(double value_s) except? -1


cdef class LatencyHistogram:
    cdef public dict counts
    cdef public Py_ssize_t count
    cdef public double max_s

    cpdef add_in(self, object bucket, double value_s)


cdef class LatencyRecorder:
    cdef public dict by_kind
    cdef public LatencyHistogram completed
    cdef public LatencyHistogram all_causes
    cdef public Py_ssize_t expired_releases
    cdef public double expired_block_seconds

    @cython.locals(held_s=double)
    cpdef double observe(self, object release, Side side) except? -1.0

    @cython.locals(bucket=object, histogram=LatencyHistogram)
    cpdef double record(self, object release, double held_s) except? -1.0
