// kvcache: the ring layout for sliding-window attention layers (F10).
//
// A sliding-window layer only looks at the last Window positions: a query at
// position p sees keys at positions (p - Window, p]. Each sequence id s owns a
// region of R = n_cells / n_seq_max cells starting at cell s * R, and position p
// of s lives in cell s * R + p mod R. R must be at least Window + the largest
// micro-batch per sequence (ring<W>::cells_for() computes n_cells), so that in
// generation that cell is always free when p is placed. When it is not (positions
// placed out of order, moved by seq_add / seq_div, or cells of other sequences still
// in the region, see below), p goes to the next free cell of the region.
//
// Pruning. After every commit, cells that fell out of the window of their sequence
// are pruned (the sequence leaves the cell), so memory stays constant however long
// generation runs. pruned_below(s) is the sequence's pruning point: positions of s
// below it may be missing here although a cache that never pruned would hold them.
// It is raised by every pruning, inherited by seq_cp (see below), saved and loaded
// with the sequence's state (io/state.hpp), and reset when s loses its last cell.
//
// Shared tokens. A token of several sequences (seq_cp, multi-sequence placement)
// lives in the region of its lowest sequence. When that sequence leaves the cell
// (pruning, seq_rm, seq_keep, its own copy after seq_add) while others still hold it,
// the cell is "foreign" to its region. So that each region only ever has to hold its
// own sequence's window, commit() moves every foreign cell (K/V of every layer,
// position, pending shift, all its holders) to a free cell in the region of its lowest
// holder, or of the next holder when that one is full (it stays put while all are).
// Commit is where such a move is safe: a placement could not make it, since restoring
// a transaction puts cell metadata back but not K/V bytes. Cells the commit itself
// prunes are checked directly; other foreign cells by scanning only the regions that
// have some (counted incrementally). Each move copies one cell and inserts it into the
// cell table's indexes (node allocations: the only ones of commit, and only when a
// shared cell is left behind). Until the next commit a region with foreign cells has
// that much less room for a placement (no_space names them). Loading a state (io/),
// which has no transaction, moves the foreign cells of the regions it fills first
// (plan_load).
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
// Attention on ring storage must apply the window mask (ops/ attention takes it).
#pragma once

#include <algorithm>    // std::max, std::min, std::fill
#include <cstdint>      // fixed-width integers
#include <iterator>     // std::prev
#include <map>          // simulated positions of check_seq_steps
#include <memory>       // std::unique_ptr
#include <set>          // per-sequence cells, cells taken by a placement
#include <span>         // batch inputs
#include <string>       // messages
#include <string_view>  // name
#include <utility>      // std::pair
#include <vector>       // tables

#include "../cells/cell_table.hpp"
#include "../concepts.hpp"
#include "../error.hpp"
#include "kv_storage.hpp"
#include "../cells/seq_step.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace detail {

/// Bookkeeping of the ring layout, kept in step with the cell table through
/// cell_observer (heap-allocated: its address survives moves): per sequence its cells
/// and pruning point, per cell its number of holders and whether the owner of its
/// region holds it, per region its occupied and foreign cells.
class ring_tables final : public cell_observer {
public:
    ring_tables(std::uint32_t n_cells, std::uint32_t n_seq, std::uint32_t region)
        : region_(region),
          n_seq_(n_seq),
          cells_(n_seq),
          pruned_(n_seq, 0),
          emptied_(n_seq, 0),
          holders_(n_cells, 0),
          owner_holds_(n_cells, 0),
          used_in_(n_seq + 1, 0),
          foreign_in_(n_seq + 1, 0) {}

