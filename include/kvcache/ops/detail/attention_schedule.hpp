// kvcache ops: scheduling of attention: work items, split-K planning and the parallel
// driver that runs the items (kernels/attention.hpp) and finishes them
// (attention_merge.hpp).
//
// A work item is (KV head, group of up to 16 query slots, part of one segment of tiles).
// A segment is either a cascade class (tiles whose cells several sequences share, e.g. a
// prefix forked with seq_cp: attention_cells.hpp) with the slots of every sequence of the
// call that sees it, read once for all of them (GEMM-shaped, like prefill), or one
// sequence's remaining tiles with its own slots. The query slots (rows x the query heads
// of the GQA group) are cut into groups of up to 16 that share every K/V read; a row
// never pays for another sequence's cells. Long segments are cut into n_split parts
// (split-K, see split_count); a row's partial states (its segments' parts) are merged
// by log-sum-exp in a fixed order (attention_merge.hpp).
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
#include "../../kernels/quant_decode.hpp"
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

/// One work item of a call: KV head h, the m slots from slot0 (rows of one sequence, or
/// of every sequence of the call that shares a cascade class's tiles), one part of one
/// segment's tiles (split_ranges[split_first[part], split_first[part + 1])).
struct work_item {
    std::uint32_t h = 0;
    std::uint32_t m = 1;           ///< slots: 1, 2, 4, 8 or 16
    std::size_t slot0 = 0;         ///< first slot in the call's arrays
    std::size_t part = 0;          ///< index of its part in split_first
    std::size_t partial0 = 0;      ///< its M x (dv + 2) partial states (floats; slots that merge)
};

/// Everything a call's work items read (built by ops/attention.hpp).
template <class T>
struct call_items {
    kv_layer_view<const T> kv{};
    kernels::attn_meta<cell_seqs> meta{};
    kernels::attn_shape sh{};
    const kernels::attn_slot* slots = nullptr;
    const work_item* items = nullptr;
    std::size_t n_items = 0;
    const kernels::tile_range* split_ranges = nullptr;
    const std::size_t* split_first = nullptr;
    slot_targets tg{};
};

/// Floats of scratch one thread needs to run items of up to m_max slots (stage: the
/// generic path's converted tiles, k_tile x (dk + dv) floats; 0 for f32 / f16 / bf16).
inline std::size_t item_scratch_floats(std::size_t m_max, std::uint32_t dk, std::uint32_t dv,
                                       std::size_t stage) noexcept {
    return m_max * dv + m_max * k_tile + std::size_t{k_tile} * dv + m_max * dk + 16 + stage;
}

/// Runs work item i of the call c on `scratch` (item_scratch_floats floats, this
/// caller's own) and finishes it (finish_slots). Fixed: every score in one fixed order
/// (kernels::attend_item_fixed_order). Thread-safe for distinct items.
template <class Element, bool Fixed>
void run_one_item(const call_items<typename Element::storage_type>& c, std::size_t i, float* scratch) noexcept {
    using T = typename Element::storage_type;
    const std::uint32_t dv = c.sh.dv;
    const float ninf = -std::numeric_limits<float>::infinity();
    auto run_m = [&](const work_item& w, auto m_tag) {
        constexpr std::size_t M = decltype(m_tag)::value;
        float* acc = scratch;
        float* p_buf = acc + M * dv;
        float* vt_buf = p_buf + M * k_tile;
        float* q_buf = vt_buf + std::size_t{k_tile} * dv;
        const kernels::attn_slot* sl = c.slots + w.slot0;
        const kernels::tile_range* rg = c.split_ranges + c.split_first[w.part];
        const std::size_t n_rg = c.split_first[w.part + 1] - c.split_first[w.part];
        kernels::attn_state<M> st;
        st.acc = acc;
        for (std::size_t s = 0; s < M; ++s) {
            st.m[s] = ninf;
            st.l[s] = 0.0f;
        }
        std::fill(acc, acc + M * dv, 0.0f);
        auto attend = [&](const auto&... conv) {
            if constexpr (Fixed)
                kernels::attend_item_fixed_order<M, T>(c.kv, w.h, c.meta, c.sh, sl, rg, n_rg, st, p_buf, vt_buf, q_buf,
                                                       conv...);
            else
                kernels::attend_item<M, T>(c.kv, w.h, c.meta, c.sh, sl, rg, n_rg, st, p_buf, vt_buf, q_buf, conv...);
        };
        if constexpr (kvcache::detail::has_simd_storage<Element>) {
            attend();
        } else {
            // Generic path: tiles converted through Element::to_float into this caller's scratch
            // (q8_0 / q4_0: read in place by decode items, kernels/quant_decode.hpp).
            float* stage = q_buf + M * c.sh.dk;  // k_tile x (dk + dv) floats
            const auto src = kernels::make_tile_source<Element>(stage, stage + std::size_t{k_tile} * c.sh.dk);
            attend(src);
        }
        finish_slots<M>(st, acc, dv, w.slot0, w.partial0, c.tg);
    };
    const work_item& w = c.items[i];
    switch (w.m) {
        case 1: run_m(w, std::integral_constant<std::size_t, 1>{}); break;
        case 2: run_m(w, std::integral_constant<std::size_t, 2>{}); break;
        case 4: run_m(w, std::integral_constant<std::size_t, 4>{}); break;
        case 8: run_m(w, std::integral_constant<std::size_t, 8>{}); break;
        default: run_m(w, std::integral_constant<std::size_t, 16>{}); break;
    }
}
}  // namespace ops::detail_attn
KVCACHE_END_NAMESPACE
