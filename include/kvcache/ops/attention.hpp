// kvcache ops: attention over the cache, prefill and decode, for every element policy.
//
// The public API (attention(), attention_params, attention_workspace) and the call's
// setup. The rest lives in ops/detail/: what the kernels know of the cells
// (attention_cells.hpp), scheduling of work items and split-K (attention_schedule.hpp),
// the end of an item and the split-K merge (attention_merge.hpp); the kernels themselves
// in kernels/attention.hpp (SIMD) and kernels/attention_scalar.hpp (the oracle).
#pragma once

#include <cmath>    // std::sqrt, std::isfinite
#include <cstddef>  // std::size_t
#include <algorithm>  // std::min, std::fill
#include <cstdint>  // fixed-width integers
#include <string>   // messages
#include <type_traits>  // std::integral_constant
#include <utility>   // std::pair
#include <vector>   // workspace buffers

#include "../config.hpp"
#include "../element/contract.hpp"
#include "../error.hpp"
#include "../format/kv_view.hpp"
#include "../kernels/attention.hpp"
#include "../kernels/attention_scalar.hpp"
#include "../kernels/path.hpp"
#include "../layout/capabilities.hpp"
#include "../memory/memory.hpp"
#include "../model_shape.hpp"
#include "detail/attention_cells.hpp"     // cell_seqs, summarise_tile
#include "detail/attention_schedule.hpp"  // slots, split-K planning, run_items
#include "detail/attention_merge.hpp"     // finish_item, merge_slot

KVCACHE_BEGIN_NAMESPACE
namespace ops {

/// How the attention kernel asks for K/V ahead of use (cold caches, long contexts).
/// Which is fastest depends on the core and on the machine's load (bench/README.md):
/// `interleaved` was best on an Intel Xeon (0.91 of read bandwidth on one thread against
/// 0.62 for `burst`); on an AMD Zen 5 VM `none` won by 4-21% on one thread in quiet hours
/// (16-cell tiles; `burst` cost 37%), but whenever the shared host's memory latency was
/// high `interleaved` ran 1.06-1.56x faster on 1 and 2 threads, and its cost when K/V sit
/// in cache is ~12% of a compute-bound call. `automatic` therefore uses it where K/V come
/// from memory: decode-shaped calls over more than 1 MiB of K/V. The fused decode loop
/// (up to 4 query heads per KV head, 16-lane vectors, row-major V; kernels/attention.hpp)
/// issues no software prefetch: it reads K and V together, which the hardware
/// prefetchers follow; the mode applies to the kernel's other loops.
enum class prefetch_mode : std::uint8_t {
    automatic = 0,    ///< interleaved on Intel CPUs and for decode-shaped calls over > 1 MiB of K/V, else none
    burst = 1,        ///< each visited tile asks for all of the next tile at once
    interleaved = 2,  ///< one line of the next tile per step of the score loop
    none = 3,         ///< no software prefetch (the hardware prefetchers only)
};

/// Attention options.
struct attention_params {
    std::uint32_t n_head = 0;  ///< query heads; a multiple of the cache's n_head_kv (GQA)
    float scale = 0.0f;        ///< logit scale; 0 means 1 / sqrt(head_dim_k)
    std::int32_t window = 0;   ///< > 0: sliding window, a query at p sees positions (p - window, p]
    float softcap = 0.0f;      ///< > 0: logits = softcap * tanh(logits / softcap)
    int n_threads = 0;         ///< <= 0: the OpenMP default
    kernel_path path = kernel_path::simd;  ///< scalar: the plain reference loop (benchmarks)
    prefetch_mode prefetch = prefetch_mode::automatic;  ///< K/V prefetch strategy (speed only)
};

namespace detail_attn {
/// prefetch_mode::automatic resolved for one call: `interleaved` on Intel CPUs; elsewhere
/// `interleaved` when the call is decode-shaped (at most 8 query slots share each K/V
/// read, so it streams K/V rather than computing on it) and reads more than 1 MiB of K/V
/// (more than one core's L2: with every layer of a model, far more than the L3), `none`
/// otherwise (prefill is compute-bound; small K/V stays in cache).
inline prefetch_mode resolve_prefetch(prefetch_mode m, std::size_t slots_per_item, std::size_t kv_bytes) noexcept {
    if (m != prefetch_mode::automatic) return m;
    if (cpu_is_intel()) return prefetch_mode::interleaved;
    return slots_per_item <= 8 && kv_bytes > (std::size_t{1} << 20) ? prefetch_mode::interleaved : prefetch_mode::none;
}
}  // namespace detail_attn

/// Caller-owned scratch for attention(), reused across calls: it grows to the largest
/// call seen and then the hot path allocates nothing. One workspace per calling thread.
/// It also keeps the per-tile mask summaries of the last cells it saw (keyed on
/// cell_table::stamp()), so the layers of one decode step build them once: pass the
/// same workspace for every layer.
class attention_workspace {
public:
    attention_workspace() = default;
    /// Bytes currently reserved.
    [[nodiscard]] std::size_t bytes() const noexcept {
        return tiles_.capacity() * sizeof(kernels::tile_meta) + slots_.capacity() * sizeof(kernels::attn_slot) +
               ranges_.capacity() * sizeof(kernels::tile_range) + split_ranges_.capacity() * sizeof(kernels::tile_range) +
               seq_ranges_.capacity() * sizeof(std::pair<std::uint32_t, std::uint32_t>) +
               split_first_.capacity() * sizeof(std::size_t) + scratch_.capacity() * sizeof(float) +
               partial_.capacity() * sizeof(float) + parts_done_.capacity() * sizeof(std::uint32_t) +
               out_rows_.capacity() * sizeof(float*);
    }

private:
    template <class Cache>
    friend void attention(const Cache&, std::uint32_t, const float*, const pos_t*, const seq_id_t*, std::uint32_t,
                          const attention_params&, float*, attention_workspace&);

