// kvcache ops: K-shift (F6), the deferred RoPE correction after seq_add / seq_div, for
// every element policy.
#pragma once

#include <algorithm>  // std::sort, std::unique, std::lower_bound
#include <atomic>     // kshift_plan's item count
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers
#include <functional>  // std::function (composite K-shift)
#include <memory>      // std::shared_ptr
#include <type_traits>  // std::remove_reference_t
#include <string>     // messages
#include <vector>     // per-call tables

#include "../config.hpp"
#include "../element/contract.hpp"
#include "../kernels/kshift.hpp"
#include "../kernels/path.hpp"
#include "../kernels/rope_angles.hpp"
#include "../memory/memory.hpp"
#include "../detail/policy_select.hpp"
#include "../format/kv_view.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops {

namespace detail_kshift {

/// The per-call plan: distinct deltas with their cos/sin tables, and the tiles that move.
struct plan {
    std::uint32_t n_rot = 0, n_pairs = 0;
    std::vector<std::int64_t> deltas;           // distinct keys 2 * delta + long_table, sorted
    std::vector<float> cos_tab, sin_tab;        // [delta index][pair]
    std::vector<kernels::tile_rotation> tiles;  // tiles with at least one moving cell
    std::vector<float> lane_cos, lane_sin;      // [mixed tile][pair][k_tile]
};

// Tables: the rotation by delta d with the frequencies the key was rotated with, and no
// magnitude (attn_factor / YaRN mscale): K already carries it once (rope_rows), and a
// rotation by d composes with the rotation at p as R(d) R(p) = R(p + d) for every
// variant whose frequencies do not depend on the position. LongRoPE's do (short_factors
// below n_ctx_orig, long_factors from it): a key moves exactly only within one side, with
// that side's table, so a table is one per distinct (delta, side); kv_cache::seq_add /
// seq_div refuse moves across (errc::unsupported result), and a pending move across
// reaching the K-shift (it cannot come from those) throws unsupported before any change.
template <class Cache>
plan make_plan(const Cache& cache, int n_threads) {
    plan pl;
    const model_shape& shape = cache.shape();
    const rope_params& rope = shape.rope;
    pl.n_rot = shape.n_rot();
    pl.n_pairs = pl.n_rot / 2;
    const std::uint32_t n = cache.n_window();
    const std::int32_t* shift = cache.cells().shift_data();
    const pos_t* pos = cache.cells().pos_data();
    auto key_of = [&](std::uint32_t c) {
        return std::int64_t{shift[c]} * 2 + (rope.uses_long_factors(pos[c]) ? 1 : 0);
    };
    for (std::uint32_t c = 0; c < n; ++c) {
        if (pos[c] < 0 || shift[c] == 0) continue;
        const std::int64_t from = std::int64_t{pos[c]} - shift[c];
        if (!rope.shift_exact(from, pos[c]))
            kvcache::detail::fail(errc::unsupported,
                                  "apply_k_shift: cell " + std::to_string(c) + " moved from position " +
                                      std::to_string(from) + " to " + std::to_string(pos[c]) +
                                      " across LongRoPE's n_ctx_orig = " + std::to_string(rope.n_ctx_orig) +
                                      " (its factor table changes there; no rotation turns one into the other)");
        pl.deltas.push_back(key_of(c));
    }
    std::sort(pl.deltas.begin(), pl.deltas.end());
    pl.deltas.erase(std::unique(pl.deltas.begin(), pl.deltas.end()), pl.deltas.end());
    const auto n_deltas = static_cast<std::int64_t>(pl.deltas.size());
    const bool two_tables = rope.scaling == rope_scaling::longrope;
    std::vector<double> inv_freq(std::size_t{pl.n_pairs} * (two_tables ? 2 : 1));  // [short | long]
    kernels::rope_inv_freqs(rope, pl.n_rot, false, inv_freq.data());
    if (two_tables) kernels::rope_inv_freqs(rope, pl.n_rot, true, inv_freq.data() + pl.n_pairs);
    kernels::rope_temporal_only(rope, pl.n_pairs, inv_freq.data());  // M-RoPE: moves are temporal only
    pl.cos_tab.resize(pl.deltas.size() * pl.n_pairs);
    pl.sin_tab.resize(pl.deltas.size() * pl.n_pairs);
    const int threads = resolve_threads(n_threads);
    static_cast<void>(threads);
    // Each distinct delta's table once (costly only when there are many distinct deltas).
    KVCACHE_OMP(parallel for schedule(static) num_threads(threads) if (n_deltas > 64))
    for (std::int64_t k = 0; k < n_deltas; ++k) {
        const std::int64_t key = pl.deltas[static_cast<std::size_t>(k)];
        const std::int64_t delta = key >> 1;  // floor: 2 * delta + side with side in {0, 1}
        const double* w = inv_freq.data() + ((key & 1) != 0 ? pl.n_pairs : 0);
        kernels::rope_cos_sin(delta, w, pl.n_pairs, pl.cos_tab.data() + k * pl.n_pairs,
                              pl.sin_tab.data() + k * pl.n_pairs);
    }
    auto index_of = [&](std::int64_t d) {
        return static_cast<std::uint32_t>(std::lower_bound(pl.deltas.begin(), pl.deltas.end(), d) - pl.deltas.begin());
    };
    const std::uint32_t n_tiles = (n + k_tile - 1) / k_tile;
    std::vector<std::size_t> mixed_slot;
    for (std::uint32_t t = 0; t < n_tiles; ++t) {
        kernels::tile_rotation rot;
        rot.tile = t;
        std::int64_t first = 0;
        bool uniform = true;
        for (std::uint32_t j = 0; j < k_tile; ++j) {
            const std::uint32_t c = t * k_tile + j;
            if (c >= n || pos[c] < 0 || shift[c] == 0) continue;
            if (rot.mask == 0) first = key_of(c);
            uniform = uniform && key_of(c) == first;
            rot.mask |= tile_mask{1} << j;
        }
        if (rot.mask == 0) continue;
        rot.uniform = uniform;
        if (uniform) {
            rot.table = index_of(first);
        } else {
            mixed_slot.push_back(pl.tiles.size());
            const std::size_t base = pl.lane_cos.size();
            pl.lane_cos.resize(base + std::size_t{pl.n_pairs} * k_tile, 1.0f);
            pl.lane_sin.resize(base + std::size_t{pl.n_pairs} * k_tile, 0.0f);
            for (std::uint32_t j = 0; j < k_tile; ++j) {
                if (!((rot.mask >> j) & 1u)) continue;
                const std::uint32_t k = index_of(key_of(t * k_tile + j));
                for (std::uint32_t i = 0; i < pl.n_pairs; ++i) {
                    pl.lane_cos[base + std::size_t{i} * k_tile + j] = pl.cos_tab[std::size_t{k} * pl.n_pairs + i];
                    pl.lane_sin[base + std::size_t{i} * k_tile + j] = pl.sin_tab[std::size_t{k} * pl.n_pairs + i];
                }
            }
        }
        pl.tiles.push_back(rot);
    }
    // Pointers into lane tables only once they no longer move.
    for (std::size_t m = 0; m < mixed_slot.size(); ++m) {
        pl.tiles[mixed_slot[m]].lane_cos = pl.lane_cos.data() + m * pl.n_pairs * k_tile;
        pl.tiles[mixed_slot[m]].lane_sin = pl.lane_sin.data() + m * pl.n_pairs * k_tile;
    }
    return pl;
}

}  // namespace detail_kshift

