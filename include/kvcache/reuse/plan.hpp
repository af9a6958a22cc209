// kvcache: the reuse plan: given the tokens a sequence holds and a new request,
// what can be kept, what is moved into place by K-shift, and what the host must
// compute (F19, F20).
//
//   cached : [A B C D | x x | E F G H ... (>= min_chunk) | y ...]
//   request: [A B C D | E F G H ... | z z z]
//             n_lcp     moved chunk    computed
//
// make_plan() is a pure function of the two token lists; a reuse policy's plan()
// (concepts.hpp) is made of it. check_plan() verifies that a plan claims only what
// the token lists allow; apply_plan() performs it on one sequence of a kv_cache
// with seq_rm / seq_add, after checking that it can succeed, so that a refused
// plan leaves the cache untouched.
#pragma once

#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <span>     // steps for the layout hook
#include <string>   // messages
#include <string_view>  // check_plan caller name
#include <vector>   // moves

#include "../cells/rollback.hpp"
#include "../error.hpp"
#include "../cells/seq_step.hpp"
#include "../layout/capabilities.hpp"
#include "../model_shape.hpp"
#include "../tokens/prompt_tokens.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace reuse {

/// Cached positions [src, src + n) of the sequence are moved to [dst, dst + n), dst < src (F20).
struct chunk_move {
    pos_t src = 0;
    pos_t dst = 0;
    std::uint32_t n = 0;
    friend constexpr bool operator==(const chunk_move&, const chunk_move&) = default;
};

/// What a request reuses from a sequence's cached tokens.
/// After apply_plan(), the sequence holds exactly request positions [0, n_past);
/// the host computes request positions [n_past, request.size()).
struct plan {
    std::uint32_t n_lcp = 0;         ///< common prefix kept in place
    std::vector<chunk_move> moves;   ///< chunks moved into place after the prefix, in order
    std::uint32_t n_past = 0;        ///< n_lcp + every move's n
    std::uint32_t n_request = 0;     ///< request size

    /// Tokens reused by chunk shifting.
    [[nodiscard]] std::uint32_t n_shifted() const noexcept {
        std::uint32_t n = 0;
        for (const auto& m : moves) n += m.n;
        return n;
    }
    /// Tokens the host must compute: request positions [n_past, n_request).
    [[nodiscard]] std::uint32_t n_compute() const noexcept { return n_request - n_past; }

    friend bool operator==(const plan&, const plan&) = default;
};

/// Inputs of make_plan besides the two token lists.
struct plan_options {
    /// false: reuse nothing, recompute the whole request (llama-server's cache_prompt = false).
    bool cache_prompt = true;
    /// Minimum run of matching tokens moved by chunk shifting (n_cache_reuse); 0 disables it.
    /// A reuse policy's plan() sets it from its own parameter (lcp: 0, chunk_shift<N>: N)
    /// whatever its caller passed.
    std::uint32_t min_chunk = 0;
    /// Whether plans may move positions (layout::can_shift, and no sliding window in the
    /// slot manager); false disables chunk shifting.
    bool can_shift = true;
    /// Keep at least the last request token to compute, so the host gets logits (F24):
    /// an exact repeat recomputes its last token instead of nothing.
    bool need_logits = true;
};