    void on_seq_added(std::uint32_t c, seq_id_t s) noexcept override {
        const bool was = foreign(c);
        cells_[idx(s)].insert(c);
        if (holders_[c]++ == 0) ++used_in_[owner(c)];
        if (static_cast<std::uint32_t>(s) == owner(c)) owner_holds_[c] = 1;
        recount(c, was);
    }
    void on_seq_removed(std::uint32_t c, seq_id_t s) noexcept override {
        const bool was = foreign(c);
        auto& set = cells_[idx(s)];
        set.erase(c);
        if (set.empty() && emptied_[idx(s)] == 0) {
            emptied_[idx(s)] = 1;
            ++n_emptied_;
        }
        if (--holders_[c] == 0) --used_in_[owner(c)];
        if (static_cast<std::uint32_t>(s) == owner(c)) owner_holds_[c] = 0;
        recount(c, was);
    }
    void on_cleared() noexcept override {
        for (auto& set : cells_) set.clear();
        std::fill(emptied_.begin(), emptied_.end(), std::uint8_t{1});
        n_emptied_ = n_seq_;
        std::fill(holders_.begin(), holders_.end(), 0u);
        std::fill(owner_holds_.begin(), owner_holds_.end(), std::uint8_t{0});
        std::fill(used_in_.begin(), used_in_.end(), 0u);
        std::fill(foreign_in_.begin(), foreign_in_.end(), 0u);
    }

    /// Resets the pruning point of every sequence that lost its last cell since the last
    /// call. Deferred to the layout's next hook: a transaction restore empties and refills
    /// sequences on its way back and must find their pruning points intact.
    void settle() noexcept {
        if (n_emptied_ == 0) return;
        for (std::size_t s = 0; s < n_seq_; ++s) {
            if (emptied_[s] != 0 && cells_[s].empty()) pruned_[s] = 0;
            emptied_[s] = 0;
        }
        n_emptied_ = 0;
    }

    [[nodiscard]] const std::set<std::uint32_t>& cells_of(seq_id_t s) const noexcept { return cells_[idx(s)]; }
    /// Every position of s below this may be missing (0: nothing pruned, or s is empty).
    [[nodiscard]] pos_t pruned_below(seq_id_t s) const noexcept {
        return cells_[idx(s)].empty() ? 0 : pruned_[idx(s)];
    }
    void raise_pruned_below(seq_id_t s, pos_t p) noexcept { pruned_[idx(s)] = std::max(pruned_[idx(s)], p); }
    void set_pruned_below(seq_id_t s, pos_t p) noexcept { pruned_[idx(s)] = p; }

    /// Region of cell c: its sequence id, or n_seq for the cells past the last region.
    [[nodiscard]] std::uint32_t owner(std::uint32_t c) const noexcept { return std::min(c / region_, n_seq_); }
    /// Occupied cells in region r.
    [[nodiscard]] std::uint32_t used_in(std::uint32_t r) const noexcept { return used_in_[r]; }
    /// Occupied cells in region r that its sequence does not hold.
    [[nodiscard]] std::uint32_t foreign_in(std::uint32_t r) const noexcept { return foreign_in_[r]; }

    /// Empty string when every table matches the cell table, else the first mismatch.
    [[nodiscard]] std::string check(const cell_table& cells) const {
        std::vector<std::uint32_t> used(n_seq_ + 1, 0), foreign(n_seq_ + 1, 0);
        for (std::uint32_t c = 0; c < cells.size(); ++c) {
            const std::uint32_t r = owner(c);
            const auto n = static_cast<std::uint32_t>(cells.seqs(c).count());
            const bool owned = r < n_seq_ && cells.seqs(c).test(static_cast<seq_id_t>(r));
            if (holders_[c] != n || (owner_holds_[c] != 0) != owned)
                return "ring: cell " + std::to_string(c) + " has " + std::to_string(n) +
                       " sequences, the tables say " + std::to_string(holders_[c]);
            used[r] += n > 0;
            foreign[r] += n > 0 && !owned;
        }
        for (std::uint32_t r = 0; r <= n_seq_; ++r)
            if (used[r] != used_in_[r] || foreign[r] != foreign_in_[r])
                return "ring: region " + std::to_string(r) + " holds " + std::to_string(used[r]) + " cells (" +
                       std::to_string(foreign[r]) + " foreign), the tables say " + std::to_string(used_in_[r]) +
                       " (" + std::to_string(foreign_in_[r]) + ")";
        for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq_); ++s) {
            std::set<std::uint32_t> want;
            for (std::uint32_t c : cells.used_cells())
                if (cells.seqs(c).test(s)) want.insert(c);
            if (want != cells_[idx(s)]) return "ring: the cell set of sequence " + std::to_string(s) + " is stale";
        }
        return {};
    }

