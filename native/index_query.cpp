// IndexCore's other reads: per-key and per-pod lookups, DP ranks, stats, and the consistency check.
#include "index_core.h"

namespace kvnative {

void IndexCore::begin_multi() {
    nb::gil_scoped_release nogil;
    auto lk = wlock();
    ++multi_;
}

void IndexCore::end_multi() {
    nb::gil_scoped_release nogil;
    auto lk = wlock();
    if (multi_ == 0) throw std::logic_error("end_multi without begin_multi");
    --multi_;
}

nb::dict IndexCore::pod_masks(nb::handle keys_o, std::vector<std::string> names) {
    U64View keys;
    to_u64(keys_o, keys, "request_keys");
    std::vector<std::vector<u64>> rows(names.size(), std::vector<u64>(keys.n, 0));
    {
        nb::gil_scoped_release nogil;
        std::shared_lock lk(mu_);
        for (size_t c = 0; c < names.size(); ++c) {
            auto it = pod_by_name_.find(names[c]);
            if (it == pod_by_name_.end()) continue;
            for (size_t i = 0; i < keys.n; ++i) {
                Found bi = rk_map_.find_ptr(keys.data[i]);
                if (!bi) continue;
                u64 m = 0;
                for (const Holder& h : blocks_[*bi].hs)
                    if (h.pod() == it->second) m |= hmask(h);
                rows[c][i] = m;
            }
        }
    }
    nb::dict out;
    for (size_t c = 0; c < names.size(); ++c) out[nb::str(names[c].c_str())] = new_u64_array(std::move(rows[c]));
    return out;
}

nb::bytes IndexCore::stream_masks(const std::string& pod, int32_t rank, uint16_t mid, nb::handle keys_o) {
    U64View keys;
    to_u64(keys_o, keys, "request_keys");
    std::vector<u64> out(keys.n, 0);
    {
        nb::gil_scoped_release nogil;
        std::shared_lock lk(mu_);
        auto it = pod_by_name_.find(pod);
        if (it != pod_by_name_.end())
            for (size_t i = 0; i < keys.n; ++i) {
                Found bi = rk_map_.find_ptr(keys.data[i]);
                if (!bi) continue;
                for (const Holder& h : blocks_[*bi].hs)
                    if (h.pod() == it->second && hrank(h) == rank && hmodel(h) == mid) {
                        out[i] = hmask(h);
                        break;
                    }
            }
    }
    return new_u64_array(std::move(out));
}

std::vector<std::vector<std::tuple<std::string, u64, int32_t>>> IndexCore::lookup(nb::handle keys_o) {
    U64View keys;
    to_u64(keys_o, keys, "request_keys");
    std::vector<std::vector<std::tuple<std::string, u64, int32_t>>> out(keys.n);
    nb::gil_scoped_release nogil;
    std::shared_lock lk(mu_);
    for (size_t i = 0; i < keys.n; ++i) {
        Found bi = rk_map_.find_ptr(keys.data[i]);
        if (!bi) continue;
        for (const Holder& h : blocks_[*bi].hs) out[i].emplace_back(pod_names_[h.pod()], hmask(h), hrank(h));
    }
    return out;
}

std::optional<int32_t> IndexCore::best_dp_rank(const std::string& pod, nb::handle keys_o) {
    U64View keys;
    to_u64(keys_o, keys, "request_keys");
    nb::gil_scoped_release nogil;
    std::shared_lock lk(mu_);
    auto it = pod_by_name_.find(pod);
    if (it == pod_by_name_.end() || keys.n == 0) return std::nullopt;
    uint16_t ps = it->second;
    // the common case: the pod publishes from one DP rank, which then holds its whole match
    int32_t only = 0;
    int nranks = 0;
    for (auto& kv : streams_) {
        if (stream_pod(kv.first) != ps || kv.second.empty()) continue;
        int32_t r = stream_rank(kv.first);
        if (nranks == 0 || r != only) {
            if (nranks == 1) {
                nranks = 2;
                break;
            }
            only = r;
            nranks = 1;
        }
    }
    if (nranks == 1) {
        Found bi = rk_map_.find_ptr(keys.data[0]);
        if (bi)
            for (const Holder& h : blocks_[*bi].hs)
                if (h.pod() == ps && hrank(h) == only) return only;
        return std::nullopt;
    }
    std::vector<int32_t> alive, next;
    bool first = true;
    std::optional<int32_t> best;
    for (size_t i = 0; i < keys.n; ++i) {
        Found bi = rk_map_.find_ptr(keys.data[i]);
        next.clear();
        if (bi)
            for (const Holder& h : blocks_[*bi].hs)
                if (h.pod() == ps && (first || std::find(alive.begin(), alive.end(), hrank(h)) != alive.end()))
                    next.push_back(hrank(h));
        first = false;
        alive.swap(next);
        if (alive.empty()) break;
        best = *std::min_element(alive.begin(), alive.end());
    }
    return best;
}

std::optional<u64> IndexCore::resolve(const std::string& pod, int32_t rank, uint16_t mid, u64 ek) {
    nb::gil_scoped_release nogil;
    std::shared_lock lk(mu_);
    auto it = pod_by_name_.find(pod);
    if (it != pod_by_name_.end()) return resolve_locked(it->second, rank, mid, ek);
    return engine_find(mid, ek);
}

std::optional<u64> IndexCore::request_key_of(u64 ek, int model) {
    nb::gil_scoped_release nogil;
    std::shared_lock lk(mu_);
    if (compat_) {
        u64 rk;
        for (auto& kv : streams_)
            if ((model == ALL || stream_model(kv.first) == (uint16_t)model) && s_find(kv.second, ek, rk)) return ek;
        return std::nullopt;
    }
    for (auto& e : engines_)
        if (model == ALL || e.first == (uint16_t)model)
            if (std::optional<u64> rk = e_find(e.second, ek)) return rk;
    return std::nullopt;
}

std::vector<std::string> IndexCore::pods() {
    std::shared_lock lk(mu_);
    std::vector<std::string> out;
    for (size_t s = 0; s < pod_names_.size(); ++s)
        if (pod_blocks_[s]) out.push_back(pod_names_[s]);
    return out;
}

bool IndexCore::holds_pod(const std::string& pod) {
    std::shared_lock lk(mu_);
    auto it = pod_by_name_.find(pod);
    return it != pod_by_name_.end() && pod_blocks_[it->second] > 0;
}

bool IndexCore::pod_holds(const std::string& pod, u64 rk) {
    std::shared_lock lk(mu_);
    auto it = pod_by_name_.find(pod);
    if (it == pod_by_name_.end()) return false;
    Found bi = rk_map_.find_ptr(rk);
    if (!bi) return false;
    for (const Holder& h : blocks_[*bi].hs)
        if (h.pod() == it->second) return true;
    return false;
}

std::vector<bool> IndexCore::pod_holds_many(const std::string& pod, nb::handle keys_o) {
    U64View keys;
    to_u64(keys_o, keys, "request_keys");
    std::vector<bool> out(keys.n, false);
    nb::gil_scoped_release nogil;
    std::shared_lock lk(mu_);
    auto it = pod_by_name_.find(pod);
    if (it == pod_by_name_.end()) return out;
    for (size_t i = 0; i < keys.n; ++i) {
        Found bi = rk_map_.find_ptr(keys.data[i]);
        if (!bi) continue;
        for (const Holder& h : blocks_[*bi].hs)
            if (h.pod() == it->second) {
                out[i] = true;
                break;
            }
    }
    return out;
}

bool IndexCore::contains(u64 rk) {
    std::shared_lock lk(mu_);
    return rk_map_.find(rk) != NIL;
}

std::vector<u64> IndexCore::pod_keys(const std::string& pod, std::optional<int32_t> rank) {
    std::vector<u64> out;
    nb::gil_scoped_release nogil;
    std::shared_lock lk(mu_);
    auto it = pod_by_name_.find(pod);
    if (it == pod_by_name_.end()) return out;
    for (auto& kv : streams_)
        if (stream_pod(kv.first) == it->second && (!rank || stream_rank(kv.first) == *rank))
            s_for_each(kv.second, [&](u64, u64 rk) { out.push_back(rk); });
    return out;
}

size_t IndexCore::len() {
    std::shared_lock lk(mu_);
    return rk_map_.size();
}

nb::dict IndexCore::stats() {
    size_t entries = 0, pods = 0;
    std::vector<bool> live;
    u64 keys, engine_keys, ev, st, rm, ur, uo;
    {
        std::shared_lock lk(mu_);
        live.assign(pod_names_.size(), false);
        for (auto& kv : streams_) {
            entries += kv.second.size();
            if (!kv.second.empty()) live[stream_pod(kv.first)] = true;
        }
        for (bool b : live) pods += b;
        keys = rk_map_.size();
        engine_keys = entries;
        if (!compat_) {
            engine_keys = 0;
            for (auto& e : engines_) engine_keys += e.second.size();
        }
        ev = c_evictions_;
        st = c_stored_blocks_;
        rm = c_removed_blocks_;
        ur = c_unknown_removals_;
        uo = c_unknown_offloads_;
    }
    nb::dict d;
    d["keys"] = keys;
    d["entries"] = entries;
    d["engine_keys"] = engine_keys;
    d["pods"] = pods;
    d["evictions"] = ev;
    d["stored_blocks"] = st;
    d["removed_blocks"] = rm;
    d["unknown_removals"] = ur;
    d["unknown_offloads"] = uo;
    return d;
}

std::vector<std::pair<u64, u64>> IndexCore::tier_counts() {
    std::vector<std::pair<u64, u64>> out(64, {0, 0});
    std::shared_lock lk(mu_);
    for (u32 i = lru_head_; i != NIL; i = blocks_[i].next()) {
        u64 uni = 0;
        for (const Holder& h : blocks_[i].hs) {
            uni |= hmask(h);
            for (u64 m = hmask(h); m; m &= m - 1) ++out[__builtin_ctzll(m)].second;
        }
        for (u64 m = uni; m; m &= m - 1) ++out[__builtin_ctzll(m)].first;
    }
    size_t n = 64;
    while (n && out[n - 1].first == 0) --n;
    out.resize(n);
    return out;
}

size_t IndexCore::memory_bytes() {
    std::shared_lock lk(mu_);
    size_t b = blocks_.capacity() * sizeof(Block) + free_.capacity() * sizeof(u32) + rk_map_.bytes();
    for (auto& e : engines_) b += e.second.t.bytes() + e.second.x.bytes() + 64;
    for (const Block& blk : blocks_)
        b += blk.hs.heap_bytes();
    b += attrs_.capacity() * sizeof(Attr) + rank_vals_.capacity() * sizeof(int32_t);
    for (auto& kv : streams_) b += kv.second.carried.bytes() + kv.second.x.bytes() + 96;
    return b;
}

void IndexCore::check() {
    std::shared_lock lk(mu_);
    size_t n = 0;
    u32 prev = NIL;
    for (u32 i = lru_head_; i != NIL; i = blocks_[i].next()) {
        if (blocks_[i].prev() != prev) throw std::runtime_error("LRU links broken");
        Found bi = rk_map_.find_ptr(blocks_[i].rk);
        if (!bi || *bi != i) throw std::runtime_error("level 1 does not map a listed block");
        if (blocks_[i].hs.empty()) throw std::runtime_error("a block without holders");
        prev = i;
        ++n;
    }
    if (prev != lru_tail_) throw std::runtime_error("LRU tail wrong");
    if (n != rk_map_.size()) throw std::runtime_error("LRU length != level 1 size");
    std::vector<u64> counted(pod_names_.size(), 0);
    for (u32 i = lru_head_; i != NIL; i = blocks_[i].next()) {
        std::vector<uint16_t> seen;
        for (const Holder& h : blocks_[i].hs)
            if (std::find(seen.begin(), seen.end(), h.pod()) == seen.end()) seen.push_back(h.pod());
        for (uint16_t p : seen) ++counted[p];
    }
    for (size_t s = 0; s < counted.size(); ++s)
        if (counted[s] != pod_blocks_[s]) throw std::runtime_error("pod block count wrong");
    // entries carried by holders: each set slot has its holder, each flagged holder its slot
    auto check_set = [&](const IdxSet<HolderKey>& t) {
        t.for_each([&](u32 bi) {
            const Holder* h = t.key().holder(bi);
            if (!h || t.find(h->ek) != bi) throw std::runtime_error("a carried entry without its holder");
        });
    };
    for (auto& e : engines_) check_set(e.second.t);
    // carried stream entries: each listed record has the stream's flagged holder, found through
    // level 2 (level 1 in compat mode) by its engine key, with no explicit entry beside it
    for (auto& kv : streams_) {
        const Stream& st = kv.second;
        st.carried.for_each([&](u32 bi) {
            const Holder* h = s_holder(st, bi);
            if (!h) throw std::runtime_error("a listed stream record without its holder");
            if (carried_block(st.model, h->ek) != bi)
                throw std::runtime_error("a carried stream entry that its lookup does not find");
            if (st.x.find(h->ek)) throw std::runtime_error("a carried stream entry also kept explicitly");
        });
    }
    for (u32 i = lru_head_; i != NIL; i = blocks_[i].next())
        for (const Holder& h : blocks_[i].hs) {
            if (h.pf & FLAG_S) {
                auto it = streams_.find(stream_id(h.pod(), hmodel(h), hrank(h)));
                if (it == streams_.end() || !it->second.carried.contains(i))
                    throw std::runtime_error("a holder's stream entry is missing");
            }
            if (h.pf & FLAG_L) {
                Engine* em = nullptr;
                for (auto& e : engines_)
                    if (e.first == hmodel(h)) em = &e.second;
                if (!em || em->t.find(h.ek) != i) throw std::runtime_error("a holder's level-2 entry is missing");
            }
        }
}

}  // namespace kvnative
