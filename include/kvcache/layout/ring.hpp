// kvcache: the ring layout for sliding-window attention layers (F10).
//
// A sliding-window layer only looks at the last Window positions: a query at
// position p sees keys at positions (p - Window, p]. Each sequence id s owns a
// region of R = n_cells / n_seq_max cells starting at cell s * R, and position p
// of s lives in cell s * R + p mod R. R must be at least Window + the largest
// micro-batch per sequence (ring<W>::cells_for() computes n_cells), so that in
// generation that cell is always free when p is placed. When it is not (positions
// placed out of order, or cells of a forked sequence still held by the fork), p goes
// to the next free cell of the region; a batch that finds its region full is refused
// with no_space.
//
// After every commit, cells that fell out of the window of their sequence are
// pruned (the sequence leaves the cell), so memory stays constant however long
// generation runs. A token shared by several sequences lives in the region of the
// lowest one.
//
// What the layout refuses (errc::unsupported, cache unchanged):
// - seq_add / seq_div (positions cannot move: can_shift = false);
// - seq_rm that needs pruned data: removing a range that reaches below the
//   pruning point while positions above it remain, or truncating a sequence so that
//   the next position's window would reach pruned positions.
// Attention on ring storage must apply the window mask (ops/ attention takes it).
#pragma once

#include <algorithm>    // std::max
#include <cstdint>      // fixed-width integers
#include <memory>       // std::unique_ptr
#include <set>          // per-sequence cells
#include <span>         // batch inputs
#include <string>       // messages
#include <string_view>  // name
#include <vector>       // tables

#include "../cells/cell_table.hpp"
#include "../concepts.hpp"
#include "../error.hpp"
#include "kv_storage.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace detail {

/// Per-sequence cell sets and pruning points of the ring layout, kept in step with
/// the cell table through cell_observer (heap-allocated: its address survives moves).
class ring_tables final : public cell_observer {
public:
    explicit ring_tables(std::uint32_t n_seq_max) : cells_(n_seq_max), pruned_below_(n_seq_max, 0) {}

    void on_seq_added(std::uint32_t c, seq_id_t s) noexcept override { cells_[idx(s)].insert(c); }
    void on_seq_removed(std::uint32_t c, seq_id_t s) noexcept override {
        auto& set = cells_[idx(s)];
        set.erase(c);
        if (set.empty()) pruned_below_[idx(s)] = 0;  // an empty sequence starts afresh
    }
    void on_cleared() noexcept override {
        for (auto& set : cells_) set.clear();
        std::fill(pruned_below_.begin(), pruned_below_.end(), 0);
    }

    [[nodiscard]] const std::set<std::uint32_t>& cells_of(seq_id_t s) const noexcept { return cells_[idx(s)]; }
    /// Every position of s below this was pruned (0: nothing pruned).
    [[nodiscard]] pos_t pruned_below(seq_id_t s) const noexcept { return pruned_below_[idx(s)]; }
    void raise_pruned_below(seq_id_t s, pos_t p) noexcept {
        pruned_below_[idx(s)] = std::max(pruned_below_[idx(s)], p);
    }

private:
    static std::size_t idx(seq_id_t s) noexcept { return static_cast<std::size_t>(s); }

    std::vector<std::set<std::uint32_t>> cells_;  // per sequence: the cells it uses
    std::vector<pos_t> pruned_below_;             // per sequence: pruning point; 0 when empty
};

}  // namespace detail

/// Ring-buffer layout policy for sliding-window layers: keeps the last Window positions
/// of every sequence (F10).
template <std::uint32_t Window, v_layout VLayout = v_layout::row_major>
struct ring {
    static_assert(Window >= 1, "kvcache::ring<Window>: Window must be >= 1");
    using policy_kind = layout_tag;
    static constexpr std::string_view name =
        VLayout == v_layout::row_major ? std::string_view("ring") : std::string_view("ring_vt");
    static constexpr std::uint32_t layout_id = VLayout == v_layout::row_major ? 4u : 5u;
    static constexpr bool can_shift = false;
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
              tables_(std::make_unique<detail::ring_tables>(s.n_seq_max)) {
            scratch_.reserve(s.n_cells);
        }

        /// Cells per sequence region (R above).
        [[nodiscard]] std::uint32_t region() const noexcept { return region_; }
        /// Positions of sequence s below this were pruned (0 when nothing was).
        [[nodiscard]] pos_t pruned_below(seq_id_t s) const { return tables_->pruned_below(checked_seq(s)); }
        /// Cells held: the region of every sequence that has cells.
        [[nodiscard]] std::uint64_t held_cells(const cell_table&) const noexcept {
            std::uint64_t n = 0;
            for (seq_id_t s = 0; s < static_cast<seq_id_t>(n_seq_); ++s) n += !tables_->cells_of(s).empty();
            return n * region_;
        }

