/* _hubchain_loops_learning.c: shadow and follow (loops.py's twins): the shadow LRU's work and the
   sampled reuse distances' episodes, with the same double additions in the same order as the Python.
   follow returns NotImplemented where its keys or clock are outside what hubchain passes. The
   invariants shared by every file are at the top of _hubchain_loops.c. */

#include "_hubchain_loops.h"

/* shadow's work on keys[0..m): adds to *ours, *lru */
static int shadow_keys(PyObject *sim, PyObject **keys, Py_ssize_t m, int hit, Py_ssize_t cap, int counting,
                       long long *ours, long long *lru) {
    if (counting) {
        Py_ssize_t found = 0;
        for (Py_ssize_t i = 0; i < m; i++) {
            int r = PyDict_Contains(sim, keys[i]);
            if (r < 0)
                return -1;
            found += r;
        }
        if (hit)
            *ours += m - found;
        else
            *lru += found;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        if (pop(sim, keys[i]) < 0)
            return -1;
    for (Py_ssize_t i = m - 1; i >= 0; i--)
        if (PyObject_SetItem(sim, keys[i], Py_None) < 0)
            return -1;
    Py_ssize_t size = PyDict_GET_SIZE(sim);  /* (a dict: shadow and follow check) */
    return size > cap ? pop_oldest(sim, size - cap) : 0;
}

/* shadow(sim, keys, hit, cap, counting) -> (ours, lru) */
PyObject *hc_shadow(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 5, "shadow") < 0 || need_dicts("shadow", 1, args) < 0)
        return NULL;
    int hit = PyObject_IsTrue(args[2]), counting = PyObject_IsTrue(args[4]);
    Py_ssize_t cap = PyLong_AsSsize_t(args[3]);
    if (hit < 0 || counting < 0 || (cap == -1 && PyErr_Occurred()))
        return NULL;
    PyObject *keys = PySequence_Tuple(args[1]);
    if (keys == NULL)
        return NULL;
    long long ours = 0, lru = 0;
    int r = shadow_keys(args[0], &PyTuple_GET_ITEM(keys, 0), PyTuple_GET_SIZE(keys), hit, cap, counting,
                        &ours, &lru);
    Py_DECREF(keys);
    if (r < 0)
        return NULL;
    return Py_BuildValue("(LL)", ours, lru);
}

/* list[i] += delta (ints) */
static int add_int(PyObject *list, Py_ssize_t i, long long delta) {
    if (!PyList_Check(list) || i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_IndexError, "follow: counter index out of range");
        return -1;
    }
    long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *o = PyLong_FromLongLong(v + delta);
    return o == NULL ? -1 : PyList_SetItem(list, i, o);
}

/* list[i] += w (floats: the same double addition as Python's) */
static int add_float(PyObject *list, Py_ssize_t i, double w) {
    if (!PyList_Check(list) || i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_IndexError, "follow: histogram index out of range");
        return -1;
    }
    double v = PyFloat_AsDouble(PyList_GET_ITEM(list, i));
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    PyObject *o = PyFloat_FromDouble(v + w);
    return o == NULL ? -1 : PyList_SetItem(list, i, o);
}

/* follow(keys, cls, hit, now, low, k, s, episodes, live, dist, met, sim, sim_cap, counting, bin_of)
   -> (started, ours, lru), or NotImplemented when a key is not bytes of the first key's length (5 or more):
   the Python twin then does it (its hash bytes differ there). */
