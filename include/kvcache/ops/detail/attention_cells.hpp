// kvcache ops: what the attention kernels know of the cells, built from the cell table.
//
// kernels/ know no cell type: the op hands them the cells' positions as a flat array,
// per-tile summaries (kernels::tile_meta) and a view of the cells' sequence membership
// (cell_seqs below, read only for tiles that mix sequences).
#pragma once

#include <algorithm>  // std::min, std::max, std::sort
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers
#include <cstring>    // std::memcmp
#include <utility>    // std::pair
#include <vector>     // classes

#include "../../cells/cell_table.hpp"
#include "../../cells/seq_set.hpp"
#include "../../config.hpp"
#include "../../format/kv_view.hpp"
#include "../../kernels/attention.hpp"
#include "../../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops::detail_attn {

/// The cells' sequence sets as the kernels read them (kernels::attn_meta's Seqs,
/// kernels::scalar_attn_args's): test(c, s) is true when cell c is used by sequence s.
struct cell_seqs {
    const seq_set* sets = nullptr;  ///< per cell sequence set (cell_table::seq_data())
    [[nodiscard]] bool test(std::uint32_t c, seq_id_t s) const noexcept { return sets[c].test(s); }
};

/// Summary of tile t of the cells [0, n) for the kernel's masking; `uni` receives the
/// union of the sequence sets of its occupied cells (which sequences can see the tile).
inline kernels::tile_meta summarise_tile(const cell_table& cells, std::uint32_t n, std::uint32_t t,
                                         seq_set& uni) noexcept {
    const pos_t* pos = cells.pos_data();
    const seq_set* seqs = cells.seq_data();
    kernels::tile_meta tm;
    const seq_set* first = nullptr;
    std::uint32_t first_c = 0;
    bool same = true;
    uni = seq_set{};
    const std::uint32_t c0 = t * k_tile;
    const std::uint32_t c1 = std::min(c0 + k_tile, n);
    for (std::uint32_t c = c0; c < c1; ++c) {
        if (pos[c] < 0) continue;
        if (tm.occ == 0) {
            tm.pmin = tm.pmax = pos[c];
            first = &seqs[c];
            first_c = c;
            uni = seqs[c];
        } else {
            tm.pmin = std::min(tm.pmin, pos[c]);
            tm.pmax = std::max(tm.pmax, pos[c]);
            if (!(seqs[c] == *first)) {
                same = false;
                seqs[c].for_each([&uni](seq_id_t q) { uni.set(q); });
            }
        }
        tm.occ |= tile_mask{1} << (c - c0);
    }
    if (tm.occ != 0) {
        tm.sid = -2;
        if (same && first->count() == 1) first->for_each([&](seq_id_t q) { tm.sid = q; });
        if (same) tm.uniform = static_cast<std::int32_t>(first_c);
    }
    return tm;
}

/// Whether sequence q uses some cell of a tile summarised as (tm, uni).
inline bool tile_has_seq(const kernels::tile_meta& tm, const seq_set& uni, seq_id_t q) noexcept {
    if (tm.occ == 0) return false;
    return tm.sid >= 0 ? tm.sid == q : uni.test(q);
}

/// Tiles a cascade class needs at least (1024 cells): below that, reading the tiles
/// once per sequence costs less than the extra partial state and merge per row.
inline constexpr std::size_t cascade_min_tiles = 32;

/// The cascade classes of a window (shared-prefix attention): a class is the set of
/// tiles whose union of cell sequence sets (`tile_seqs`) is one same set K of at least
/// two sequences, when it holds >= cascade_min_tiles tiles (e.g. a prefix forked to
/// several sequences with seq_cp, on contiguous cells or shared paged blocks). Class c's
/// tiles are ranges[first[c], first[c+1]) in tile order, its set keys[c]; classes are
/// ordered by their first tile; tile_cls[t] is t's class (-1: none). Everything here is a
/// function of the cells alone (never of a call's rows), so a row's segments, and so its
/// bits, do not depend on what else is in the call.
struct cascade_classes {
    std::vector<std::int32_t> tile_cls;
    std::vector<kernels::tile_range> ranges;
    std::vector<std::size_t> first;
    std::vector<seq_set> keys;
    std::vector<std::uint32_t> order;  // (scratch)

    void build(const kernels::tile_meta* tiles, const seq_set* tile_seqs, std::uint32_t n_tiles) {
        tile_cls.assign(n_tiles, -1);
        ranges.clear();
        first.assign(1, 0);
        keys.clear();
        order.clear();
        for (std::uint32_t t = 0; t < n_tiles; ++t)
            if (tiles[t].occ != 0 && tiles[t].sid == -2 && tile_seqs[t].count() >= 2) order.push_back(t);
        if (order.size() < cascade_min_tiles) return;
        auto key_less = [&](std::uint32_t a, std::uint32_t b) {
            const int c = std::memcmp(&tile_seqs[a], &tile_seqs[b], sizeof(seq_set));
            return c != 0 ? c < 0 : a < b;
        };
        std::sort(order.begin(), order.end(), key_less);
        // Runs of one key in `order`: a class when long enough; ids by first tile below.
        std::vector<std::pair<std::uint32_t, std::uint32_t>> runs;  // (first tile, start in order)
        std::vector<std::size_t> run_end;
        for (std::size_t i = 0; i < order.size();) {
            std::size_t e = i + 1;
            while (e < order.size() && tile_seqs[order[e]] == tile_seqs[order[i]]) ++e;
            if (e - i >= cascade_min_tiles) {
                runs.emplace_back(order[i], static_cast<std::uint32_t>(i));
                run_end.push_back(e);
            }
            i = e;
        }
        std::vector<std::size_t> by_first(runs.size());
        for (std::size_t r = 0; r < runs.size(); ++r) by_first[r] = r;
        std::sort(by_first.begin(), by_first.end(), [&](std::size_t a, std::size_t b) { return runs[a].first < runs[b].first; });
        for (std::size_t c = 0; c < by_first.size(); ++c) {
            const std::size_t r = by_first[c];
            keys.push_back(tile_seqs[runs[r].first]);
            for (std::size_t i = runs[r].second; i < run_end[r]; ++i) tile_cls[order[i]] = static_cast<std::int32_t>(c);
            // (order is sorted by tile within a key: consecutive tiles make one range)
            for (std::size_t i = runs[r].second; i < run_end[r];) {
                std::size_t e = i + 1;
                while (e < run_end[r] && order[e] == order[e - 1] + 1) ++e;
                ranges.push_back({order[i], order[e - 1] + 1});
                i = e;
            }
            first.push_back(ranges.size());
        }
    }
};

}  // namespace ops::detail_attn
KVCACHE_END_NAMESPACE