namespace detail_kshift {
/// The tiles of one K-shift call as flat work: tile k of (layer l, KV head h) is unit
/// (l * n_head_kv + h) * n_tiles + k. rotate(u) rotates unit u, the same code (and so
/// the same bits) whoever calls it.
template <class Cache>
struct units {
    using storage_type = typename Cache::storage_type;
    using element = typename Cache::element;
    plan pl;
    std::vector<kv_layer_view<storage_type>> views;
    std::uint32_t n_head_kv = 0;
    std::int64_t n_tiles = 0, n_units = 0;
    kernel_path path = kernel_path::simd;
    bool prefetch = false;

    units(Cache& cache, int n_threads, kernel_path kp) : pl(make_plan(cache, n_threads)), path(kp) {
        const model_shape& shape = cache.shape();
        n_head_kv = shape.n_head_kv;
        prefetch = cpu_is_intel();
        n_tiles = static_cast<std::int64_t>(pl.tiles.size());
        if (pl.n_pairs == 0 || pl.tiles.empty()) return;
        views.reserve(shape.n_layer);
        for (std::uint32_t l = 0; l < shape.n_layer; ++l) views.push_back(cache.storage().view(l));
        n_units = std::int64_t{shape.n_layer} * n_head_kv * n_tiles;
    }
    storage_type* tile_ptr(std::int64_t u) const noexcept {
        const std::int64_t stream = u / n_tiles;
        const kv_layer_view<storage_type>& v = views[static_cast<std::size_t>(stream / n_head_kv)];
        const auto& rot = pl.tiles[static_cast<std::size_t>(u - stream * n_tiles)];
        return v.k_tile_ptr(static_cast<std::uint32_t>(stream % n_head_kv), rot.tile);
    }
    void rotate(std::int64_t u) const noexcept {
        const kernels::tile_rotation& rot = pl.tiles[static_cast<std::size_t>(u % n_tiles)];
        const float* ct = pl.cos_tab.data() + std::size_t{rot.table} * pl.n_pairs;
        const float* st = pl.sin_tab.data() + std::size_t{rot.table} * pl.n_pairs;
        storage_type* tile = tile_ptr(u);
        // The tile after next, asked for one line per row pair as the kernel goes.
        // The kernel walks each tile in address order (rows are in pair order, see
        // format/kv_view.hpp): on the 16-core Xeon it still needs the prefetch
        // (1 thread, f16: 0.58 of the in-place bandwidth without, 1.2 with), on Zen 5
        // it runs 5-7% faster without. A burst of prefetches per tile did no better
        // and swung by 2x with its loop's alignment.
        const char* ahead = prefetch && u + 2 < n_units ? reinterpret_cast<const char*>(tile_ptr(u + 2)) : nullptr;
        if (path == kernel_path::simd || kvcache::is_block_element<element>) {  // (blocks: one path)
            if constexpr (kvcache::detail::has_simd_storage<element>)
                kernels::rotate_tile(tile, pl.n_rot, rot, ct, st, ahead);
            else  // generic path: row pairs converted through element::to_float / from_float
                kernels::rotate_tile_converted<element>(tile, pl.n_rot, rot, ct, st);
        } else if constexpr (!kvcache::is_block_element<element>) {
            kernels::rotate_tile_scalar(
                tile, pl.n_rot, rot, ct, st,
                [](storage_type x) {
                    float f;
                    element::to_float(&x, &f, 1);
                    return f;
                },
                [](float f) {
                    storage_type x;
                    element::from_float(&f, &x, 1);
                    return x;
                });
        }
    }
};

/// Rotates every unit of un (one parallel region) and clears the pending shifts; allocates
/// nothing, so a K-shift whose units were built completes.
/// Room for the cache's clear_shifts() at the end (a K-shift inside a compound operation's
/// checkpoint journals it): taken before anything rotates. May throw std::bad_alloc.
template <class Cache>
void reserve_clear(Cache& cache) {
    if constexpr (requires { cache.reserve_clear_shifts(kvcache::detail::internal_access{}); })
        cache.reserve_clear_shifts(kvcache::detail::internal_access{});
}

template <class Cache>
void run_units(Cache& cache, const units<Cache>& un, int n_threads) {
    if (un.n_units > 0) {
        const std::int64_t n_items = un.n_units;
        const int threads = resolve_threads(n_threads);
        static_cast<void>(threads);
        // The units are split into one contiguous range per thread inside one parallel
        // region (a region per layer and head cost a wake-up of every thread each time:
        // with passive waiting, 16 threads spent a third of the call asleep).
        KVCACHE_OMP(parallel for schedule(static) num_threads(threads) if (threads > 1))
        for (std::int64_t item = 0; item < n_items; ++item) un.rotate(item);
    }
    cache.clear_shifts();
}
}  // namespace detail_kshift

