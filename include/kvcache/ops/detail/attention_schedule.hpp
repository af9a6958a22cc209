// kvcache ops: scheduling of attention: query slots, work items, split-K planning and the
// parallel driver that runs the items (kernels/attention.hpp) and finishes them
// (attention_merge.hpp).
//
// A work item is (KV head, group of M query slots, part of the KV range). The query slots
// of one KV head (rows x query heads of its GQA group) are cut into groups of M (up to
// 16) that share every K/V read; when there are too few items to feed the threads the
// KV range is cut into n_split parts (split-K, see plan_split).
#pragma once

#include <algorithm>  // std::min, std::max, std::fill
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers
#include <limits>     // infinity
#include <vector>     // ranges

#include "../../cells/cell_table.hpp"
#include "../../config.hpp"
#include "../../element/contract.hpp"
#include "../../format/kv_view.hpp"
#include "../../kernels/attention.hpp"
#include "../../kernels/tile_source.hpp"
#include "../../model_shape.hpp"
#include "attention_cells.hpp"
#include "attention_merge.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops::detail_attn {

/// Query slots per work item for `want` slots per KV head: 16, 8, 4, 2 or 1.
inline std::size_t slots_per_item(std::size_t want) noexcept {
    return want >= 16 ? 16 : want >= 8 ? 8 : want >= 4 ? 4 : want >= 2 ? 2 : 1;
}

/// Cuts the tiles of `ranges` into parts for split-K and returns n_split; split_ranges /
/// split_first receive the parts (part k: split_ranges[split_first[k], split_first[k+1])).
/// base_items: work items without split-K.
inline std::size_t plan_split(const std::vector<kernels::tile_range>& ranges, std::size_t base_items, int threads,
                              std::vector<kernels::tile_range>& split_ranges, std::vector<std::size_t>& split_first) {
    // Split-K when there are too few items to feed the threads: at least 4 items per
    // thread (parts of >= 256 cells), and up to 16 while every part keeps >= 4096 cells.
    // The finer cut evens out the threads' finishing times (one item's worth of tail,
    // when a worker wakes late or a core runs slow): 16K-cell decode, 8 KV heads, 2
    // threads of the Zen 5 VM, 32 items instead of 8: 1.03x (median of 11 same-process
    // A/Bs, faster in 9); parts below ~4096 cells lose more to each item's pipeline start
    // and end than they gain (4K cells cut 4 ways: 0.91x, 1K: 0.76x).
    // Parts are measured by the tiles the items visit (a paged sequence's own blocks, not
    // the whole window), so a short sequence in a large paged cache is cut as the same
    // sequence in a contiguous cache of its own size would be. (Measuring by the window,
    // 16 threads cut a 1K-cell sequence in a 64K-cell paged cache into 16 parts of 64
    // cells; on 2 threads the two rules' results for 1K-2K cells in a 16K window were
    // within 2% of each other, same-process A/B.)
    std::size_t total = 0;
    for (const auto& r : ranges) total += r.t1 - r.t0;
    const std::size_t cells = total * k_tile;
    auto splits_for = [&](std::size_t per_thread, std::size_t min_cells) -> std::size_t {
        const std::size_t target = per_thread * static_cast<std::size_t>(threads);
        const std::size_t want = base_items >= target ? 1 : (target + base_items - 1) / base_items;
        return std::min(want, cells / min_cells);
    };
    const std::size_t n_split =
        threads == 1 ? 1 : std::max<std::size_t>({1, splits_for(4, 256), splits_for(16, 4096)});
    split_ranges.clear();
    split_first.assign(1, 0);
    for (std::size_t k = 0; k < n_split; ++k) {
        const std::size_t b = total * k / n_split, e = total * (k + 1) / n_split;
        std::size_t off = 0;
        for (const auto& r : ranges) {
            const std::size_t len = r.t1 - r.t0;
            const std::size_t lo = std::max(b, off), hi = std::min(e, off + len);
            if (lo < hi)
                split_ranges.push_back({static_cast<std::uint32_t>(r.t0 + (lo - off)),
                                        static_cast<std::uint32_t>(r.t0 + (hi - off))});
            off += len;
        }
        split_first.push_back(split_ranges.size());
    }
    return n_split;
}

