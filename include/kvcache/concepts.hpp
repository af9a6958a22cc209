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
#include <utility>      // std::pair (eviction_rank)

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
//        The tiled layouts (contiguous, paged, ring) store block_size 1 and 32 (one
//        storage_type per 32 values of one cell: format/kv_view.hpp, "Block elements";
//        built in: q8_0, q4_0); kv_cache refuses other block sizes with a static_assert
//        ("... store elements of block_size 1 or 32 ...").
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

/// An element the tiled K/V format can store: one storage_type per value (block_size 1)
/// or per 32 values of one cell (block_size 32).
template <class E>
concept tiled_element = element_policy<E> && (element_block_size_v<E> == 1 || element_block_size_v<E> == 32);

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
// Eviction policy (of a global prompt cache, reuse/eviction.hpp).
//
// Required members of an eviction policy E:
//   1. static constexpr std::string_view name;            e.g. "lru"
//   2. static eviction_rank rank(const entry_stats&) noexcept;   smaller = evicted sooner

struct entry_stats;  // reuse/eviction.hpp

/// Eviction rank: entries are evicted in increasing (first, second) order.
using eviction_rank = std::pair<std::uint64_t, std::uint64_t>;

template <class E>
concept eviction_has_rank = requires(const entry_stats& s) {
    { E::rank(s) } noexcept -> std::same_as<eviction_rank>;
};

template <class E>
concept eviction_policy = has_policy_name<E> && eviction_has_rank<E>;

// ---------------------------------------------------------------------------
// Reuse policy: what a new request keeps of the tokens a sequence holds. The slot
// manager (prompt/slots.hpp) asks the policy for a plan and executes exactly that
// plan (reuse::apply_plan) after checking it (reuse::check_plan): nothing else
// decides what is reused.
//
// Required members:
//   1. using policy_kind = kvcache::reuse_tag;
//   2. static constexpr std::string_view name;            e.g. "none", "lcp"
//   3. static constexpr bool needs_shift;                 true: plans may move cells (seq_add,
//                                                         reuse::plan::moves). A policy with
//                                                         needs_shift = true on a layout with
//                                                         can_shift = false does not compile; a
//                                                         plan with moves from a policy with
//                                                         needs_shift = false is refused.
//   4. static constexpr bool global_cache;                true: released slot states go to a
//                                                         global prompt cache (reuse::global)
//   5. using eviction = ...;                              only if global_cache: the global
//                                                         cache's eviction_policy
//   6. reuse::plan plan(const prompt_tokens& cached,      the plan (static or not; the slot
//                       const prompt_tokens& request,     manager owns one default-constructed
//                       const reuse::plan_options&);      policy object, so it may keep state)
//      The plan's inputs are those of reuse::make_plan: the sequence's tokens, the request
//      and what the cache allows (opt.can_shift false: no moves; opt.need_logits: leave at
//      least one position to compute). Built-in plans are reuse::make_plan calls.
//
// Minimal conforming type: see examples/custom_reuse.cpp.

class prompt_tokens;  // tokens/prompt_tokens.hpp
namespace reuse {
struct plan;          // reuse/plan.hpp
struct plan_options;  // reuse/plan.hpp
}  // namespace reuse

template <class R>
concept reuse_has_needs_shift = requires {
    { R::needs_shift } -> std::convertible_to<bool>;
};

template <class R>
concept reuse_has_global_cache = requires {
    { R::global_cache } -> std::convertible_to<bool>;
};

template <class R>
concept reuse_has_eviction = reuse_has_global_cache<R> &&
    (!static_cast<bool>(R::global_cache) || (requires { typename R::eviction; } && eviction_policy<typename R::eviction>));

template <class R>
concept reuse_has_plan = std::default_initializable<R> &&
    requires(R& r, const prompt_tokens& tokens, const reuse::plan_options& opt) {
        { r.plan(tokens, tokens, opt) } -> std::same_as<reuse::plan>;
    };

template <class R>
concept reuse_policy = policy_of_kind<R, reuse_tag> && has_policy_name<R> && reuse_has_needs_shift<R> &&
                       reuse_has_global_cache<R> && reuse_has_eviction<R> && reuse_has_plan<R>;

/// Whether reuse policy R's plans can run on layout L: a policy whose plans move cells
/// (needs_shift) needs a layout that can move positions (can_shift).
template <class R, class L>
concept reuse_fits_layout = reuse_policy<R> && layout_policy<L> &&
                            (!static_cast<bool>(R::needs_shift) || static_cast<bool>(L::can_shift));

KVCACHE_END_NAMESPACE
