// kvcache ops: context shift for endless generation (F13) and Self-Extend grouped
// attention (F14), built on the sequence operations. Both validate every argument
// and check that the operations cannot fail half-way before changing anything: on a
// composite memory (iswa_cache) every part is checked first (what the ring would refuse,
// free cells in each part), so both parts change or neither.
#pragma once

#include <cstdint>   // fixed-width integers
#include <optional>  // default n_discard
#include <span>      // steps for the layout hook
#include <string>    // messages
#include <utility>   // std::pair
#include <vector>    // steps for the layout hook

#include "../cells/rollback.hpp"
#include "../error.hpp"
#include "../cells/seq_step.hpp"
#include "../layout/capabilities.hpp"
#include "../memory/memory.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops {

/// What a context shift did: positions [n_keep, n_keep + n_discard) were removed and
/// [n_keep + n_discard, n_past) moved left by n_discard; the sequence now ends at n_past_after.
struct context_shift_result {
    pos_t n_keep = 0;
    pos_t n_discard = 0;
    pos_t n_past_after = 0;
};

namespace detail_ctx {
/// Cells of `seq` at positions >= from that other sequences also use (each needs a free
/// cell to be split off before it can move).
template <class Cache>
std::uint32_t shared_cells_from(const Cache& cache, seq_id_t seq, std::int64_t from) {
    const auto& cells = cache.cells();
    std::uint32_t n = 0;
    for (std::uint32_t c : cells.used_cells())
        if (cells.pos(c) >= from && cells.seqs(c).test(seq) && cells.seqs(c).count() > 1) ++n;
    return n;
}
/// Cells freed when `seq` leaves positions [lo, hi): those no other sequence uses.
template <class Cache>
std::uint32_t exclusive_cells_in(const Cache& cache, seq_id_t seq, std::int64_t lo, std::int64_t hi) {
    const auto& cells = cache.cells();
    std::uint32_t n = 0;
    for (std::uint32_t c : cells.used_cells())
        if (cells.pos(c) >= lo && cells.pos(c) < hi && cells.seqs(c).test(seq) && cells.seqs(c).count() == 1) ++n;
    return n;
}
}  // namespace detail_ctx

namespace detail_ctx {
/// What a context shift would refuse in one K/V cache (free cells for splits, the
/// layout hook check_seq_steps), checked before anything changes.
template <class Cache>
result<void> check_context_shift(const Cache& cache, seq_id_t seq, pos_t n_keep, pos_t discard) {
    using std::to_string;
    const std::int64_t moved_from = std::int64_t{n_keep} + discard;
    const std::uint32_t splits = shared_cells_from(cache, seq, moved_from);
    const std::uint32_t freed = exclusive_cells_in(cache, seq, n_keep, moved_from);
    if (splits > cache.capacity() - cache.used() + freed)
        return detail::make_error(errc::no_space, "context_shift: moving shared cells needs " + to_string(splits) +
                                                      " free cells, " +
                                                      to_string(cache.capacity() - cache.used() + freed) +
                                                      " available");
    if constexpr (cache_has_capability<Cache, layout_caps::seq_steps_check>()) {  // layout capability (ring: both calls checked before the first runs)
        const seq_step steps[] = {{seq_step::op::rm, n_keep, static_cast<pos_t>(moved_from), 0},
                                  {seq_step::op::add, static_cast<pos_t>(moved_from), -1, -discard}};
        return cache.storage().check_seq_steps(cache.cells(), seq, std::span<const seq_step>(steps),
                                               "context_shift");
    }
    return {};
}
}  // namespace detail_ctx

