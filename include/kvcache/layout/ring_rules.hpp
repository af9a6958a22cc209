// kvcache: the rules of the ring layout (ring.hpp) for moving and removing positions
// of a sequence whose window pruned some, and their simulator for lists of steps.
//
// Moving positions (seq_add / seq_div, hence K-shift, context shift and chunk reuse)
// works like on the contiguous layout (shared cells are split, the moving sequence's
// copy going to a free cell of its own region when there is one) except where the
// result could differ from a cache that never pruned. With w = pruned_below(t) > 0
// for a sequence t the operation moves, it is refused (errc::unsupported, nothing
// changed) when
//   (a) the range [p0, p1) reaches below w (p0 < w): a full cache would move positions
//       that are gone here, or
//   (b) the operation lowers t's last position to m and the window of the next token,
//       at m + 1, would start below w: m + 1 - Window + 1 < w (the rule seq_rm applies
//       to a truncation below). Right after a commit w = last - Window + 1, so on a
//       sequence that pruned anything this allows lowering the last position by at most
//       one: a context shift or Self-Extend needs the positions the window dropped.
// Positions below w are never moved (a), so w stays valid afterwards. Every other move
// gives the same windows as a cache that never pruned: the positions moved are all
// present, and the window of every later token starts at or above w (b).
// ops::context_shift, reuse::apply_plan (chunk reuse) and ops::self_extend check their
// lists of seq_rm / seq_add / seq_div calls first (check_seq_steps: each call is checked
// by these rules against the positions the calls before it leave, simulated on a copy of
// the sequence's positions), so they are refused whole rather than half-done.
//
// What else the layout refuses (errc::unsupported, cache unchanged):
// - seq_rm that needs pruned data: removing a range that reaches below the pruning
//   point w while positions above it remain; truncating a sequence at p > 0 so that
//   it ends at m and the next token's window would reach below w (m + 2 - Window < w,
//   as (b)), or so that every position held here goes while a full cache would keep
//   the pruned ones (remove the whole sequence with p0 <= 0 instead);
// - seq_cp of a range that reaches below src's pruning point w when it would give dst
//   no cell, or leave dst's next window reaching below w; otherwise dst inherits w.
#pragma once

#include <algorithm>  // std::max, std::min
#include <cstdint>    // fixed-width integers
#include <iterator>   // std::prev
#include <map>        // simulated positions of check_seq_steps
#include <span>       // step lists
#include <string>     // refusal messages
#include <utility>    // std::pair
#include <vector>     // moved positions

#include "../cells/cell_table.hpp"
#include "../cells/seq_step.hpp"
#include "../error.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace detail {

/// The refusal rules of ring<Window> (above) as pure functions of a sequence's positions
/// and pruning point, plus the simulator check_seq_steps runs them on.
template <std::uint32_t Window>
struct ring_rules {
    static std::string range_end(std::int64_t hi) {
        return hi > std::int64_t{0x7fffffff} ? std::string("end") : std::to_string(hi);
    }
    using pos_map = std::map<pos_t, std::uint32_t>;  // position -> cells (cell_table::seq_positions)
    static constexpr std::int64_t end_of_positions = std::int64_t{0x7fffffff} + 1;  // p1 < 0: to the end

    /// Largest position of m in [lo, hi), or -1.
    static pos_t max_in(const pos_map& m, std::int64_t lo, std::int64_t hi) {
        auto it = hi >= end_of_positions ? m.end() : m.lower_bound(static_cast<pos_t>(hi));
        if (it == m.begin()) return -1;
        const pos_t p = std::prev(it)->first;
        return p >= lo ? p : -1;
    }
    static pos_t max_in(const cell_table& cells, seq_id_t s, std::int64_t lo, std::int64_t hi) {
        return max_in(cells.seq_positions(s), lo, hi);
    }
    static pos_t max_of(const pos_map& m) { return m.empty() ? -1 : m.rbegin()->first; }

