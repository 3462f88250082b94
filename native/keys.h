// Key inputs and the xxh3_chain recurrence (kvindex/keys.py, bit-identical).
#pragma once

#include "common.h"

namespace kvnative {

// A read-only view of uint64 values: a C-contiguous uint64 numpy array, or a copy of
// a Python sequence of ints (each must be in [0, 2**64)).
struct U64View {
    const u64* data = nullptr;
    size_t n = 0;
    std::vector<u64> owned;
};

// Reads obj (a uint64 array or a sequence of ints) into out; `what` names it in errors.
void to_u64(nb::handle obj, U64View& out, const char* what);

// uint64 values as native-endian bytes (Python wraps them with numpy.frombuffer: creating a
// numpy array from C++ through DLPack costs several microseconds, bytes well under one).
inline nb::bytes new_u64_array(std::vector<u64>&& v) {
    return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(u64));
}

// key_{-1} = state; key_i = A * key_{i-1} + fmix64(sum_t tok[i*bs+t] * K[t] + add_i)
inline void chain_into(u64 state, const u64* toks, size_t nblocks, const u64* K, size_t bs, u64 A, const u64* add,
                u64* out) {
    for (size_t i = 0; i < nblocks; ++i) {
        const u64* b = toks + i * bs;
        u64 u = 0;
        for (size_t t = 0; t < bs; ++t) u += b[t] * K[t];
        if (add) u += add[i];
        state = A * state + fmix64(u);
        out[i] = state;
    }
}


// The module function xxh3_chain: request keys of the full blocks of tokens, as uint64 bytes.
nb::bytes xxh3_chain(u64 state, nb::handle toks_o, nb::handle K_o, u64 A, nb::handle add_o);

}  // namespace kvnative
