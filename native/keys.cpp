// Reading key inputs from Python, and the xxh3_chain module function.
#include "keys.h"

namespace kvnative {

namespace {

// An exact int that fits one internal digit (|v| < 2**30): its value without a call.
inline bool compact_int(PyObject* o, long long& v) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject*)o)) return false;
    v = (long long)PyUnstable_Long_CompactValue((PyLongObject*)o);
    return true;
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0) {
        v = 0;
        return true;
    }
    if (size == 1 || size == -1) {
        v = (long long)((PyLongObject*)o)->ob_digit[0];
        if (size < 0) v = -v;
        return true;
    }
    return false;
#endif
}

}  // namespace

void to_u64(nb::handle obj, U64View& out, const char* what) {
    using Arr = nb::ndarray<const u64, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
    Arr arr;
    // lists and tuples (the events' form) go straight to the sequence path
    if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr()) && nb::try_cast(obj, arr, false)) {
        out.data = arr.data();
        out.n = arr.shape(0);
        out.owned.clear();
        return;
    }
    PyObject* seq = PySequence_Fast(obj.ptr(), what);
    if (!seq) throw nb::python_error();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    out.owned.resize((size_t)n);
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* it = items[i];
        // fast path: an exact int of one digit (token ids, small keys): read it without a call
        if (Py_IS_TYPE(it, &PyLong_Type)) {
            long long small;
            if (compact_int(it, small)) {
                if (small < 0) {
                    Py_DECREF(seq);
                    throw nb::value_error((std::string(what) + ": values must be in [0, 2**64)").c_str());
                }
                out.owned[(size_t)i] = (u64)small;
                continue;
            }
        }
        if (PyBool_Check(it) || !PyLong_Check(it)) {
            Py_DECREF(seq);
            throw nb::type_error((std::string(what) + ": integers expected").c_str());
        }
        unsigned long long v = PyLong_AsUnsignedLongLong(it);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_DECREF(seq);
            throw nb::value_error((std::string(what) + ": values must be in [0, 2**64)").c_str());
        }
        out.owned[(size_t)i] = (u64)v;
    }
    Py_DECREF(seq);
    out.data = out.owned.data();
    out.n = out.owned.size();
}

nb::bytes xxh3_chain(u64 state, nb::handle toks_o, nb::handle K_o, u64 A, nb::handle add_o) {
    U64View toks, K, add;
    to_u64(toks_o, toks, "token_ids");
    to_u64(K_o, K, "K");
    size_t bs = K.n;
    if (bs == 0) throw nb::value_error("empty K");
    size_t n = toks.n / bs;
    const u64* addp = nullptr;
    if (!add_o.is_none()) {
        to_u64(add_o, add, "add");
        if (add.n != n) throw nb::value_error("one addend per block expected");
        addp = add.data;
    }
    std::vector<u64> out(n);
    {
        nb::gil_scoped_release nogil;
        chain_into(state, toks.data, n, K.data, bs, A, addp, out.data());
    }
    return new_u64_array(std::move(out));
}

}  // namespace kvnative
