// IndexCore's writes: stores, removals, clears, the recency refresh, and the bookkeeping they share
// (records, holders, streams, level 2, pod slots, interned attributes).
#include "index_core.h"

namespace kvnative {

size_t IndexCore::store_keys(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o, nb::handle rks_o,
                             u64 bit) {
    U64View eks, rks;
    to_u64(eks_o, eks, "engine_keys");
    to_u64(rks_o, rks, "request_keys");
    if (eks.n != rks.n) throw nb::value_error("engine_keys and request_keys differ in length");
    nb::gil_scoped_release nogil;
    auto lk = wlock();
    uint16_t ps = pod_slot(pod);
    u64 sid = stream_id(ps, mid, rank);
    for (size_t i = 0; i < eks.n; ++i) put(ps, rank, mid, sid, eks.data[i], rks.data[i], bit);
    finish_write(ps);
    return eks.n;
}

nb::bytes IndexCore::store_chain(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o,
                                 u64 state, nb::handle toks_o, nb::handle K_o, u64 A,
                                 u64 bit) {
    U64View eks, toks, K;
    to_u64(eks_o, eks, "engine_keys");
    to_u64(toks_o, toks, "token_ids");
    to_u64(K_o, K, "K");
    size_t bs = K.n;
    if (bs == 0 || toks.n != bs * eks.n) throw nb::value_error("token count is not block_size * blocks");
    std::vector<u64> rks(eks.n);
    {
        nb::gil_scoped_release nogil;
        chain_into(state, toks.data, eks.n, K.data, bs, A, nullptr, rks.data());
        auto lk = wlock();
        uint16_t ps = pod_slot(pod);
        u64 sid = stream_id(ps, mid, rank);
        for (size_t i = 0; i < eks.n; ++i) put(ps, rank, mid, sid, eks.data[i], rks[i], bit);
        finish_write(ps);
    }
    return new_u64_array(std::move(rks));
}

nb::bytes IndexCore::store_tokenless(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o,
                                     u64 bit) {
    U64View eks;
    to_u64(eks_o, eks, "engine_keys");
    std::vector<u64> done;
    {
        nb::gil_scoped_release nogil;
        auto lk = wlock();
        uint16_t ps = pod_slot(pod);
        u64 sid = stream_id(ps, mid, rank);
        stream_mk(sid);
        for (size_t i = 0; i < eks.n; ++i) {
            u64 ek = eks.data[i];
            std::optional<u64> rk = compat_ ? std::optional<u64>(ek) : resolve_locked(ps, rank, mid, ek);
            if (!rk) {
                ++c_unknown_offloads_;
                continue;
            }
            put(ps, rank, mid, sid, ek, *rk, bit);
            done.push_back(*rk);
        }
        finish_write(ps);
    }
    return new_u64_array(std::move(done));
}

std::vector<bool> IndexCore::remove(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o, u64 bit) {
    U64View eks;
    to_u64(eks_o, eks, "engine_keys");
    std::vector<bool> hit(eks.n, false);
    nb::gil_scoped_release nogil;
    auto lk = wlock();
    auto it = pod_by_name_.find(pod);
    if (it == pod_by_name_.end()) return hit;
    uint16_t ps = it->second;
    u64 sid = stream_id(ps, mid, rank);
    for (size_t i = 0; i < eks.n; ++i) {
        u64 ek = eks.data[i];
        Stream* st = stream(sid);
        u64 rk;
        if (st && s_find(*st, ek, rk) && drop_copy(ps, rank, ek, rk, bit)) hit[i] = true;
    }
    finish_write(ps);
    return hit;
}

size_t IndexCore::clear(const std::string& pod, std::optional<int32_t> rank, int model) {
    nb::gil_scoped_release nogil;
    auto lk = wlock();
    return clear_locked(pod, rank, model);
}

size_t IndexCore::clear_locked(const std::string& pod, std::optional<int32_t> rank, int model) {
    auto it = pod_by_name_.find(pod);
    if (it == pod_by_name_.end()) return 0;
    uint16_t ps = it->second;
    std::vector<u64> sids;
    for (auto& kv : streams_)
        if (stream_pod(kv.first) == ps && (!rank || stream_rank(kv.first) == *rank) &&
            (model == ALL || stream_model(kv.first) == (uint16_t)model))
            sids.push_back(kv.first);
    size_t n = 0;
    std::vector<std::pair<u64, u64>> ents;
    for (u64 sid : sids) {
        ents.clear();
        {
            // take the stream's entries out (the holders carrying them let go) and drop it
            Stream& st = streams_.find(sid)->second;
            st.carried.for_each([&](u32 bi) {
                Holder* h = s_holder(st, bi);
                ents.emplace_back(h->ek, blocks_[bi].rk);
                h->pf &= (uint16_t)~FLAG_S;
            });
            st.x.for_each([&](u64 ek, u64 rk) { ents.emplace_back(ek, rk); });
            streams_.erase(sid);
        }
        int32_t r = stream_rank(sid);
        uint16_t sm = stream_model(sid);
        for (auto& [ek, rk] : ents) {
            unref_engine(ek, sm);
            Found bi = rk_map_.find_ptr(rk);
            if (!bi) continue;
            Block& b = blocks_[*bi];
            size_t h = find_holder(b, ps, r);
            if (h == NIL) continue;
            ++n;
            erase_holder(*bi, h);
        }
    }
    finish_write(ps);
    return n;
}

void IndexCore::touch(nb::handle keys_o) {
    U64View keys;
    to_u64(keys_o, keys, "request_keys");
    nb::gil_scoped_release nogil;
    auto lk = wlock();
    touch_locked(keys.data, keys.n);
}

void IndexCore::flush_touches_locked() {
    std::lock_guard<std::mutex> g(log_mu_);
    size_t n = touch_log_.size();
    if (n == 0) return;
    if (n <= 64) {
        for (u32 i : touch_log_) relink_tail(i);
    } else {
        size_t cap = 64;
        while (cap < 2 * n) cap <<= 1;
        std::vector<u32> seen(cap, NIL), order;
        order.reserve(n);
        for (size_t k = n; k-- > 0;) {
            u32 i = touch_log_[k];
            size_t s = fmix64(i) & (cap - 1);
            while (seen[s] != NIL && seen[s] != i) s = (s + 1) & (cap - 1);
            if (seen[s] == i) continue;
            seen[s] = i;
            order.push_back(i);
        }
        for (size_t k = order.size(); k-- > 0;) relink_tail(order[k]);
    }
    touch_log_.clear();
    if (touch_log_.capacity() > 2 * TOUCH_LOG_MAX) std::vector<u32>().swap(touch_log_);
}

inline void IndexCore::relink_tail(u32 i) {
    if (i == lru_tail_) return;
    lru_unlink(i);
    lru_push(i);
}

uint16_t IndexCore::pod_slot(const std::string& pod) {
    auto it = pod_by_name_.find(pod);
    if (it != pod_by_name_.end()) return it->second;
    uint16_t s;
    if (!free_pods_.empty()) {
        s = free_pods_.back();
        free_pods_.pop_back();
        pod_names_[s] = pod;
        pod_blocks_[s] = 0;
    } else {
        if (pod_names_.size() >= MAX_PODS) throw std::length_error("more than 16381 pods hold blocks");
        s = (uint16_t)pod_names_.size();
        pod_names_.push_back(pod);
        pod_blocks_.push_back(0);
    }
    pod_by_name_.emplace(pod, s);
    return s;
}

inline void IndexCore::maybe_release(uint16_t ps) {
    if (pod_blocks_[ps] || pod_names_[ps].empty()) return;
    std::vector<u64> sids;
    for (auto& kv : streams_)
        if (stream_pod(kv.first) == ps) {
            if (!kv.second.empty()) return;
            sids.push_back(kv.first);
        }
    for (u64 sid : sids) streams_.erase(sid);
    pod_by_name_.erase(pod_names_[ps]);
    pod_names_[ps].clear();
    free_pods_.push_back(ps);
}

Stream& IndexCore::stream_mk(u64 sid) {
    auto [it, ins] = streams_.try_emplace(sid);
    if (ins) {
        it->second.pod = stream_pod(sid);
        it->second.rid = rank_id(stream_rank(sid));
        it->second.model = stream_model(sid);
    }
    return it->second;
}

inline bool IndexCore::s_erase_if(Stream& st, u64 ek, u64 rk) {
    if (const u64* v = st.x.find(ek)) {
        if (*v != rk) return false;
        st.x.erase(ek);
        return true;
    }
    u32 bi;
    Holder* h = s_carrier(st, ek, &bi);
    if (!h || blocks_[bi].rk != rk) return false;
    h->pf &= (uint16_t)~FLAG_S;
    st.carried.erase(bi);
    return true;
}

inline void IndexCore::s_detach(u32 bi, Holder& h) {
    Stream* st = stream(stream_id(h.pod(), hmodel(h), hrank(h)));
    st->carried.erase(bi);
    h.pf &= (uint16_t)~FLAG_S;
    *st->x.emplace(h.ek).first = blocks_[bi].rk;
}

inline void IndexCore::s_detach_value(uint16_t mid, u64 ek, u64 old) {
    u32 bi = rk_map_.find(old);
    if (bi == NIL) return;
    for (Holder& h : blocks_[bi].hs)
        if ((h.pf & FLAG_S) && h.ek == ek && hmodel(h) == mid) s_detach(bi, h);
}

inline void IndexCore::e_untake(Engine& em, u64 ek, u32 bi) {
    Holder* h = const_cast<Holder*>(em.t.key().holder(bi));
    em.t.erase(ek);
    h->pf &= (uint16_t)~FLAG_L;
}

inline void IndexCore::detach(u32 bi, Holder& h) {
    if (!(h.pf & (FLAG_S | FLAG_L))) return;
    u64 rk = blocks_[bi].rk;
    if (h.pf & FLAG_S) s_detach(bi, h);
    if (h.pf & FLAG_L) {
        Engine* em = engine_map(hmodel(h));
        em->t.erase(h.ek);
        h.pf &= (uint16_t)~FLAG_L;
        EngineRef* e = em->x.emplace(h.ek).first;
        e->rk = rk;
        e->refs = 1;
    }
}

inline void IndexCore::touch_locked(const u64* keys, size_t n) {
    for (size_t k = 0; k < n; ++k) {
        Found bi = rk_map_.find_ptr(keys[k]);
        if (!bi || *bi == lru_tail_) continue;
        u32 i = *bi;
        lru_unlink(i);
        lru_push(i);
    }
}

inline u32 IndexCore::new_block(u64 rk) {
    u32 i;
    if (!free_.empty()) {
        i = free_.back();
        free_.pop_back();
    } else {
        if (blocks_.size() >= MAX_BLOCKS) throw std::length_error("index full (134,217,727 blocks)");
        i = (u32)blocks_.size();
        size_t cap = blocks_.capacity();
        blocks_.emplace_back();
        if (blocks_.capacity() != cap) release_freed(cap * sizeof(Block));
    }
    blocks_[i].rk = rk;
    rk_map_.insert(rk, i);
    lru_push(i);
    return i;
}

inline void IndexCore::free_block(u32 i) {
    Block& b = blocks_[i];
    for (Holder& h : b.hs) detach(i, h);
    lru_unlink(i);
    rk_map_.erase(b.rk);
    b.hs.clear();
    free_.push_back(i);
}

inline void IndexCore::erase_holder(u32 bi, size_t h) {
    Block& b = blocks_[bi];
    uint16_t ps = b.hs[h].pod();
    detach(bi, b.hs[h]);
    b.hs.erase(h);
    if (!has_pod(b, ps)) --pod_blocks_[ps];
    if (b.hs.empty()) free_block(bi);
}

inline void IndexCore::unref_engine(u64 ek, uint16_t mid) {
    if (compat_) return;
    for (size_t i = 0; i < engines_.size(); ++i) {
        if (engines_[i].first != mid) continue;
        Engine& em = engines_[i].second;
        if (EngineRef* v = em.x.find(ek)) {
            if (--v->refs == 0) em.x.erase(ek);
        } else {
            u32 bi = em.t.find(ek);
            if (bi == NIL) return;
            e_untake(em, ek, bi);
        }
        if (em.empty()) engines_.erase(engines_.begin() + (long)i);
        return;
    }
}

inline void IndexCore::link(uint16_t mid, Stream& st, u64 ek, u64 rk, u32 bi, Holder& hd, bool absent,
                            bool l2_absent) {
    u64 cur = 0;
    bool has = !absent && s_find(st, ek, cur);
    if (!has || cur != rk) {
        if (has) s_erase_if(st, ek, cur);
        if (!compat_) {
            Engine* em = engine_map(mid);
            if (!em) {
                engines_.emplace_back(mid, Engine());
                em = &engines_.back().second;
                em->t.key() = HolderKey{&blocks_, &attrs_, mid, FLAG_L};
            }
            EngineRef* v = nullptr;
            u32 bj = NIL;
            if (!l2_absent && (v = em->x.find(ek)) == nullptr) bj = em->t.find(ek);
            if (v) {
                if (v->rk != rk) s_detach_value(mid, ek, v->rk);
                v->rk = rk;
                v->refs += 1;
            } else if (bj != NIL) {
                if (blocks_[bj].rk != rk) s_detach_value(mid, ek, blocks_[bj].rk);
                e_untake(*em, ek, bj);
                EngineRef* e = em->x.emplace(ek).first;
                e->rk = rk;
                e->refs = 2;
            } else if (hmodel(hd) == mid && hd.ek == ek && !(hd.pf & FLAG_L) && !em->t.key().holder(bi)) {
                em->t.insert(ek, bi);
                hd.pf |= FLAG_L;
            } else {
                EngineRef* e = em->x.emplace(ek).first;
                e->rk = rk;
                e->refs = 1;
            }
        }
        // the holder carries the entry when its lookup (level 2, or level 1 in compat mode)
        // leads to this record
        if (hmodel(hd) == mid && hd.ek == ek && !(hd.pf & FLAG_S) && (!compat_ || rk == ek)) {
            hd.pf |= FLAG_S;
            st.carried.insert(bi);
        } else {
            *st.x.emplace(ek).first = rk;
        }
    }
    ++c_stored_blocks_;
}

void IndexCore::put_s(Stream& st, uint16_t ps, int32_t rank, uint16_t mid, u64 ek, u64 rk, u64 bit) {
    u64 old_rk = 0;
    bool absent;
    bool l2_absent = false;  // level 2 of mid has no entry for ek (link() then skips its lookups)
    if (const u64* v = st.x.find(ek)) {
        old_rk = *v;
        absent = false;
    } else if (compat_ || st.carried.empty()) {
        absent = !s_find(st, ek, old_rk);
    } else {
        // s_carrier's lookup, done here so that its answer serves link() too
        u32 b = NIL;
        if (Engine* em = engine_map(mid)) {
            if (const EngineRef* xv = em->x.find(ek)) {
                b = rk_map_.find(xv->rk);
            } else {
                b = em->t.find(ek);
                l2_absent = b == NIL;
            }
        }
        const Holder* h = b == NIL ? nullptr : s_holder(st, b);
        absent = !(h && h->ek == ek);
        if (!absent) old_rk = blocks_[b].rk;
    }
    if (!absent && old_rk != rk) drop_copy(ps, rank, ek, old_rk, ~0ULL);
    Found bip = rk_map_.find_ptr(rk);
    u32 bi;
    if (!bip) {
        bi = new_block(rk);
        if (rk_map_.size() > capacity_) evict_one();
    } else {
        bi = *bip;
        if (bi != lru_tail_) {
            lru_unlink(bi);
            lru_push(bi);
        }
    }
    Block& b = blocks_[bi];
    size_t h = find_holder(b, ps, rank);
    if (h == NIL) {
        if (!has_pod(b, ps)) ++pod_blocks_[ps];
        b.hs.push_back(Holder{ek, ps, attr_id(mid, rank_id(rank), bit)});
        h = b.hs.size() - 1;
    } else {
        Holder& hd = b.hs[h];
        set_hmask(hd, hmask(hd) | bit);
        if (hd.ek != ek) {
            if (s_erase_if(st, hd.ek, rk)) unref_engine(hd.ek, mid);
            detach(bi, hd);
            hd.ek = ek;
        }
    }
    link(mid, st, ek, rk, bi, b.hs[h], absent, absent && l2_absent);
}

bool IndexCore::drop_copy(uint16_t ps, int32_t rank, u64 ek, u64 rk, u64 bit) {
    Found bip = rk_map_.find_ptr(rk);
    if (!bip) return false;
    u32 bi = *bip;
    Block& b = blocks_[bi];
    size_t h = find_holder(b, ps, rank);
    if (h == NIL || !(hmask(b.hs[h]) & bit)) return false;
    u64 left = hmask(b.hs[h]) & ~bit;
    if (left) {
        set_hmask(b.hs[h], left);
    } else {
        uint16_t hm = hmodel(b.hs[h]);
        Stream* st = stream(stream_id(ps, hm, rank));
        if (st && s_erase_if(*st, ek, rk)) unref_engine(ek, hm);
        erase_holder(bi, h);
    }
    return true;
}

inline void IndexCore::evict_one() {
    u32 bi = lru_head_;
    Block& b = blocks_[bi];
    u64 rk = b.rk;
    std::vector<uint16_t> seen;
    for (size_t k = 0; k < b.hs.size(); ++k) {
        Holder h = b.hs[k];
        if (std::find(seen.begin(), seen.end(), h.pod()) == seen.end()) {
            seen.push_back(h.pod());
            --pod_blocks_[h.pod()];
        }
        if (Stream* st = stream(stream_id(h.pod(), hmodel(h), hrank(h))))
            if (s_erase_if(*st, h.ek, rk)) unref_engine(h.ek, hmodel(h));
    }
    free_block(bi);
    ++c_evictions_;
    // a pod left with nothing gives its slot back at the end of the write call
    for (uint16_t p : seen)
        if (!pod_blocks_[p]) pending_release_.push_back(p);
}

void IndexCore::finish_write(uint16_t ps) {
    maybe_release(ps);
    std::vector<uint16_t> pend;
    pend.swap(pending_release_);
    for (uint16_t p : pend)
        if (!pod_names_[p].empty()) maybe_release(p);
}

inline void IndexCore::set_hmask(Holder& h, u64 m) {
    Attr a = attrs_[h.at];
    h.at = attr_id(a.model, a.rid, m);
}

inline uint16_t IndexCore::attr_id(uint16_t model, uint16_t rid, u64 m) {
    u64 key = ((u64)model << 16) | rid;
    AttrCache& c = attr_cache_[fmix64(key ^ (m * 0x9E3779B97F4A7C15ULL)) & 15];
    if (c.key == key && c.mask == m) return c.id;
    std::vector<uint16_t>& ids = attr_ids_[key];
    uint16_t id = 0xFFFF;
    for (uint16_t x : ids)
        if (attrs_[x].mask == m) {
            id = x;
            break;
        }
    if (id == 0xFFFF) {
        if (attrs_.size() >= 0xFFFF)
            throw std::length_error("more than 65535 distinct (model, DP rank, tier mask) combinations");
        id = (uint16_t)attrs_.size();
        attrs_.push_back(Attr{m, model, rid});
        ids.push_back(id);
    }
    c = AttrCache{key, m, id};
    return id;
}

inline uint16_t IndexCore::rank_id(int32_t r) {
    uint16_t id = rank_find(r);
    if (id != NO_RID) return id;
    if (rank_vals_.size() >= NO_RID) throw std::length_error("more than 65535 distinct DP ranks");
    id = (uint16_t)rank_vals_.size();
    rank_vals_.push_back(r);
    rank_ids_.emplace(r, id);
    return id;
}

}  // namespace kvnative
