# Cython declarations for ledger/jsonl.py (see indexes.pxd): the reader counts a chunk's lines in a C loop.

cimport cython


@cython.locals(n=Py_ssize_t, byte=cython.uchar)
cdef Py_ssize_t _newlines(bytes chunk) except -1
