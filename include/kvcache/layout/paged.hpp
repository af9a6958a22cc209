// kvcache: the paged layout (PagedAttention, F11).
//
// Cells are grouped in fixed-size blocks of BlockSize cells (a multiple of the
// 32-cell K tile, so a block is BlockSize/32 whole K tiles of every layer and head).
// A sequence's cells live in the blocks of its block table; blocks are taken from
// the pool on demand and return to it when no sequence uses them any more.
//
// Bookkeeping (all incremental, driven by the cell table's observer callbacks):
// - refcount(b) = number of sequences that use at least one cell of block b;
//   a block is free exactly when its refcount is 0 (free + referenced == total).
// - block_table(s) = the blocks sequence s uses, in increasing block id.
//
// Placement: a token of sequence set S goes into a block used by exactly S that has
// a free cell (the block S appended to last, then any other such block), else into
// a fresh block: the one right after its last block when free, so that sequences
// growing side by side stay in long runs of blocks (scattered small blocks read
// several times slower from DRAM than long runs), else one inside the largest free run. Appending to a sequence whose last block is shared with another
// sequence first copies that sequence's cells of the block into a fresh block
// (copy-on-write at block granularity), so the other sequences keep the original
// and both can keep appending. seq_cp shares cells (and so blocks) without copying;
// seq_add / seq_div on shared cells give the moving sequence copies in blocks of its own.
#pragma once

#include <algorithm>    // std::find_if, std::max
#include <cstdint>      // fixed-width integers
#include <memory>       // std::unique_ptr
#include <set>          // free blocks, block tables
#include <span>         // batch inputs
#include <string>       // messages
#include <string_view>  // name
#include <utility>      // std::pair
#include <vector>       // tables

#include "../cells/cell_table.hpp"
#include "../concepts.hpp"
#include "../error.hpp"
#include "block_pool.hpp"
#include "capabilities.hpp"
#include "kv_storage.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace detail {

/// Per-block and per-sequence tables of the paged layout, kept in step with the
/// cell table through cell_observer. Heap-allocated by the storage so that its
/// address (held by the cell table) survives moves of the cache.
class paged_tables final : public cell_observer {
public:
    static constexpr std::uint32_t no_block = ~std::uint32_t{0};

    paged_tables(std::uint32_t n_blocks, std::uint32_t block_size, std::uint32_t n_seq_max)
        : bs_(block_size),
          pool_(n_blocks),
          cell_refs_(std::size_t{n_blocks} * block_size, 0),
          block_used_(n_blocks, 0),
          block_seqs_(n_blocks),
          tables_(n_seq_max),
          open_(n_seq_max, no_block) {}

    void on_seq_added(std::uint32_t c, seq_id_t s) override {
        const std::uint32_t b = c / bs_;
        if (cell_refs_[c]++ == 0) ++block_used_[b];
        auto& v = block_seqs_[b];
        auto it = find(v, s);
        if (it != v.end()) {
            ++it->second;
            return;
        }
        v.emplace_back(s, 1u);
        tables_[static_cast<std::size_t>(s)].insert(b);
        pool_.retain_unchecked(b);
    }
    void on_seq_removed(std::uint32_t c, seq_id_t s) override {
        const std::uint32_t b = c / bs_;
        auto& v = block_seqs_[b];
        auto it = find(v, s);
        KVCACHE_ASSERT(it != v.end() && cell_refs_[c] > 0);
        if (--it->second == 0) {
            v.erase(it);
            tables_[static_cast<std::size_t>(s)].erase(b);
            if (open_[static_cast<std::size_t>(s)] == b) open_[static_cast<std::size_t>(s)] = no_block;
            pool_.release_unchecked(b);
        }
        if (--cell_refs_[c] == 0) --block_used_[b];
    }
    void on_cleared() override {
        std::fill(cell_refs_.begin(), cell_refs_.end(), std::uint16_t{0});
        std::fill(block_used_.begin(), block_used_.end(), 0u);
        for (auto& v : block_seqs_) v.clear();
        for (auto& t : tables_) t.clear();
        std::fill(open_.begin(), open_.end(), no_block);
        pool_.reset();
    }
    [[nodiscard]] std::unique_ptr<cell_observer> clone() const override { return std::make_unique<paged_tables>(*this); }
    void assign_from(const cell_observer& o) override { *this = static_cast<const paged_tables&>(o); }
    void swap_state(cell_observer& o) noexcept override { std::swap(*this, static_cast<paged_tables&>(o)); }

