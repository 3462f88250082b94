#include "picker.h"

namespace kvnative {


// ---------------------------------------------------------------- the ttft picker's rows

// scorer.picker.TTFTPicker.pick's per-candidate pass and ranking for the common inputs, with the
// same float operations in the same order (so every value is bit-identical).  Returns the ranked
// tuple of PodInputs, or None when an input needs the Python path's clamping or conversion (a
// load or prefix field that is not an exact float/int in range, a pod id that is not an exact
// str, kv_stall > 0, a prefix or load value that is not None and lacks a field): the caller then
// runs the Python loop, which handles (or raises for) every such input as before.
struct PickRow {
    double key, cost, qlen;
    PyObject* pod;
    nb::object row;
};

// An exact float in [lo, hi) (hi_incl: [lo, hi]); false (no error set) otherwise.
inline bool float_in(PyObject* o, double lo, double hi, bool hi_incl, double& v) {
    if (!PyFloat_CheckExact(o)) return false;
    v = PyFloat_AS_DOUBLE(o);
    return v >= lo && (hi_incl ? v <= hi : v < hi);
}

// An exact int of magnitude below 2**53 (exact as a double); false (no error set) otherwise.
inline bool int53(PyObject* o, long long& v) {
    if (!PyLong_CheckExact(o)) return false;
    int overflow = 0;
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
    }
    return v > -(1LL << 53) && v < (1LL << 53);
}

// The attribute `name` of o as a new reference, or null (error cleared) when it has none.
inline PyObject* attr(PyObject* o, PyObject* name) {
    PyObject* r = PyObject_GetAttr(o, name);
    if (!r) PyErr_Clear();
    return r;
}