private:
    static std::size_t idx(seq_id_t s) noexcept { return static_cast<std::size_t>(s); }
    bool foreign(std::uint32_t c) const noexcept { return holders_[c] > 0 && owner_holds_[c] == 0; }
    void recount(std::uint32_t c, bool was) noexcept {
        const bool now = foreign(c);
        if (now && !was) ++foreign_in_[owner(c)];
        if (was && !now) --foreign_in_[owner(c)];
    }

    std::uint32_t region_;                          // cells per region (> 0)
    std::uint32_t n_seq_;                           // sequence ids are in [0, n_seq_)
    std::vector<std::set<std::uint32_t>> cells_;    // per sequence: the cells it uses
    std::vector<pos_t> pruned_;                     // per sequence: pruning point (read through pruned_below)
    std::vector<std::uint8_t> emptied_;             // per sequence: lost its last cell since the last settle()
    std::uint32_t n_emptied_ = 0;                   // number of set emptied_ flags
    std::vector<std::uint32_t> holders_;            // per cell: number of sequences using it
    std::vector<std::uint8_t> owner_holds_;         // per cell: the sequence of its region uses it
    std::vector<std::uint32_t> used_in_;            // per region (n_seq + 1: the tail): occupied cells
    std::vector<std::uint32_t> foreign_in_;         // per region: occupied cells its sequence does not use
};

}  // namespace detail

/// Where a loaded state goes in a ring (ring::storage::plan_load): first each move (a cell
/// with all its sequences, K/V and pending shift, from `from` to the free cell `to`), then
/// saved cell i to cells[i].
struct load_plan {
    struct move {
        std::uint32_t from = 0;
        std::uint32_t to = 0;
    };
    std::vector<std::uint32_t> cells;
    std::vector<move> moves;
};

/// Ring-buffer layout policy for sliding-window layers: keeps the last Window positions
/// of every sequence (F10).
template <std::uint32_t Window, v_layout VLayout = v_layout::row_major>
struct ring {
    static_assert(Window >= 1, "kvcache::ring<Window>: Window must be >= 1");
    using policy_kind = layout_tag;
    static constexpr std::string_view name =
        VLayout == v_layout::row_major ? std::string_view("ring") : std::string_view("ring_vt");
    static constexpr std::uint32_t layout_id = VLayout == v_layout::row_major ? 4u : 5u;
    static constexpr bool can_shift = true;
    static constexpr v_layout v_arrangement = VLayout;
    static constexpr std::uint32_t window = Window;

    /// Capacity (model_shape::n_cells) for n_seq sequences and micro-batches of up to
    /// max_ubatch tokens per sequence: n_seq x (Window + max_ubatch).
    static constexpr std::uint32_t cells_for(std::uint32_t n_seq, std::uint32_t max_ubatch) noexcept {
        return n_seq * (Window + max_ubatch);
    }

    /// Tiled K/V buffers plus per-sequence regions and pruning.
    template <class Element>
    class storage : public tiled_kv_storage<Element, VLayout> {
        using base = tiled_kv_storage<Element, VLayout>;

    public:
        explicit storage(const model_shape& s)
            : base(checked(s)),
              region_(s.n_cells / s.n_seq_max),
              n_seq_(s.n_seq_max),
              tables_(std::make_unique<detail::ring_tables>(s.n_cells, s.n_seq_max, s.n_cells / s.n_seq_max)) {
            scratch_.reserve(s.n_cells);
        }