    /// Why seq_rm of [lo, hi) from sequence s (positions m, pruning point w > 0) is refused,
    /// or an empty string when it is allowed.
    static std::string rm_refusal(const pos_map& m, pos_t w, seq_id_t s, std::int64_t lo, std::int64_t hi) {
        const pos_t mx = max_of(m);
        const std::string head = "seq_rm: sequence " + std::to_string(s) + " of the ring<" +
                                 std::to_string(Window) + "> layout has no positions below " + std::to_string(w) +
                                 " any more (pruned by the sliding window); ";
        if (hi > mx) {                  // truncation: keeps positions < lo
            if (lo <= 0) return {};     // removes the whole sequence, in a full cache too
            const pos_t last = max_in(m, 0, lo);  // the new last position (-1: none left here)
            if (std::int64_t{last} + 2 - static_cast<std::int64_t>(Window) >= w) return {};
            return head + "truncating at " + std::to_string(lo) +
                   (last < 0 ? std::string(" removes every position held here while a full cache would keep "
                                           "those below it; remove the whole sequence (p0 <= 0) or recompute")
                             : " leaves it ending at " + std::to_string(last) +
                                   ", and the next token's window would need positions from " +
                                   std::to_string(std::int64_t{last} + 2 - static_cast<std::int64_t>(Window)) +
                                   "; recompute instead");
        }
        if (lo < w)
            return head + "cannot remove the range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                   ") that reaches below it";
        return {};
    }

    /// Why moving [lo, hi) of sequence s (positions m, pruning point w > 0) to f(p) is
    /// refused (rules (a) and (b) of the file comment), or an empty string.
    template <class F>
    static std::string shift_refusal(const pos_map& m, pos_t w, const char* fn, seq_id_t s, std::int64_t lo,
                                     std::int64_t hi, F f) {
        const pos_t top = max_in(m, lo, hi);
        if (top < 0) return {};  // nothing of s in the range: nothing moves
        const std::string head = std::string(fn) + ": sequence " + std::to_string(s) + " of the ring<" +
                                 std::to_string(Window) + "> layout has no positions below " + std::to_string(w) +
                                 " any more (pruned by the sliding window); ";
        if (lo < w)  // (a)
            return head + "cannot move the range [" + std::to_string(lo) + ", " + range_end(hi) +
                   ") that reaches below it";
        // (b): the new last position is the larger of the unmoved ones and the moved top
        const pos_t mx = max_of(m);
        std::int64_t last = std::max<std::int64_t>(max_in(m, 0, lo), f(top) >= 0 ? f(top) : -1);
        if (mx >= hi) last = std::max<std::int64_t>(last, mx);
        if (last < mx && last + 2 - static_cast<std::int64_t>(Window) < w)
            return head + "after moving [" + std::to_string(lo) + ", " + range_end(hi) +
                   ") the sequence would end at " + std::to_string(last) +
                   " and the next token's window would start at " +
                   std::to_string(last + 2 - static_cast<std::int64_t>(Window)) + ", below it";
        return {};
    }

    /// Applies step st (range [lo, hi)) of sequence s to its positions m, as the cache would.
    static void simulate(pos_map& m, const seq_step& st, seq_id_t s, std::int64_t lo, std::int64_t hi,
                         const char* what) {
        const auto first = m.lower_bound(static_cast<pos_t>(std::min<std::int64_t>(lo, 0x7fffffff)));
        const auto last = hi >= end_of_positions ? m.end() : m.lower_bound(static_cast<pos_t>(hi));
        if (first == last) return;  // nothing of s in the range
        std::vector<std::pair<std::int64_t, std::uint32_t>> moved;
        if (st.kind != seq_step::op::rm)
            for (auto it = first; it != last; ++it)
                moved.emplace_back(st.kind == seq_step::op::add ? std::int64_t{it->first} + st.arg
                                                                : std::int64_t{it->first} / st.arg,
                                   it->second);
        m.erase(first, last);
        for (const auto& [p, n] : moved) {
            if (p > 0x7fffffff)
                detail::fail(errc::invalid_argument, std::string(what) + ": step " + describe(st, s) +
                                                         " would move position past 2^31-1");
            if (p >= 0) m[static_cast<pos_t>(p)] += n;
        }
    }

    /// The steps as calls, for messages (the first eight).
    static std::string list_steps(std::span<const seq_step> steps, seq_id_t s) {
        std::string out;
        for (std::size_t i = 0; i < steps.size() && i < 8; ++i) out += (i == 0 ? "" : ", ") + describe(steps[i], s);
        return steps.size() > 8 ? out + ", ..." : out;
    }
};

}  // namespace detail

KVCACHE_END_NAMESPACE
