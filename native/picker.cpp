// ttft_rows: scorer.picker.TTFTPicker's per-candidate pass and ranking for the common inputs.
#include "picker.h"

#include <cmath>

namespace kvnative {

namespace {

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

// The interned names of the fields the pass reads.
struct Fields {
    PyObject *waiting, *in_flight, *kv_usage, *prefill, *coverage, *matched_tokens, *matched_blocks, *weighted;
};

const Fields& fields() {
    static const Fields f{PyUnicode_InternFromString("waiting"), PyUnicode_InternFromString("in_flight"),
                          PyUnicode_InternFromString("kv_usage"), PyUnicode_InternFromString("prefill_tokens"),
                          PyUnicode_InternFromString("coverage"), PyUnicode_InternFromString("matched_tokens"),
                          PyUnicode_InternFromString("matched_blocks"), PyUnicode_InternFromString("weighted_blocks")};
    return f;
}

// One candidate's inputs: the field objects its row reuses, and their values.
struct Cand {
    nb::object waiting_o, in_flight_o, usage_o, cov_o, matched_o;
    double waiting = 0.0, usage = 0.0, q = 0.0, cov = 0.0, cached = 0.0;
    long long in_flight = 0;
};

// The load fields of ld into c; false (decline) when one is missing or not an exact value in range.
bool read_load(PyObject* ld, double np_d, Cand& c) {
    const Fields& f = fields();
    c.waiting_o = nb::steal(attr(ld, f.waiting));
    c.in_flight_o = nb::steal(attr(ld, f.in_flight));
    c.usage_o = nb::steal(attr(ld, f.kv_usage));
    nb::object q_o = nb::steal(attr(ld, f.prefill));
    if (!c.waiting_o.is_valid() || !c.in_flight_o.is_valid() || !c.usage_o.is_valid() || !q_o.is_valid())
        return false;
    if (!float_in(c.waiting_o.ptr(), 0.0, HUGE_VAL, false, c.waiting)) return false;
    if (!int53(c.in_flight_o.ptr(), c.in_flight) || c.in_flight < 0) return false;
    if (!float_in(c.usage_o.ptr(), 0.0, 1.0, true, c.usage)) return false;
    if (q_o.is_none()) {
        c.q = c.waiting * np_d;
    } else if (!float_in(q_o.ptr(), 0.0, HUGE_VAL, false, c.q)) {
        return false;
    }
    return true;
}

// The prefix fields of ps into c (cached: the prompt tokens the pod holds, capped at hit_cap);
// false (decline) when one is missing or not an exact value in range.
bool read_prefix(PyObject* ps, double hit_cap, Cand& c) {
    const Fields& f = fields();
    c.cov_o = nb::steal(attr(ps, f.coverage));
    c.matched_o = nb::steal(attr(ps, f.matched_tokens));
    nb::object mb_o = nb::steal(attr(ps, f.matched_blocks));
    if (!c.cov_o.is_valid() || !c.matched_o.is_valid() || !mb_o.is_valid()) return false;
    long long matched, mb;
    if (!float_in(c.cov_o.ptr(), 0.0, 1.0, true, c.cov)) return false;
    if (!int53(c.matched_o.ptr(), matched) || !int53(mb_o.ptr(), mb)) return false;
    if (mb > 0) {
        nb::object wb_o = nb::steal(attr(ps, f.weighted));
        double wb;
        if (!wb_o.is_valid() || !float_in(wb_o.ptr(), 0.0, HUGE_VAL, false, wb)) return false;
        c.cached = wb * ((double)matched / (double)mb);
        if (c.cached > hit_cap) c.cached = hit_cap;
    }
    return true;
}

// pod's PodInputs (row_type called with the fields in order); throws when Python fails.
nb::object make_row(nb::handle row_type, PyObject* pod, bool has_ps, bool has_ld, const Cand& c, double un,
                    double cost, double qlen, double over, const nb::object& zero_f, const nb::object& zero_i) {
    PyObject* args[14];
    nb::object total = nb::steal(PyFloat_FromDouble(-cost)), kv = nb::steal(PyFloat_FromDouble(1.0 - c.usage)),
               qlen_o = nb::steal(PyFloat_FromDouble(qlen)), un_o = nb::steal(PyLong_FromDouble(std::nearbyint(un))),
               q_f = nb::steal(PyFloat_FromDouble(c.q)), cost_o = nb::steal(PyFloat_FromDouble(cost)),
               over_o = nb::steal(PyFloat_FromDouble(over));
    if (!total.is_valid() || !kv.is_valid() || !qlen_o.is_valid() || !un_o.is_valid() || !q_f.is_valid() ||
        !cost_o.is_valid() || !over_o.is_valid())
        throw nb::python_error();
    args[0] = pod;
    args[1] = total.ptr();
    args[2] = has_ps ? c.cov_o.ptr() : zero_f.ptr();
    args[3] = kv.ptr();
    args[4] = qlen_o.ptr();
    args[5] = has_ps ? c.matched_o.ptr() : zero_i.ptr();
    args[6] = c.waiting_o.ptr();
    args[7] = c.in_flight_o.ptr();
    args[8] = c.usage_o.ptr();
    args[9] = has_ld ? Py_True : Py_False;
    args[10] = un_o.ptr();
    args[11] = q_f.ptr();
    args[12] = cost_o.ptr();
    args[13] = over_o.ptr();
    PyObject* row = PyObject_Vectorcall(row_type.ptr(), args, 14, nullptr);
    if (!row) throw nb::python_error();
    return nb::steal(row);
}

// The rows ranked by (cost within `tie` of the best, queue, pod) as a tuple; None when pods do not compare.
nb::object rank_rows(std::vector<PickRow>& rows, double tie) {
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

}  // namespace

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
        Cand c;
        c.waiting_o = zero_f;
        c.in_flight_o = zero_i;
        c.usage_o = zero_f;
        c.cov_o = zero_f;
        c.matched_o = zero_i;
        if (ld && !read_load(ld, np_d, c)) return nb::none();
        if (ps && !read_prefix(ps, hit_cap, c)) return nb::none();
        double un = np_d > c.cached ? np_d - c.cached : 0.0;
        double over = 0.0;
        double cost = c.q + un * (1.0 + kvp * c.usage) + stall * over;
        double qlen = c.waiting + (double)c.in_flight;
        if (cost != cost) return nb::none();  // never for checked inputs; the sort below needs an order
        nb::object row = make_row(row_type, pod, ps != nullptr, ld != nullptr, c, un, cost, qlen, over, zero_f, zero_i);
        rows.push_back(PickRow{cost, cost, qlen, pod, std::move(row)});
    }
    return rank_rows(rows, tie);
}

}  // namespace kvnative
