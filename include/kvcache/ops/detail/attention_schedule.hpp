// kvcache ops: scheduling of attention: work items, split-K planning and the parallel
// driver that runs the items (kernels/attention.hpp) and finishes them
// (attention_merge.hpp).
//
// A work item is (KV head, group of M query slots of ONE sequence, part of that
// sequence's tiles). The query slots of one sequence and KV head (its rows x the query
// heads of the GQA group) are cut into groups of up to 16 that share every K/V read;
// each group visits only the tiles holding cells of its sequence (ops/attention.hpp
// lists them), so a row never pays for another sequence's cells. When there are too
// few items to feed the threads (or, in deterministic mode, whenever a sequence is long)
// a sequence's tiles are cut into n_split parts (split-K, see split_count).
#pragma once

#include <algorithm>  // std::min, std::max, std::fill
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers
#include <limits>     // infinity
#include <type_traits>  // std::integral_constant
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

/// Cells per split-K part in deterministic mode (see split_count).
inline constexpr std::size_t det_part_cells = 4096;

/// Parts to cut one sequence's `tiles` (tiles it visits) into.
/// deterministic: a function of the tiles alone, so a row's bits do not depend on the
/// threads or on the rest of the call: parts of >= 4096 cells, at most 16 (what the
/// threaded rule reaches on long contexts; on a short context it gives up the split the
/// threaded rule makes when few items feed many threads).
/// Otherwise: when there are too few items to feed the threads, at least 4 items per
/// thread (parts of >= 256 cells), and up to 16 while every part keeps >= 4096 cells.
/// The finer cut evens out the threads' finishing times (one item's worth of tail,
/// when a worker wakes late or a core runs slow): 16K-cell decode, 8 KV heads, 2
/// threads of the Zen 5 VM, 32 items instead of 8: 1.03x (median of 11 same-process
/// A/Bs, faster in 9); parts below ~4096 cells lose more to each item's pipeline start
/// and end than they gain (4K cells cut 4 ways: 0.91x, 1K: 0.76x).
/// Parts are measured by the tiles the items visit (a sequence's own tiles, not the
/// whole window), so a short sequence in a large cache is cut as the same sequence in a
/// cache of its own size would be. base_items: the call's work items without split-K.
inline std::size_t split_count(std::size_t tiles, std::size_t base_items, int threads, bool deterministic) noexcept {
    const std::size_t cells = tiles * k_tile;
    if (deterministic) return std::clamp<std::size_t>(cells / det_part_cells, 1, 16);
    auto splits_for = [&](std::size_t per_thread, std::size_t min_cells) -> std::size_t {
        const std::size_t target = per_thread * static_cast<std::size_t>(threads);
        const std::size_t want = base_items >= target ? 1 : (target + base_items - 1) / std::max<std::size_t>(base_items, 1);
        return std::min(want, cells / min_cells);
    };
    return threads == 1 ? 1 : std::max<std::size_t>({1, splits_for(4, 256), splits_for(16, 4096)});
}

/// Appends the tiles of `ranges` cut into n_split even parts to split_ranges; part k is
/// split_ranges[split_first[k0 + k], split_first[k0 + k + 1]) where k0 is
/// split_first.size() - 1 on entry (split_first must hold at least one entry).
inline void cut_parts(const kernels::tile_range* ranges, std::size_t n_ranges, std::size_t n_split,
                      std::vector<kernels::tile_range>& split_ranges, std::vector<std::size_t>& split_first) {
    std::size_t total = 0;
    for (std::size_t i = 0; i < n_ranges; ++i) total += ranges[i].t1 - ranges[i].t0;
    for (std::size_t k = 0; k < n_split; ++k) {
        const std::size_t b = total * k / n_split, e = total * (k + 1) / n_split;
        std::size_t off = 0;
        for (std::size_t i = 0; i < n_ranges; ++i) {
            const auto& r = ranges[i];
            const std::size_t len = r.t1 - r.t0;
            const std::size_t lo = std::max(b, off), hi = std::min(e, off + len);
            if (lo < hi)
                split_ranges.push_back({static_cast<std::uint32_t>(r.t0 + (lo - off)),
                                        static_cast<std::uint32_t>(r.t0 + (hi - off))});
            off += len;
        }
        split_first.push_back(split_ranges.size());
    }
}

/// Cuts the tiles of `ranges` into parts for split-K by the threaded rule (split_count)
/// and returns n_split; split_ranges / split_first receive the parts (part k:
/// split_ranges[split_first[k], split_first[k+1])). base_items: work items without split-K.
inline std::size_t plan_split(const std::vector<kernels::tile_range>& ranges, std::size_t base_items, int threads,
                              std::vector<kernels::tile_range>& split_ranges, std::vector<std::size_t>& split_first) {
    std::size_t total = 0;
    for (const auto& r : ranges) total += r.t1 - r.t0;
    const std::size_t n_split = split_count(total, base_items, threads, false);
    split_ranges.clear();
    split_first.assign(1, 0);
    cut_parts(ranges.data(), ranges.size(), n_split, split_ranges, split_first);
    return n_split;
}