        /// Cells per sequence region (R above).
        [[nodiscard]] std::uint32_t region() const noexcept { return region_; }
        /// Positions of sequence s below this may be missing: the window pruned them (0 when
        /// nothing was, or s holds no cell).
        [[nodiscard]] pos_t pruned_below(seq_id_t s) const { return tables_->pruned_below(checked_seq(s)); }
        /// Restores a pruning point saved with a state (io/state.hpp loads call it after
        /// placing the sequence's cells). Throws invalid_argument for s out of range or w < 0.
        void set_pruned_below(seq_id_t s, pos_t w) {
            checked_seq(s);
            if (w < 0)
                detail::fail(errc::invalid_argument,
                             "ring: pruning point " + std::to_string(w) + " of sequence " + std::to_string(s) +
                                 ", must be >= 0");
            tables_->settle();
            tables_->set_pruned_below(s, w);
        }
        /// Cells held: the whole region of every region that holds a cell, plus the occupied
        /// cells past the last region (when n_cells is not a multiple of n_seq_max, split copies
        /// land there once every region is full), so that held >= used.
        [[nodiscard]] std::uint64_t held_cells(const cell_table&) const noexcept {
            std::uint64_t n = 0;
            for (std::uint32_t r = 0; r < n_seq_; ++r) n += tables_->used_in(r) != 0;
            return n * region_ + tables_->used_in(n_seq_);
        }
        /// Occupied cells of region r (sequence r's) that sequence r does not hold.
        [[nodiscard]] std::uint32_t foreign_cells(seq_id_t r) const {
            return tables_->foreign_in(static_cast<std::uint32_t>(checked_seq(r)));
        }
        /// Empty string when the layout's tables match the cell table (tests call it).
        [[nodiscard]] std::string check_invariants(const cell_table& cells) const { return tables_->check(cells); }

        // ---- layout hooks used by kv_cache ----
        [[nodiscard]] cell_observer* observer() noexcept { return tables_.get(); }

        /// Token i goes to cell s0 * R + pos[i] mod R (s0: its lowest sequence), or to the
        /// next free cell of that region; refused (no_space) when the region is full.
        [[nodiscard]] result<placement_plan> plan_place(const cell_table& cells, std::span<const pos_t> pos,
                                                        std::span<const seq_set> seqs) const {
            tables_->settle();
            placement_plan plan;
            plan.cells.reserve(pos.size());
            std::set<std::uint32_t> taken;
            for (std::size_t i = 0; i < pos.size(); ++i) {
                const auto s0 = static_cast<std::uint32_t>(detail::lowest_seq(seqs[i]));
                const std::uint32_t c = free_cell(cells, s0, pos[i], &taken);
                if (c == no_cell) return region_full(s0, pos[i]);
                taken.insert(c);
                plan.cells.push_back(c);
            }
            return plan;
        }

        /// plan_place for state loading (io/state.hpp), where no transaction can be restored:
        /// every region the state goes to first moves its foreign cells out, as commit() would
        /// (moves, applied in order before the tokens: cell `from` with all its holders to the
        /// free cell `to` in one of their regions). Refused (no_space) when a region stays full.
        [[nodiscard]] result<load_plan> plan_load(const cell_table& cells, std::span<const pos_t> pos,
                                                  std::span<const seq_set> seqs) const {
            tables_->settle();
            load_plan plan;
            plan.cells.reserve(pos.size());
            std::set<std::uint32_t> taken, freed, cleared;  // cleared: regions whose foreign cells moved
            for (std::size_t i = 0; i < pos.size(); ++i) {
                const auto s0 = static_cast<std::uint32_t>(detail::lowest_seq(seqs[i]));
                if (tables_->foreign_in(s0) != 0 && cleared.insert(s0).second)
                    for (std::uint32_t f = s0 * region_; f < (s0 + 1) * region_; ++f) {
                        if (cells.is_free(f) || cells.seqs(f).test(static_cast<seq_id_t>(s0))) continue;
                        std::uint32_t to = no_cell;
                        cells.seqs(f).for_each([&](seq_id_t u) {
                            if (to == no_cell)
                                to = free_cell(cells, static_cast<std::uint32_t>(u), cells.pos(f), &taken, &freed);
                        });
                        if (to == no_cell) continue;  // its holders' regions are full: it stays
                        taken.insert(to);
                        freed.insert(f);
                        plan.moves.push_back({f, to});
                    }
                const std::uint32_t c = free_cell(cells, s0, pos[i], &taken, &freed);
                if (c == no_cell) return region_full(s0, pos[i]);
                taken.insert(c);
                plan.cells.push_back(c);
            }
            return plan;
        }

