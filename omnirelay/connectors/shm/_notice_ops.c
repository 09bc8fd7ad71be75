/*
 * Arrival notices of the shm connector (see notices.py for the wire format), sent and
 * drained in one call each: on the connector's hot path a notice's packing, its sendto,
 * and on the other side the recv, the unpacking and the key's decoding cost about a
 * microsecond here instead of ten to twenty of interpreted code (this class of machine
 * runs that code cold, right after a wake-up).
 *
 * Both calls are non-blocking and keep the GIL: a non-blocking sendto/recv on a UNIX
 * datagram socket takes a couple of microseconds, and releasing the GIL around it would
 * invite another thread of the process to take it in the middle of a chunk's path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#define HEADER_SIZE 11 /* u8 tag | u64 seq (LE) | u16 slot name length (LE) */
#define TAG_NORMAL 0x4E
#define TAG_SMALL 0x53

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected, nargs);
        return -1;
    }
    return 0;
}

static int
as_fd(PyObject *obj, int *fd)
{
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < 0 || v > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "bad file descriptor");
        return -1;
    }
    *fd = (int)v;
    return 0;
}

static int
fill_address(PyObject *addr, struct sockaddr_un *sa, socklen_t *len)
{
    char *data;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(addr, &data, &n) < 0) {
        return -1;
    }
    if (n <= 0 || (size_t)n > sizeof(sa->sun_path)) {
        PyErr_SetString(PyExc_ValueError, "notice address must be 1..108 bytes");
        return -1;
    }
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    memcpy(sa->sun_path, data, (size_t)n);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)n);
    return 0;
}

/*
 * send(fd, addr, tag, seq, name, key) -> int: one notice to the abstract address ``addr``
 * (or the overflow marker when ``tag`` is 0: an empty datagram). Returns 0, or the errno
 * of a failed sendto (EAGAIN: the receiver's queue is full; others: nobody listens).
 */
static PyObject *
notice_send(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("send", nargs, 6)) {
        return NULL;
    }
    int fd;
    if (as_fd(args[0], &fd) < 0) {
        return NULL;
    }
    struct sockaddr_un sa;
    socklen_t sa_len;
    if (fill_address(args[1], &sa, &sa_len) < 0) {
        return NULL;
    }
    long tag = PyLong_AsLong(args[2]);
    if (tag == -1 && PyErr_Occurred()) {
        return NULL;
    }
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[3]);
    if (seq == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    char *name, *key;
    Py_ssize_t name_len, key_len;
    if (PyBytes_AsStringAndSize(args[4], &name, &name_len) < 0
        || PyBytes_AsStringAndSize(args[5], &key, &key_len) < 0) {
        return NULL;
    }
    if (name_len > 0xFFFF || key_len > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "notice slot name or key too long");
        return NULL;
    }
    ssize_t sent;
    if (tag == 0) {
        sent = sendto(fd, "", 0, MSG_DONTWAIT, (struct sockaddr *)&sa, sa_len);
    } else {
        size_t total = HEADER_SIZE + (size_t)name_len + (size_t)key_len;
        unsigned char stack_buf[1024];
        unsigned char *buf = total <= sizeof(stack_buf) ? stack_buf : PyMem_Malloc(total);
        if (buf == NULL) {
            return PyErr_NoMemory();
        }
        buf[0] = (unsigned char)tag;
        for (int i = 0; i < 8; i++) {
            buf[1 + i] = (unsigned char)(seq >> (8 * i));
        }
        buf[9] = (unsigned char)(name_len & 0xFF);
        buf[10] = (unsigned char)(name_len >> 8);
        memcpy(buf + HEADER_SIZE, name, (size_t)name_len);
        memcpy(buf + HEADER_SIZE + name_len, key, (size_t)key_len);
        sent = sendto(fd, buf, total, MSG_DONTWAIT, (struct sockaddr *)&sa, sa_len);
        if (buf != stack_buf) {
            PyMem_Free(buf);
        }
    }
    return PyLong_FromLong(sent < 0 ? errno : 0);
}

/* One received datagram as (tag, seq, name, key), or None for the overflow marker and
 * anything that is not a well-formed notice (the caller then polls everything). */
static PyObject *
parse(const unsigned char *buf, ssize_t n, ssize_t bufsize)
{
    if (n < HEADER_SIZE || n >= bufsize || (buf[0] != TAG_NORMAL && buf[0] != TAG_SMALL)) {
        Py_RETURN_NONE;
    }
    unsigned long long seq = 0;
    for (int i = 7; i >= 0; i--) {
        seq = (seq << 8) | buf[1 + i];
    }
    Py_ssize_t name_len = (Py_ssize_t)buf[9] | ((Py_ssize_t)buf[10] << 8);
    if (n <= HEADER_SIZE + name_len) {
        Py_RETURN_NONE;
    }
    PyObject *key = PyUnicode_DecodeUTF8((const char *)buf + HEADER_SIZE + name_len,
                                         n - HEADER_SIZE - name_len, "surrogatepass");
    if (key == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *name = PyBytes_FromStringAndSize((const char *)buf + HEADER_SIZE, name_len);
    if (name == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *item = Py_BuildValue("(iKNN)", (int)buf[0], seq, name, key);
    return item;
}

/*
 * drain(fd, bufsize, max_count) -> list: the datagrams queued on ``fd`` (at most
 * ``max_count``; 0: all), each parsed as by parse(). Stops at an empty queue without
 * raising; raises OSError only if the first recv fails for another reason.
 */
static PyObject *
notice_drain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("drain", nargs, 3)) {
        return NULL;
    }
    int fd;
    if (as_fd(args[0], &fd) < 0) {
        return NULL;
    }
    Py_ssize_t bufsize = PyLong_AsSsize_t(args[1]);
    if (bufsize == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t max_count = PyLong_AsSsize_t(args[2]);
    if (max_count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (bufsize < HEADER_SIZE + 2 || bufsize > (1 << 21)) {
        PyErr_SetString(PyExc_ValueError, "drain bufsize out of range");
        return NULL;
    }
    unsigned char stack_buf[16384];
    unsigned char *buf = (size_t)bufsize <= sizeof(stack_buf) ? stack_buf : PyMem_Malloc((size_t)bufsize);
    if (buf == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        goto fail;
    }
    while (max_count == 0 || PyList_GET_SIZE(out) < max_count) {
        ssize_t n = recv(fd, buf, (size_t)bufsize, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK || PyList_GET_SIZE(out) > 0) {
                break;
            }
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
        PyObject *item = parse(buf, n, bufsize);
        if (item == NULL) {
            goto fail;
        }
        int rc = PyList_Append(out, item);
        Py_DECREF(item);
        if (rc < 0) {
            goto fail;
        }
    }
    if (buf != stack_buf) {
        PyMem_Free(buf);
    }
    return out;
fail:
    Py_XDECREF(out);
    if (buf != stack_buf) {
        PyMem_Free(buf);
    }
    return NULL;
}

static PyMethodDef methods[] = {
    {"send", (PyCFunction)(void (*)(void))notice_send, METH_FASTCALL,
     "send(fd, addr, tag, seq, name, key) -> errno (0: sent; tag 0: the overflow marker)"},
    {"drain", (PyCFunction)(void (*)(void))notice_drain, METH_FASTCALL,
     "drain(fd, bufsize, max_count) -> [(tag, seq, name, key) | None, ...]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "omnirelay.connectors.shm._notice_ops",
    "Send and drain shm connector arrival notices in one call each (see notices.py).",
    0,
    methods,
};

PyMODINIT_FUNC
PyInit__notice_ops(void)
{
    return PyModule_Create(&module_def);
}
