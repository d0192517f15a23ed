/* kvoffload.tiers.cpu._memcopy: one call copies a whole job's byte ranges.

   copy(dst_base, dst_offsets, src_base, src_offsets, sizes) -> bytes copied

   Range i: memmove(dst_base + dst_offsets[i], src_base + src_offsets[i], sizes[i]).
   The bases are ints (addresses); the offsets and sizes are 1-D C-contiguous
   int64 buffers of one length (numpy arrays), so a plan's arrays go in as they
   are: no Python int per range, no ctypes call per range. The GIL is released
   once for the whole loop (not once per range: taking it back can wait for
   another thread, tens of us on a loaded machine). The caller guarantees the
   addresses; this only checks the arrays' shape and type. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* a 1-D contiguous buffer of native int64, or a ValueError naming it */
static int get_int64s(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be an int64 array, got %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=') f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0) || view->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D int64 array, got format '%s' with %d dimension(s)",
                     name, view->format ? view->format : "B", view->ndim);
    } else if (!PyBuffer_IsContiguous(view, 'C')) {
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
        if (get_int64s(objs[got], &views[got], names[got]) < 0) goto done;
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
        memmove((void *)(uintptr_t)(dst_base + (uint64_t)dst[i]),
                (const void *)(uintptr_t)(src_base + (uint64_t)src[i]), (size_t)size[i]);
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(total);
done:
    while (got-- > 0) PyBuffer_Release(&views[got]);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst_base, dst_offsets, src_base, src_offsets, sizes) -> bytes copied\n\n"
     "memmove(dst_base + dst_offsets[i], src_base + src_offsets[i], sizes[i]) for every i, without the GIL;\n"
     "offsets and sizes: 1-D contiguous int64 arrays of one length."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_memcopy", "A job's byte ranges in one call.", -1, methods};

PyMODINIT_FUNC PyInit__memcopy(void) { return PyModule_Create(&module); }