/// One work item of a call: KV head h, the m slots from slot0 (of one sequence), part
/// `part` of the n_split parts of that sequence's tiles.
struct work_item {
    std::uint32_t h = 0;
    std::uint32_t m = 1;           ///< slots: 1, 2, 4, 8 or 16
    std::size_t slot0 = 0;         ///< first slot (and output row) in the call's arrays
    std::size_t part = 0;          ///< index of its part in split_first (ranges [first[part], first[part+1]))
    std::uint32_t k = 0;           ///< which part of its group (0 .. n_split-1)
    std::uint32_t n_split = 1;
    std::size_t group = 0;         ///< merge group (parts_done index; n_split > 1 only)
    std::size_t partial0 = 0;      ///< the group's partial states (floats; n_split > 1 only)
};

/// Runs every work item on `threads` threads, each on its own part of `scratch`.
/// Fixed: every score in one fixed order (kernels::attend_item_fixed_order).
template <class Element, bool Fixed>
void run_items(const kv_layer_view<const typename Element::storage_type>& kv,
               const kernels::attn_meta<cell_seqs>& meta, const kernels::attn_shape& sh,
               const kernels::attn_slot* slots, float* const* out_rows, const work_item* items, std::size_t n_items,
               const kernels::tile_range* split_ranges, const std::size_t* split_first, float* scratch,
               std::size_t scratch_per_thread, float* partial, std::uint32_t* parts_done, int threads) {
    using T = typename Element::storage_type;
    const std::uint32_t dv = sh.dv;
    const float ninf = -std::numeric_limits<float>::infinity();

    // One work item of M slots on thread tid's scratch: its output rows or its partial state.
    auto run_m = [&](const work_item& w, int tid, auto m_tag) {
        constexpr std::size_t M = decltype(m_tag)::value;
        float* acc = scratch + static_cast<std::size_t>(tid) * scratch_per_thread;
        float* p_buf = acc + M * dv;
        float* vt_buf = p_buf + M * k_tile;
        float* q_buf = vt_buf + std::size_t{k_tile} * dv;
        const kernels::attn_slot* sl = slots + w.slot0;
        const kernels::tile_range* rg = split_ranges + split_first[w.part];
        const std::size_t n_rg = split_first[w.part + 1] - split_first[w.part];
        kernels::attn_state<M> st;
        st.acc = acc;
        for (std::size_t s = 0; s < M; ++s) {
            st.m[s] = ninf;
            st.l[s] = 0.0f;
        }
        std::fill(acc, acc + M * dv, 0.0f);
        auto attend = [&](const auto&... conv) {
            if constexpr (Fixed)
                kernels::attend_item_fixed_order<M, T>(kv, w.h, meta, sh, sl, rg, n_rg, st, p_buf, vt_buf, q_buf, conv...);
            else
                kernels::attend_item<M, T>(kv, w.h, meta, sh, sl, rg, n_rg, st, p_buf, vt_buf, q_buf, conv...);
        };
        if constexpr (kvcache::detail::has_simd_storage<Element>) {
            attend();
        } else {
            // Generic path: tiles converted through Element::to_float into this thread's scratch.
            float* stage = q_buf + M * sh.dk;  // k_tile x (dk + dv) floats (see `need` in attention())
            const kernels::converted_tiles<Element> src{stage, stage + std::size_t{k_tile} * sh.dk};
            attend(src);
        }
        finish_item<M>(st, acc, dv, w.k, w.n_split, out_rows + w.slot0, partial + w.partial0,
                       parts_done + w.group);
    };
    auto run_item = [&](std::size_t i, int tid) {
        const work_item& w = items[i];
        switch (w.m) {
            case 1: run_m(w, tid, std::integral_constant<std::size_t, 1>{}); break;
            case 2: run_m(w, tid, std::integral_constant<std::size_t, 2>{}); break;
            case 4: run_m(w, tid, std::integral_constant<std::size_t, 4>{}); break;
            case 8: run_m(w, tid, std::integral_constant<std::size_t, 8>{}); break;
            default: run_m(w, tid, std::integral_constant<std::size_t, 16>{}); break;
        }
    };
    if (threads <= 1 || n_items <= 1) {
        // No parallel region at all: entering one costs microseconds even with one thread.
        for (std::size_t i = 0; i < n_items; ++i) run_item(i, 0);
        return;
    }
    const auto n = static_cast<std::int64_t>(n_items);
    // nowait: the region's end is the only barrier after the items. With
    // OMP_WAIT_POLICY=passive each barrier can cost a sleeping thread's wake-up; one
    // barrier less per call (two with split-K, whose merge needed one of its own) made
    // 1K-cell decode on 2 threads of the Zen 5 VM 1.12-1.18x faster, 4K 1.03x.
    KVCACHE_OMP(parallel num_threads(threads))
    {
        int tid = 0;
#if defined(_OPENMP)
        tid = omp_get_thread_num();
#endif
        KVCACHE_OMP(for schedule(dynamic, 1) nowait)
        for (std::int64_t it = 0; it < n; ++it) run_item(static_cast<std::size_t>(it), tid);
    }
}
}  // namespace ops::detail_attn
KVCACHE_END_NAMESPACE
