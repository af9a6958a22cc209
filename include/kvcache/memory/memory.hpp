// kvcache: the memory contract. A memory is what an inference engine keeps between
// forward passes: K/V caches (kv_cache<Policies...>, iswa_cache), recurrent states
// (recurrent_memory) and both (hybrid_memory). Every public entry point that takes one (ops::, io::, slots, the
// prompt cache, reuse plans) is written against these concepts, and checks them with a
// static_assert whose message names the concept.
//
// kvcache::memory<M>, required members (m: M&, cm: const M&; s: seq_id_t; p0, p1, d: pos_t):
//   1. using memory_concept = kvcache::memory_tag;            opt in by name
//   2. placement with transactions (F3, F4):
//        using placement_type = ...;                           where a micro-batch went
//        m.place(span<const pos_t>, span<const seq_id_t>) -> result<placement_type>
//        m.commit() -> tx_result        m.restore() -> tx_result      cm.in_transaction() -> bool
//   3. sequence operations (F5), each complete or refused with nothing changed:
//        m.seq_rm(s, p0, p1)   m.seq_cp(s, s, p0, p1)   m.seq_add(s, p0, p1, d)
//        m.seq_div(s, p0, p1, int)      (the library's memories return [[nodiscard]] result<void>)
//        m.seq_keep(s)   m.clear()      (cannot be refused: void)
//      The concept only requires the calls to be valid. The error rule of every memory:
//      an expected runtime refusal (no free cell or block to split a shared cell:
//      no_space; positions the layout already dropped, e.g. a ring's pruned positions:
//      unsupported) is an error result<void>; a programming error (invalid argument,
//      a call while placements are staged: transaction_open, moving positions on a
//      memory with can_shift == false: unsupported) throws kvcache::error. Generic
//      callers that accept any memory should check the result when there is one.
//   4. positions: cm.seq_pos_min(s) -> pos_t, cm.seq_pos_max(s) -> pos_t (-1: empty);
//        cm.n_seq_max() -> std::uint32_t, cm.n_layer() -> std::uint32_t
//   5. shifting (F6): static constexpr bool can_shift; cm.has_shift() -> bool (a K-shift
//        is pending: ops::apply_k_shift before the next attention)
//   6. accounting: cm.total_bytes() -> std::size_t (every buffer the memory reserved)
// State save/load: io::save_state / io::load_state (io/state.hpp) take every memory.
//
// Minimal conforming type: see tests/memory/test_memory_concept.cpp.
//
// kvcache::kv_memory<M> refines memory for one cell-indexed K/V cache whose cells and
// storage kernels read directly (kv_cache<Policies...>): element, layout, shape(),
// cells(), storage(). composite_memory<M> is a memory made of kv_memory parts
// (iswa_cache): for_each_part(f) calls f on each part.
#pragma once

#include <concepts>  // std::same_as, std::convertible_to
#include <cstddef>   // std::size_t
#include <cstdint>   // std::uint32_t
#include <span>      // place arguments
#include <utility>   // std::declval
#include <vector>    // placement

#include "../cells/cell_table.hpp"
#include "../error.hpp"
#include "../model_shape.hpp"
#include "../simd/convert.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Tag a memory opts in with: `using memory_concept = kvcache::memory_tag;`.
struct memory_tag {};

/// Where each token of a placed micro-batch went: cells[i] is token i's cell.
struct placement {
    std::vector<std::uint32_t> cells;
};

/// Value types the memories' write_k / write_v take rows in: float, or the 16-bit floats
/// engines keep activations in, half (IEEE binary16) and bfloat16. A 16-bit row is widened
/// to f32 (exactly) one row at a time, then stored like a float row: the bytes are those of
/// writing the same values as floats, whatever the element.
template <class R>
concept kv_row_value = std::same_as<R, float> || std::same_as<R, half> || std::same_as<R, bfloat16>;

namespace detail {
/// Widens n row values to f32 (vectorised where the translation unit's flags allow).
inline void widen_row(const half* src, float* dst, std::size_t n) noexcept { f16_to_f32(src, dst, n); }
inline void widen_row(const bfloat16* src, float* dst, std::size_t n) noexcept { bf16_to_f32(src, dst, n); }
}  // namespace detail

