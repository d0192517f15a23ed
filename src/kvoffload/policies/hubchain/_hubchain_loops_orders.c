/* _hubchain_loops_orders.c: stamp, renew, renew_all, touch, drop (loops.py's twins of the same
   names): the updates of one order, or of hubchain's four orders and their ghosts, key by key in
   loops.py's order. The invariants shared by every file are at the top of _hubchain_loops.c. */

#include "_hubchain_loops.h"

/* stamp(od, keys, now) */
PyObject *hc_stamp(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 3, "stamp") < 0)
        return NULL;
    PyObject *od = args[0], *now = args[2];
    PyObject *keys = PySequence_Tuple(args[1]);
    if (keys == NULL)
        return NULL;
    for (Py_ssize_t i = PyTuple_GET_SIZE(keys) - 1; i >= 0; i--) {
        if (PyObject_SetItem(od, PyTuple_GET_ITEM(keys, i), now) < 0) {
            Py_DECREF(keys);
            return NULL;
        }
    }
    Py_DECREF(keys);
    Py_RETURN_NONE;
}

static int renew_keys(PyObject *od, PyObject *keys, PyObject *now, int all) {
    for (Py_ssize_t i = PyTuple_GET_SIZE(keys) - 1; i >= 0; i--) {
        PyObject *k = PyTuple_GET_ITEM(keys, i);
        if (!all) {
            int r = PyDict_Contains(od, k);
            if (r < 0)
                return -1;
            if (!r)
                continue;
        }
        if (PyObject_SetItem(od, k, now) < 0 || move_to_end(od, k) < 0)
            return -1;
    }
    return 0;
}

/* renew(od, keys, now) */
PyObject *hc_renew(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 3, "renew") < 0 || need_dicts("renew", 1, args) < 0)
        return NULL;
    PyObject *keys = PySequence_Tuple(args[1]);
    if (keys == NULL)
        return NULL;
    int r = renew_keys(args[0], keys, args[2], 0);
    Py_DECREF(keys);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* renew_all(od, keys, now) -> bool */
PyObject *hc_renew_all(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 3, "renew_all") < 0 || need_dicts("renew_all", 1, args) < 0)
        return NULL;
    PyObject *od = args[0];
    PyObject *keys = PySequence_Tuple(args[1]);
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = PyDict_Contains(od, PyTuple_GET_ITEM(keys, i));
        if (r <= 0) {
            Py_DECREF(keys);
            if (r < 0)
                return NULL;
            Py_RETURN_FALSE;
        }
    }
    int r = renew_keys(od, keys, args[2], 1);
    Py_DECREF(keys);
    if (r < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* touch(keys, order, loose, heads, hubbed, used, now) */
PyObject *hc_touch(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 7, "touch") < 0 || need_dicts("touch", 4, args + 1) < 0)
        return NULL;
    PyObject *order = args[1], *loose = args[2], *heads = args[3], *hubbed = args[4];
    PyObject *used = args[5], *now = args[6];
    PyObject *keys = PySequence_Tuple(args[0]);
    if (keys == NULL)
        return NULL;
    for (Py_ssize_t i = PyTuple_GET_SIZE(keys) - 1; i >= 0; i--) {
        PyObject *k = PyTuple_GET_ITEM(keys, i);
        int r;
        if ((r = PyDict_Contains(order, k)) != 0) {
            if (r < 0 || PyObject_SetItem(order, k, used) < 0 || move_to_end(order, k) < 0)
                goto fail;
        } else if ((r = PyDict_Contains(loose, k)) != 0) {
            if (r < 0 || PyObject_DelItem(loose, k) < 0 || PyObject_SetItem(order, k, used) < 0)
                goto fail;
        } else if ((r = PyDict_Contains(heads, k)) != 0) {
            if (r < 0 || PyObject_SetItem(heads, k, now) < 0 || move_to_end(heads, k) < 0)
                goto fail;
        } else if ((r = PyDict_Contains(hubbed, k)) != 0) {
            if (r < 0 || PyObject_DelItem(hubbed, k) < 0 || PyObject_SetItem(order, k, used) < 0)
                goto fail;
        }
    }
    Py_DECREF(keys);
    Py_RETURN_NONE;