    std::vector<kernels::tile_meta> tiles_;           // per tile of [0, n): occupancy / position / sequence summary
    std::uint64_t tiles_stamp_ = 0;                   // cell_table::stamp() tiles_ was built from (0: none)
    std::uint32_t tiles_n_ = 0;                       // ... and the n it covered
    std::vector<kernels::attn_slot> slots_;           // per KV head: n_q x group slots, padded to a multiple of M
    std::vector<kernels::tile_range> ranges_;         // tiles to visit (one range for the contiguous layout)
    std::vector<std::pair<std::uint32_t, std::uint32_t>> seq_ranges_;  // a paged layout's tile ranges of one sequence
    std::vector<kernels::tile_range> split_ranges_;   // the ranges cut into n_split parts
    std::vector<std::size_t> split_first_;            // split k's ranges: [split_first_[k], split_first_[k+1])
    std::vector<float> scratch_;                      // per thread: accumulators, p, transposed-V rows
    std::vector<float> partial_;                      // split-K: per item M x (dv + 2) partial states
    std::vector<std::uint32_t> parts_done_;           // split-K: per head group, parts finished (atomic_ref)
    std::vector<float*> out_rows_;                    // per slot: where its output row goes (null: padding)
};

namespace detail_attn {
template <class Cache>
void check(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos, const seq_id_t* q_seq,
           std::uint32_t n_q, const attention_params& p, float* out) {
    using std::to_string;
    const model_shape& s = cache.shape();
    if (layer >= s.n_layer)
        detail::fail(errc::invalid_argument,
                     "attention: layer = " + to_string(layer) + ", must be < n_layer = " + to_string(s.n_layer));
    if (p.n_head == 0 || p.n_head % s.n_head_kv != 0)
        detail::fail(errc::invalid_argument, "attention: n_head = " + to_string(p.n_head) +
                                                 ", must be a positive multiple of n_head_kv = " + to_string(s.n_head_kv));
    if (!std::isfinite(p.scale) || p.scale < 0.0f)
        detail::fail(errc::invalid_argument,
                     "attention: scale = " + std::to_string(p.scale) + ", must be finite and >= 0 (0: 1/sqrt(head_dim))");
    if (p.window < 0)
        detail::fail(errc::invalid_argument, "attention: window = " + to_string(p.window) + ", must be >= 0 (0: none)");
    if (!std::isfinite(p.softcap) || p.softcap < 0.0f)
        detail::fail(errc::invalid_argument,
                     "attention: softcap = " + std::to_string(p.softcap) + ", must be finite and >= 0 (0: none)");
    if (n_q == 0) return;
    if (q == nullptr) detail::fail(errc::invalid_argument, "attention: q is null with n_q = " + to_string(n_q));
    if (q_pos == nullptr) detail::fail(errc::invalid_argument, "attention: q_pos is null with n_q = " + to_string(n_q));
    if (q_seq == nullptr) detail::fail(errc::invalid_argument, "attention: q_seq is null with n_q = " + to_string(n_q));
    if (out == nullptr) detail::fail(errc::invalid_argument, "attention: out is null with n_q = " + to_string(n_q));
    for (std::uint32_t i = 0; i < n_q; ++i) {
        if (q_seq[i] < 0 || static_cast<std::uint32_t>(q_seq[i]) >= s.n_seq_max)
            detail::fail(errc::invalid_argument, "attention: q_seq[" + to_string(i) + "] = " + to_string(q_seq[i]) +
                                                     ", must be in [0, " + to_string(s.n_seq_max) + ")");
        if (q_pos[i] < 0)
            detail::fail(errc::invalid_argument,
                         "attention: q_pos[" + to_string(i) + "] = " + to_string(q_pos[i]) + ", must be >= 0");
    }
}

/// kernel_path::scalar: the plain reference loop (kernels/attention_scalar.hpp).
template <class Cache>
void attention_scalar(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos,
                      const seq_id_t* q_seq, std::uint32_t n_q, const attention_params& p, float* out,
                      std::vector<float>& acc_buf) {
    const model_shape& s = cache.shape();
    kernels::scalar_attn_args<cell_seqs> a;
    a.cell_pos = cache.cells().pos_data();
    a.cell_seqs = cell_seqs{cache.cells().seq_data()};
    a.n = cache.n_window();
    a.q = q;
    a.q_pos = q_pos;
    a.q_seq = q_seq;
    a.n_q = n_q;
    a.n_head = p.n_head;
    a.scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(s.dim_k()));
    a.window = p.window;
    a.softcap = p.softcap;
    a.out = out;
    if (acc_buf.size() < s.dim_v()) acc_buf.resize(s.dim_v());
    kernels::attention_scalar<typename Cache::element>(cache.storage().view(layer), a, acc_buf.data());
}

}  // namespace detail_attn

