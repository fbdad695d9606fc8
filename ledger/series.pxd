# Cython declarations for ledger/series.py (see indexes.pxd): the series is an extension type, its fields
# C struct members and `observe` (called after every map and release the service folds) a C method.

cimport cython


cdef class HoldingSeries:
    cdef public Py_ssize_t points_max
    cdef public double bucket_s
    cdef public object start_ts
    cdef public object end_ts
    cdef public dict _buckets

    @cython.locals(buckets=dict, bucket=list, newest=Py_ssize_t)
    cpdef observe(self, object ts, object source, Py_ssize_t held)
    cdef _widen(self, object index)
