// kvcache io: the one place xxHash is included (header-only use of Debian's
// libxxhash-dev, nothing to link). The rest of io/ hashes through detail::hasher and
// io::checksum; no other kvcache header includes <xxhash.h>.
//
// With AVX-512 enabled, GCC 12 reports a false -Wuninitialized inside its own AVX-512
// intrinsics that xxHash's AVX-512 path inlines, so that path is replaced by the AVX2 one
// (still faster than DRAM per core). Define XXH_VECTOR yourself to choose another.
//
// Macros: XXH_INLINE_ALL, XXH_VECTOR and XXH_IMPLEMENTATION are #undef'd after the
// include unless you defined them first (a test checks that XXH_INLINE_ALL and
// XXH_VECTOR are not defined after #include <kvcache/kvcache.hpp>). xxHash's own
// function-name macros of its inline mode (XXH3_64bits -> XXH_INLINE_XXH3_64bits, ...)
// and its include guards stay: a later #include <xxhash.h> then sees the same inline
// functions instead of conflicting declarations.
#pragma once

#include <cstddef>  // std::byte, std::size_t
#include <cstdint>  // std::uint64_t
#include <span>     // checksum input

#include "../../config.hpp"

#if defined(XXH_INLINE_ALL)
#define KVCACHE_XXH_KEEP_INLINE_ALL
#else
#define XXH_INLINE_ALL
#endif
#if defined(XXH_VECTOR)
#define KVCACHE_XXH_KEEP_VECTOR
#elif defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define XXH_VECTOR 2  // XXH_AVX2
#endif
#include <xxhash.h>

KVCACHE_BEGIN_NAMESPACE
namespace io {

/// XXH3-64 of `bytes`: the checksum stored in the last 8 bytes of a state.
[[nodiscard]] inline std::uint64_t checksum(std::span<const std::byte> bytes) noexcept {
    return XXH3_64bits(bytes.data(), bytes.size());
}

namespace detail {
/// Streaming XXH3-64 (the state checksum computed while the bytes are written).
class hasher {
public:
    hasher() noexcept { XXH3_64bits_reset(&state_); }
    void update(const void* p, std::size_t n) noexcept { XXH3_64bits_update(&state_, p, n); }
    [[nodiscard]] std::uint64_t digest() const noexcept { return XXH3_64bits_digest(&state_); }

private:
    XXH3_state_t state_;
};
}  // namespace detail

}  // namespace io
KVCACHE_END_NAMESPACE

#if defined(KVCACHE_XXH_KEEP_INLINE_ALL)
#undef KVCACHE_XXH_KEEP_INLINE_ALL
#else
#undef XXH_INLINE_ALL
#undef XXH_IMPLEMENTATION
#endif
#if defined(KVCACHE_XXH_KEEP_VECTOR)
#undef KVCACHE_XXH_KEEP_VECTOR
#else
#undef XXH_VECTOR
#endif
