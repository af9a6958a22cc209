// kvcache: every policy kind, as a C++20 concept.
//
// A kv_cache<Policies...> is composed from one policy of each kind (any order,
// each kind at most once, defaults for kinds left out). A policy opts in to a
// kind by name:
//
//     struct my_layout { using policy_kind = kvcache::layout_tag; ... };
//
// Each public concept is a conjunction of small named concepts, one per required
// member, so that a compile error points at the exact member that is missing.
#pragma once

#include <concepts>     // std::same_as, std::convertible_to
#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint32_t
#include <string_view>  // policy names
#include <type_traits>  // std::is_trivially_copyable_v

#include "config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Policy kind tags.
struct element_tag {};  ///< storage element type and its conversion to/from f32
struct layout_tag {};   ///< where each cell's K and V live and how cells are placed
struct reuse_tag {};    ///< how a new request reuses cached tokens

struct model_shape;  // model_shape.hpp

// ---------------------------------------------------------------------------
// Common: every policy names its kind and a human-readable name.

template <class P>
concept has_policy_kind = requires { typename P::policy_kind; };

template <class P, class Tag>
concept policy_of_kind = has_policy_kind<P> && std::same_as<typename P::policy_kind, Tag>;

template <class P>
concept has_policy_name = requires {
    { P::name } -> std::convertible_to<std::string_view>;
};

// ---------------------------------------------------------------------------
// Element policy.
//
// What a value of K or V is stored as, and how it converts to and from f32. Every
// kernel works with every element: f32, f16 and bf16 have SIMD loads and stores
// (simd/tile_io.hpp); any other element goes through its to_float / from_float on
// whole tile rows (kernels convert into small f32 scratch buffers), so a custom
// element is correct everywhere and only slower.
//
// Required members:
//   1. using policy_kind = kvcache::element_tag;
//   2. static constexpr std::string_view name;        e.g. "f16"
//   3. static constexpr std::uint32_t type_id;        stable id written into state files
//   4. using storage_type = ...;                       trivially copyable, stored in the cache
//   5. static void to_float(const storage_type*, float*, std::size_t n) noexcept;
//   6. static void from_float(const float*, storage_type*, std::size_t n) noexcept;
//
// Optional members:
//   7. static constexpr std::uint32_t block_size;      default 1 (read it through
//        element_block_size_v<E>). Values are grouped in blocks of block_size that
//        share state (e.g. llama.cpp's q8_0 / q4_0: 32 values and one scale), and
//        to_float / from_float are only ever called with n a multiple of block_size,
//        on whole blocks (src / dst pointing at the start of a block). Must be >= 1.
//        Block elements (block_size > 1) satisfy element_policy, but the tiled layouts
//        (contiguous, paged, ring) do not store them yet: kv_cache refuses them with a
//        static_assert ("block elements ... are not supported by the tiled layouts yet").
//
// kv_cache checks each member with its own static_assert (element/contract.hpp), so
// the first error line of a non-conforming element names the member that is wrong.
// Minimal conforming type: see examples/custom_policy.cpp.

template <class E>
concept element_has_storage_type =
    requires { typename E::storage_type; } && std::is_trivially_copyable_v<typename E::storage_type>;

template <class E>
concept element_has_type_id = requires {
    { E::type_id } -> std::convertible_to<std::uint32_t>;
};

template <class E>
concept element_has_to_float = element_has_storage_type<E> &&
    requires(const typename E::storage_type* s, float* f, std::size_t n) {
        { E::to_float(s, f, n) } noexcept;
    };

template <class E>
concept element_has_from_float = element_has_storage_type<E> &&
    requires(const float* f, typename E::storage_type* s, std::size_t n) {
        { E::from_float(f, s, n) } noexcept;
    };

/// Optional member 7: absent, or a constant convertible to std::uint32_t that is >= 1.
template <class E>
concept element_has_valid_block_size = !requires { E::block_size; } || requires {
    { E::block_size } -> std::convertible_to<std::uint32_t>;
    requires static_cast<std::uint32_t>(E::block_size) >= 1;
};