PyObject *hc_follow(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 15, "follow") < 0)
        return NULL;
    long cls = PyLong_AsLong(args[1]), low = PyLong_AsLong(args[4]), k = PyLong_AsLong(args[5]);
    long s = PyLong_AsLong(args[6]);
    long long now = PyLong_AsLongLong(args[3]);
    Py_ssize_t sim_cap = PyLong_AsSsize_t(args[12]);
    if (PyErr_Occurred())
        return NULL;
    int hit = PyObject_IsTrue(args[2]), counting = PyObject_IsTrue(args[13]);
    if (hit < 0 || counting < 0)
        return NULL;
    PyObject *episodes = args[7], *live = args[8], *dist = args[9], *met = args[10], *sim = args[11];
    PyObject *bin_of = args[14];
    if (cls < 0 || cls > 1 || low < 0 || low > 8 || k < low || k > 8 || s < 0 || s > 8 || !PyDict_Check(episodes)
        || !PySequence_Check(dist) || PySequence_Size(dist) != 2 || !PyBytes_Check(bin_of) || PyBytes_GET_SIZE(bin_of) < 1
        || !PyDict_Check(sim)) {
        PyErr_SetString(PyExc_ValueError, "follow: bad arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(args[0]);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject **keys = &PyTuple_GET_ITEM(seq, 0);
    PyObject **pick = NULL, **cand = NULL;
    unsigned char *hb = NULL;
    long long *ended = NULL, ours = 0, lru = 0, started = 0;
    if (n == 0) {
        Py_DECREF(seq);
        return Py_BuildValue("(iii)", 0, 0, 0);
    }
    Py_ssize_t size = PyBytes_Check(keys[0]) ? PyBytes_GET_SIZE(keys[0]) : 0;
    if (size < 5 || now < 0 || now >= (1LL << 54))  /* ((now << 8) must fit) */
        goto python;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_Check(keys[i]) || PyBytes_GET_SIZE(keys[i]) != size)
            goto python;
    hb = PyMem_Malloc(n);
    pick = PyMem_Malloc(n * sizeof(PyObject *));
    cand = PyMem_Malloc(n * sizeof(PyObject *));
    ended = PyMem_Malloc(n * sizeof(long long));
    if (hb == NULL || pick == NULL || cand == NULL || ended == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        hb[i] = (unsigned char)PyBytes_AS_STRING(keys[i])[size - 5];
    /* the keys that end episodes (the lowest live rate's sample), checked before anything changes: an
       episode that is not an int of this clock's past goes to the Python twin, whatever it makes of it */
    unsigned mask = (1u << low) - 1;
    Py_ssize_t nc = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!(hb[i] & mask))
            cand[nc++] = keys[i];
    for (Py_ssize_t i = 0; i < nc; i++) {
        PyObject *v = PyDict_GetItemWithError(episodes, cand[i]);
        if (v == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        long long e;
        int r = as_ll(v, &e);
        if (r < 0)
            goto fail;
        if (r == 0 || e < 0 || (e >> 8) > now || ((e >> 1) & 127) > 62)
            goto python;
    }
    /* the shadow LRU's sample */
    mask = (1u << s) - 1;
    Py_ssize_t np = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!(hb[i] & mask))
            pick[np++] = keys[i];
    if (np && shadow_keys(sim, pick, np, hit, sim_cap, counting, &ours, &lru) < 0)
        goto fail;
    /* episodes: the lowest live rate's sample ends them, class cls's starts them */
    if (nc == 0)
        goto done;
    Py_ssize_t ne = 0;
    for (Py_ssize_t i = 0; i < nc; i++) {
        PyObject *v = PyDict_GetItemWithError(episodes, cand[i]);  /* (a key twice: found once) */
        if (v == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        long long e = PyLong_AsLongLong(v);
        if ((e == -1 && PyErr_Occurred()) || PyDict_DelItem(episodes, cand[i]) < 0)
            goto fail;
        ended[ne++] = e;
    }
    Py_ssize_t before = PyDict_GET_SIZE(episodes);
    PyObject *packed = NULL;
    mask = (1u << k) - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (hb[i] & mask)
            continue;
        if (packed == NULL && (packed = PyLong_FromLongLong((now << 8) | (k << 1) | cls)) == NULL)
            goto fail;
        if (PyDict_SetItem(episodes, keys[i], packed) < 0) {
            Py_DECREF(packed);
            goto fail;
        }
    }
    if (packed != NULL) {
        Py_DECREF(packed);
        Py_ssize_t added = PyDict_GET_SIZE(episodes) - before;
        started = (long long)added << k;
        if (add_int(live, k, added) < 0)
            goto fail;
    }
    Py_ssize_t last = PyBytes_GET_SIZE(bin_of) - 1;
    const unsigned char *bins = (const unsigned char *)PyBytes_AS_STRING(bin_of);
    for (Py_ssize_t i = 0; i < ne; i++) {
        long long e = ended[i], d = now - (e >> 8);
        long ek = (long)((e >> 1) & 127);
        Py_ssize_t b = bins[d < last ? d : last];
        double w = (double)(1LL << ek);
        PyObject *h = PySequence_GetItem(dist, e & 1);
        int bad = h == NULL || add_int(live, ek, -1) < 0 || add_float(h, b, w) < 0 || add_float(met, b, w) < 0;
        Py_XDECREF(h);
        if (bad)
            goto fail;
    }
done:
    PyMem_Free(hb);
    PyMem_Free(pick);
    PyMem_Free(cand);
    PyMem_Free(ended);
    Py_DECREF(seq);
    return Py_BuildValue("(LLL)", started, ours, lru);
python:
    PyMem_Free(hb);
    PyMem_Free(pick);
    PyMem_Free(cand);
    PyMem_Free(ended);
    Py_DECREF(seq);
    Py_RETURN_NOTIMPLEMENTED;
fail:
    PyMem_Free(hb);
    PyMem_Free(pick);
    PyMem_Free(cand);
    PyMem_Free(ended);
    Py_DECREF(seq);
    return NULL;
}