/// K-shift (F6): rotates the cached K of every layer by each cell's pending delta
/// (cache.cells().shift(c), the sum of every seq_add / seq_div since the last K-shift),
/// then clears the pending deltas. V is not touched. Reads and writes only cells [0, n)
/// with n = cache.n_window() (F8), and only the cells that move. Each distinct delta's
/// cos/sin table is computed once (in double, accurate for deltas up to 2^31) and shared
/// by every cell, layer and head that uses it. n_threads <= 0: the OpenMP default.
/// Every RoPE variant of rope_params: the tables rotate by the angle of the delta with the
/// frequencies K was rotated with, never by the magnitude attn_factor (see make_plan).
/// M-RoPE (rope.mrope): a delta moves the temporal component only; the pairs of the
/// height / width / extra sections are left exactly as they are (their positions never move).
/// Throws unsupported, before any change, if a pending move crosses LongRoPE's n_ctx_orig
/// (seq_add / seq_div refuse those, so only a cache rebuilt by hand can hold one).
/// Refused (kvcache::error transaction_open, nothing changed) while placements are staged.
/// Complete or nothing: everything it allocates (std::bad_alloc) is allocated before the
/// first K row changes. (kshift_plan runs the same work on the caller's threads.)
template <class Cache>
void apply_k_shift(Cache& cache, int n_threads = 0, kernel_path path = kernel_path::simd) {
    static_assert(kv_memory<Cache>, "kvcache: ops::apply_k_shift needs a kvcache::kv_memory or a "
                                    "kvcache::composite_memory (see kvcache/memory/memory.hpp)");
    if (cache.in_transaction())  // restore() would put back metadata of K already rotated
        kvcache::detail::fail(errc::transaction_open, "apply_k_shift: placements are staged; commit() or restore() first");
    if (!cache.has_shift()) return;
    const detail_kshift::units<Cache> un(cache, n_threads, path);  // everything it allocates
    detail_kshift::reserve_clear(cache);
    detail_kshift::run_units(cache, un, n_threads);
}