/// Runs every work item (n_head_kv x slots_per_head / M x n_split) on `threads` threads,
/// each on its own part of `scratch`, after filling the tile summaries of cells [0, n)
/// unless tiles_ready.
template <std::size_t M, class Element>
void run_items(const kv_layer_view<const typename Element::storage_type>& kv,
               const kernels::attn_meta<cell_seqs>& meta, const kernels::attn_shape& sh,
               const kernels::attn_slot* slots, std::size_t slots_per_head, std::uint32_t n_head_kv,
               const kernels::tile_range* split_ranges, const std::size_t* split_first, std::size_t n_split,
               float* scratch, std::size_t scratch_per_thread, float* partial, std::uint32_t* parts_done,
               float* const* out_rows,
               int threads, const cell_table& cells, std::uint32_t n, kernels::tile_meta* tiles, bool tiles_ready) {
    // The tile summaries (meta.tiles) are filled first, unless they are still valid from
    // an earlier call (tiles_ready: same cells, e.g. the previous layer of this decode
    // step), inside the same parallel region as the work items: a region of their own
    // cost a second fork and join per call (~25 us with OMP_WAIT_POLICY=passive on the
    // 2-core VM, ~2% of a 16K decode).
    const auto n_tiles = tiles_ready ? std::int64_t{0} : static_cast<std::int64_t>((n + k_tile - 1) / k_tile);
    auto summarise = [&](std::int64_t t) { tiles[t] = summarise_tile(cells, n, static_cast<std::uint32_t>(t)); };
    const std::size_t groups = slots_per_head / M;
    const auto n_items = static_cast<std::int64_t>(std::size_t{n_head_kv} * groups * n_split);
    using T = typename Element::storage_type;
    const std::uint32_t dv = sh.dv;
    const float ninf = -std::numeric_limits<float>::infinity();

    // One work item on thread tid's scratch: its output rows (n_split == 1) or its partial state.
    auto run_item = [&](std::int64_t it, int tid) {
        float* acc = scratch + static_cast<std::size_t>(tid) * scratch_per_thread;
        float* p_buf = acc + M * dv;
        float* vt_buf = p_buf + M * k_tile;
        float* q_buf = vt_buf + std::size_t{k_tile} * dv;
        const auto item = static_cast<std::size_t>(it);
        const std::size_t k = item % n_split;
        const std::size_t hg = item / n_split;
        const auto h = static_cast<std::uint32_t>(hg / groups);
        const std::size_t g = hg % groups;
        const kernels::attn_slot* sl = slots + h * slots_per_head + g * M;
        kernels::attn_state<M> st;
        st.acc = acc;
        for (std::size_t s = 0; s < M; ++s) {
            st.m[s] = ninf;
            st.l[s] = 0.0f;
        }
        std::fill(acc, acc + M * dv, 0.0f);
        if constexpr (kvcache::detail::has_simd_storage<Element>) {
            kernels::attend_item<M, T>(kv, h, meta, sh, sl, split_ranges + split_first[k],
                                       split_first[k + 1] - split_first[k], st, p_buf, vt_buf, q_buf);
        } else {
            // Generic path: tiles converted through Element::to_float into this thread's scratch.
            float* stage = q_buf + M * sh.dk;  // k_tile x (dk + dv) floats (see `need` in attention())
            const kernels::converted_tiles<Element> src{stage, stage + std::size_t{k_tile} * sh.dk};
            kernels::attend_item<M, T>(kv, h, meta, sh, sl, split_ranges + split_first[k],
                                       split_first[k + 1] - split_first[k], st, p_buf, vt_buf, q_buf, src);
        }
        finish_item<M>(st, acc, dv, item, hg, n_split, out_rows + h * slots_per_head + g * M, partial, parts_done);
    };
    if (threads <= 1) {
        // No parallel region at all: entering one costs microseconds even with one thread.
        for (std::int64_t t = 0; t < n_tiles; ++t) summarise(t);
        for (std::int64_t it = 0; it < n_items; ++it) run_item(it, 0);
        return;
    }
    KVCACHE_OMP(parallel num_threads(threads))
    {
        int tid = 0;
#if defined(_OPENMP)
        tid = omp_get_thread_num();
#endif
        if (n_tiles > 0) {
            KVCACHE_OMP(for schedule(static))  // (implicit barrier: every summary is ready after it)
            for (std::int64_t t = 0; t < n_tiles; ++t) summarise(t);
        }
        // nowait: the region's end is the only barrier after the items. With
        // OMP_WAIT_POLICY=passive each barrier can cost a sleeping thread's wake-up; one
        // barrier less per call (two with split-K, whose merge needed one of its own) made
        // 1K-cell decode on 2 threads of the Zen 5 VM 1.12-1.18x faster, 4K 1.03x.
        KVCACHE_OMP(for schedule(dynamic, 1) nowait)
        for (std::int64_t it = 0; it < n_items; ++it) run_item(it, tid);
    }
}
}  // namespace ops::detail_attn
KVCACHE_END_NAMESPACE
