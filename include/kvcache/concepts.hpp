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
// Required members:
//   1. using policy_kind = kvcache::element_tag;
//   2. static constexpr std::string_view name;        e.g. "f16"
//   3. static constexpr std::uint32_t type_id;        stable id written into state files
//   4. using storage_type = ...;                       trivially copyable, stored in the cache
//   5. static void to_float(const storage_type*, float*, std::size_t n) noexcept;
//   6. static void from_float(const float*, storage_type*, std::size_t n) noexcept;
//
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

template <class E>
concept element_policy = policy_of_kind<E, element_tag> && has_policy_name<E> && element_has_type_id<E> &&
                         element_has_storage_type<E> && element_has_to_float<E> && element_has_from_float<E>;

// ---------------------------------------------------------------------------
// Layout policy.
//
// Required members:
//   1. using policy_kind = kvcache::layout_tag;
//   2. static constexpr std::string_view name;            e.g. "contiguous"
//   3. static constexpr std::uint32_t layout_id;          stable id written into state files
//   4. template <class Element> class storage;            K/V buffers for an element policy,
//      satisfying kv_storage below: what kv_cache, the kernels (ops/) and state files
//      (io/) read. The way to get it right is to derive from
//      kvcache::tiled_kv_storage<Element, VLayout> (layout/kv_storage.hpp), which
//      provides all of it in the format of format/kv_view.hpp:
//        using storage_type = Element::storage_type;
//        storage(const model_shape&)                      allocate once, zero-initialised
//        std::size_t bytes() const                        bytes reserved for K and V
//        std::uint32_t n_cells_padded() const             cells allocated (multiple of 32)
//        kv_layer_view<storage_type> view(uint32_t layer)              raw K/V of one layer
//        kv_layer_view<const storage_type> view(uint32_t layer) const  (format/kv_view.hpp)
//        void write_k(uint32_t layer, uint32_t cell, const float* row)   row: n_head_kv * head_dim_k
//        void write_v(uint32_t layer, uint32_t cell, const float* row)   row: n_head_kv * head_dim_v
//        void read_k(uint32_t layer, uint32_t cell, float* row) const
//        void read_v(uint32_t layer, uint32_t cell, float* row) const
//        void copy_cell(uint32_t src, uint32_t dst)       K and V of every layer
//      Optional behaviour (placing tokens, pruning, refusing sequence operations, memory
//      accounting) is a declared capability of the storage: layout/capabilities.hpp.
//   5. static constexpr bool can_shift;                   positions may move (seq_add/seq_div)
//
// layout_policy<L> checks 1-3 and 5; layout_policy_for<L, Element> adds 4.
// Minimal conforming layout: examples/custom_layout.cpp.

template <class T>
struct kv_layer_view;  // format/kv_view.hpp

template <class L>
concept layout_has_layout_id = requires {
    { L::layout_id } -> std::convertible_to<std::uint32_t>;
};

template <class L>
concept layout_has_can_shift = requires {
    { L::can_shift } -> std::convertible_to<bool>;
};

template <class S>
concept storage_has_storage_type = requires { typename S::storage_type; };

template <class S>
concept storage_has_bytes = requires(const S& cs) {
    { cs.bytes() } -> std::convertible_to<std::size_t>;
};

template <class S>
concept storage_has_n_cells_padded = requires(const S& cs) {
    { cs.n_cells_padded() } -> std::convertible_to<std::uint32_t>;
};

/// view(layer) gives the raw K/V of one layer in the format kernels and io read.
template <class S>
concept storage_has_view = storage_has_storage_type<S> && requires(S& s, const S& cs, std::uint32_t layer) {
    { s.view(layer) } -> std::same_as<kv_layer_view<typename S::storage_type>>;
    { cs.view(layer) } -> std::same_as<kv_layer_view<const typename S::storage_type>>;
};

template <class S>
concept storage_has_row_io = requires(S& s, const S& cs, std::uint32_t u, const float* in, float* out) {
    s.write_k(u, u, in);
    s.write_v(u, u, in);
    cs.read_k(u, u, out);
    cs.read_v(u, u, out);
};

template <class S>
concept storage_has_copy_cell = requires(S& s, std::uint32_t u) { s.copy_cell(u, u); };

template <class S>
concept kv_storage = storage_has_storage_type<S> && storage_has_bytes<S> && storage_has_n_cells_padded<S> &&
                     storage_has_view<S> && storage_has_row_io<S> && storage_has_copy_cell<S>;

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
