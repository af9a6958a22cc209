// kvcache: the bookkeeping of the ring layout (ring.hpp): per sequence its cells and
// pruning point, per cell its number of holders and whether the owner of its region
// holds it, per region its occupied and foreign cells, kept in step with the cell table
// through cell_observer.
#pragma once

#include <algorithm>  // std::max, std::min, std::fill
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers
#include <memory>     // observer checkpoints (clone)
#include <set>        // per-sequence cells
#include <string>     // check() messages
#include <utility>    // std::swap
#include <vector>     // tables

#include "../cells/cell_table.hpp"

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

    void on_seq_added(std::uint32_t c, seq_id_t s) override {
        const bool was = foreign(c);
        cells_[idx(s)].insert(c);
        if (holders_[c]++ == 0) ++used_in_[owner(c)];
        if (static_cast<std::uint32_t>(s) == owner(c)) owner_holds_[c] = 1;
        recount(c, was);
    }
    void on_seq_removed(std::uint32_t c, seq_id_t s) override {
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
    void on_cleared() override {
        for (auto& set : cells_) set.clear();
        std::fill(emptied_.begin(), emptied_.end(), std::uint8_t{1});
        n_emptied_ = n_seq_;
        std::fill(holders_.begin(), holders_.end(), 0u);
        std::fill(owner_holds_.begin(), owner_holds_.end(), std::uint8_t{0});
        std::fill(used_in_.begin(), used_in_.end(), 0u);
        std::fill(foreign_in_.begin(), foreign_in_.end(), 0u);
    }
    [[nodiscard]] std::unique_ptr<cell_observer> clone() const override { return std::make_unique<ring_tables>(*this); }
    void assign_from(const cell_observer& o) override { *this = static_cast<const ring_tables&>(o); }
    void swap_state(cell_observer& o) noexcept override { std::swap(*this, static_cast<ring_tables&>(o)); }

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

KVCACHE_END_NAMESPACE