/// Plans how `request` reuses `cached` (F19, F20). Never ends inside a media chunk.
[[nodiscard]] inline plan make_plan(const prompt_tokens& cached, const prompt_tokens& request,
                                    const plan_options& opt = {}) {
    plan p;
    p.n_request = static_cast<std::uint32_t>(request.size());
    if (!opt.cache_prompt) return p;
    p.n_lcp = static_cast<std::uint32_t>(cached.common_prefix(request));
    p.n_past = p.n_lcp;
    const bool shift_ok = opt.min_chunk > 0 && opt.can_shift && !cached.has_media() && !request.has_media();
    if (shift_ok) {
        const auto ct = cached.tokens();
        const auto rt = request.tokens();
        std::size_t head_c = p.n_lcp, head_p = p.n_lcp;
        while (head_c < ct.size() && head_p < rt.size()) {
            std::size_t n = 0;
            while (head_c + n < ct.size() && head_p + n < rt.size() && ct[head_c + n] == rt[head_p + n]) ++n;
            if (n >= opt.min_chunk) {
                p.moves.push_back({static_cast<pos_t>(head_c), static_cast<pos_t>(head_p), static_cast<std::uint32_t>(n)});
                p.n_past += static_cast<std::uint32_t>(n);
                head_c += n;
                head_p += n;
            } else {
                ++head_c;
            }
        }
    }
    if (opt.need_logits && p.n_request > 0 && p.n_past == p.n_request) {
        // Recompute the last position (the whole chunk if it is media) to get logits.
        const auto keep = static_cast<std::uint32_t>(request.chunk_floor(p.n_request - 1));
        while (!p.moves.empty() && static_cast<std::uint32_t>(p.moves.back().dst) >= keep) {
            p.n_past -= p.moves.back().n;
            p.moves.pop_back();
        }
        if (!p.moves.empty() && static_cast<std::uint32_t>(p.moves.back().dst) + p.moves.back().n > keep) {
            const std::uint32_t cut = static_cast<std::uint32_t>(p.moves.back().dst) + p.moves.back().n - keep;
            p.moves.back().n -= cut;
            p.n_past -= cut;
        }
        if (p.moves.empty()) p.n_lcp = std::min(p.n_lcp, keep);
        p.n_past = std::min(p.n_past, keep);
    }
    return p;
}

/// Checks that plan p only claims what `request` can reuse of `cached`, as the slot manager
/// does before executing a reuse policy's plan. Throws kvcache::error(invalid_argument),
/// the message starting with `who` and naming the first violation, unless:
///   - p.n_request == request.size(); nothing is kept when !opt.cache_prompt;
///   - n_lcp <= the common prefix of cached and request, not inside a media chunk;
///   - moves only if may_move (the policy's needs_shift) and opt.can_shift, no media in
///     either list; move i starts where the previous one ended (the first at n_lcp), each
///     n >= 1, dst <= src, sources increasing without overlap and inside `cached`, and
///     cached[src, src + n) == request[dst, dst + n);
///   - n_past == n_lcp + every move's n, n_past <= n_request, n_past < n_request when
///     opt.need_logits, and n_past not inside a media chunk of the request.
inline void check_plan(const prompt_tokens& cached, const prompt_tokens& request, const plan& p,
                       const plan_options& opt, bool may_move, std::string_view who) {
    using std::to_string;
    const auto bad = [&](const std::string& what) {
        detail::fail(errc::invalid_argument, std::string(who) + ": refused reuse plan: " + what);
    };
    if (p.n_request != request.size())
        bad("n_request = " + to_string(p.n_request) + ", the request has " + to_string(request.size()) + " positions");
    if (!opt.cache_prompt && (p.n_lcp != 0 || !p.moves.empty()))
        bad("cache_prompt is false but the plan keeps " + to_string(p.n_lcp) + " positions and " +
            to_string(p.moves.size()) + " moves");
    const std::size_t lcp = cached.common_prefix(request);
    if (p.n_lcp > lcp)
        bad("n_lcp = " + to_string(p.n_lcp) + " but cached and request share only " + to_string(lcp) + " positions");
    if (request.cuts_chunk(p.n_lcp)) bad("n_lcp = " + to_string(p.n_lcp) + " ends inside a media chunk");
    if (!p.moves.empty()) {
        if (!may_move) bad("the plan moves chunks but the reuse policy declares needs_shift = false");
        if (!opt.can_shift) bad("the plan moves chunks but plan_options::can_shift is false");
        if (cached.has_media() || request.has_media()) bad("the plan moves chunks but the tokens hold media");
    }
    std::uint64_t at = p.n_lcp;     // next request position a move must fill
    std::uint64_t src_end = p.n_lcp;  // first cached position a move may read
    for (std::size_t i = 0; i < p.moves.size(); ++i) {
        const chunk_move& m = p.moves[i];
        const std::string name = "moves[" + to_string(i) + "] = {src " + to_string(m.src) + ", dst " +
                                 to_string(m.dst) + ", n " + to_string(m.n) + "}";
        if (m.n == 0) bad(name + ": n must be >= 1");
        if (m.dst < 0 || static_cast<std::uint64_t>(m.dst) != at)
            bad(name + ": dst must be " + to_string(at) + " (where the previous chunk ends)");
        if (m.src < m.dst || static_cast<std::uint64_t>(m.src) < src_end)
            bad(name + ": src must be >= dst and >= " + to_string(src_end) + " (sources increase without overlap)");
        if (std::uint64_t{static_cast<std::uint32_t>(m.src)} + m.n > cached.size() || at + m.n > request.size())
            bad(name + ": past the end of the cached (" + to_string(cached.size()) + ") or request (" +
                to_string(request.size()) + ") tokens");
        for (std::uint32_t k = 0; k < m.n; ++k)
            if (cached[static_cast<std::size_t>(m.src) + k] != request[static_cast<std::size_t>(at) + k])
                bad(name + ": cached position " + to_string(m.src + static_cast<pos_t>(k)) +
                    " does not hold request position " + to_string(at + k));
        at += m.n;
        src_end = static_cast<std::uint64_t>(m.src) + m.n;
    }
    if (p.n_past != at)
        bad("n_past = " + to_string(p.n_past) + ", must be n_lcp + every move's n = " + to_string(at));
    if (p.n_past > request.size())
        bad("n_past = " + to_string(p.n_past) + " exceeds the request's " + to_string(request.size()) + " positions");
    if (opt.need_logits && !request.empty() && p.n_past == request.size())
        bad("n_past = n_request = " + to_string(p.n_past) + " but need_logits asks to compute at least one position");
    if (request.cuts_chunk(p.n_past)) bad("n_past = " + to_string(p.n_past) + " ends inside a media chunk");
}

