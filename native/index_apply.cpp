// IndexCore::apply_events: runs of a decoded batch's events applied in one call.
#include "index_core.h"

namespace kvnative {

std::tuple<size_t, size_t, size_t, size_t, size_t, size_t, size_t, size_t, size_t, std::vector<u64>,
           std::vector<u64>>
IndexCore::apply_events(
    const std::string& pod, int32_t rank, uint16_t mid, nb::handle events_o, size_t start,
    nb::handle stored_t, nb::handle removed_t, nb::handle cleared_t, nb::handle tier_bits, u64 root,
    nb::handle K_o, u64 A) {
    U64View K;
    to_u64(K_o, K, "K");
    size_t bs = K.n;
    if (bs == 0) throw nb::value_error("empty K");
    if (!PyDict_Check(tier_bits.ptr())) throw nb::type_error("tier_bits must be a dict");
    PyObject* seq = PySequence_Fast(events_o.ptr(), "events");
    if (!seq) throw nb::python_error();
    nb::object seq_ref = nb::steal(seq);
    size_t n = (size_t)PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    static nb::str a_hashes("block_hashes"), a_parent("parent_block_hash"), a_tokens("token_ids"),
        a_bsize("block_size"), a_tier("tier"), a_lora("lora_name"), a_extra("extra_keys");

    struct Ev {
        int kind = 0;  // 0 stored, 1 removed, 2 cleared
        u64 bit = 0;
        bool has_parent = false;
        u64 parent = 0;
        U64View eks, toks;
    };
    std::vector<Ev> evs;
    evs.reserve(n > start ? n - start : 0);
    size_t stop = start;
    for (; stop < n; ++stop) {
        PyObject* ev = items[stop];
        PyObject* tp = (PyObject*)Py_TYPE(ev);
        if (tp == cleared_t.ptr()) {
            evs.emplace_back();
            evs.back().kind = 2;
            continue;
        }
        bool is_store = tp == stored_t.ptr();
        if (!is_store && tp != removed_t.ptr()) break;
        nb::handle e(ev);
        nb::object tier = nb::getattr(e, a_tier);
        PyObject* bit_o = PyDict_GetItemWithError(tier_bits.ptr(), tier.ptr());
        if (!bit_o) {
            if (PyErr_Occurred()) PyErr_Clear();
            break;
        }
        Ev x;
        x.kind = is_store ? 0 : 1;
        x.bit = PyLong_AsUnsignedLongLong(bit_o);
        if (x.bit == (u64)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            break;
        }
        try {
            to_u64(nb::getattr(e, a_hashes), x.eks, "block_hashes");
        } catch (nb::builtin_exception&) {
            break;
        } catch (nb::python_error&) {
            break;
        }
        if (is_store) {
            if (!nb::getattr(e, a_lora).is_none() || !nb::getattr(e, a_extra).is_none()) break;
            nb::object bsz = nb::getattr(e, a_bsize);
            if (!bsz.is_none()) {
                long v = PyLong_AsLong(bsz.ptr());
                if (v == -1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    break;
                }
                if ((size_t)v != bs) break;
            }
            try {
                to_u64(nb::getattr(e, a_tokens), x.toks, "token_ids");
            } catch (nb::builtin_exception&) {
                break;
            } catch (nb::python_error&) {
                break;
            }
            if (x.toks.n == 0 || x.toks.n != bs * x.eks.n) break;
            nb::object par = nb::getattr(e, a_parent);
            if (!par.is_none()) {
                if (!PyLong_Check(par.ptr()) || PyBool_Check(par.ptr())) break;
                x.parent = PyLong_AsUnsignedLongLong(par.ptr());
                if (x.parent == (u64)-1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    break;
                }
                x.has_parent = true;
            }
        }
        evs.push_back(std::move(x));
    }

    size_t st_ev = 0, st_blocks = 0, rm_ev = 0, rm_blocks = 0, hits = 0, misses = 0, clears = 0, clears_n = 0;
    std::vector<u64> st_bits(64, 0), rm_bits(64, 0);
    size_t applied = 0;
    {
        nb::gil_scoped_release nogil;
        auto lk = wlock();
        std::vector<u64> rks;
        for (; applied < evs.size(); ++applied) {
            Ev& x = evs[applied];
            if (x.kind == 2) {
                size_t removed = clear_locked(pod, rank, mid);
                ++clears;
                if (removed) ++clears_n;
                continue;
            }
            if (x.kind == 1) {
                auto it = pod_by_name_.find(pod);
                if (it == pod_by_name_.end()) {
                    misses += x.eks.n;
                } else {
                    uint16_t ps = it->second;
                    u64 sid = stream_id(ps, mid, rank);
                    for (size_t i = 0; i < x.eks.n; ++i) {
                        u64 ek = x.eks.data[i];
                        Stream* stp = stream(sid);
                        u64 rk;
                        if (stp && s_find(*stp, ek, rk) && drop_copy(ps, rank, ek, rk, x.bit))
                            ++hits;
                        else
                            ++misses;
                    }
                    finish_write(ps);
                }
                ++rm_ev;
                rm_blocks += x.eks.n;
                if (x.bit) rm_bits[__builtin_ctzll(x.bit)] += x.eks.n;
                continue;
            }
            size_t nb_ = x.eks.n;
            const u64* keys = x.eks.data;
            if (!compat_) {
                u64 state = root;
                if (x.has_parent) {
                    std::optional<u64> prk;
                    auto it = pod_by_name_.find(pod);
                    if (it != pod_by_name_.end()) {
                        prk = resolve_locked(it->second, rank, mid, x.parent);
                    } else {
                        prk = engine_find(mid, x.parent);
                    }
                    if (!prk) break;  // an orphan: the caller keeps it
                    state = *prk;
                }
                rks.resize(nb_);
                chain_into(state, x.toks.data, nb_, K.data, bs, A, nullptr, rks.data());
                keys = rks.data();
            }
            prefetch_put(mid, x.eks.data, keys, nb_);
            uint16_t ps = pod_slot(pod);
            Stream& st = stream_mk(stream_id(ps, mid, rank));
            for (size_t i = 0; i < nb_; ++i) put_s(st, ps, rank, mid, x.eks.data[i], keys[i], x.bit);
            finish_write(ps);
            ++st_ev;
            st_blocks += nb_;
            if (x.bit) st_bits[__builtin_ctzll(x.bit)] += nb_;
        }
    }
    for (std::vector<u64>* v : {&st_bits, &rm_bits})
        while (!v->empty() && v->back() == 0) v->pop_back();
    return {start + applied, st_ev, st_blocks, rm_ev, rm_blocks, hits, misses, clears, clears_n,
            std::move(st_bits), std::move(rm_bits)};
}

void IndexCore::prefetch_put(uint16_t mid, const u64* eks, const u64* rks, size_t n) {
    Engine* em = compat_ ? nullptr : engine_map(mid);
    for (size_t i = 0; i < n; ++i) {
        rk_map_.prefetch(rks[i]);
        if (em) em->t.prefetch(eks[i]);
    }
    for (size_t i = 0; i < n; ++i) {
        u32 b = rk_map_.at_home(rks[i]);
        if (b != NIL) rk_map_.key().prefetch(b);
        if (em && (b = em->t.at_home(eks[i])) != NIL) em->t.key().prefetch(b);
    }
}

}  // namespace kvnative
