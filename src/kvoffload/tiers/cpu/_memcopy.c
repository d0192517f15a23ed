/* kvoffload.tiers.cpu._memcopy: one call copies a whole job's byte ranges.

   copy(dst_base, dst_offsets, src_base, src_offsets, sizes) -> bytes copied

   Range i: sizes[i] bytes from src_base + src_offsets[i] to dst_base + dst_offsets[i]
   (copy_range: streaming stores from STREAM_MIN, else memmove).
   The bases are ints (addresses); the offsets and sizes are 1-D C-contiguous
   int64 buffers of one length (numpy arrays), so a plan's arrays go in as they
   are: no Python int per range, no ctypes call per range. The GIL is released
   once for the whole loop (not once per range: taking it back can wait for
   another thread, tens of us on a loaded machine). The caller guarantees the
   addresses; this only checks the arrays' shape and type.

   copy_blocks(...): the same for one KV group's job given as GPU blocks and
   pool slots, its addresses computed here; outside(ids, limit): the planner's
   id check (both below). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* One range. From STREAM_MIN bytes, with 16-byte aligned ends, the stores
   bypass the cache (non-temporal): a copy that large evicts what it writes
   anyway, and skipping the read-for-ownership of every destination line
   made random 128 KiB-2 MiB ranges 1.2-1.5x faster here (docs/BENCHMARKS.md).
   Overlapping ranges (never a job's) keep memmove. */
#define STREAM_MIN (128 << 10)

static inline void copy_range(char *dst, const char *src, size_t size) {
#ifdef __SSE2__
    if (size >= STREAM_MIN && !(((uintptr_t)dst | (uintptr_t)src) & 15) && (dst + size <= src || src + size <= dst)) {
        size_t body = size & ~(size_t)63;
        for (size_t j = 0; j < body; j += 64) {
            __m128i a = _mm_load_si128((const __m128i *)(src + j)), b = _mm_load_si128((const __m128i *)(src + j + 16));
            __m128i c = _mm_load_si128((const __m128i *)(src + j + 32)), d = _mm_load_si128((const __m128i *)(src + j + 48));
            _mm_stream_si128((__m128i *)(dst + j), a);
            _mm_stream_si128((__m128i *)(dst + j + 16), b);
            _mm_stream_si128((__m128i *)(dst + j + 32), c);
            _mm_stream_si128((__m128i *)(dst + j + 48), d);
        }
        memcpy(dst + body, src + body, size - body);
        return;
    }
#endif
    memmove(dst, src, size);
}

static inline void fence(void) {
#ifdef __SSE2__
    _mm_sfence();  /* streamed stores visible before the job is reported done */
#endif
}

/* a buffer of native int64 of ndim dimensions (contiguous unless strided_ok), or a ValueError naming it */
static int get_int64s(PyObject *obj, Py_buffer *view, const char *name, int ndim, int strided_ok) {
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be an int64 array, got %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=') f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0) || view->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must be a %d-D int64 array, got format '%s' with %d dimension(s)",
                     name, ndim, view->format ? view->format : "B", view->ndim);
    } else if (!strided_ok && !PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s must be contiguous", name);
    } else {
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "copy(dst_base, dst_offsets, src_base, src_offsets, sizes) takes 5 "
                     "arguments, got %zd", nargs);
        return NULL;
    }
    uint64_t dst_base = PyLong_AsUnsignedLongLongMask(args[0]);
    if (PyErr_Occurred()) return NULL;
    uint64_t src_base = PyLong_AsUnsignedLongLongMask(args[2]);
    if (PyErr_Occurred()) return NULL;
    static const char *names[3] = {"dst_offsets", "src_offsets", "sizes"};
    PyObject *objs[3] = {args[1], args[3], args[4]};
    Py_buffer views[3];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 3; got++)
        if (get_int64s(objs[got], &views[got], names[got], 1, 0) < 0) goto done;
    Py_ssize_t n = views[2].shape[0];
    if (views[0].shape[0] != n || views[1].shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "dst_offsets, src_offsets and sizes differ in length: %zd, %zd, %zd",
                     views[0].shape[0], views[1].shape[0], n);
        goto done;
    }
    const int64_t *dst = views[0].buf, *src = views[1].buf, *size = views[2].buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (size[i] < 0) {
            PyErr_Format(PyExc_ValueError, "sizes[%zd] is negative: %lld", i, (long long)size[i]);
            goto done;
        }
        total += (uint64_t)size[i];
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)  /* unsigned sums: an offset may be negative */
        copy_range((char *)(uintptr_t)(dst_base + (uint64_t)dst[i]),
                   (const char *)(uintptr_t)(src_base + (uint64_t)src[i]), (size_t)size[i]);
    fence();
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(total);
done:
    while (got-- > 0) PyBuffer_Release(&views[got]);
    return result;
}

