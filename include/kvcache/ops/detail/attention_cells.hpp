// kvcache ops: what the attention kernels know of the cells, built from the cell table.
//
// kernels/ know no cell type: the op hands them the cells' positions as a flat array,
// per-tile summaries (kernels::tile_meta) and a view of the cells' sequence membership
// (cell_seqs below, read only for tiles that mix sequences).
#pragma once

#include <algorithm>  // std::min, std::max
#include <cstdint>    // fixed-width integers

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
    bool same = true;
    uni = seq_set{};
    const std::uint32_t c0 = t * k_tile;
    const std::uint32_t c1 = std::min(c0 + k_tile, n);
    for (std::uint32_t c = c0; c < c1; ++c) {
        if (pos[c] < 0) continue;
        if (tm.occ == 0) {
            tm.pmin = tm.pmax = pos[c];
            first = &seqs[c];
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
    }
    return tm;
}

/// Whether sequence q uses some cell of a tile summarised as (tm, uni).
inline bool tile_has_seq(const kernels::tile_meta& tm, const seq_set& uni, seq_id_t q) noexcept {
    if (tm.occ == 0) return false;
    return tm.sid >= 0 ? tm.sid == q : uni.test(q);
}

}  // namespace ops::detail_attn
KVCACHE_END_NAMESPACE
