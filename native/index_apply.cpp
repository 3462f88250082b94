// IndexCore::apply_events: runs of a decoded batch's events applied in one call.
#include "index_core.h"

namespace kvnative {

// One event of a batch, read from Python: its kind, tier bit and keys.
struct IndexCore::BatchEvent {
    int kind = 0;  // 0 stored, 1 removed, 2 cleared
    u64 bit = 0;
    bool has_parent = false;
    u64 parent = 0;
    U64View eks, toks;
};

// Which group's events a run takes (see apply_events in index_core.h).
struct IndexCore::GroupGate {
    bool grouped = false;   // the publisher has learned a KV-cache group
    long long primary = -1;  // its primary group_idx, -1 while none is usable
    PyObject* kind = nullptr;
    PyObject* window = nullptr;
    bool none_kind = false;  // a store without a kind has the primary's spec (full attention)
};

// What apply_events applied: events, blocks, removal hits and misses, clears, blocks per tier bit.
struct IndexCore::BatchCounts {
    size_t st_ev = 0, st_blocks = 0, rm_ev = 0, rm_blocks = 0, hits = 0, misses = 0, clears = 0, clears_n = 0;
    u64 st_bits[64] = {}, rm_bits[64] = {};
};

IndexCore::ApplyOut IndexCore::apply_events(
    const std::string& pod, int32_t rank, uint16_t mid, nb::handle events_o, size_t start,
    nb::handle stored_t, nb::handle removed_t, nb::handle cleared_t, nb::handle tier_bits, u64 root,
    nb::handle K_o, u64 A, nb::handle gate_o) {
    GroupGate gate;
    nb::tuple g = nb::cast<nb::tuple>(gate_o);
    if (g.size() != 0) {
        if (g.size() != 4) throw nb::value_error("gate: () or (primary, kind, window, none_kind)");
        gate.grouped = true;
        gate.primary = nb::cast<long long>(g[0]);
        gate.kind = g[1].ptr();
        gate.window = g[2].ptr();
        gate.none_kind = nb::cast<bool>(g[3]);
    }
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

    std::vector<BatchEvent> evs;
    evs.reserve(n > start ? n - start : 0);
    read_events(items, start, n, stored_t, removed_t, cleared_t, tier_bits, bs, gate, evs);

    BatchCounts c;
    size_t applied;
    {
        nb::gil_scoped_release nogil;  // as apply_raw: every write gives the GIL up
        applied = apply_locked(pod, rank, mid, evs, root, K, A, c);
    }
    return apply_out(start + applied, c);
}

IndexCore::ApplyOut IndexCore::apply_raw(const std::string& pod, int32_t rank, uint16_t mid, const RawBatch& rb,
                                         size_t start, u64 root, nb::bytes K_b, u64 A) {
    U64View K;  // the chain's K as native-endian uint64 bytes (read in place: no array conversion)
    if (K_b.size() % sizeof(u64)) throw nb::value_error("K: a whole number of uint64 expected");
    K.owned.resize(K_b.size() / sizeof(u64));
    std::memcpy(K.owned.data(), K_b.c_str(), K_b.size());
    K.data = K.owned.data();
    K.n = K.owned.size();
    size_t bs = K.n;
    if (bs == 0) throw nb::value_error("empty K");
    BatchCounts c;
    size_t applied;
    size_t n = rb.evs.size();
    {
        // every write gives the GIL up, however small: a thread waiting for it (a router's score)
        // gets it within about one message.  A pool shard that kept it for small batches made
        // such a thread wait for the interpreter's switch interval (5 ms); and one that gave it
        // up only now and then starved the waiter, whose wait for the GIL starts over at each
        // release it loses (docs/design.md, "Locks")
        nb::gil_scoped_release nogil;
        std::vector<BatchEvent> evs;
        evs.reserve(n > start ? n - start : 0);
        const u64* d = rb.data.data();
        for (size_t i = start; i < n; ++i) {
            const RawEvent& r = rb.evs[i];
            // read_event's stop: a store of another block size (read_raw_batch took only stores
            // with tokens, block_size tokens per hash, and a known tier)
            if (r.kind == 0 && (size_t)r.block_size != bs) break;
            evs.emplace_back();
            BatchEvent& x = evs.back();
            x.kind = r.kind;
            x.bit = r.bit;
            x.has_parent = r.has_parent;
            x.parent = r.parent;
            x.eks.data = d + r.h_off;
            x.eks.n = r.h_n;
            x.toks.data = d + r.t_off;
            x.toks.n = r.t_n;
        }
        applied = apply_locked(pod, rank, mid, evs, root, K, A, c);
    }
    return apply_out(start + applied, c);
}

inline size_t IndexCore::apply_locked(const std::string& pod, int32_t rank, uint16_t mid,
                                      std::vector<BatchEvent>& evs, u64 root, const U64View& K, u64 A,
                                      BatchCounts& c) {
    auto lk = wlock();
    std::vector<u64> rks;
    size_t applied = 0;
    for (; applied < evs.size(); ++applied) {
        BatchEvent& x = evs[applied];
        if (x.kind == 2) {
            size_t removed = clear_locked(pod, rank, mid);
            ++c.clears;
            if (removed) ++c.clears_n;
            continue;
        }
        if (x.kind == 1) {
            apply_removed(pod, rank, mid, x, c);
            continue;
        }
        if (!apply_stored(pod, rank, mid, x, root, K, A, rks, c)) break;  // an orphan: the caller keeps it
    }
    return applied;
}

inline IndexCore::ApplyOut IndexCore::apply_out(size_t next, BatchCounts& c) {
    auto upto_last = [](const u64* v) {
        size_t n = 64;
        while (n && v[n - 1] == 0) --n;
        return std::vector<u64>(v, v + n);
    };
    return {next, c.st_ev, c.st_blocks, c.rm_ev, c.rm_blocks, c.hits, c.misses, c.clears, c.clears_n,
            upto_last(c.st_bits), upto_last(c.rm_bits)};
}

inline void IndexCore::read_events(PyObject** items, size_t start, size_t n, nb::handle stored_t,
                                   nb::handle removed_t, nb::handle cleared_t, nb::handle tier_bits, size_t bs,
                                   const GroupGate& gate, std::vector<BatchEvent>& evs) {
    for (size_t stop = start; stop < n; ++stop) {
        PyObject* ev = items[stop];
        PyObject* tp = (PyObject*)Py_TYPE(ev);
        if (tp == cleared_t.ptr()) {
            if (gate.grouped) break;  // the groups' tables are cleared too: in Python
            evs.emplace_back();
            evs.back().kind = 2;
            continue;
        }
        bool is_store = tp == stored_t.ptr();
        if (!is_store && tp != removed_t.ptr()) break;
        BatchEvent x;
        if (!read_event(ev, is_store, tier_bits, bs, gate, x)) break;
        evs.push_back(std::move(x));
    }
}

// Python equality of two objects (false on an error, which is cleared).
static inline bool py_eq(PyObject* a, PyObject* b) {
    if (a == b) return true;
    int r = PyObject_RichCompareBool(a, b, Py_EQ);
    if (r < 0) PyErr_Clear();
    return r == 1;
}

// Does the primary group's table take event e as it is (kvindex/groups.py GroupTables.learn / route)?
inline bool IndexCore::group_ok(nb::handle e, bool is_store, const GroupGate& gate) {
    static nb::str a_group("group_idx"), a_kind("kv_cache_spec_kind"), a_window("kv_cache_spec_sliding_window");
    nb::object gi = nb::getattr(e, a_group);
    if (gi.is_none()) return true;
    if (!PyLong_Check(gi.ptr()) || PyBool_Check(gi.ptr())) return false;
    long long g = PyLong_AsLongLong(gi.ptr());
    if (g == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    if (!is_store) return !gate.grouped || (g >= 0 && g == gate.primary);  // no group learned: the main tables
    if (g < 0 || g != gate.primary) return false;  // a group to learn, or another group's store
    nb::object kind = nb::getattr(e, a_kind);
    if (kind.is_none() ? !gate.none_kind : !py_eq(kind.ptr(), gate.kind)) return false;
    return py_eq(nb::getattr(e, a_window).ptr(), gate.window);
}

inline bool IndexCore::read_event(PyObject* ev, bool is_store, nb::handle tier_bits, size_t bs, const GroupGate& gate,
                                  BatchEvent& x) {
    static nb::str a_hashes("block_hashes"), a_parent("parent_block_hash"), a_tokens("token_ids"),
        a_bsize("block_size"), a_tier("tier"), a_lora("lora_name"), a_extra("extra_keys");
    nb::handle e(ev);
    nb::object tier = nb::getattr(e, a_tier);
    PyObject* bit_o = PyDict_GetItemWithError(tier_bits.ptr(), tier.ptr());
    if (!bit_o) {
        if (PyErr_Occurred()) PyErr_Clear();
        return false;
    }
    if (!group_ok(e, is_store, gate)) return false;
    x.kind = is_store ? 0 : 1;
    x.bit = PyLong_AsUnsignedLongLong(bit_o);
    if (x.bit == (u64)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    try {
        to_u64(nb::getattr(e, a_hashes), x.eks, "block_hashes");
    } catch (nb::builtin_exception&) {
        return false;
    } catch (nb::python_error&) {
        return false;
    }
    if (!is_store) return true;
    if (!nb::getattr(e, a_lora).is_none() || !nb::getattr(e, a_extra).is_none()) return false;
    nb::object bsz = nb::getattr(e, a_bsize);
    if (!bsz.is_none()) {
        long v = PyLong_AsLong(bsz.ptr());
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return false;
        }
        if ((size_t)v != bs) return false;
    }
    try {
        to_u64(nb::getattr(e, a_tokens), x.toks, "token_ids");
    } catch (nb::builtin_exception&) {
        return false;
    } catch (nb::python_error&) {
        return false;
    }
    if (x.toks.n == 0 || x.toks.n != bs * x.eks.n) return false;
    nb::object par = nb::getattr(e, a_parent);
    if (!par.is_none()) {
        if (!PyLong_Check(par.ptr()) || PyBool_Check(par.ptr())) return false;
        x.parent = PyLong_AsUnsignedLongLong(par.ptr());
        if (x.parent == (u64)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return false;
        }
        x.has_parent = true;
    }
    return true;
}

inline void IndexCore::apply_removed(const std::string& pod, int32_t rank, uint16_t mid, const BatchEvent& x,
                                     BatchCounts& c) {
    auto it = pod_by_name_.find(pod);
    if (it == pod_by_name_.end()) {
        c.misses += x.eks.n;
    } else {
        uint16_t ps = it->second;
        u64 sid = stream_id(ps, mid, rank);
        for (size_t i = 0; i < x.eks.n; ++i) {
            u64 ek = x.eks.data[i];
            Stream* stp = stream(sid);
            u64 rk;
            if (stp && s_find(*stp, ek, rk) && drop_copy(ps, rank, ek, rk, x.bit))
                ++c.hits;
            else
                ++c.misses;
        }
        finish_write(ps);
    }
    ++c.rm_ev;
    c.rm_blocks += x.eks.n;
    if (x.bit) c.rm_bits[__builtin_ctzll(x.bit)] += x.eks.n;
}

inline bool IndexCore::apply_stored(const std::string& pod, int32_t rank, uint16_t mid, const BatchEvent& x, u64 root,
                                    const U64View& K, u64 A, std::vector<u64>& rks, BatchCounts& c) {
    size_t bs = K.n;
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
            if (!prk) return false;
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
    ++c.st_ev;
    c.st_blocks += nb_;
    if (x.bit) c.st_bits[__builtin_ctzll(x.bit)] += nb_;
    return true;
}

inline void IndexCore::prefetch_put(uint16_t mid, const u64* eks, const u64* rks, size_t n) {
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