    [[nodiscard]] std::uint32_t block_size() const noexcept { return bs_; }
    [[nodiscard]] const block_pool& pool() const noexcept { return pool_; }
    [[nodiscard]] const std::set<std::uint32_t>& table(seq_id_t s) const noexcept {
        return tables_[static_cast<std::size_t>(s)];
    }
    [[nodiscard]] std::uint32_t used_in_block(std::uint32_t b) const noexcept { return block_used_[b]; }

    /// Plans cells for tokens with sequence sets `seqs` (see the file comment).
    /// With allow_cow, may add copy-on-write steps to `plan`. Returns false (plan
    /// unusable, `why` set) when the pool runs out of free blocks.
    bool plan(const cell_table& cells, std::span<const seq_set> seqs, bool allow_cow, placement_plan& plan,
              std::string& why) {
        std::set<std::uint32_t> taken;       // cells given out by this plan
        std::set<std::uint32_t> new_blocks;  // free blocks this plan takes
        std::vector<std::pair<seq_set, std::uint32_t>> current;  // block each sequence set fills now
        plan.cells.clear();
        plan.copies.clear();
        plan.cells.reserve(seqs.size());
        for (const seq_set& set : seqs) {
            auto cur = std::find_if(current.begin(), current.end(), [&](const auto& e) { return e.first == set; });
            std::uint32_t b = no_block;
            if (cur != current.end() && free_cell(cells, cur->second, taken) != no_cell) b = cur->second;
            if (b == no_block) {
                b = choose_block(cells, set, allow_cow, taken, new_blocks, plan);
                if (b == no_block) {
                    why = "needs more free blocks than the " + std::to_string(pool_.free_count()) + " of " +
                          std::to_string(pool_.n_blocks()) + " free (block size " + std::to_string(bs_) + ")";
                    return false;
                }
                if (cur != current.end())
                    cur->second = b;
                else
                    current.emplace_back(set, b);
            }
            const std::uint32_t c = free_cell(cells, b, taken);
            KVCACHE_ASSERT(c != no_cell);
            taken.insert(c);
            plan.cells.push_back(c);
        }
        return true;
    }

    /// Empty string when every table agrees with the cell table and the pool invariant holds.
    [[nodiscard]] std::string check(const cell_table& cells) const {
        if (auto e = pool_.check(); !e.empty()) return e;
        const std::uint32_t n_blocks = pool_.n_blocks();
        for (std::uint32_t b = 0; b < n_blocks; ++b) {
            std::vector<std::pair<seq_id_t, std::uint32_t>> expect;
            std::uint32_t used = 0;
            for (std::uint32_t c = b * bs_; c < (b + 1) * bs_; ++c) {
                if (cells.is_free(c)) continue;
                ++used;
                cells.seqs(c).for_each([&](seq_id_t s) {
                    auto it = find(expect, s);
                    if (it == expect.end())
                        expect.emplace_back(s, 1u);
                    else
                        ++it->second;
                });
            }
            auto got = block_seqs_[b];
            std::sort(expect.begin(), expect.end());
            std::sort(got.begin(), got.end());
            if (got != expect || used != block_used_[b] || pool_.refcount(b) != expect.size())
                return "block " + std::to_string(b) + ": tables disagree with the cells (refcount " +
                       std::to_string(pool_.refcount(b)) + ", sequences in cells " + std::to_string(expect.size()) +
                       ")";
            for (const auto& [s, n] : expect)
                if (tables_[static_cast<std::size_t>(s)].count(b) == 0)
                    return "block " + std::to_string(b) + " missing from the block table of sequence " +
                           std::to_string(s);
        }
        for (std::size_t s = 0; s < tables_.size(); ++s)
            for (std::uint32_t b : tables_[s])
                if (find(block_seqs_[b], static_cast<seq_id_t>(s)) == block_seqs_[b].end())
                    return "block table of sequence " + std::to_string(s) + " lists block " + std::to_string(b) +
                           " that it does not use";
        return {};
    }

private:
    static constexpr std::uint32_t no_cell = ~std::uint32_t{0};
    using seq_counts = std::vector<std::pair<seq_id_t, std::uint32_t>>;