/// F13: context shift of sequence `seq`, whose next position is n_past = seq_pos_max + 1.
/// Keeps the first n_keep positions, discards the n_discard after them (default:
/// (n_past - n_keep) / 2) and moves the rest left by n_discard, recording the K-shift
/// (apply it with ops::apply_k_shift before the next attention).
/// Requires 0 <= n_keep <= n_past and 0 < n_discard <= n_past - n_keep; anything else
/// throws kvcache::error(invalid_argument) naming the value (llama.cpp accepted a negative
/// n_discard: CVE-2026-21869), and errc::unsupported on a memory that can never move
/// positions (can_shift == false). Returns an error result when the cache cannot take the
/// shift now: no_space (free cells to split shared cells), unsupported (a ring whose window
/// pruned positions the calls need). The cache is unchanged when it refuses or throws.
template <class Memory>
[[nodiscard]] result<context_shift_result> context_shift(Memory& cache, seq_id_t seq, pos_t n_keep,
                                                         std::optional<pos_t> n_discard = {}) {
    static_assert(kvcache::memory<Memory>, "kvcache: ops::context_shift needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    static_assert(kv_memory<Memory> || composite_memory<Memory>,
                  "kvcache: ops::context_shift needs a kvcache::kv_memory or a kvcache::composite_memory of them");
    using std::to_string;
    const pos_t n_past = cache.seq_pos_max(seq) + 1;  // validates seq
    if (n_keep < 0 || n_keep > n_past)
        detail::fail(errc::invalid_argument, "context_shift: n_keep = " + to_string(n_keep) + ", must be in [0, n_past = " +
                                                 to_string(n_past) + "]");
    const pos_t discard = n_discard.value_or((n_past - n_keep) / 2);
    if (discard <= 0 || discard > n_past - n_keep)
        detail::fail(errc::invalid_argument, "context_shift: n_discard = " + to_string(discard) +
                                                 ", must be in [1, n_past - n_keep = " + to_string(n_past - n_keep) + "]");
    if constexpr (!Memory::can_shift)
        detail::fail(errc::unsupported, "context_shift: the memory cannot move positions (can_shift == false)");
    const std::int64_t moved_from = std::int64_t{n_keep} + discard;
    // Every part is checked before any changes (a composite's seq_rm / seq_add are each
    // atomic, and these checks make sure neither can refuse in any part).
    result<void> allowed;
    if constexpr (composite_memory<Memory>)
        cache.for_each_part([&](const auto& part) {
            if (allowed) allowed = detail_ctx::check_context_shift(part, seq, n_keep, discard);
        });
    else
        allowed = detail_ctx::check_context_shift(cache, seq, n_keep, discard);
    if (!allowed) return detail::make_error(allowed.code(), allowed.message());
    // Both calls or neither: a refusal of the second (paged: no free block for the splits)
    // or a throw (std::bad_alloc) rolls the first back.
    result<void> done = detail::with_rollback(cache, [&]() -> result<void> {
        if (result<void> r = cache.seq_rm(seq, n_keep, static_cast<pos_t>(moved_from)); !r) return r;
        return cache.seq_add(seq, static_cast<pos_t>(moved_from), -1, -discard);
    });
    if (!done) return detail::make_error(done.code(), done.message());
    return context_shift_result{n_keep, discard, n_past - discard};
}

/// F14: Self-Extend state of one sequence: group factor ga_n, window ga_w (a multiple of
/// ga_n), and ga_i, the start of the next group (0 at the start of a sequence).
struct self_extend_state {
    int ga_n = 1;
    int ga_w = 512;
    pos_t ga_i = 0;
};

namespace detail_ctx {
/// The Self-Extend rounds from (ga_i, n_past) while n_past >= ga_i + ga_w, in 64-bit:
/// round(gi, np, up, dd) per round, with up = ib*bd, then np -= bd and gi += ga_w/ga_n
/// (names as in self_extend). Returns {n_past, ga_i} after the last round.
template <class Round>
std::pair<std::int64_t, std::int64_t> self_extend_rounds(const self_extend_state& st, std::int64_t n_past,
                                                         Round&& round) {
    std::int64_t gi = st.ga_i;
    while (n_past >= gi + st.ga_w) {
        const std::int64_t ib = std::int64_t{st.ga_n} * gi / st.ga_w;
        const std::int64_t bd = std::int64_t{st.ga_w / st.ga_n} * (st.ga_n - 1);
        const std::int64_t dd = std::int64_t{st.ga_w / st.ga_n} - ib * bd - st.ga_w;
        round(gi, n_past, ib * bd, dd);
        n_past -= bd;
        gi += st.ga_w / st.ga_n;
    }
    return {n_past, gi};
}
/// The seq_add / seq_div calls of those rounds, three per round, given to emit(const
/// seq_step&). The caller checked that every value fits pos_t.
template <class Emit>
std::pair<std::int64_t, std::int64_t> self_extend_steps(const self_extend_state& st, pos_t n_past, Emit&& emit) {
    const auto p = [](std::int64_t x) { return static_cast<pos_t>(x); };
    return self_extend_rounds(st, n_past, [&](std::int64_t gi, std::int64_t np, std::int64_t up, std::int64_t dd) {
        emit(seq_step{seq_step::op::add, p(gi), p(np), p(up)});
        emit(seq_step{seq_step::op::div, p(gi + up), p(gi + up + st.ga_w), st.ga_n});
        emit(seq_step{seq_step::op::add, p(gi + up + st.ga_w), p(np + up), p(dd)});
    });
}
}  // namespace detail_ctx