nb::object ttft_rows(nb::handle prefix_o, nb::handle loads_o, nb::handle pods_o, nb::handle n_prompt_o, double kvp,
                     double stall, double reserve, double tie, nb::handle row_type) {
    (void)reserve;  // only the overflow term (kv_stall > 0, the Python path) reads it
    if (!PyDict_CheckExact(prefix_o.ptr()) || !PyDict_CheckExact(loads_o.ptr()) || !PyList_CheckExact(pods_o.ptr()))
        return nb::none();
    // the prompt length as any int (2**63 and past it included): the Python path takes them all
    long long n_prompt;
    if (!int53(n_prompt_o.ptr(), n_prompt)) return nb::none();
    if (stall > 0.0 || n_prompt < 0) return nb::none();
    // parameters changed after the constructor's checks (NaN, infinite, negative): the Python path
    if (!(kvp >= 0.0 && kvp < HUGE_VAL) || !(stall >= 0.0) || !(tie >= 0.0 && tie < HUGE_VAL)) return nb::none();
    static PyObject *s_waiting = PyUnicode_InternFromString("waiting"),
                    *s_in_flight = PyUnicode_InternFromString("in_flight"),
                    *s_kv_usage = PyUnicode_InternFromString("kv_usage"),
                    *s_prefill = PyUnicode_InternFromString("prefill_tokens"),
                    *s_coverage = PyUnicode_InternFromString("coverage"),
                    *s_matched_tokens = PyUnicode_InternFromString("matched_tokens"),
                    *s_matched_blocks = PyUnicode_InternFromString("matched_blocks"),
                    *s_weighted = PyUnicode_InternFromString("weighted_blocks");
    const double np_d = (double)n_prompt;
    const double hit_cap = (double)(n_prompt > 1 ? n_prompt - 1 : 0);
    PyObject* prefix = prefix_o.ptr();
    PyObject* loads = loads_o.ptr();
    Py_ssize_t n = PyList_GET_SIZE(pods_o.ptr());
    std::vector<PickRow> rows;
    rows.reserve((size_t)n);
    nb::object zero_f = nb::steal(PyFloat_FromDouble(0.0)), zero_i = nb::steal(PyLong_FromLong(0));
    for (Py_ssize_t k = 0; k < n; ++k) {
        PyObject* pod = PyList_GET_ITEM(pods_o.ptr(), k);
        if (!PyUnicode_CheckExact(pod)) return nb::none();
        PyObject* ps = PyDict_GetItemWithError(prefix, pod);  // borrowed
        if (!ps && PyErr_Occurred()) throw nb::python_error();
        PyObject* ld = PyDict_GetItemWithError(loads, pod);
        if (!ld && PyErr_Occurred()) throw nb::python_error();
        // owned while their fields are read: a field's getter may drop the dicts' references
        nb::object ps_ref = nb::borrow(ps), ld_ref = nb::borrow(ld);
        if (ps == Py_None) ps = nullptr;
        if (ld == Py_None) ld = nullptr;
        nb::object waiting_o = zero_f, in_flight_o = zero_i, usage_o = zero_f, cov_o = zero_f, matched_o = zero_i;
        double waiting = 0.0, usage = 0.0, q = 0.0, cov = 0.0, cached = 0.0;
        long long in_flight = 0;
        if (ld) {
            waiting_o = nb::steal(attr(ld, s_waiting));
            in_flight_o = nb::steal(attr(ld, s_in_flight));
            usage_o = nb::steal(attr(ld, s_kv_usage));
            nb::object q_o = nb::steal(attr(ld, s_prefill));
            if (!waiting_o.is_valid() || !in_flight_o.is_valid() || !usage_o.is_valid() || !q_o.is_valid())
                return nb::none();
            if (!float_in(waiting_o.ptr(), 0.0, HUGE_VAL, false, waiting)) return nb::none();
            if (!int53(in_flight_o.ptr(), in_flight) || in_flight < 0) return nb::none();
            if (!float_in(usage_o.ptr(), 0.0, 1.0, true, usage)) return nb::none();
            if (q_o.is_none()) {
                q = waiting * np_d;
            } else if (!float_in(q_o.ptr(), 0.0, HUGE_VAL, false, q)) {
                return nb::none();
            }
        }
        if (ps) {
            cov_o = nb::steal(attr(ps, s_coverage));
            matched_o = nb::steal(attr(ps, s_matched_tokens));
            nb::object mb_o = nb::steal(attr(ps, s_matched_blocks));
            if (!cov_o.is_valid() || !matched_o.is_valid() || !mb_o.is_valid()) return nb::none();
            long long matched, mb;
            if (!float_in(cov_o.ptr(), 0.0, 1.0, true, cov)) return nb::none();
            if (!int53(matched_o.ptr(), matched) || !int53(mb_o.ptr(), mb)) return nb::none();
            if (mb > 0) {
                nb::object wb_o = nb::steal(attr(ps, s_weighted));
                double wb;
                if (!wb_o.is_valid() || !float_in(wb_o.ptr(), 0.0, HUGE_VAL, false, wb)) return nb::none();
                cached = wb * ((double)matched / (double)mb);
                if (cached > hit_cap) cached = hit_cap;
            }
        }
        double un = np_d > cached ? np_d - cached : 0.0;
        double over = 0.0;
        double cost = q + un * (1.0 + kvp * usage) + stall * over;
        double qlen = waiting + (double)in_flight;
        if (cost != cost) return nb::none();  // never for checked inputs; the sort below needs an order
        PyObject* args[14];
        nb::object total = nb::steal(PyFloat_FromDouble(-cost)), kv = nb::steal(PyFloat_FromDouble(1.0 - usage)),
                   qlen_o = nb::steal(PyFloat_FromDouble(qlen)), un_o = nb::steal(PyLong_FromDouble(std::nearbyint(un))),
                   q_f = nb::steal(PyFloat_FromDouble(q)), cost_o = nb::steal(PyFloat_FromDouble(cost)),
                   over_o = nb::steal(PyFloat_FromDouble(over));
        if (!total.is_valid() || !kv.is_valid() || !qlen_o.is_valid() || !un_o.is_valid() || !q_f.is_valid() ||
            !cost_o.is_valid() || !over_o.is_valid())
            throw nb::python_error();
        args[0] = pod;
        args[1] = total.ptr();
        args[2] = ps ? cov_o.ptr() : zero_f.ptr();
        args[3] = kv.ptr();
        args[4] = qlen_o.ptr();
        args[5] = ps ? matched_o.ptr() : zero_i.ptr();
        args[6] = waiting_o.ptr();
        args[7] = in_flight_o.ptr();
        args[8] = usage_o.ptr();
        args[9] = ld ? Py_True : Py_False;
        args[10] = un_o.ptr();
        args[11] = q_f.ptr();
        args[12] = cost_o.ptr();
        args[13] = over_o.ptr();
        PyObject* row = PyObject_Vectorcall(row_type.ptr(), args, 14, nullptr);
        if (!row) throw nb::python_error();
        rows.push_back(PickRow{cost, cost, qlen, pod, nb::steal(row)});
    }
    if (tie > 0.0 && !rows.empty()) {
        double best = rows[0].cost;
        for (const PickRow& r : rows)
            if (r.cost < best) best = r.cost;
        for (PickRow& r : rows) r.key = r.cost - best <= tie ? best : r.cost;
    }
    bool failed = false;
    // (key, queue, pod): pod ids are unique, so this is the Python sort's total order
    std::sort(rows.begin(), rows.end(), [&](const PickRow& a, const PickRow& b) {
        if (a.key != b.key) return a.key < b.key;
        if (a.qlen != b.qlen) return a.qlen < b.qlen;
        int c = PyUnicode_Compare(a.pod, b.pod);
        if (c == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            failed = true;
        }
        return c < 0;
    });
    if (failed) return nb::none();
    nb::object out = nb::steal(PyTuple_New((Py_ssize_t)rows.size()));
    if (!out.is_valid()) throw nb::python_error();
    for (size_t k = 0; k < rows.size(); ++k) PyTuple_SET_ITEM(out.ptr(), (Py_ssize_t)k, rows[k].row.release().ptr());
    return out;
}


}  // namespace kvnative