    static seq_counts::iterator find(seq_counts& v, seq_id_t s) noexcept {
        return std::find_if(v.begin(), v.end(), [s](const auto& e) { return e.first == s; });
    }
    static seq_counts::const_iterator find(const seq_counts& v, seq_id_t s) noexcept {
        return std::find_if(v.begin(), v.end(), [s](const auto& e) { return e.first == s; });
    }
    /// Whether the sequences using block b are exactly `set`.
    [[nodiscard]] bool owned_by(std::uint32_t b, const seq_set& set) const noexcept {
        const auto& v = block_seqs_[b];
        if (v.size() != static_cast<std::size_t>(set.count())) return false;
        for (const auto& e : v)
            if (!set.test(e.first)) return false;
        return true;
    }
    /// Lowest free cell of block b not yet taken by the plan, or no_cell.
    [[nodiscard]] std::uint32_t free_cell(const cell_table& cells, std::uint32_t b,
                                          const std::set<std::uint32_t>& taken) const {
        if (block_used_[b] == bs_) return no_cell;
        for (std::uint32_t c = b * bs_; c < (b + 1) * bs_; ++c)
            if (cells.is_free(c) && taken.count(c) == 0) return c;
        return no_cell;
    }
    /// A free block for a sequence whose last block is `after` (or no_block): the block
    /// right after it when free, so a growing sequence stays contiguous; else a block in
    /// the largest run of free blocks (its start at the front of the pool, else its
    /// middle, leaving room for the sequence before the run to grow).
    std::uint32_t fresh_block(std::set<std::uint32_t>& new_blocks, std::uint32_t after) const {
        const auto& free = pool_.free_blocks();
        auto usable = [&](std::uint32_t b) { return free.count(b) != 0 && new_blocks.count(b) == 0; };
        std::uint32_t pick = no_block;
        if (after != no_block && after + 1 < pool_.n_blocks() && usable(after + 1)) {
            pick = after + 1;
        } else {
            std::uint32_t best_start = 0, best_len = 0, run_start = 0, run_len = 0, prev = no_block;
            for (std::uint32_t b : free) {
                if (new_blocks.count(b) != 0) {
                    run_len = 0;
                    prev = no_block;
                    continue;
                }
                if (run_len > 0 && b == prev + 1) {
                    ++run_len;
                } else {
                    run_start = b;
                    run_len = 1;
                }
                prev = b;
                if (run_len > best_len) {
                    best_len = run_len;
                    best_start = run_start;
                }
            }
            if (best_len == 0) return no_block;
            pick = best_start == 0 ? 0 : best_start + best_len / 2;
        }
        new_blocks.insert(pick);
        return pick;
    }
    std::uint32_t choose_block(const cell_table& cells, const seq_set& set, bool allow_cow,
                               std::set<std::uint32_t>& taken, std::set<std::uint32_t>& new_blocks,
                               placement_plan& plan) {
        const seq_id_t s0 = lowest_seq(set);
        std::uint32_t& open = open_[static_cast<std::size_t>(s0)];
        const bool single = set.count() == 1;
        // 1. the block this sequence set appended to last, if still exactly its own
        if (open != no_block && owned_by(open, set) && free_cell(cells, open, taken) != no_cell) return open;
        // 2. any other block of its own with a free cell (holes left by seq_rm)
        if (single)
            for (std::uint32_t b : tables_[static_cast<std::size_t>(s0)])
                if (owned_by(b, set) && free_cell(cells, b, taken) != no_cell) return open = b;
        // 3. copy-on-write: its last block (the one it appended to last, else its highest,
        //    e.g. after seq_cp) is shared and not full
        const auto& own = tables_[static_cast<std::size_t>(s0)];
        const std::uint32_t tail = open != no_block ? open : own.empty() ? no_block : *own.rbegin();
        if (single && allow_cow && tail != no_block && find(block_seqs_[tail], s0) != block_seqs_[tail].end() &&
            block_seqs_[tail].size() > 1 && free_cell(cells, tail, taken) != no_cell) {
            const std::uint32_t nb = fresh_block(new_blocks, tail);
            if (nb == no_block) return no_block;
            for (std::uint32_t c = tail * bs_; c < (tail + 1) * bs_; ++c) {
                if (cells.is_free(c) || !cells.seqs(c).test(s0)) continue;
                const std::uint32_t dst = free_cell(cells, nb, taken);
                taken.insert(dst);
                plan.copies.push_back({c, dst, s0});
            }
            return open = nb;
        }
        // 4. a fresh block, next to the sequence's last one if possible
        const auto& table = tables_[static_cast<std::size_t>(s0)];
        const std::uint32_t last = open != no_block ? open : table.empty() ? no_block : *table.rbegin();
        const std::uint32_t nb = fresh_block(new_blocks, last);
        if (nb != no_block) open = nb;
        return nb;
    }