        // ---- layout hooks used by kv_cache ----
        [[nodiscard]] cell_observer* observer() noexcept { return tables_.get(); }

        /// Token i goes to cell s0 * R + pos[i] mod R (s0: its lowest sequence), or to the
        /// next free cell of that region; refused (no_space) when the region is full.
        [[nodiscard]] result<placement_plan> plan_place(const cell_table& cells, std::span<const pos_t> pos,
                                                        std::span<const seq_set> seqs) const {
            placement_plan plan;
            plan.cells.reserve(pos.size());
            std::set<std::uint32_t> taken;
            for (std::size_t i = 0; i < pos.size(); ++i) {
                const seq_id_t s0 = detail::lowest_seq(seqs[i]);
                const std::uint32_t base = static_cast<std::uint32_t>(s0) * region_;
                const std::uint32_t home = static_cast<std::uint32_t>(pos[i]) % region_;
                std::uint32_t c = no_cell;
                for (std::uint32_t k = 0; k < region_ && c == no_cell; ++k) {
                    const std::uint32_t cand = base + (home + k) % region_;
                    if (cells.is_free(cand) && taken.count(cand) == 0) c = cand;
                }
                if (c == no_cell)
                    return detail::make_error(
                        errc::no_space, "place: ring<" + std::to_string(Window) + ">: the region of sequence " +
                                            std::to_string(s0) + " (cells [" + std::to_string(base) + ", " +
                                            std::to_string(base + region_) + ")) has no free cell for position " +
                                            std::to_string(pos[i]) + "; a micro-batch may hold at most n_cells / "
                                            "n_seq_max - window = " + std::to_string(region_ - Window) +
                                            " tokens per sequence (see ring::cells_for)");
                taken.insert(c);
                plan.cells.push_back(c);
            }
            return plan;
        }

        /// Prunes, for every sequence, the cells below its window (max position - Window + 1).
        void on_commit(cell_table& cells) noexcept {
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
                if (direct != wanted) {  // some live outside their home cell (shared or duplicated): scan
                    scratch_.clear();
                    for (std::uint32_t c : tables_->cells_of(s))
                        if (cells.pos(c) < lim) scratch_.push_back(c);
                }
                for (std::uint32_t c : scratch_) cells.rm_seq(c, s);
                tables_->raise_pruned_below(s, lim);
            }
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
        /// dst inherits src's pruning point when it receives some of src's cells.
        void before_seq_cp(const cell_table& cells, seq_id_t src, seq_id_t dst, std::int64_t lo, std::int64_t hi) {
            const auto& m = cells.seq_positions(src);
            auto it = m.lower_bound(static_cast<pos_t>(std::min<std::int64_t>(lo, 0x7fffffff)));
            if (it != m.end() && it->first < hi) tables_->raise_pruned_below(dst, tables_->pruned_below(src));
        }

    private:
        static constexpr std::uint32_t no_cell = ~std::uint32_t{0};

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
        void check_rm_one(const cell_table& cells, seq_id_t s, std::int64_t lo, std::int64_t hi) const {
            const pos_t w = tables_->pruned_below(s);
            if (w == 0 || tables_->cells_of(s).empty()) return;
            const pos_t mx = cells.seq_pos_max(s);
            const pos_t mn = cells.seq_pos_min(s);
            const std::string head = "seq_rm: sequence " + std::to_string(s) + " of the ring<" +
                                     std::to_string(Window) + "> layout has no positions below " + std::to_string(w) +
                                     " any more (pruned by the sliding window); ";
            if (hi > mx) {  // truncation: keeps positions < lo
                if (lo <= mn) return;  // removes everything
                if (lo - static_cast<std::int64_t>(Window) + 1 < w)
                    detail::fail(errc::unsupported,
                                 head + "truncating at " + std::to_string(lo) + " needs positions from " +
                                     std::to_string(lo - static_cast<std::int64_t>(Window) + 1) +
                                     " for the next token's window; recompute instead");
                return;
            }
            if (lo < w)
                detail::fail(errc::unsupported, head + "cannot remove the range [" + std::to_string(lo) + ", " +
                                                    std::to_string(hi) + ") that reaches below it");
        }

        std::uint32_t region_;  // cells per sequence region: n_cells / n_seq_max >= Window + 1
        std::uint32_t n_seq_;   // sequence ids are in [0, n_seq_)
        std::unique_ptr<detail::ring_tables> tables_;  // never null; address stable across moves
        std::vector<std::uint32_t> scratch_;           // cells to prune (reserved: no allocation in on_commit)
    };
};

KVCACHE_END_NAMESPACE
