/*
 * Atomic operations on aligned 8-byte words in shared memory, for omnirelay's slot
 * stamps (see atomics.py). The same three operations atomics.py can also reach through
 * libatomic and ctypes, without ctypes' argument conversion: a call costs tens of
 * nanoseconds instead of most of a microsecond, which matters on the connector's hot
 * path (a claim is one CAS, a consume one store).
 *
 * Addresses come from atomics.Word, which holds an export of the mapped buffer for as
 * long as it uses them; these functions only check that an address is non-null and
 * 8-byte aligned. The GIL stays held: every operation is a single instruction.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int
word_at(PyObject *obj, uint64_t **word)
{
    unsigned long long addr = PyLong_AsUnsignedLongLong(obj);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (addr == 0 || (addr & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "atomic word address must be non-null and 8-byte aligned");
        return -1;
    }
    *word = (uint64_t *)(uintptr_t)addr;
    return 0;
}

static int
value_of(PyObject *obj, uint64_t *value)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *value = (uint64_t)v;
    return 0;
}

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected, nargs);
        return -1;
    }
    return 0;
}

/* load(addr) -> int: acquire load. */
static PyObject *
atomic_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *word;
    if (check_nargs("load", nargs, 1) || word_at(args[0], &word)) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(__atomic_load_n(word, __ATOMIC_ACQUIRE));
}

/* store(addr, value) -> None: release store. */
static PyObject *
atomic_store(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *word;
    uint64_t value;
    if (check_nargs("store", nargs, 2) || word_at(args[0], &word) || value_of(args[1], &value)) {
        return NULL;
    }
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* cas(addr, expected, desired) -> bool: sequentially consistent compare-and-swap. */
static PyObject *
atomic_cas(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *word;
    uint64_t expected, desired;
    if (check_nargs("cas", nargs, 3) || word_at(args[0], &word) || value_of(args[1], &expected)
        || value_of(args[2], &desired)) {
        return NULL;
    }
    if (__atomic_compare_exchange_n(word, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* lock_free() -> bool: 8-byte atomics are lock-free here (safe across processes). */
static PyObject *
atomic_lock_free(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("lock_free", nargs, 0)) {
        return NULL;
    }
    return PyBool_FromLong(__atomic_always_lock_free(sizeof(uint64_t), 0));
}

static PyMethodDef methods[] = {
    {"load", (PyCFunction)(void (*)(void))atomic_load, METH_FASTCALL, "load(addr) -> int (acquire)"},
    {"store", (PyCFunction)(void (*)(void))atomic_store, METH_FASTCALL, "store(addr, value) (release)"},
    {"cas", (PyCFunction)(void (*)(void))atomic_cas, METH_FASTCALL,
     "cas(addr, expected, desired) -> bool (seq_cst)"},
    {"lock_free", (PyCFunction)(void (*)(void))atomic_lock_free, METH_FASTCALL,
     "lock_free() -> bool: 8-byte atomics never take a lock"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "omnirelay.connectors.shm._atomic_ops",
    "Atomic load, store and compare-and-swap of aligned 8-byte words (omnirelay slot stamps).",
    0,
    methods,
};

PyMODINIT_FUNC
PyInit__atomic_ops(void)
{
    return PyModule_Create(&module_def);
}