    std::uint32_t bs_;                          // cells per block
    block_pool pool_;                           // refcount = sequences using the block
    std::vector<std::uint16_t> cell_refs_;      // per cell: sequences using it (0 = free)
    std::vector<std::uint32_t> block_used_;     // per block: occupied cells
    std::vector<seq_counts> block_seqs_;        // per block: (sequence, cells it uses there)
    std::vector<std::set<std::uint32_t>> tables_;  // per sequence: blocks it uses (block table)
    std::vector<std::uint32_t> open_;           // per sequence: block it appended to last (a hint)
};

}  // namespace detail

/// Paged layout policy (F11): BlockSize cells per block, a multiple of k_tile = 32 (one K tile).
/// The cache capacity (model_shape::n_cells) must be a multiple of BlockSize.
template <std::uint32_t BlockSize = 32, v_layout VLayout = v_layout::row_major>
struct paged {
    static_assert(BlockSize > 0 && BlockSize % k_tile == 0,
                  "kvcache::paged<BlockSize>: BlockSize must be a positive multiple of 32 (the K tile)");
    using policy_kind = layout_tag;
    static constexpr std::string_view name =
        VLayout == v_layout::row_major ? std::string_view("paged") : std::string_view("paged_vt");
    static constexpr std::uint32_t layout_id = VLayout == v_layout::row_major ? 2u : 3u;
    static constexpr bool can_shift = true;
    static constexpr v_layout v_arrangement = VLayout;
    static constexpr std::uint32_t block_size = BlockSize;

    /// Tiled K/V buffers (cell = block * BlockSize + offset) plus block tables and refcounts.
    template <class Element>
    class storage : public tiled_kv_storage<Element, VLayout> {
        using base = tiled_kv_storage<Element, VLayout>;

    public:
        /// The hooks this storage provides (layout/capabilities.hpp).
        static constexpr layout_caps capabilities = layout_caps::cell_observer | layout_caps::placement_plan |
                                                    layout_caps::split_targets | layout_caps::held_cells |
                                                    layout_caps::tile_ranges;

        explicit storage(const model_shape& s)
            : base(checked(s)),
              tables_(std::make_unique<detail::paged_tables>(s.n_cells / BlockSize, BlockSize, s.n_seq_max)),
              n_seq_(s.n_seq_max) {}

