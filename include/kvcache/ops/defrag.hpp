// kvcache ops: defragmentation of the contiguous layout (F7).
//
// Attention reads cells [0, n) with n = last used cell + 1 (F8), so holes below the
// last used cell cost bandwidth. When fragmentation 1 - used / n exceeds a threshold
// (and n >= min_cells), defrag() moves occupied cells from the end into the holes at
// the front: the k holes nearest the front take the k occupied cells nearest the end
// (k stops where the two meet, or at max_moves per pass), in increasing order on both
// sides, so runs of cells move as runs (whole K tiles and V rows by memcpy). K and V
// of every layer move with the cell's metadata (position, sequences, pending shift). Every sequence's contents, and so every attention
// result, are bit-identical before and after; only cell indices change.
//
// Layouts that place cells themselves (paged blocks, ring regions) keep their own
// order and are refused at compile time.
#pragma once

#include <algorithm>  // std::reverse, std::min
#include <cmath>    // std::isfinite
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <cstring>  // std::memcpy
#include <string>   // messages
#include <vector>   // move list

#include "../cells/cell_table.hpp"
#include "../config.hpp"
#include "../detail/policy_select.hpp"
#include "../cells/rollback.hpp"
#include "../error.hpp"
#include "../format/kv_view.hpp"
#include "../layout/capabilities.hpp"
#include "../memory/memory.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops {

/// When and how much defrag() compacts.
struct defrag_params {
    float threshold = 0.1f;       ///< compact when fragmentation > threshold; in [0, 1]
    std::uint32_t min_cells = 128;  ///< never compact while n = last used cell + 1 < min_cells
    std::uint32_t max_moves = 0;  ///< cells moved per pass at most; 0 = no bound
    int n_threads = 0;            ///< <= 0: the OpenMP default (layers are copied in parallel)
};

/// What one defrag() pass did.
struct defrag_result {
    std::uint32_t moves = 0;      ///< cells moved
    std::size_t bytes_moved = 0;  ///< K and V bytes copied (all layers)
};

/// 1 - used / n with n = last used cell + 1; 0 for an empty cache.
template <class Cache>
[[nodiscard]] double fragmentation(const Cache& cache) noexcept {
    static_assert(kv_memory<Cache>, "kvcache: ops::fragmentation needs a kvcache::kv_memory (see kvcache/memory/memory.hpp)");
    if (cache.used() == 0) return 0.0;
    const double n = static_cast<double>(cache.cells().last_used()) + 1.0;
    return 1.0 - static_cast<double>(cache.used()) / n;
}