namespace detail {
template <class E>
consteval std::uint32_t element_block_size() noexcept {
    if constexpr (requires { E::block_size; })
        return static_cast<std::uint32_t>(E::block_size);
    else
        return 1;
}
}  // namespace detail

/// Values per block of element E (optional member 7; 1 when E does not declare it).
template <class E>
inline constexpr std::uint32_t element_block_size_v = detail::element_block_size<E>();

template <class E>
concept element_policy = policy_of_kind<E, element_tag> && has_policy_name<E> && element_has_type_id<E> &&
                         element_has_storage_type<E> && element_has_to_float<E> && element_has_from_float<E> &&
                         element_has_valid_block_size<E>;

/// An element the tiled K/V format can store: one storage_type per value (block_size 1).
template <class E>
concept tiled_element = element_policy<E> && element_block_size_v<E> == 1;

// ---------------------------------------------------------------------------
// Layout policy.
//
// Required members:
//   1. using policy_kind = kvcache::layout_tag;
//   2. static constexpr std::string_view name;            e.g. "contiguous"
//   3. static constexpr std::uint32_t layout_id;          stable id written into state files
//   4. template <class Element> class storage;            K/V buffers for an element policy:
//        storage(const model_shape&)                      allocate once, zero-initialised
//        std::size_t bytes() const                        bytes reserved for K and V
//        void write_k(uint32_t layer, uint32_t cell, const float* row)   row: n_head_kv * head_dim_k
//        void write_v(uint32_t layer, uint32_t cell, const float* row)   row: n_head_kv * head_dim_v
//        void read_k(uint32_t layer, uint32_t cell, float* row) const
//        void read_v(uint32_t layer, uint32_t cell, float* row) const
//        void copy_cell(uint32_t src, uint32_t dst)       K and V of every layer
//   5. static constexpr bool can_shift;                   positions may move (seq_add/seq_div)
//
// layout_policy<L> checks 1-3 and 5; layout_policy_for<L, Element> adds 4.

template <class L>
concept layout_has_layout_id = requires {
    { L::layout_id } -> std::convertible_to<std::uint32_t>;
};

template <class L>
concept layout_has_can_shift = requires {
    { L::can_shift } -> std::convertible_to<bool>;
};

template <class S>
concept kv_storage = requires(S& s, const S& cs, std::uint32_t u, const float* in, float* out) {
    { cs.bytes() } -> std::convertible_to<std::size_t>;
    s.write_k(u, u, in);
    s.write_v(u, u, in);
    cs.read_k(u, u, out);
    cs.read_v(u, u, out);
    s.copy_cell(u, u);
};

template <class L>
concept layout_policy = policy_of_kind<L, layout_tag> && has_policy_name<L> && layout_has_layout_id<L> &&
                        layout_has_can_shift<L>;

template <class L, class Element>
concept layout_has_storage_for = requires { typename L::template storage<Element>; } &&
    std::constructible_from<typename L::template storage<Element>, const model_shape&> &&
    kv_storage<typename L::template storage<Element>>;

template <class L, class Element>
concept layout_policy_for = layout_policy<L> && element_policy<Element> && layout_has_storage_for<L, Element>;

// ---------------------------------------------------------------------------
// Reuse policy.
//
// Required members:
//   1. using policy_kind = kvcache::reuse_tag;
//   2. static constexpr std::string_view name;            e.g. "none", "lcp"
//   3. static constexpr bool needs_shift;                 true if plans move cells (seq_add)

template <class R>
concept reuse_has_needs_shift = requires {
    { R::needs_shift } -> std::convertible_to<bool>;
};

template <class R>
concept reuse_policy = policy_of_kind<R, reuse_tag> && has_policy_name<R> && reuse_has_needs_shift<R>;

KVCACHE_END_NAMESPACE
