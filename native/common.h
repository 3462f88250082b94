// Shared basics of the compiled core: integer types, the 64-bit mixer, the nanobind alias.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstddef>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace kvnative {

using u64 = uint64_t;
using u32 = uint32_t;
constexpr u32 NIL = 0xFFFFFFFFu;

inline u64 fmix64(u64 x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

// After a large table or array has grown, give the freed old one back to the system: glibc keeps
// freed blocks below its (adaptive) mmap threshold inside the heap, where they stay resident.
inline void release_freed(size_t old_bytes) {
#if defined(__GLIBC__)
    if (old_bytes >= (1u << 20)) malloc_trim(0);
#else
    (void)old_bytes;
#endif
}


// A found block index (NIL: none), for `if (bi)` / `*bi`.
struct Found {
    u32 v = NIL;
    explicit operator bool() const { return v != NIL; }
    u32 operator*() const { return v; }
};

}  // namespace kvnative