/// Outcome of commit() / restore().
enum class tx_result {
    committed,       ///< staged placements are now permanent
    restored,        ///< every staged cell is back to its prior state
    nothing_staged,  ///< no-op: nothing was placed since the last commit/restore (likely a bug)
};


// ---------------------------------------------------------------------------
// The memory concept, one small concept per requirement (see the file comment).

template <class M>
concept memory_has_kind = requires { typename M::memory_concept; } &&
                          std::same_as<typename M::memory_concept, memory_tag>;

template <class M>
concept memory_has_placement = requires(M& m, const M& cm, std::span<const pos_t> pos, std::span<const seq_id_t> seq) {
    typename M::placement_type;
    { m.place(pos, seq) } -> std::same_as<result<typename M::placement_type>>;
    { m.commit() } -> std::same_as<tx_result>;
    { m.restore() } -> std::same_as<tx_result>;
    { cm.in_transaction() } -> std::convertible_to<bool>;
};

template <class M>
concept memory_has_sequence_ops = requires(M& m, seq_id_t s, pos_t p, int d) {
    m.seq_rm(s, p, p);
    m.seq_cp(s, s, p, p);
    m.seq_keep(s);
    m.seq_add(s, p, p, p);
    m.seq_div(s, p, p, d);
    m.clear();
};

template <class M>
concept memory_has_positions = requires(const M& cm, seq_id_t s) {
    { cm.seq_pos_min(s) } -> std::convertible_to<pos_t>;
    { cm.seq_pos_max(s) } -> std::convertible_to<pos_t>;
    { cm.n_seq_max() } -> std::convertible_to<std::uint32_t>;
    { cm.n_layer() } -> std::convertible_to<std::uint32_t>;
};

template <class M>
concept memory_has_shift = requires(const M& cm) {
    { M::can_shift } -> std::convertible_to<bool>;
    { cm.has_shift() } -> std::convertible_to<bool>;
};

template <class M>
concept memory_has_accounting = requires(const M& cm) {
    { cm.total_bytes() } -> std::convertible_to<std::size_t>;
};

/// What an engine's memory is (see the file comment for the members).
template <class M>
concept memory = memory_has_kind<M> && memory_has_placement<M> && memory_has_sequence_ops<M> &&
                 memory_has_positions<M> && memory_has_shift<M> && memory_has_accounting<M>;

/// A memory that is one cell-indexed K/V cache: kernels read its cells and storage views.
template <class M>
concept kv_memory = memory<M> && requires(const M& cm) {
    typename M::element;
    typename M::layout;
    typename M::storage_t;
    { cm.shape() } -> std::convertible_to<const model_shape&>;
    { cm.cells() } -> std::same_as<const cell_table&>;
    cm.storage();
};

/// A memory made of kv_memory parts (iswa_cache): for_each_part(f) calls f(part) on each.
template <class M>
concept composite_memory = memory<M> && requires(const M& cm) {
    cm.for_each_part([](const auto&) {});
};

/// RAII transaction guard (F4): restores every placement made through the cache
/// since construction unless commit() was called.
///
///     kvcache::transaction tx(cache);
///     auto p = cache.place(pos, seq).value();   // throws on failure: tx restores
///     ... write K/V, run attention ...
///     tx.commit();
template <class Memory>
class transaction {
    static_assert(memory<Memory>, "kvcache: transaction<M> needs M to satisfy kvcache::memory (see kvcache/memory/memory.hpp)");

public:
    explicit transaction(Memory& cache) : cache_(&cache) {}
    transaction(const transaction&) = delete;
    transaction& operator=(const transaction&) = delete;
    ~transaction() {
        if (cache_ != nullptr) static_cast<void>(cache_->restore());
    }
    /// Commits the staged placements; the guard then does nothing. A commit that throws
    /// (std::bad_alloc from a layout's commit hook, ring pruning) leaves the placements
    /// staged and the guard armed: its destructor restores them.
    tx_result commit() noexcept(noexcept(std::declval<Memory&>().commit())) {
        tx_result r = cache_ != nullptr ? cache_->commit() : tx_result::nothing_staged;
        cache_ = nullptr;
        return r;
    }
    /// Restores now; the guard then does nothing.
    tx_result restore() {
        tx_result r = cache_ != nullptr ? cache_->restore() : tx_result::nothing_staged;
        cache_ = nullptr;
        return r;
    }

private:
    Memory* cache_;
};

KVCACHE_END_NAMESPACE