/// Number of free cells apply_plan needs: one per cell of a moved range that `seq` shares
/// with another sequence (seq_add splits such cells, F5).
template <class Cache>
[[nodiscard]] std::uint32_t cells_needed(const Cache& cache, seq_id_t seq, const plan& p) {
    std::uint32_t n = 0;
    if (p.moves.empty()) return 0;
    const auto& cells = cache.cells();
    for (std::uint32_t c : cells.used_cells()) {
        if (!cells.seqs(c).test(seq) || cells.seqs(c).count() < 2) continue;
        const pos_t pos = cells.pos(c);
        for (const auto& m : p.moves)
            if (pos >= m.src && pos < m.src + static_cast<pos_t>(m.n)) {
                ++n;
                break;
            }
    }
    return n;
}

/// The seq_rm / seq_add calls of plan p, in order, given to emit(const seq_step&): per move,
/// seq_rm of the positions between its destination and source, then seq_add of the chunk
/// into place; last, seq_rm of every position >= n_past.
template <class Emit>
void for_each_step(const plan& p, Emit&& emit) {
    for (const auto& m : p.moves) {
        emit(seq_step{seq_step::op::rm, m.dst, m.src, 0});
        emit(seq_step{seq_step::op::add, m.src, m.src + static_cast<pos_t>(m.n), m.dst - m.src});
    }
    emit(seq_step{seq_step::op::rm, static_cast<pos_t>(p.n_past), -1, 0});
}