        /// Block-level queries.
        [[nodiscard]] std::uint32_t n_blocks() const noexcept { return tables_->pool().n_blocks(); }
        [[nodiscard]] std::uint32_t free_blocks() const noexcept { return tables_->pool().free_count(); }
        [[nodiscard]] std::uint32_t referenced_blocks() const noexcept { return tables_->pool().referenced_count(); }
        /// Sequences referencing block b; throws invalid_argument for b >= n_blocks().
        [[nodiscard]] std::uint32_t refcount(std::uint32_t b) const { return tables_->pool().refcount(b); }
        /// Occupied cells of block b; throws invalid_argument for b >= n_blocks().
        [[nodiscard]] std::uint32_t used_in_block(std::uint32_t b) const {
            static_cast<void>(tables_->pool().refcount(b));
            return tables_->used_in_block(b);
        }
        /// Block table of sequence s (blocks it uses, increasing id); throws for s out of range.
        [[nodiscard]] std::vector<std::uint32_t> block_table(seq_id_t s) const {
            check_seq(s);
            const auto& t = tables_->table(s);
            return {t.begin(), t.end()};
        }
        /// K tile ranges [first, last) that hold sequence s's cells, merged where blocks are
        /// adjacent: what an attention kernel visits instead of a contiguous window.
        [[nodiscard]] std::vector<std::pair<std::uint32_t, std::uint32_t>> tile_ranges(seq_id_t s) const {
            std::vector<std::pair<std::uint32_t, std::uint32_t>> out;
            tile_ranges(s, out);
            return out;
        }
        /// The same into `out` (replacing its contents, reusing its capacity): attention
        /// calls this one with a workspace vector, so a decode step allocates nothing.
        void tile_ranges(seq_id_t s, std::vector<std::pair<std::uint32_t, std::uint32_t>>& out) const {
            check_seq(s);
            constexpr std::uint32_t tiles = BlockSize / k_tile;
            out.clear();
            for (std::uint32_t b : tables_->table(s)) {
                if (!out.empty() && out.back().second == b * tiles)
                    out.back().second += tiles;
                else
                    out.emplace_back(b * tiles, (b + 1) * tiles);
            }
        }
        /// Cells held (unavailable to other sequences): every referenced block, in full.
        [[nodiscard]] std::uint64_t held_cells(const cell_table&) const noexcept {
            return std::uint64_t{referenced_blocks()} * BlockSize;
        }
        /// Empty string when free + referenced == total and every refcount and block table
        /// matches the cells; else the first violation. Tests call it after every step.
        [[nodiscard]] std::string check_invariants(const cell_table& cells) const { return tables_->check(cells); }

        // ---- layout capabilities (layout/capabilities.hpp) ----
        [[nodiscard]] cell_observer* observer() noexcept { return tables_.get(); }
        [[nodiscard]] result<placement_plan> plan_place(const cell_table& cells, std::span<const pos_t>,
                                                        std::span<const seq_set> seqs) {
            placement_plan plan;
            std::string why;
            if (!tables_->plan(cells, seqs, true, plan, why))
                return detail::make_error(errc::no_space, "place: batch of " + std::to_string(seqs.size()) +
                                                              " tokens " + why);
            return plan;
        }
        /// Cells in blocks of s's own for n split copies, or a no_space result (no free block).
        [[nodiscard]] result<std::vector<std::uint32_t>> split_targets(const cell_table& cells, seq_id_t s,
                                                                       std::uint32_t n) {
            placement_plan plan;
            std::string why;
            const std::vector<seq_set> sets(n, seq_set::of(s));
            if (!tables_->plan(cells, sets, false, plan, why))
                return detail::make_error(errc::no_space, "splitting " + std::to_string(n) +
                                                              " shared cells of sequence " + std::to_string(s) +
                                                              " into blocks of its own " + why);
            return std::move(plan.cells);
        }

    private:
        static const model_shape& checked(const model_shape& s) {
            if (s.n_cells % BlockSize != 0)
                detail::fail(errc::invalid_config, "model_shape.n_cells = " + std::to_string(s.n_cells) +
                                                       ": the paged layout needs a multiple of the block size " +
                                                       std::to_string(BlockSize));
            if (s.n_seq_max > 0xFFFFu)
                detail::fail(errc::invalid_config, "model_shape.n_seq_max = " + std::to_string(s.n_seq_max) +
                                                       ": the paged layout supports at most 65535 sequences");
            return s;
        }
        void check_seq(seq_id_t s) const {
            if (s < 0 || static_cast<std::uint32_t>(s) >= n_seq_)
                detail::fail(errc::invalid_argument,
                             "paged: seq_id = " + std::to_string(s) + ", must be in [0, " + std::to_string(n_seq_) + ")");
        }

        std::unique_ptr<detail::paged_tables> tables_;  // never null; address stable across moves
        std::uint32_t n_seq_;                           // sequence ids are in [0, n_seq_)
    };
};

KVCACHE_END_NAMESPACE
