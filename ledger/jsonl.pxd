# Cython declarations for ledger/jsonl.py (see indexes.pxd): the reader counts a chunk's lines in a C loop,
# `line_marks` tells a chunk's lines' partitions in one loop over its bytes, and `select_lines` takes a partition's.

cimport cython


@cython.locals(n=Py_ssize_t, byte=cython.uchar)
cdef Py_ssize_t _newlines(bytes chunk) except -1

ctypedef const unsigned char *cbytes

cdef unsigned int _CRC32[256]


cpdef tuple split_lines(bytes chunk, Py_ssize_t partition, Py_ssize_t partitions)


@cython.locals(
    data=cbytes, special=cbytes, word=cbytes, size=Py_ssize_t, count=Py_ssize_t, out=bytearray, marks=cython.uchar[:],
    out_ends=bytearray, ends=cython.uchar[:], lines=Py_ssize_t,
    events=Py_ssize_t, newest=double, best_start=Py_ssize_t, best_end=Py_ssize_t, start=Py_ssize_t, i=Py_ssize_t,
    odd=bint, ids=Py_ssize_t, stamps=Py_ssize_t, id_start=Py_ssize_t, ts_start=Py_ssize_t, c=cython.uchar,
    k=Py_ssize_t, line_start=Py_ssize_t, crc=cython.uint, id_end=Py_ssize_t, ts_end=Py_ssize_t, plain=bint,
    dots=Py_ssize_t, ts=double,
)
cpdef tuple line_marks(bytes chunk, Py_ssize_t partitions)


@cython.locals(k=Py_ssize_t)
cdef inline void _put_end(cython.uchar[:] ends, Py_ssize_t line, Py_ssize_t end)


@cython.locals(
    lines=Py_ssize_t, data=cbytes, events=Py_ssize_t, start=Py_ssize_t, end=Py_ssize_t, line=Py_ssize_t,
    mark=cython.uchar, keep=bint,
)
cpdef tuple select_lines(bytes chunk, bytes marks, bytes ends, Py_ssize_t partition)


@cython.locals(k=Py_ssize_t)
cdef inline Py_ssize_t _end_of(cbytes ends, Py_ssize_t line)


@cython.locals(a_int=Py_ssize_t, b_int=Py_ssize_t)
cdef bint _decimal_greater(cbytes data, Py_ssize_t a, Py_ssize_t a_end, Py_ssize_t b, Py_ssize_t b_end)
