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
// Moving positions (seq_add / seq_div) and removing or copying ranges of a sequence
// that pruned are refused (an errc::unsupported result, nothing changed) where the result
// could differ from a cache that never pruned:
// the rules are in ring_rules.hpp; the bookkeeping (per-sequence cells, regions, pruning
// points) is in ring_tables.hpp. The hooks are declared capabilities of the storage
// (layout/capabilities.hpp).
// Attention on ring storage must apply the window mask (ops/ attention takes it).
#pragma once

#include <algorithm>    // std::max, std::min, std::fill
#include <cstdint>      // fixed-width integers
#include <memory>       // std::unique_ptr
#include <set>          // per-sequence cells, cells taken by a placement
#include <span>         // batch inputs
#include <string>       // messages
#include <string_view>  // name
#include <utility>      // std::pair
#include <vector>       // tables

#include "../cells/cell_table.hpp"
#include "../cells/seq_step.hpp"
#include "../concepts.hpp"
#include "../error.hpp"
#include "capabilities.hpp"
#include "kv_storage.hpp"
#include "ring_rules.hpp"
#include "ring_tables.hpp"

KVCACHE_BEGIN_NAMESPACE

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
        using rules = detail::ring_rules<Window>;

    public:
        /// The hooks this storage provides (layout/capabilities.hpp).
        static constexpr layout_caps capabilities =
            layout_caps::cell_observer | layout_caps::placement_plan | layout_caps::load_plan |
            layout_caps::commit_hook | layout_caps::seq_rm_check | layout_caps::seq_cp_check |
            layout_caps::seq_cp_hook | layout_caps::seq_shift_check | layout_caps::seq_steps_check |
            layout_caps::split_targets | layout_caps::pruning | layout_caps::sliding_window |
            layout_caps::held_cells;

        explicit storage(const model_shape& s)
            : base(checked(s)),
              region_(s.n_cells / s.n_seq_max),
              n_seq_(s.n_seq_max),
              tables_(std::make_unique<detail::ring_tables>(s.n_cells, s.n_seq_max, s.n_cells / s.n_seq_max)) {
            scratch_.reserve(s.n_cells);
            moves_.reserve(s.n_cells);
        }

        /// Cells per sequence region (R above).
        [[nodiscard]] std::uint32_t region() const noexcept { return region_; }
        /// The attention window: the last Window positions of every sequence are kept.
        [[nodiscard]] static constexpr std::uint32_t window() noexcept { return Window; }
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

        // ---- layout capabilities (layout/capabilities.hpp) ----
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
        /// free cell `to` in one of their regions). Tokens whose region stays full go to any free
        /// cell (see below). Refused (no_space) only when no cell is free.
        [[nodiscard]] result<load_plan> plan_load(const cell_table& cells, std::span<const pos_t> pos,
                                                  std::span<const seq_set> seqs) const {
            tables_->settle();
            load_plan plan;
            plan.cells.reserve(pos.size());
            std::set<std::uint32_t> taken, freed, cleared;  // cleared: regions whose foreign cells moved
            std::vector<std::size_t> overflow;               // tokens whose own region is full
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
                if (c == no_cell) overflow.push_back(i);
                else taken.insert(c);
                plan.cells.push_back(c);
            }
            // A saved sequence may hold more cells than its region (positions collapsed by
            // seq_div, cells another sequence left in a foreign region): such a state was
            // legal where it was saved, so its overflow goes to any free cell, a holder's
            // region first; commit() moves them home when room appears, as for foreign cells.
            for (std::size_t i : overflow) {
                std::uint32_t c = no_cell;
                seqs[i].for_each([&](seq_id_t u) {
                    if (c == no_cell) c = free_cell(cells, static_cast<std::uint32_t>(u), pos[i], &taken, &freed);
                });
                for (std::uint32_t cand = 0; c == no_cell && cand < cells.size(); ++cand)
                    if ((cells.is_free(cand) || freed.count(cand) != 0) && taken.count(cand) == 0) c = cand;
                if (c == no_cell) return region_full(static_cast<std::uint32_t>(detail::lowest_seq(seqs[i])), pos[i]);
                taken.insert(c);
                plan.cells[i] = c;
            }
            return plan;
        }

        /// Prunes, for every sequence, the cells below its window (max position - Window + 1).
        /// The moves' K/V copies run last, in order, once every bookkeeping step (which may
        /// allocate and throw; the cache then restores its checkpoint) has succeeded: a cell a
        /// move frees can be the destination of a later one, so copying as it goes would leave
        /// a restored cell holding another cell's K/V.
        void on_commit(cell_table& cells) {
            on_commit(cells, [](std::uint32_t) {});
        }
        /// The same; before_copy(to) runs for every move's destination before any K/V is
        /// copied (kv_cache's byte guard keeps what those cells held; it may throw).
        template <class F>
        void on_commit(cell_table& cells, F&& before_copy) {
            tables_->settle();
            moves_.clear();
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
            for (const auto& m : moves_) before_copy(m.second);
            for (const auto& [from, to] : moves_) this->copy_cell(from, to);  // noexcept
        }

        /// Refuses (an errc::unsupported result) a seq_rm that needs positions the window already dropped.
        [[nodiscard]] result<void> check_seq_rm(const cell_table& cells, seq_id_t s, std::int64_t lo,
                                                std::int64_t hi) const {
            if (lo >= hi) return {};
            if (s >= 0) return check_rm_one(cells, s, lo, hi);
            for (seq_id_t t = 0; t < static_cast<seq_id_t>(n_seq_); ++t)
                if (result<void> r = check_rm_one(cells, t, lo, hi); !r) return r;
            return {};
        }

        /// Refuses (an errc::unsupported result) a seq_cp whose range [lo, hi) reaches below src's
        /// pruning point w when dst would get none of src's cells or a next window reaching below w.
        [[nodiscard]] result<void> check_seq_cp(const cell_table& cells, seq_id_t src, seq_id_t dst, std::int64_t lo,
                                                std::int64_t hi) const {
            const pos_t w = tables_->pruned_below(src);
            if (w == 0 || lo >= w || lo >= hi) return {};  // every position of the range is here
            const pos_t top = rules::max_in(cells, src, lo, hi);
            const std::string head = "seq_cp: the range [" + std::to_string(lo) + ", " + rules::range_end(hi) +
                                     ") of sequence " + std::to_string(src) + " reaches below its pruning point " +
                                     std::to_string(w) + " (ring<" + std::to_string(Window) +
                                     "> dropped those positions); ";
            if (top < 0)
                return detail::make_error(errc::unsupported,
                                          head + "the copy would give sequence " + std::to_string(dst) + " none of them");
            const pos_t m = std::max(cells.seq_pos_max(dst), top);
            if (std::int64_t{m} + 2 - Window < w)
                return detail::make_error(errc::unsupported, head + "sequence " + std::to_string(dst) +
                                                                 " would end at " + std::to_string(m) +
                                                                 " and its next token's window would need them");
            return {};
        }
        /// check_seq_cp, then (allowed) dst inherits src's pruning point when the range reaches below it.
        [[nodiscard]] result<void> before_seq_cp(const cell_table& cells, seq_id_t src, seq_id_t dst, std::int64_t lo,
                                                 std::int64_t hi) {
            if (result<void> r = check_seq_cp(cells, src, dst, lo, hi); !r) return r;
            tables_->settle();
            const pos_t w = tables_->pruned_below(src);
            if (w != 0 && lo < w && lo < hi) tables_->raise_pruned_below(dst, w);
            return {};
        }

        /// Refuses (an errc::unsupported result) a seq_add / seq_div (new position = f(old)) of
        /// sequence s (every sequence if s < 0) over [lo, hi) that could differ from a cache that
        /// never pruned: rules (a) and (b) of the file comment.
        template <class F>
        [[nodiscard]] result<void> check_seq_shift(const cell_table& cells, const char* fn, seq_id_t s, std::int64_t lo,
                                                   std::int64_t hi, F f) const {
            if (lo >= hi) return {};
            if (s >= 0) return check_shift_one(cells, fn, s, lo, hi, f);
            for (seq_id_t t = 0; t < static_cast<seq_id_t>(n_seq_); ++t)
                if (result<void> r = check_shift_one(cells, fn, t, lo, hi, f); !r) return r;
            return {};
        }

        /// Refuses (an errc::unsupported result) a list of seq_rm / seq_add / seq_div calls on sequence s
        /// (ops::context_shift, reuse::apply_plan, ops::self_extend) that this layout would
        /// refuse part-way: each step is checked by the rules of its own call against the
        /// positions that the steps before it leave (simulated on a copy of s's positions),
        /// before any step runs. `what`
        /// names the caller in the message. Throws invalid_argument for a step the cache itself
        /// would refuse (divisor <= 0, reversed range, position past 2^31-1).
        [[nodiscard]] result<void> check_seq_steps(const cell_table& cells, seq_id_t s,
                                                   std::span<const seq_step> steps, const char* what) const {
            const pos_t w = tables_->pruned_below(checked_seq(s));
            if (w == 0) return {};  // nothing pruned: every step is allowed
            typename rules::pos_map m = cells.seq_positions(s);
            for (std::size_t i = 0; i < steps.size() && !m.empty(); ++i) {  // emptied: nothing pruned any more
                const seq_step& st = steps[i];
                const std::int64_t lo = st.p0 < 0 ? 0 : st.p0;
                const std::int64_t hi = st.p1 < 0 ? rules::end_of_positions : st.p1;
                if (lo > hi || (st.kind == seq_step::op::div && st.arg <= 0))
                    detail::fail(errc::invalid_argument,
                                 std::string(what) + ": step " + describe(st, s) + " has a reversed range or divisor");
                std::string why;
                if (st.kind == seq_step::op::rm) {
                    why = rules::rm_refusal(m, w, s, lo, hi);
                } else {
                    const std::int64_t a = st.arg;
                    const bool add = st.kind == seq_step::op::add;
                    why = rules::shift_refusal(m, w, add ? "seq_add" : "seq_div", s, lo, hi,
                                        [a, add](pos_t p) { return add ? std::int64_t{p} + a : std::int64_t{p} / a; });
                }
                if (!why.empty())
                    return detail::make_error(errc::unsupported,
                                              std::string(what) + ": step " + std::to_string(i + 1) + " of " +
                                                  std::to_string(steps.size()) + " (" + rules::list_steps(steps, s) +
                                                  ") would be refused after the steps before it, so none was run: " +
                                                  why);
                rules::simulate(m, st, s, lo, hi, what);
            }
            return {};
        }

        /// n free cells for the copies of shared cells that sequence s splits off when it
        /// moves: its own region first, then any free cell (placement moves them home later).
        /// The cache checked that n cells are free.
        [[nodiscard]] result<std::vector<std::uint32_t>> split_targets(const cell_table& cells, seq_id_t s,
                                                                       std::uint32_t n) {
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
        /// pending shift (its K/V copy is queued in moves_, see on_commit). Stays put when
        /// those regions are full.
        void rehome(cell_table& cells, std::uint32_t f) {
            const seq_set holders = cells.seqs(f);
            std::uint32_t t = no_cell;
            holders.for_each([&](seq_id_t u) {
                if (t == no_cell) t = free_cell(cells, static_cast<std::uint32_t>(u), cells.pos(f), nullptr);
            });
            if (t == no_cell) return;
            moves_.emplace_back(f, t);
            cells.occupy(t, cells.pos(f), holders, cells.ext(f));
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
        result<void> check_rm_one(const cell_table& cells, seq_id_t s, std::int64_t lo, std::int64_t hi) const {
            const pos_t w = tables_->pruned_below(s);
            if (w == 0) return {};
            if (std::string why = rules::rm_refusal(cells.seq_positions(s), w, s, lo, hi); !why.empty())
                return detail::make_error(errc::unsupported, std::move(why));
            return {};
        }

        template <class F>
        result<void> check_shift_one(const cell_table& cells, const char* fn, seq_id_t s, std::int64_t lo,
                                     std::int64_t hi, F f) const {
            const pos_t w = tables_->pruned_below(s);
            if (w == 0) return {};
            if (std::string why = rules::shift_refusal(cells.seq_positions(s), w, fn, s, lo, hi, f); !why.empty())
                return detail::make_error(errc::unsupported, std::move(why));
            return {};
        }

        std::uint32_t region_;  // cells per sequence region: n_cells / n_seq_max >= Window + 1
        std::uint32_t n_seq_;   // sequence ids are in [0, n_seq_)
        std::unique_ptr<detail::ring_tables> tables_;  // never null; address stable across moves
        std::vector<std::uint32_t> scratch_;           // cells to prune (reserved: no allocation in on_commit)
        std::vector<std::pair<std::uint32_t, std::uint32_t>> moves_;  // on_commit's K/V copies (from, to)
    };
};

KVCACHE_END_NAMESPACE
