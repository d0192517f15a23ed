/* kvoffload.policies.hubchain._hubchain_loops: hubchain's hot loops, in C.

   The C twin of loops.py (read that file first: it says what each
   function does, and its functions are the reference). An order is an
   OrderedDict of key -> last use. These make the same calls on the same
   dicts in the same order as the Python (od[k] = v, del od[k],
   od.move_to_end(k), od.popitem(False), iteration from the oldest) and the
   same double additions in the same order, so both leave the same state
   and return the same values; the saving is the interpreter's loop, not a
   different structure. tests/policies/test_hubchain_loops.py compares them
   on random operations. Where an argument is outside what hubchain passes
   (keys of mixed lengths, positions that are not ints, a clock past 2**54),
   follow and prefix_end return NotImplemented and the Python module runs its
   own twin; the others raise TypeError or ValueError where the Python might
   do something else, never crash. merge reads last uses and the threshold as
   doubles: exact below 2**53, which a clock counting requests never reaches. */

#include "_hubchain_loops.h"

/* The C files: _hubchain_loops.h lists them, one concern each; this one holds the module itself. */

PyObject *hc_str_move_to_end, *hc_str_popitem;
PyTypeObject *hc_odict_type;
PyObject *hc_odict_move_to_end, *hc_odict_popitem;

static PyMethodDef methods[] = {
    {"stamp", (PyCFunction)(void (*)(void))hc_stamp, METH_FASTCALL, "stamp(od, keys, now)"},
    {"renew", (PyCFunction)(void (*)(void))hc_renew, METH_FASTCALL, "renew(od, keys, now)"},
    {"renew_all", (PyCFunction)(void (*)(void))hc_renew_all, METH_FASTCALL, "renew_all(od, keys, now) -> bool"},
    {"touch", (PyCFunction)(void (*)(void))hc_touch, METH_FASTCALL, "touch(keys, order, loose, heads, hubbed, used, now)"},
    {"drop", (PyCFunction)(void (*)(void))hc_drop, METH_FASTCALL,
     "drop(victims, order, loose, hubbed, heads, b1, b2, hub_ghosts, recent, branches, c)"},
    {"merge", (PyCFunction)(void (*)(void))hc_merge, METH_FASTCALL,
     "merge(n, loose, order, hubbed, heads, p, q, threshold, hub_off, head_off, own, held, can_evict) -> list"},
    {"prefix_end", (PyCFunction)(void (*)(void))hc_prefix_end, METH_FASTCALL,
     "prefix_end(positions, first_key, orders) -> (last, key) | (None, None)"},
    {"shadow", (PyCFunction)(void (*)(void))hc_shadow, METH_FASTCALL, "shadow(sim, keys, hit, cap, counting) -> (ours, lru)"},
    {"follow", (PyCFunction)(void (*)(void))hc_follow, METH_FASTCALL,
     "follow(keys, cls, hit, now, low, k, s, episodes, live, dist, met, sim, sim_cap, counting, bin_of) -> tuple"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hubchain_loops",
                                     "hubchain's hot loops over its orders (C twin of loops.py)", -1, methods};

PyMODINIT_FUNC PyInit__hubchain_loops(void) {
    hc_str_move_to_end = PyUnicode_InternFromString("move_to_end");
    hc_str_popitem = PyUnicode_InternFromString("popitem");
    if (hc_str_move_to_end == NULL || hc_str_popitem == NULL)
        return NULL;
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL)
        return NULL;
    hc_odict_type = (PyTypeObject *)PyObject_GetAttrString(collections, "OrderedDict");
    Py_DECREF(collections);
    if (hc_odict_type == NULL || !PyType_Check(hc_odict_type))
        return NULL;
    hc_odict_move_to_end = PyObject_GetAttr((PyObject *)hc_odict_type, hc_str_move_to_end);
    hc_odict_popitem = PyObject_GetAttr((PyObject *)hc_odict_type, hc_str_popitem);
    if (hc_odict_move_to_end == NULL || hc_odict_popitem == NULL)
        return NULL;
    return PyModule_Create(&module);
}
