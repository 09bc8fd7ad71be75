/*
 * Atomic operations on aligned 8-byte words in shared memory, for omnirelay's slot
 * stamps (see atomics.py). The same three operations atomics.py can also reach through
 * libatomic and ctypes, without ctypes' argument conversion: a call costs tens of
 * nanoseconds instead of most of a microsecond, which matters on the connector's hot
 * path (a claim is one CAS, a consume one store).
 *
 * Addresses come from atomics.Word, which holds an export of the mapped buffer for as
 * long as it uses them; these functions only check that an address is non-null and
 * 8-byte aligned. The GIL stays held: every operation is a single instruction (claim()
 * is one CAS and a few small copies: a reader's whole claim in one call).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

/*
 * The slot header layout claim() relies on (slot.py's docstring; layout() lets Python
 * check that both agree before it uses claim()).
 */
#define SLOT_STAMP 8
#define SLOT_KEY_LEN 16
#define SLOT_PAYLOAD_LEN 24
#define SLOT_CLAIMER_PID 40
#define SLOT_CLAIMER_START 48
#define SLOT_CLAIM_SEQ 72
#define SLOT_HEADER 128
#define STATE_PUBLISHED 2
#define STATE_CLAIMED 3

/*
 * claim(stamp_addr, size, seq, key, claimer_pid, claimer_start) -> (offset, length) | None
 *
 * A reader's claim of publish ``seq`` of the slot mapped ``size`` bytes from
 * ``stamp_addr - 8``, as slot.claim does it in Python: CAS the stamp PUBLISHED(seq) ->
 * CLAIMED(seq); check that the header names ``key`` and that the payload fits (else put
 * the stamp back: not ours to take); write the claimer's record and then, with release
 * order, the claim's seq. Returns the payload's offset and length, or None.
 */
static PyObject *
slot_claim(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t *stamp;
    uint64_t seq, pid, start;
    if (check_nargs("claim", nargs, 6) || word_at(args[0], &stamp) || value_of(args[2], &seq)
        || value_of(args[4], &pid) || value_of(args[5], &start)) {
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    char *key;
    Py_ssize_t key_len;
    if (PyBytes_AsStringAndSize(args[3], &key, &key_len) < 0) {
        return NULL;
    }
    if (size < SLOT_HEADER || seq > (UINT64_MAX >> 8) || pid > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "claim: bad slot size, seq or pid");
        return NULL;
    }
    unsigned char *base = (unsigned char *)stamp - SLOT_STAMP;
    uint64_t expected = (seq << 8) | STATE_PUBLISHED;
    if (!__atomic_compare_exchange_n(stamp, &expected, (seq << 8) | STATE_CLAIMED, 0, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST)) {
        Py_RETURN_NONE;
    }
    uint32_t slot_key_len;
    uint64_t payload_len;
    memcpy(&slot_key_len, base + SLOT_KEY_LEN, 4);
    memcpy(&payload_len, base + SLOT_PAYLOAD_LEN, 8);
    uint64_t off = ((uint64_t)SLOT_HEADER + slot_key_len + 63) & ~(uint64_t)63;
    if ((Py_ssize_t)slot_key_len != key_len || off > (uint64_t)size || payload_len > (uint64_t)size - off
        || memcmp(base + SLOT_HEADER, key, (size_t)key_len) != 0) {
        __atomic_store_n(stamp, (seq << 8) | STATE_PUBLISHED, __ATOMIC_RELEASE);
        Py_RETURN_NONE;
    }
    uint32_t pid32 = (uint32_t)pid;
    memcpy(base + SLOT_CLAIMER_PID, &pid32, 4);
    memcpy(base + SLOT_CLAIMER_START, &start, 8);
    __atomic_store_n((uint64_t *)(base + SLOT_CLAIM_SEQ), seq, __ATOMIC_RELEASE);
    return Py_BuildValue("(KK)", (unsigned long long)off, (unsigned long long)payload_len);
}

/* layout() -> tuple: the header offsets claim() was compiled with. */
static PyObject *
slot_layout(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("layout", nargs, 0)) {
        return NULL;
    }
    return Py_BuildValue("(iiiiiiiii)", SLOT_STAMP, SLOT_KEY_LEN, SLOT_PAYLOAD_LEN, SLOT_CLAIMER_PID,
                         SLOT_CLAIMER_START, SLOT_CLAIM_SEQ, SLOT_HEADER, STATE_PUBLISHED, STATE_CLAIMED);
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
    {"claim", (PyCFunction)(void (*)(void))slot_claim, METH_FASTCALL,
     "claim(stamp_addr, size, seq, key, pid, start) -> (offset, length) | None"},
    {"layout", (PyCFunction)(void (*)(void))slot_layout, METH_FASTCALL,
     "layout() -> the slot header offsets claim() uses"},
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