/// Attention of n_q query rows over layer `layer` of the cache, for every element policy
/// (f32 / f16 / bf16 are loaded with SIMD; any other element is converted tile by tile
/// through its to_float into per-thread f32 scratch in the workspace: no allocation once
/// the workspace has grown).
/// q: n_q rows of n_head x head_dim_k floats (head-major); q_pos / q_seq: position and
/// sequence of each row; out: n_q rows of n_head x head_dim_v floats. Query head g reads
/// KV head g / (n_head / n_head_kv). Cell c is visible to row i when it is occupied, used
/// by sequence q_seq[i], pos(c) <= q_pos[i] (causal) and, with a window W > 0,
/// pos(c) > q_pos[i] - W. Online softmax in f32; a row with no visible cell gets zeros.
/// Reads only cells [0, cache.n_window()) (F8). Throws kvcache::error(invalid_argument)
/// on bad arguments (before writing anything).
///
/// Parallel work items are (KV head, group of query slots, part of the KV range): the
/// query slots of one KV head (rows x query heads of its GQA group) are cut into groups
/// of up to 16 that share every K/V read; when there are fewer items than four per
/// thread (decode of few sequences), or fewer than 16 and the context is long (parts of
/// >= 4096 cells), the KV range is split too and the partial softmax states are merged
/// by the thread that finishes a head group's last part (split-K / flash-decoding).
template <class Cache>
void attention(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos, const seq_id_t* q_seq,
               std::uint32_t n_q, const attention_params& p, float* out, attention_workspace& ws) {
    static_assert(kv_memory<Cache>, "kvcache: ops::attention needs a kvcache::kv_memory (one K/V cache; for an "
                                    "iswa_cache pass full() or swa() per layer, see kvcache/memory/memory.hpp)");
    detail_attn::check(cache, layer, q, q_pos, q_seq, n_q, p, out);
    if (n_q == 0) return;
    if (p.path == kernel_path::scalar) {
        detail_attn::attention_scalar(cache, layer, q, q_pos, q_seq, n_q, p, out, ws.scratch_);
        return;
    }
    using T = typename Cache::storage_type;
    const model_shape& s = cache.shape();
    const std::uint32_t dk = s.dim_k(), dv = s.dim_v(), hkv = s.n_head_kv, group = p.n_head / hkv;
    const int threads = resolve_threads(p.n_threads);
    kernels::attn_shape sh;
    sh.dk = dk;
    sh.dv = dv;
    sh.scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    sh.softcap = p.softcap;
    sh.window = p.window;

    const std::uint32_t n = cache.n_window();
    const std::uint32_t n_tiles = (n + k_tile - 1) / k_tile;
    if (n_tiles == 0) {
        std::fill(out, out + std::size_t{n_q} * p.n_head * dv, 0.0f);
        return;
    }
    // Per-tile summaries: rebuilt by run_items only when the cells changed since the
    // workspace last built them. Building them read every cell's position and sequence
    // set, 7-12% of a cold 16K decode call on the Zen 5 VM (1 or 2 threads), once per
    // layer; a decode step now pays it once.
    const std::uint64_t stamp = cache.cells().stamp();
    const bool tiles_ready = ws.tiles_stamp_ == stamp && ws.tiles_n_ == n;  // (tiles_ then has n_tiles entries)
    ws.tiles_stamp_ = 0;  // (invalid until run_items has filled them)
    ws.tiles_.resize(n_tiles);
    kernels::attn_meta<detail_attn::cell_seqs> meta;
    meta.pos = cache.cells().pos_data();
    meta.seqs = detail_attn::cell_seqs{cache.cells().seq_data()};
    meta.tiles = ws.tiles_.data();

    // Slots: per KV head, row-major over (row, head of the group), padded to a multiple of M.
    const std::size_t want = std::size_t{n_q} * group;
    const std::size_t M = detail_attn::slots_per_item(want);
    const std::size_t per_head = (want + M - 1) / M * M;
    {
        const std::size_t kv_bytes = std::size_t{n} * hkv * (dk + dv) * sizeof(T);
        const prefetch_mode pm = detail_attn::resolve_prefetch(p.prefetch, M, kv_bytes);
        sh.burst_prefetch = pm == prefetch_mode::burst;
        sh.interleaved_prefetch = pm == prefetch_mode::interleaved;
    }
    ws.slots_.assign(per_head * hkv, kernels::attn_slot{});
    std::vector<float*>& out_rows = ws.out_rows_;
    out_rows.assign(per_head * hkv, nullptr);
    for (std::uint32_t h = 0; h < hkv; ++h)
        for (std::size_t k = 0; k < want; ++k) {
            const auto row = static_cast<std::uint32_t>(k / group);
            const std::uint32_t head = h * group + static_cast<std::uint32_t>(k % group);
            kernels::attn_slot& sl = ws.slots_[h * per_head + k];
            sl.q = q + (std::size_t{row} * p.n_head + head) * dk;
            sl.qp = q_pos[row];
            sl.qs = q_seq[row];
            sl.active = true;
            out_rows[h * per_head + k] = out + (std::size_t{row} * p.n_head + head) * dv;
        }
    // Padding slots read a real query (never used: they see nothing).
    for (std::size_t x = 0; x < ws.slots_.size(); ++x)
        if (!ws.slots_[x].active) ws.slots_[x].q = q;

    // Tiles to visit: one range [0, n_tiles) (the metadata skips tiles nobody sees), or,
    // when every row belongs to one sequence and the layout can list that sequence's
    // tiles (a paged layout's block table: storage.tile_ranges(seq)), just those.
    ws.ranges_.assign(1, kernels::tile_range{0, n_tiles});
    if constexpr (cache_has_capability<Cache, layout_caps::tile_ranges>()) {
        bool one_seq = true;
        for (std::uint32_t i = 1; i < n_q; ++i) one_seq = one_seq && q_seq[i] == q_seq[0];
        if (one_seq) {
            ws.ranges_.clear();
            cache.storage().tile_ranges(q_seq[0], ws.seq_ranges_);
            for (const auto& r : ws.seq_ranges_) {
                const auto t0 = static_cast<std::uint32_t>(r.first);
                const auto t1 = std::min(static_cast<std::uint32_t>(r.second), n_tiles);
                if (t0 < t1) ws.ranges_.push_back({t0, t1});
            }
        }
    }

    // Split-K (detail/attention_schedule.hpp): parts of the tiles to visit.
    const std::size_t base_items = std::size_t{hkv} * (per_head / M);
    const std::size_t n_split = detail_attn::plan_split(ws.ranges_, base_items, threads, ws.split_ranges_, ws.split_first_);
    // Per-thread scratch: each thread's part starts on a 4 KiB boundary and ends with a
    // 4 KiB gap. Packed back to back, one core's hardware prefetchers, running past the
    // end of its own buffers, pulled in the next thread's accumulator lines, which that
    // core then had to take back on every store: 512 x 512 prefill on 2 threads of a
    // Zen 5 ran ~20% slower than two single-thread processes side by side.
    constexpr std::size_t page = 4096 / sizeof(float);
    // (+ the generic path's two converted tiles, k_tile x (dk + dv) floats; 0 for f32/f16/bf16)
    constexpr bool in_place = kvcache::detail::has_simd_storage<typename Cache::element>;
    const std::size_t stage = in_place ? 0 : std::size_t{k_tile} * (dk + dv);
    const std::size_t need = M * dv + M * k_tile + std::size_t{k_tile} * dv + M * dk + 16 + stage;
    const std::size_t per_thread = (need + page - 1) / page * page + page;
    if (ws.scratch_.size() < per_thread * static_cast<std::size_t>(threads) + page)
        ws.scratch_.resize(per_thread * static_cast<std::size_t>(threads) + page);
    float* scratch = ws.scratch_.data();
    scratch += (page - (reinterpret_cast<std::uintptr_t>(scratch) / sizeof(float)) % page) % page;
    if (n_split > 1 && ws.partial_.size() < base_items * n_split * M * (dv + 2))
        ws.partial_.resize(base_items * n_split * M * (dv + 2));
    if (n_split > 1) ws.parts_done_.assign(base_items, 0);

    const kv_layer_view<const T> kv = cache.storage().view(layer);
    auto run = [&](auto m_tag) {
        constexpr std::size_t MM = decltype(m_tag)::value;
        detail_attn::run_items<MM, typename Cache::element>(kv, meta, sh, ws.slots_.data(), per_head, hkv, ws.split_ranges_.data(),
                                      ws.split_first_.data(), n_split, scratch, per_thread,
                                      ws.partial_.data(), ws.parts_done_.data(), out_rows.data(), threads,
                                      cache.cells(), n,
                                      ws.tiles_.data(), tiles_ready);
    };
    switch (M) {
        case 1: run(std::integral_constant<std::size_t, 1>{}); break;
        case 2: run(std::integral_constant<std::size_t, 2>{}); break;
        case 4: run(std::integral_constant<std::size_t, 4>{}); break;
        case 8: run(std::integral_constant<std::size_t, 8>{}); break;
        default: run(std::integral_constant<std::size_t, 16>{}); break;
    }
    ws.tiles_stamp_ = stamp;
    ws.tiles_n_ = n;
}

}  // namespace ops
KVCACHE_END_NAMESPACE