/// The programming errors apply_plan refuses before looking at the cache (every memory's
/// overload calls it first): seq out of [0, n_seq_max), an open transaction, n_past or a
/// move past 2^31-1, a move with dst < 0 or dst > src. Throws kvcache::error.
inline void check_apply_args(seq_id_t seq, std::uint32_t n_seq_max, bool in_transaction, const plan& p) {
    using std::to_string;
    if (seq < 0 || static_cast<std::uint32_t>(seq) >= n_seq_max)
        detail::fail(errc::invalid_argument, "apply_plan: seq = " + to_string(seq) + ", must be in [0, " +
                                                 to_string(n_seq_max) + ")");
    if (in_transaction)
        detail::fail(errc::transaction_open, "apply_plan: placements are staged; commit() or restore() first");
    if (p.n_past > std::uint32_t{0x7fffffff})
        detail::fail(errc::invalid_argument, "apply_plan: n_past = " + to_string(p.n_past) + ", must be < 2^31");
    for (std::size_t i = 0; i < p.moves.size(); ++i) {
        const chunk_move& m = p.moves[i];
        if (m.dst < 0 || m.dst > m.src || std::int64_t{m.src} + m.n > 0x7fffffff)
            detail::fail(errc::invalid_argument, "apply_plan: moves[" + to_string(i) + "] = {src " + to_string(m.src) +
                                                     ", dst " + to_string(m.dst) + ", n " + to_string(m.n) +
                                                     "}: needs 0 <= dst <= src and src + n < 2^31");
    }
}

/// Performs plan p on sequence seq (F19, F20): the calls of for_each_step. Moved cells keep a
/// pending K-shift (cache.has_shift()); apply it with the K-shift kernel before attention.
/// Returns an error result, nothing changed, when the cache cannot take the plan now:
/// no_space (free cells to split shared cells), unsupported (a ring that would refuse one of
/// the calls because its window pruned positions they need: every call is checked first
/// through the layout hook check_seq_steps). Throws kvcache::error, nothing changed, for a
/// programming error: unsupported (the plan moves chunks on a layout that can never move
/// positions), transaction_open, invalid_argument (seq, or a move with dst < 0, dst > src
/// or src + n past 2^31-1, or n_past past 2^31-1). A layout whose split targets need
/// whole free blocks (paged) may still refuse a seq_add after the plan's first seq_rm;
/// the result then carries that refusal and the cache is rolled back (strong guarantee,
/// also when an allocation throws).
template <class Cache>
[[nodiscard]] result<void> apply_plan(Cache& cache, seq_id_t seq, const plan& p) {
    // reuse/ sits below memory/ in the layering, so the check spells out what this needs
    // of kvcache::memory and kvcache::kv_memory (iswa_cache has its own overload).
    static_assert(requires(Cache& c, const Cache& cc, seq_id_t s, pos_t q) {
                      typename Cache::memory_concept;
                      c.seq_rm(s, q, q);
                      c.seq_add(s, q, q, q);
                      cc.cells();
                      cc.shape();
                  },
                  "kvcache: reuse::apply_plan needs a kvcache::kv_memory (see kvcache/memory/memory.hpp)");
    using std::to_string;
    check_apply_args(seq, cache.shape().n_seq_max, cache.in_transaction(), p);
    if (!p.moves.empty()) {
        if constexpr (!Cache::layout::can_shift)
            detail::fail(errc::unsupported, "apply_plan: the plan moves chunks but the " +
                                                std::string(Cache::layout::name) + " layout cannot move positions");
        const std::uint32_t need = cells_needed(cache, seq, p);
        if (need > cache.capacity() - cache.used())
            return detail::make_error(errc::no_space, "apply_plan: moving chunks needs " + to_string(need) +
                                                          " free cells to split shared cells, " +
                                                          to_string(cache.capacity() - cache.used()) + " free");
        if constexpr (cache_has_capability<Cache, layout_caps::seq_steps_check>()) {
            std::vector<seq_step> steps;  // layout capability (ring: calls that need pruned positions)
            steps.reserve(2 * p.moves.size() + 1);
            for_each_step(p, [&](const seq_step& st) { steps.push_back(st); });
            if (result<void> r =
                    cache.storage().check_seq_steps(cache.cells(), seq, std::span<const seq_step>(steps), "apply_plan");
                !r)
                return r;
        }
    }
    return detail::with_rollback(cache, [&] {  // a refusal or a throw in any call changes nothing
        result<void> out;
        for_each_step(p, [&](const seq_step& st) {
            if (out) out = run_step(cache, seq, st);
        });
        return out;
    });
}

}  // namespace reuse
KVCACHE_END_NAMESPACE