fail:
    Py_DECREF(keys);
    return NULL;
}

/* drop(victims, order, loose, hubbed, heads, b1, b2, hub_ghosts, recent, branches, c) */
PyObject *hc_drop(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 11, "drop") < 0 || need_dicts("drop", 9, args + 1) < 0)
        return NULL;
    PyObject *order = args[1], *loose = args[2], *hubbed = args[3], *heads = args[4];
    PyObject *b1 = args[5], *b2 = args[6], *hub_ghosts = args[7], *recent = args[8], *branches = args[9];
    Py_ssize_t c = PyLong_AsSsize_t(args[10]);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    if (c < 1 || c > PY_SSIZE_T_MAX / 4) {  /* (2c below must not overflow) */
        PyErr_SetString(PyExc_ValueError, "drop(): the capacity must be a positive size");
        return NULL;
    }
    PyObject *branch = NULL;
    PyObject *victims = PySequence_Tuple(args[0]);
    if (victims == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(victims);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyTuple_GET_ITEM(victims, i);
        int r;
        if ((r = pop(order, k)) != 0) {
            if (r < 0 || PyObject_SetItem(b2, k, Py_None) < 0)
                goto fail;
        } else if ((r = pop(loose, k)) != 0) {
            if (r < 0 || PyObject_SetItem(b1, k, Py_None) < 0)
                goto fail;
        } else if ((r = pop(hubbed, k)) != 0) {
            if (r < 0 || PyObject_SetItem(b1, k, Py_None) < 0 || PyObject_SetItem(hub_ghosts, k, Py_None) < 0)
                goto fail;
            if (branch == NULL && (branch = PyList_New(0)) == NULL)
                goto fail;
            if (PyList_Append(branch, k) < 0)
                goto fail;
        } else {
            if (PyObject_DelItem(heads, k) < 0 || PyObject_SetItem(b2, k, Py_None) < 0)
                goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyObject_SetItem(recent, PyTuple_GET_ITEM(victims, i), Py_None) < 0)
            goto fail;
    /* (every argument is a dict here: need_dicts) */
    if (PyDict_GET_SIZE(branches))
        for (Py_ssize_t i = 0; i < n; i++)
            if (pop(branches, PyTuple_GET_ITEM(victims, i)) < 0)
                goto fail;
    if (PyDict_GET_SIZE(recent) > c && pop_oldest(recent, PyDict_GET_SIZE(recent) - c) < 0)
        goto fail;
    /* ARC's bounds */
    Py_ssize_t n_loose = PyDict_GET_SIZE(loose), n_b1 = PyDict_GET_SIZE(b1), n_b2 = PyDict_GET_SIZE(b2);
    Py_ssize_t resident = PyDict_GET_SIZE(order) + n_loose + PyDict_GET_SIZE(hubbed) + PyDict_GET_SIZE(heads);
    Py_ssize_t over = n_loose + n_b1 - c < n_b1 ? n_loose + n_b1 - c : n_b1;
    if (over > 0) {
        if (pop_oldest(b1, over) < 0)
            goto fail;
        n_b1 -= over;
    }
    over = resident + n_b1 + n_b2 - 2 * c;
    if (over > 0) {
        Py_ssize_t from2 = over < n_b2 ? over : n_b2, from1 = over - from2 < n_b1 ? over - from2 : n_b1;
        if (pop_oldest(b2, from2) < 0 || pop_oldest(b1, from1) < 0)
            goto fail;
    }
    if (branch != NULL) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(branch); i++)
            if (pop(b1, PyList_GET_ITEM(branch, i)) < 0)
                goto fail;
        if (PyDict_GET_SIZE(hub_ghosts) > c && pop_oldest(hub_ghosts, PyDict_GET_SIZE(hub_ghosts) - c) < 0)
            goto fail;
        Py_DECREF(branch);
    }
    Py_DECREF(victims);
    Py_RETURN_NONE;
fail:
    Py_DECREF(victims);
    Py_XDECREF(branch);
    return NULL;
}