/// ops::apply_k_shift cut into work items that the caller runs (host-driven
/// parallelism: an engine's own thread pool, no OpenMP). Construction checks and plans
/// as apply_k_shift does (same errors, nothing changed when it throws); run_item(i) for
/// every i in [0, n_items()), in any order, concurrently on any threads; then finish(),
/// which clears the pending shifts. K is bit-identical to apply_k_shift's whatever the
/// order and the threads (each tile is rotated by the same code, once). n_items: how
/// many items to cut the work into (0: one per layer and KV head; fewer when there is
/// less work). The cache must outlive the plan and stay unchanged until finish().
template <class Cache>
class kshift_plan {
public:
    explicit kshift_plan(Cache& cache, std::size_t n_items = 0, kernel_path path = kernel_path::simd)
        : cache_(&cache), un_(checked(cache), 1, path) {
        detail_kshift::reserve_clear(cache);
        const std::int64_t want =
            n_items != 0 ? static_cast<std::int64_t>(n_items) : std::int64_t{cache.shape().n_layer} * un_.n_head_kv;
        n_items_ = static_cast<std::size_t>(std::min(want, un_.n_units));
    }
    kshift_plan(const kshift_plan&) = delete;
    kshift_plan& operator=(const kshift_plan&) = delete;

    /// Work items to run (0: nothing moves).
    [[nodiscard]] std::size_t n_items() const noexcept { return n_items_; }
    /// Rotates item i's tiles (i < n_items(), else invalid_argument and nothing changed).
    void run_item(std::size_t i) const {
        if (i >= n_items_)
            kvcache::detail::fail(errc::invalid_argument, "kshift_plan::run_item: i = " + std::to_string(i) +
                                                              ", must be < n_items() = " + std::to_string(n_items_));
        const auto n = static_cast<std::int64_t>(n_items_), k = static_cast<std::int64_t>(i);
        const std::int64_t b = un_.n_units * k / n, e = un_.n_units * (k + 1) / n;
        for (std::int64_t u = b; u < e; ++u) un_.rotate(u);
        done_.fetch_add(1, std::memory_order_acq_rel);
    }
    /// Ends the K-shift: clears the cache's pending shifts. Throws invalid_argument (shifts
    /// kept) unless every item ran exactly once.
    void finish() {
        const std::size_t done = done_.load(std::memory_order_acquire);
        if (done != n_items_)
            kvcache::detail::fail(errc::invalid_argument, "kshift_plan::finish: " + std::to_string(done) +
                                                              " item runs for n_items() = " + std::to_string(n_items_) +
                                                              " (each item must run exactly once)");
        cache_->clear_shifts();
    }

private:
    static Cache& checked(Cache& cache) {
        static_assert(kv_memory<Cache>, "kvcache: ops::kshift_plan needs a kvcache::kv_memory");
        if (cache.in_transaction())
            kvcache::detail::fail(errc::transaction_open,
                                  "kshift_plan: placements are staged; commit() or restore() first");
        return cache;
    }
    Cache* cache_;
    detail_kshift::units<Cache> un_;
    std::size_t n_items_ = 0;
    mutable std::atomic<std::size_t> done_{0};  // items run
};

/// K-shift of a memory made of several caches (iswa_cache): every part's pending shift.
/// Complete or nothing over all parts: every part is checked (staged placements, LongRoPE
/// moves) and its work allocated before the first part is rotated, so a refusal or a
/// std::bad_alloc leaves every part as it was.
template <class Memory>
    requires composite_memory<Memory>
void apply_k_shift(Memory& mem, int n_threads = 0, kernel_path path = kernel_path::simd) {
    std::size_t n_parts = 0;
    mem.for_each_part([&](const auto&) { ++n_parts; });
    std::vector<std::function<void()>> rotations;  // one per part, built before any runs
    rotations.reserve(n_parts);
    mem.for_each_part(kvcache::detail::internal_access{}, [&](auto& part) {
        using part_t = std::remove_reference_t<decltype(part)>;
        if (part.in_transaction())
            kvcache::detail::fail(errc::transaction_open,
                                  "apply_k_shift: placements are staged; commit() or restore() first");
        if (!part.has_shift()) return;
        auto un = std::make_shared<const detail_kshift::units<part_t>>(part, n_threads, path);
        detail_kshift::reserve_clear(part);
        rotations.emplace_back([&part, un, n_threads] { detail_kshift::run_units(part, *un, n_threads); });
    });
    for (auto& r : rotations) r();  // allocates nothing: std::function keeps its callable
}

}  // namespace ops
KVCACHE_END_NAMESPACE
