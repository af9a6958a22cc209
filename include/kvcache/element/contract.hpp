// kvcache: the element contract as compile-time checks, and which elements the
// kernels load with SIMD.
//
// kv_cache<...> runs detail::check_element<E>() (every member of concepts.hpp's
// "Element policy" with its own static_assert, so the first error names the member
// that is missing or wrong) and detail::check_tiled_element<E>() (the tiled layouts
// store one storage_type per value, or one per 32 values of one cell for block elements
// with block_size 32 such as q8_0 / q4_0; other block sizes are refused).
//
// detail::has_simd_storage<E>: true for the built-in f32, f16 and bf16, whose storage
// the kernels load and store with SIMD (simd/tile_io.hpp). For every other element the
// kernels convert tile rows through E::to_float / E::from_float into small f32
// scratch (the generic path): chosen at compile time, so the built-in elements keep
// their code.
//
// Values out of an element's range: f32 stores every float; f16 rounds |x| >= 65520 to
// inf (IEEE round-to-nearest); bf16 only the last half ulp of the f32 range (see each
// header). A custom element decides in its own from_float and should document it the
// same way: the kernels read back whatever it stores (an inf or NaN it stores makes the
// attention rows that see the cell NaN or inf, never a silent finite value).
#pragma once

#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint32_t
#include <type_traits>  // std::is_same_v

#include "../concepts.hpp"
#include "../config.hpp"
#include "bf16.hpp"
#include "f16.hpp"
#include "f32.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Bytes that n values of element E occupy in the tiled format (n a multiple of E's
/// block_size): e.g. 64 for 32 f16 values, 34 for 32 q8_0 values, 18 for 32 q4_0 values.
template <class E>
constexpr std::size_t values_bytes(std::size_t n) noexcept {
    return n / element_block_size_v<E> * sizeof(typename E::storage_type);
}

/// log2 of the values per storage unit of E in the tiled format (0, or 5 for block_size 32).
template <class E>
inline constexpr std::uint32_t block_log2 = element_block_size_v<E> == 32 ? 5u : 0u;

/// Whether E is a block element (values grouped in blocks that share state).
template <class E>
inline constexpr bool is_block_element = element_block_size_v<E> > 1;

namespace detail {

/// Whether the kernels read element E's storage with SIMD loads (the built-in elements).
template <class E>
inline constexpr bool has_simd_storage = std::is_same_v<E, f32> || std::is_same_v<E, f16> || std::is_same_v<E, bf16>;

/// Checks E against the element contract one member at a time; true when E satisfies
/// element_policy (each failing member stops compilation with its own message).
template <class E>
consteval bool check_element() {
    static_assert(policy_of_kind<E, element_tag>,
                  "kvcache: the element policy does not satisfy kvcache::element_policy: member 1 is missing, "
                  "`using policy_kind = kvcache::element_tag;` (see kvcache/concepts.hpp, \"Element policy\")");
    static_assert(has_policy_name<E>,
                  "kvcache: the element policy does not satisfy kvcache::element_policy: member 2 is missing, "
                  "`static constexpr std::string_view name` (see kvcache/concepts.hpp, \"Element policy\")");
    static_assert(element_has_type_id<E>,
                  "kvcache: the element policy does not satisfy kvcache::element_policy: member 3 is missing, "
                  "`static constexpr std::uint32_t type_id` (see kvcache/concepts.hpp, \"Element policy\")");
    static_assert(element_has_storage_type<E>,
                  "kvcache: the element policy does not satisfy kvcache::element_policy: member 4, "
                  "`using storage_type`, is missing or not trivially copyable (see kvcache/concepts.hpp, "
                  "\"Element policy\")");
    static_assert(!element_has_storage_type<E> || element_has_to_float<E>,
                  "kvcache: the element policy does not satisfy kvcache::element_policy: member 5 is missing or "
                  "not `static void to_float(const storage_type*, float*, std::size_t) noexcept` (noexcept is "
                  "required; see kvcache/concepts.hpp, \"Element policy\")");
    static_assert(!element_has_storage_type<E> || element_has_from_float<E>,
                  "kvcache: the element policy does not satisfy kvcache::element_policy: member 6 is missing or "
                  "not `static void from_float(const float*, storage_type*, std::size_t) noexcept` (noexcept is "
                  "required; see kvcache/concepts.hpp, \"Element policy\")");
    static_assert(element_has_valid_block_size<E>,
                  "kvcache: the element policy does not satisfy kvcache::element_policy: optional member 7, "
                  "`static constexpr std::uint32_t block_size`, must be >= 1 (see kvcache/concepts.hpp, "
                  "\"Element policy\")");
    return element_policy<E>;
}

/// Checks that the tiled K/V format (format/kv_view.hpp) can store E: one storage_type
/// per value (block_size 1), or one per block of 32 values of one cell (block_size 32,
/// "Block elements" in format/kv_view.hpp).
template <class E>
consteval bool check_tiled_element() {
    static_assert(element_block_size_v<E> == 1 || element_block_size_v<E> == 32,
                  "kvcache: the tiled layouts (contiguous, paged, ring) store elements of block_size 1 or 32 "
                  "(one storage_type per value, or per 32 values of one cell); other block sizes are not supported");
    return element_block_size_v<E> == 1 || element_block_size_v<E> == 32;
}


}  // namespace detail
KVCACHE_END_NAMESPACE
