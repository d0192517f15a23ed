/* _hubchain_loops_prefix.c: prefix_end (loops.py's twin): the deepest resident block before a
   store's first key, or NotImplemented where an argument is outside what hubchain passes (the Python
   twin then does it). The invariants shared by every file are at the top of _hubchain_loops.c. */

#include "_hubchain_loops.h"

/* k's last use in the first of `orders` that holds it: 1 found (in *last), 0 in none, 2 not an int, -1 error */
static int last_use(PyObject *orders, PyObject *k, long long *last) {
    for (Py_ssize_t o = 0; o < PyTuple_GET_SIZE(orders); o++) {
        PyObject *v = PyDict_GetItemWithError(PyTuple_GET_ITEM(orders, o), k);
        if (v != NULL) {
            int r = as_ll(v, last);
            return r == 1 ? 1 : r < 0 ? -1 : 2;
        }
        if (PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* prefix_end(positions, first_key, orders) -> (last, key) | (None, None), or NotImplemented where positions
   is not a dict of ints, orders not a tuple of dicts or a last use not an int (the Python twin then does it) */
PyObject *hc_prefix_end(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 3, "prefix_end") < 0)
        return NULL;
    PyObject *positions = args[0], *orders = args[2];
    if (!PyDict_CheckExact(positions) || !PyTuple_Check(orders))
        Py_RETURN_NOTIMPLEMENTED;
    for (Py_ssize_t o = 0; o < PyTuple_GET_SIZE(orders); o++)
        if (!PyDict_Check(PyTuple_GET_ITEM(orders, o)))
            Py_RETURN_NOTIMPLEMENTED;
    PyObject *fv = PyDict_GetItemWithError(positions, args[1]);
    if (fv == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return Py_BuildValue("(OO)", Py_None, Py_None);
    }
    long long first, last;
    int r = as_ll(fv, &first);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    /* The entries in order, read once (PyDict_Next: no lookups), then walked from the deep end: the
       store's own keys and those after it cost a step each, not a lookup. */
    Py_ssize_t n = PyDict_GET_SIZE(positions), at = 0, pos = 0;
    PyObject **ks = PyMem_Malloc((n ? n : 1) * sizeof(PyObject *)), *pk, *pv, *res = NULL;
    long long *ps = PyMem_Malloc((n ? n : 1) * sizeof(long long));
    if (ks == NULL || ps == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    while (PyDict_Next(positions, &pos, &pk, &pv)) {  /* (borrowed: nothing here changes positions) */
        if ((r = as_ll(pv, &ps[at])) <= 0) {
            res = r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
            goto out;
        }
        ks[at++] = pk;
    }
    Py_ssize_t i = at - 1;
    for (; i >= 0; i--) {
        if (i < at - 1 && ps[i] >= ps[i + 1])
            break;  /* out of prefix order: the full walk below */
        if (ps[i] < first) {
            r = last_use(orders, ks[i], &last);
            if (r < 0)
                goto out;
            if (r == 2) {
                res = Py_NewRef(Py_NotImplemented);
                goto out;
            }
            if (r == 1 && last >= 0) {
                res = Py_BuildValue("(LO)", last, ks[i]);
                goto out;
            }
        }
    }
    if (i < 0) {
        res = Py_BuildValue("(OO)", Py_None, Py_None);
        goto out;
    }
    long long best = -1, prev = 0;
    PyObject *parent = NULL;
    for (i = 0; i < at; i++) {
        if (best < ps[i] && ps[i] < first) {
            r = last_use(orders, ks[i], &last);
            if (r < 0)
                goto out;
            if (r == 2) {
                res = Py_NewRef(Py_NotImplemented);
                goto out;
            }
            if (r == 1 && last >= 0) {
                best = ps[i];
                prev = last;
                parent = ks[i];
            }
        }
    }
    res = parent == NULL ? Py_BuildValue("(OO)", Py_None, Py_None) : Py_BuildValue("(LO)", prev, parent);
out:
    PyMem_Free(ks);
    PyMem_Free(ps);
    return res;
}