namespace detail_ctx {
/// What Self-Extend would refuse in one K/V cache (free cells for splits, the layout hook
/// check_seq_steps over every call), checked before anything changes.
template <class Cache>
result<void> check_self_extend(const Cache& cache, seq_id_t seq, const self_extend_state& st, pos_t n_past) {
    using std::to_string;
    // Every cell of seq from ga_i on may move; each shared one is split at most once.
    const std::uint32_t splits = shared_cells_from(cache, seq, st.ga_i);
    if (splits > cache.capacity() - cache.used())
        return detail::make_error(errc::no_space, "self_extend: moving shared cells needs " + to_string(splits) +
                                                      " free cells, " + to_string(cache.capacity() - cache.used()) +
                                                      " free");
    if constexpr (cache_has_capability<Cache, layout_caps::seq_steps_check>()) {
        std::vector<seq_step> steps;  // layout capability (ring: calls that need pruned positions)
        self_extend_steps(st, n_past, [&](const seq_step& x) { steps.push_back(x); });
        return cache.storage().check_seq_steps(cache.cells(), seq, std::span<const seq_step>(steps), "self_extend");
    }
    return {};
}
}  // namespace detail_ctx

/// F14: compresses the positions of `seq` beyond the pretrained window as Self-Extend does,
/// while n_past >= ga_i + ga_w: each round shifts [ga_i, n_past) by ib*bd, divides the next
/// window [ga_i + ib*bd, ga_i + ib*bd + ga_w) by ga_n, and shifts the rest by dd, with
/// ib = ga_n*ga_i/ga_w, bd = (ga_w/ga_n)*(ga_n-1), dd = ga_w/ga_n - ib*bd - ga_w.
/// Returns the new n_past (n_past - bd per round) and advances st.ga_i by ga_w/ga_n.
/// Records the K-shifts (apply them with ops::apply_k_shift). Throws kvcache::error on
/// invalid ga_n / ga_w / n_past or positions past 2^31-1 (invalid_argument) and on a memory
/// that can never move positions (unsupported, can_shift == false). Returns an error result
/// when the cache cannot take it now: no_space (free cells to split shared cells),
/// unsupported (a ring whose window pruned positions the calls need: every call is checked
/// first through the layout hook check_seq_steps). The cache and st are unchanged when it
/// refuses or throws.
template <class Memory>
[[nodiscard]] result<pos_t> self_extend(Memory& cache, seq_id_t seq, self_extend_state& st, pos_t n_past) {
    static_assert(kvcache::memory<Memory>, "kvcache: ops::self_extend needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    static_assert(kv_memory<Memory> || composite_memory<Memory>,
                  "kvcache: ops::self_extend needs a kvcache::kv_memory or a kvcache::composite_memory of them");
    using std::to_string;
    static_cast<void>(cache.seq_pos_max(seq));  // validates seq
    if (st.ga_n < 1) detail::fail(errc::invalid_argument, "self_extend: ga_n = " + to_string(st.ga_n) + ", must be >= 1");
    if (st.ga_w <= 0 || st.ga_w % st.ga_n != 0)
        detail::fail(errc::invalid_argument, "self_extend: ga_w = " + to_string(st.ga_w) +
                                                 ", must be > 0 and a multiple of ga_n = " + to_string(st.ga_n));
    if (st.ga_i < 0) detail::fail(errc::invalid_argument, "self_extend: ga_i = " + to_string(st.ga_i) + ", must be >= 0");
    if (n_past < 0) detail::fail(errc::invalid_argument, "self_extend: n_past = " + to_string(n_past) + ", must be >= 0");
    if (st.ga_n == 1) return n_past;  // nothing to group
    // Positions may not overflow: the largest intermediate is n_past + ib*bd.
    detail_ctx::self_extend_rounds(st, n_past, [&](std::int64_t, std::int64_t np, std::int64_t up, std::int64_t) {
        if (np + up > INT32_MAX)
            detail::fail(errc::invalid_argument,
                         "self_extend: positions would pass 2^31-1 (n_past = " + to_string(n_past) + ")");
    });
    if constexpr (!Memory::can_shift)
        detail::fail(errc::unsupported, "self_extend: the memory cannot move positions (can_shift == false)");
    result<void> allowed;
    if constexpr (composite_memory<Memory>)
        cache.for_each_part([&](const auto& part) {
            if (allowed) allowed = detail_ctx::check_self_extend(part, seq, st, n_past);
        });
    else
        allowed = detail_ctx::check_self_extend(cache, seq, st, n_past);
    if (!allowed) return detail::make_error(allowed.code(), allowed.message());
    std::pair<std::int64_t, std::int64_t> after{};
    // Every round or none: a refusal (paged: free blocks for splits) or a throw rolls back.
    result<void> ran = detail::with_rollback(cache, [&]() -> result<void> {
        result<void> r;
        after = detail_ctx::self_extend_steps(st, n_past, [&](const seq_step& x) {
            if (r) r = run_step(cache, seq, x);
        });
        return r;
    });
    if (!ran) return detail::make_error(ran.code(), ran.message());
    st.ga_i = static_cast<pos_t>(after.second);
    return static_cast<pos_t>(after.first);
}

}  // namespace ops
KVCACHE_END_NAMESPACE