/// Compacts the cache if fragmentation(cache) > p.threshold and n >= p.min_cells.
/// Refused while placements are staged (errc::transaction_open) and for bad parameters
/// (errc::invalid_argument); a refused call changes nothing.
template <class Cache>
defrag_result defrag(Cache& cache, const defrag_params& p = {}) {
    static_assert(kv_memory<Cache>, "kvcache: ops::defrag needs a kvcache::kv_memory (see kvcache/memory/memory.hpp)");
    using storage_t = typename Cache::storage_t;
    static_assert(!has_capability<storage_t, layout_caps::cell_observer> &&
                      !has_capability<storage_t, layout_caps::placement_plan>,
                  "kvcache::ops::defrag: only for layouts without their own placement (contiguous); layouts with "
                  "the cell_observer or placement_plan capability (paged, ring) keep their cells in blocks / "
                  "regions");
    if (!std::isfinite(p.threshold) || p.threshold < 0.0f || p.threshold > 1.0f)
        detail::fail(errc::invalid_argument,
                     "defrag: threshold = " + std::to_string(p.threshold) + ", must be in [0, 1]");
    cell_table& cells = cache.cells_for_update(detail::internal_access{});  // refuses an open transaction
    defrag_result res;
    if (cells.used() == 0) return res;
    const std::uint32_t n = cells.last_used() + 1;
    if (n < p.min_cells || fragmentation(cache) <= p.threshold) return res;

    // Plan: holes from the front meet occupied cells from the back; every chosen hole is
    // below every chosen cell, so pairing both in increasing order is valid.
    std::vector<std::uint32_t> holes, data;
    std::uint32_t hole = 0, cell = n - 1;
    const std::uint32_t limit = p.max_moves == 0 ? n : p.max_moves;
    while (holes.size() < limit) {
        while (hole < cell && !cells.is_free(hole)) ++hole;
        while (cell > hole && cells.is_free(cell)) --cell;
        if (hole >= cell) break;
        holes.push_back(hole++);
        data.push_back(cell--);
    }
    if (holes.empty()) return res;
    std::reverse(data.begin(), data.end());
    // Runs: maximal stretches where source and destination both advance by one cell.
    struct run {
        std::uint32_t src, dst, len;
    };
    std::vector<run> runs;
    for (std::size_t i = 0; i < holes.size(); ++i) {
        if (!runs.empty() && runs.back().src + runs.back().len == data[i] && runs.back().dst + runs.back().len == holes[i])
            ++runs.back().len;
        else
            runs.push_back({data[i], holes[i], 1});
    }

    // K and V of every layer: layers in parallel, each run in turn.
    auto& storage = cache.storage();
    const model_shape& shape = cache.shape();
    using T = typename Cache::storage_type;
    const auto n_layer = static_cast<std::int64_t>(shape.n_layer);
    const int threads = resolve_threads(p.n_threads);
    static_cast<void>(threads);
    KVCACHE_OMP(parallel for schedule(static) num_threads(threads))
    for (std::int64_t l = 0; l < n_layer; ++l) {
        const auto v = storage.view(static_cast<std::uint32_t>(l));
        for (std::uint32_t h = 0; h < v.n_head_kv; ++h)
            for (const run& r : runs) {
                const bool v_rows = v.vl == v_layout::row_major;
                for (std::uint32_t i = 0; i < r.len;) {
                    const std::uint32_t src = r.src + i, dst = r.dst + i;
                    if (src % k_tile == 0 && dst % k_tile == 0 && r.len - i >= k_tile) {  // whole tiles
                        std::memcpy(v.k + v.k_offset(h, dst, 0), v.k + v.k_offset(h, src, 0),
                                    sizeof(T) * k_tile * v.k_units());
                        if (v_rows)
                            std::memcpy(v.v + v.v_offset(h, dst, 0), v.v + v.v_offset(h, src, 0),
                                        sizeof(T) * k_tile * v.v_units());
                        i += k_tile;
                        continue;
                    }
                    // Otherwise pieces: the longest stretch that stays inside both tiles
                    // (source and destination cells are distinct, so the pieces never
                    // overlap): one per K row (unit row for block elements), and one per V
                    // block ([cells][block width]).
                    const std::uint32_t seg = std::min({r.len - i, k_tile - src % k_tile, k_tile - dst % k_tile});
                    for (std::uint32_t u = 0; u < v.k_units(); ++u)
                        std::memcpy(v.k + v.k_unit(h, dst, u), v.k + v.k_unit(h, src, u), sizeof(T) * seg);
                    if (v_rows)
                        for (std::uint32_t d0 = 0; d0 < v.dim_v; d0 += v_block)
                            std::memcpy(v.v + v.v_offset(h, dst, d0), v.v + v.v_offset(h, src, d0),
                                        sizeof(T) * seg * (std::min(v_block, v.dim_v - d0) >> v.block_log2));
                    i += seg;
                }
                if (!v_rows)
                    for (std::uint32_t u = 0; u < v.v_units(); ++u)
                        std::memcpy(v.v + v.v_unit(h, r.dst, u), v.v + v.v_unit(h, r.src, u), sizeof(T) * r.len);
            }
    }
    // Metadata: each destination takes its source's exact state. K/V was copied into free
    // cells only, so a throw here (std::bad_alloc) rolls back to a bit-identical cache.
    static_cast<void>(detail::with_rollback(cache, [&]() -> result<void> {
        for (std::size_t i = 0; i < holes.size(); ++i) {
            const cell_table::snapshot s = cells.save(data[i]);
            cells.free_cell(data[i]);
            cells.load(holes[i], s);
        }
        cache.reset_head(detail::internal_access{});
        return {};
    }));
    res.moves = static_cast<std::uint32_t>(holes.size());
    res.bytes_moved = holes.size() * cache.bytes_per_token();
    return res;
}

}  // namespace ops
KVCACHE_END_NAMESPACE