        /// Prunes, for every sequence, the cells below its window (max position - Window + 1).
        void on_commit(cell_table& cells) noexcept {
            tables_->settle();
            for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq_); ++s) {
                if (tables_->cells_of(s).empty()) continue;
                const pos_t lim = cells.seq_pos_max(s) - static_cast<pos_t>(Window) + 1;
                if (lim <= 0 || cells.seq_pos_min(s) >= lim) continue;
                scratch_.clear();
                std::uint32_t direct = 0;  // pruned positions found at their home cell
                std::uint32_t wanted = 0;  // cells of s below lim
                for (const auto& [p, n] : cells.seq_positions(s)) {
                    if (p >= lim) break;
                    wanted += n;
                    const std::uint32_t home = static_cast<std::uint32_t>(s) * region_ +
                                               static_cast<std::uint32_t>(p) % region_;
                    if (home < cells.size() && cells.pos(home) == p && cells.seqs(home).test(s)) {
                        scratch_.push_back(home);
                        ++direct;
                    }
                }
                if (direct != wanted) {  // some live outside their home cell (shared, moved, duplicated): scan
                    scratch_.clear();
                    for (std::uint32_t c : tables_->cells_of(s))
                        if (cells.pos(c) < lim) scratch_.push_back(c);
                }
                for (std::uint32_t c : scratch_) cells.rm_seq(c, s);
                tables_->raise_pruned_below(s, lim);
                for (std::uint32_t c : scratch_)  // cells s left that others hold: move them to their regions
                    if (!cells.is_free(c) && tables_->owner(c) == static_cast<std::uint32_t>(s)) rehome(cells, c);
            }
            for (std::uint32_t r = 0; r < n_seq_; ++r)  // foreign cells left by sequence operations
                for (std::uint32_t c = r * region_; tables_->foreign_in(r) != 0 && c < (r + 1) * region_; ++c)
                    if (!cells.is_free(c) && !cells.seqs(c).test(static_cast<seq_id_t>(r))) rehome(cells, c);
        }

        /// Refuses (errc::unsupported) a seq_rm that needs positions the window already dropped.
        void check_seq_rm(const cell_table& cells, seq_id_t s, std::int64_t lo, std::int64_t hi) const {
            if (lo >= hi) return;
            if (s >= 0) {
                check_rm_one(cells, s, lo, hi);
                return;
            }
            for (seq_id_t t = 0; t < static_cast<seq_id_t>(n_seq_); ++t) check_rm_one(cells, t, lo, hi);
        }

        /// Refuses (errc::unsupported) a seq_cp whose range [lo, hi) reaches below src's pruning
        /// point w when dst would get none of src's cells or a next window reaching below w.
        void check_seq_cp(const cell_table& cells, seq_id_t src, seq_id_t dst, std::int64_t lo, std::int64_t hi) const {
            const pos_t w = tables_->pruned_below(src);
            if (w == 0 || lo >= w || lo >= hi) return;  // every position of the range is here
            const pos_t top = max_in(cells, src, lo, hi);
            const std::string head = "seq_cp: the range [" + std::to_string(lo) + ", " + range_end(hi) +
                                     ") of sequence " + std::to_string(src) + " reaches below its pruning point " +
                                     std::to_string(w) + " (ring<" + std::to_string(Window) +
                                     "> dropped those positions); ";
            if (top < 0)
                detail::fail(errc::unsupported,
                             head + "the copy would give sequence " + std::to_string(dst) + " none of them");
            const pos_t m = std::max(cells.seq_pos_max(dst), top);
            if (std::int64_t{m} + 2 - Window < w)
                detail::fail(errc::unsupported, head + "sequence " + std::to_string(dst) + " would end at " +
                                                    std::to_string(m) + " and its next token's window would need them");
        }
        /// check_seq_cp, then dst inherits src's pruning point when the range reaches below it.
        void before_seq_cp(const cell_table& cells, seq_id_t src, seq_id_t dst, std::int64_t lo, std::int64_t hi) {
            check_seq_cp(cells, src, dst, lo, hi);
            tables_->settle();
            const pos_t w = tables_->pruned_below(src);
            if (w != 0 && lo < w && lo < hi) tables_->raise_pruned_below(dst, w);
        }

        /// Refuses (errc::unsupported) a seq_add / seq_div (new position = f(old)) of sequence s
        /// (every sequence if s < 0) over [lo, hi) that could differ from a cache that never
        /// pruned: rules (a) and (b) of the file comment.
        template <class F>
        void check_seq_shift(const cell_table& cells, const char* fn, seq_id_t s, std::int64_t lo, std::int64_t hi,
                             F f) const {
            if (lo >= hi) return;
            if (s >= 0) {
                check_shift_one(cells, fn, s, lo, hi, f);
                return;
            }
            for (seq_id_t t = 0; t < static_cast<seq_id_t>(n_seq_); ++t) check_shift_one(cells, fn, t, lo, hi, f);
        }

        /// Refuses (errc::unsupported) a list of seq_rm / seq_add / seq_div calls on sequence s
        /// (ops::context_shift, reuse::apply_plan, ops::self_extend) that this layout would
        /// refuse part-way: each step is checked by the rules of its own call against the
        /// positions that the steps before it leave (simulated on a copy of s's positions),
        /// before any step runs. `what`
        /// names the caller in the message. Throws invalid_argument for a step the cache itself
        /// would refuse (divisor <= 0, reversed range, position past 2^31-1).
        void check_seq_steps(const cell_table& cells, seq_id_t s, std::span<const seq_step> steps,
                             const char* what) const {
            const pos_t w = tables_->pruned_below(checked_seq(s));
            if (w == 0) return;  // nothing pruned: every step is allowed
            pos_map m = cells.seq_positions(s);
            for (std::size_t i = 0; i < steps.size() && !m.empty(); ++i) {  // emptied: nothing pruned any more
                const seq_step& st = steps[i];
                const std::int64_t lo = st.p0 < 0 ? 0 : st.p0;
                const std::int64_t hi = st.p1 < 0 ? end_of_positions : st.p1;
                if (lo > hi || (st.kind == seq_step::op::div && st.arg <= 0))
                    detail::fail(errc::invalid_argument,
                                 std::string(what) + ": step " + describe(st, s) + " has a reversed range or divisor");
                std::string why;
                if (st.kind == seq_step::op::rm) {
                    why = rm_refusal(m, w, s, lo, hi);
                } else {
                    const std::int64_t a = st.arg;
                    const bool add = st.kind == seq_step::op::add;
                    why = shift_refusal(m, w, add ? "seq_add" : "seq_div", s, lo, hi,
                                        [a, add](pos_t p) { return add ? std::int64_t{p} + a : std::int64_t{p} / a; });
                }
                if (!why.empty())
                    detail::fail(errc::unsupported, std::string(what) + ": step " + std::to_string(i + 1) + " of " +
                                                        std::to_string(steps.size()) + " (" + list_steps(steps, s) +
                                                        ") would be refused after the steps before it, so none was "
                                                        "run: " + why);
                simulate(m, st, s, lo, hi, what);
            }
        }

        /// n free cells for the copies of shared cells that sequence s splits off when it
        /// moves: its own region first, then any free cell (placement moves them home later).
        /// The cache checked that n cells are free.
        [[nodiscard]] std::vector<std::uint32_t> split_targets(const cell_table& cells, seq_id_t s, std::uint32_t n) {
            tables_->settle();
            std::vector<std::uint32_t> out;
            out.reserve(n);
            const std::uint32_t base = static_cast<std::uint32_t>(s) * region_;
            for (std::uint32_t c = base; c < base + region_ && out.size() < n; ++c)
                if (cells.is_free(c)) out.push_back(c);
            for (std::uint32_t c = 0; c < cells.size() && out.size() < n; ++c)
                if (cells.is_free(c) && (c < base || c >= base + region_)) out.push_back(c);
            KVCACHE_ASSERT(out.size() == n);
            return out;
        }

    private:
        static constexpr std::uint32_t no_cell = ~std::uint32_t{0};

        /// The no_space error of a placement that finds region r full.
        error_info region_full(std::uint32_t r, pos_t p) const {
            const std::uint32_t base = r * region_;
            const std::uint32_t foreign = tables_->foreign_in(r);
            return detail::make_error(
                errc::no_space,
                "place: ring<" + std::to_string(Window) + ">: the region of sequence " + std::to_string(r) +
                    " (cells [" + std::to_string(base) + ", " + std::to_string(base + region_) +
                    ")) has no free cell for position " + std::to_string(p) +
                    "; a micro-batch may hold at most n_cells / n_seq_max - window = " +
                    std::to_string(region_ - Window) + " tokens per sequence (see ring::cells_for)" +
                    (foreign == 0 ? std::string()
                                  : "; " + std::to_string(foreign) +
                                        " of its cells belong to other sequences only and move to their regions at "
                                        "the next commit"));
        }

        /// A cell of region r for position p (its home cell or the next one) that is free or
        /// in `freed`, and not in `taken`; no_cell when there is none.
        std::uint32_t free_cell(const cell_table& cells, std::uint32_t r, pos_t p, const std::set<std::uint32_t>* taken,
                                const std::set<std::uint32_t>* freed = nullptr) const {
            const std::uint32_t base = r * region_;
            const std::uint32_t home = static_cast<std::uint32_t>(p) % region_;
            for (std::uint32_t k = 0; k < region_; ++k) {
                const std::uint32_t cand = base + (home + k) % region_;
                const bool open = cells.is_free(cand) || (freed != nullptr && freed->count(cand) != 0);
                if (open && (taken == nullptr || taken->count(cand) == 0)) return cand;
            }
            return no_cell;
        }

        /// Moves foreign cell f (its region's sequence left it) with all its holders to a free
        /// cell in the region of one of them, lowest first: K/V of every layer, position and
        /// pending shift. Stays put when those regions are full.
        void rehome(cell_table& cells, std::uint32_t f) noexcept {
            const seq_set holders = cells.seqs(f);
            std::uint32_t t = no_cell;
            holders.for_each([&](seq_id_t u) {
                if (t == no_cell) t = free_cell(cells, static_cast<std::uint32_t>(u), cells.pos(f), nullptr);
            });
            if (t == no_cell) return;
            this->copy_cell(f, t);
            cells.occupy(t, cells.pos(f), holders);
            cells.set_shift(t, cells.shift(f));
            cells.free_cell(f);
        }

        static const model_shape& checked(const model_shape& s) {
            if (s.n_seq_max == 0 || s.n_cells / s.n_seq_max < Window + 1)
                detail::fail(errc::invalid_config,
                             "model_shape.n_cells = " + std::to_string(s.n_cells) + ": ring<" +
                                 std::to_string(Window) + "> needs n_cells / n_seq_max >= window + largest micro-batch"
                                 " (at least " + std::to_string(Window + 1) + " per sequence; see ring::cells_for)");
            return s;
        }
        seq_id_t checked_seq(seq_id_t s) const {
            if (s < 0 || static_cast<std::uint32_t>(s) >= n_seq_)
                detail::fail(errc::invalid_argument,
                             "ring: seq_id = " + std::to_string(s) + ", must be in [0, " + std::to_string(n_seq_) + ")");
            return s;
        }
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

        void check_rm_one(const cell_table& cells, seq_id_t s, std::int64_t lo, std::int64_t hi) const {
            const pos_t w = tables_->pruned_below(s);
            if (w == 0) return;
            if (std::string why = rm_refusal(cells.seq_positions(s), w, s, lo, hi); !why.empty())
                detail::fail(errc::unsupported, why);
        }

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

        template <class F>
        void check_shift_one(const cell_table& cells, const char* fn, seq_id_t s, std::int64_t lo, std::int64_t hi,
                             F f) const {
            const pos_t w = tables_->pruned_below(s);
            if (w == 0) return;
            if (std::string why = shift_refusal(cells.seq_positions(s), w, fn, s, lo, hi, f); !why.empty())
                detail::fail(errc::unsupported, why);
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

        std::uint32_t region_;  // cells per sequence region: n_cells / n_seq_max >= Window + 1
        std::uint32_t n_seq_;   // sequence ids are in [0, n_seq_)
        std::unique_ptr<detail::ring_tables> tables_;  // never null; address stable across moves
        std::vector<std::uint32_t> scratch_;           // cells to prune (reserved: no allocation in on_commit)
    };
};

KVCACHE_END_NAMESPACE