/* copy_blocks(store, pieces, pool_base, slot_bytes, k, skip, blocks, slots) -> bytes copied

   A job of one KV group, planned here rather than by numpy (plan.py's
   CopyPlanner.plan, same addresses; Python run right after a large copy
   finds the caches cold, ~10 us per numpy call). pieces: one row per piece,
   (address of the piece in GPU block 0, block stride, offset in a chunk,
   bytes between sub-block pages in a chunk, size); GPU block j of the job
   is page (skip + j) % k of the chunk in slot slots[(skip + j) / k].
   The ids were checked by the caller (CopyPlanner.check); the slot count
   is checked here. Ranges are not merged: a memmove call costs ~10 ns. */
static PyObject *copy_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "copy_blocks(store, pieces, pool_base, slot_bytes, k, skip, blocks, slots) "
                     "takes 8 arguments, got %zd", nargs);
        return NULL;
    }
    int store = PyObject_IsTrue(args[0]);
    uint64_t pool_base = PyLong_AsUnsignedLongLongMask(args[2]);
    long long slot_bytes = PyLong_AsLongLong(args[3]), k = PyLong_AsLongLong(args[4]), skip = PyLong_AsLongLong(args[5]);
    if (store < 0 || PyErr_Occurred()) return NULL;
    if (k < 1 || skip < 0 || slot_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "k must be >= 1, skip and slot_bytes >= 0; got %lld, %lld, %lld", k, skip,
                     slot_bytes);
        return NULL;
    }
    Py_buffer pv, bv, sv;
    PyObject *result = NULL;
    if (get_int64s(args[1], &pv, "pieces", 2, 0) < 0) return NULL;
    if (get_int64s(args[6], &bv, "blocks", 1, 1) < 0) goto release_p;  /* a spec's ids may be a strided view */
    if (get_int64s(args[7], &sv, "slots", 1, 1) < 0) goto release_b;
    Py_ssize_t np_ = pv.shape[0], n = bv.shape[0];
    if (pv.shape[1] != 5) {
        PyErr_Format(PyExc_ValueError, "pieces must have 5 columns, got %zd", pv.shape[1]);
        goto release_s;
    }
    if (n && (skip + n - 1) / k >= sv.shape[0]) {
        PyErr_Format(PyExc_ValueError, "%zd blocks from page %lld of a %lld-page chunk span %lld slots, got %zd",
                     n, skip, k, (skip + n - 1) / k + 1, sv.shape[0]);
        goto release_s;
    }
    const int64_t *pieces = pv.buf;
    const char *blocks = bv.buf, *slots = sv.buf;
    Py_ssize_t bs = bv.strides[0], ss = sv.strides[0];
    uint64_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < np_; p++) {  /* piece-major: one layer's pages in job order */
        const int64_t *r = pieces + 5 * p;
        uint64_t gpu0 = (uint64_t)r[0], size = (uint64_t)r[4];
        for (Py_ssize_t j = 0; j < n; j++) {
            int64_t block = *(const int64_t *)(blocks + j * bs);
            long long pos = skip + j;
            int64_t slot = *(const int64_t *)(slots + (pos / k) * ss);
            char *gpu = (char *)(uintptr_t)(gpu0 + (uint64_t)block * (uint64_t)r[1]);
            char *pool = (char *)(uintptr_t)(pool_base + (uint64_t)slot * (uint64_t)slot_bytes
                                             + (uint64_t)r[2] + (uint64_t)(pos % k) * (uint64_t)r[3]);
            if (store) copy_range(pool, gpu, size);
            else copy_range(gpu, pool, size);
            total += size;
        }
    }
    fence();
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(total);
release_s:
    PyBuffer_Release(&sv);
release_b:
    PyBuffer_Release(&bv);
release_p:
    PyBuffer_Release(&pv);
    return result;
}

/* outside(ids, limit) -> whether any id of a 1-D int64 array is outside [0, limit)
   (CopyPlanner.check's test, per job in the caller: one call instead of three numpy ones) */
static PyObject *outside(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "outside(ids, limit) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    long long limit = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer v;
    if (get_int64s(args[0], &v, "ids", 1, 1) < 0) return NULL;
    int out = 0;
    for (Py_ssize_t i = 0; i < v.shape[0] && !out; i++) {
        int64_t id = *(const int64_t *)((const char *)v.buf + i * v.strides[0]);
        out = id < 0 || id >= limit;
    }
    PyBuffer_Release(&v);
    return PyBool_FromLong(out);
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst_base, dst_offsets, src_base, src_offsets, sizes) -> bytes copied\n\n"
     "memmove(dst_base + dst_offsets[i], src_base + src_offsets[i], sizes[i]) for every i, without the GIL;\n"
     "offsets and sizes: 1-D contiguous int64 arrays of one length."},
    {"copy_blocks", (PyCFunction)(void (*)(void))copy_blocks, METH_FASTCALL,
     "copy_blocks(store, pieces, pool_base, slot_bytes, k, skip, blocks, slots) -> bytes copied\n\n"
     "A KV group's job, its addresses computed here (see the source)."},
    {"outside", (PyCFunction)(void (*)(void))outside, METH_FASTCALL,
     "outside(ids, limit) -> whether any id of a 1-D int64 array is outside [0, limit)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_memcopy", "The CPU tier's copy: a job's byte ranges in one call, without the GIL.",
    -1, methods};

PyMODINIT_FUNC PyInit__memcopy(void) { return PyModule_Create(&module); }
