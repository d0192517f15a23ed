/* _hubchain_loops.h: what the C files of kvoffload.policies.hubchain._hubchain_loops share.

   One extension module, separately compiled files (setup.py lists them):
     _hubchain_loops.c           the module: its method table, its init, the cached names below
     _hubchain_loops_orders.c    stamp, renew, renew_all, touch, drop: one order's or all four's updates
     _hubchain_loops_merge.c     merge: the victims, oldest first across the four orders
     _hubchain_loops_prefix.c    prefix_end: the resident prefix's deepest block
     _hubchain_loops_learning.c  shadow, follow: the shadow LRU and the sampled reuse distances
   The invariants they all keep (the same calls in the same order as loops.py) are stated at the
   top of _hubchain_loops.c. The helpers here are static inline: each file gets its own copy, so a
   call costs what it did in one file. Every name the files share starts hc_ (besides PyInit_). */

#ifndef KVOFFLOAD_HUBCHAIN_LOOPS_H
#define KVOFFLOAD_HUBCHAIN_LOOPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Set once by the module's init (_hubchain_loops.c) before any method can run; never changed after. */
extern PyObject *hc_str_move_to_end, *hc_str_popitem;
extern PyTypeObject *hc_odict_type;  /* collections.OrderedDict */
extern PyObject *hc_odict_move_to_end, *hc_odict_popitem;  /* its methods (descriptors): no lookup per call */

/* od.method(arg): the cached descriptor for a plain OrderedDict, else a lookup (a subclass may override) */
static inline PyObject *call_method(PyObject *od, PyObject *cached, PyObject *name, PyObject *arg) {
    PyObject *args[2] = {od, arg};
    if (Py_TYPE(od) == hc_odict_type)
        return PyObject_Vectorcall(cached, args, 2, NULL);
    return PyObject_VectorcallMethod(name, args, 2, NULL);
}

static inline int move_to_end(PyObject *od, PyObject *k) {
    PyObject *r = call_method(od, hc_odict_move_to_end, hc_str_move_to_end, k);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static inline int pop_oldest(PyObject *od, Py_ssize_t count) {
    for (; count > 0; count--) {
        PyObject *r = call_method(od, hc_odict_popitem, hc_str_popitem, Py_False);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* od.pop(k, None) is not None: 1 popped, 0 absent, -1 error (values are never None here) */
static inline int pop(PyObject *od, PyObject *k) {
    PyObject *v = PyDict_GetItemWithError(od, k);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return PyObject_DelItem(od, k) < 0 ? -1 : 1;
}

/* each of n objects a dict (an OrderedDict is one), else a TypeError: PyDict_Contains does not check */
static inline int need_dicts(const char *name, Py_ssize_t n, PyObject *const *objs) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyDict_Check(objs[i])) {
            PyErr_Format(PyExc_TypeError, "%s(): expected an OrderedDict, got %.100s", name, Py_TYPE(objs[i])->tp_name);
            return -1;
        }
    return 0;
}

static inline int check_args(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

/* an int's value into *v: 1, 0 if not an int that fits (the Python twin takes it), -1 on error */
static inline int as_ll(PyObject *o, long long *v) {
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow;
    *v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (*v == -1 && PyErr_Occurred())
        return -1;
    return !overflow;
}

/* The module's methods (METH_FASTCALL), one file per concern: see the list above. */
PyObject *hc_stamp(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *hc_renew(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *hc_renew_all(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *hc_touch(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *hc_drop(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *hc_merge(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *hc_prefix_end(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *hc_shadow(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *hc_follow(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

#endif
