// kvcache ops: attention over the cache, prefill and decode, for every element policy.
//
// The public API (attention(), attention_plan for host-driven work items,
// attention_params, attention_workspace, attention_scratch) and the call's setup
// (attention_plan's constructor: segments, cascade classes, slots, items). The rest lives in ops/detail/: what the kernels know of the cells
// (attention_cells.hpp), scheduling of work items and split-K (attention_schedule.hpp),
// the end of an item and the split-K merge (attention_merge.hpp); the kernels themselves
// in kernels/attention.hpp (SIMD) and kernels/attention_scalar.hpp (the oracle).
#pragma once

#include <cmath>    // std::sqrt, std::isfinite
#include <cstddef>  // std::size_t
#include <algorithm>  // std::min, std::fill
#include <atomic>     // std::atomic_ref
#include <cstdint>  // fixed-width integers
#include <string>   // messages
#include <type_traits>  // std::integral_constant
#include <utility>   // std::exchange
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
#include "detail/attention_schedule.hpp"  // work items, split-K planning, run_one_item
#include "detail/attention_merge.hpp"     // finish_slots, merge_list

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
    automatic = 0,    ///< interleaved on Intel CPUs and for decode-shaped items (<= 8 slots) of calls over > 1 MiB of K/V, else none
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
    /// true: a row's output bits depend only on the row (query, position, sequence), the
    /// cells and the params, never on the other rows of the call, the threads or the
    /// split (see attention()). false: split-K follows the threads and the score sums of
    /// small slot groups use more FMA chains (faster on many cores with few KV heads and
    /// short contexts, on MHA models on AVX2); bits may then change with n_threads and
    /// with the rows of the row's own sequence in the call.
    bool deterministic = true;
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

/// Sets sh's prefetch flags for a call reading kv_bytes of K/V: each item gets the mode
/// resolve_prefetch gives for its own slots, so in a call that mixes decode rows with a
/// prefill chunk (continuous batching) the decode items keep the prefetch the same rows
/// get in a call of their own. (Resolved once for the call's largest item, the decode
/// rows beside a 512-row chunk lost it: on a Zen 3, 0.92-0.94 of the separate calls.)
inline void set_prefetch(kernels::attn_shape& sh, prefetch_mode m, std::size_t kv_bytes) noexcept {
    const prefetch_mode small = resolve_prefetch(m, 8, kv_bytes), large = resolve_prefetch(m, 16, kv_bytes);
    sh.burst_prefetch = small == prefetch_mode::burst;
    sh.interleaved_prefetch = small == prefetch_mode::interleaved;
    sh.prefetch_max_slots = large == small ? 16 : 8;  // (large is then `none`)
}
}  // namespace detail_attn

/// Caller-owned scratch for attention() and attention_plan, reused across calls: it
/// grows to the largest call seen and then the hot path allocates nothing. One
/// workspace per calling thread (and per live attention_plan). It also keeps the
/// per-tile mask summaries and the cascade classes of the last cells it saw (keyed on
/// cell_table::stamp()), so the layers of one decode step build them once: pass the
/// same workspace for every layer.
class attention_workspace {
public:
    attention_workspace() = default;
    /// Bytes currently reserved.
    [[nodiscard]] std::size_t bytes() const noexcept {
        return tiles_.capacity() * sizeof(kernels::tile_meta) + tile_seqs_.capacity() * sizeof(seq_set) +
               cls_.tile_cls.capacity() * sizeof(std::int32_t) + cls_.ranges.capacity() * sizeof(kernels::tile_range) +
               cls_.first.capacity() * sizeof(std::size_t) + cls_.keys.capacity() * sizeof(seq_set) +
               cls_.order.capacity() * sizeof(std::uint32_t) + slots_.capacity() * sizeof(kernels::attn_slot) +
               ranges_.capacity() * sizeof(kernels::tile_range) + range_first_.capacity() * sizeof(std::size_t) +
               split_ranges_.capacity() * sizeof(kernels::tile_range) + split_first_.capacity() * sizeof(std::size_t) +
               items_.capacity() * sizeof(detail_attn::work_item) + seq_index_.capacity() * sizeof(std::int32_t) +
               call_seqs_.capacity() * sizeof(seq_id_t) + row_first_.capacity() * sizeof(std::uint32_t) +
               rows_.capacity() * sizeof(std::uint32_t) + segs_.capacity() * sizeof(segment) +
               seg_seqs_.capacity() * sizeof(std::uint32_t) + seg_rows_.capacity() * sizeof(std::uint32_t) +
               row_parts_.capacity() * sizeof(std::uint32_t) + tgt_parts_.capacity() * sizeof(std::uint32_t) +
               tgt_first_.capacity() * sizeof(std::size_t) + part_off_.capacity() * sizeof(std::size_t) +
               tgt_done_.capacity() * sizeof(std::uint32_t) + slot_tgt_.capacity() * sizeof(std::uint32_t) +
               scratch_.capacity() * sizeof(float) + partial_.capacity() * sizeof(float);
    }

private:
    template <class Cache>
    friend class attention_plan;
    template <class Cache>
    friend void attention(const Cache&, std::uint32_t, const float*, const pos_t*, const seq_id_t*, std::uint32_t,
                          const attention_params&, float*, attention_workspace&);

    // One segment of a call (see ops/detail/attention_schedule.hpp): tiles, the call
    // sequences whose rows visit them (seg_seqs_[seq0, seq1)), slots per KV head, parts.
    struct segment {
        const kernels::tile_range* rg = nullptr;
        std::size_t n_rg = 0, seq0 = 0, seq1 = 0, want = 0, n_split = 1;
    };

    std::vector<kernels::tile_meta> tiles_;           // per tile of [0, n): occupancy / position / sequence summary
    std::vector<seq_set> tile_seqs_;                  // per tile: the sequences of its cells
    detail_attn::cascade_classes cls_;                // tiles shared by several sequences, by sequence set
    std::uint64_t tiles_stamp_ = 0;                   // cell_table::stamp() tiles_ / cls_ were built from (0: none)
    std::uint32_t tiles_n_ = 0;                       // ... and the n they covered
    std::vector<std::int32_t> seq_index_;             // per sequence id: its index in call_seqs_ (-1: not in the call)
    std::vector<seq_id_t> call_seqs_;                 // the call's sequences, in order of first row
    std::vector<std::uint32_t> row_first_;            // sequence i's rows: rows_[row_first_[i], row_first_[i+1])
    std::vector<std::uint32_t> rows_;                 // the rows grouped by sequence (in row order within one)
    std::vector<kernels::tile_range> ranges_;         // sequence i's own tiles (no class): ranges_[range_first_[i], [i+1])
    std::vector<std::size_t> range_first_;
    std::vector<segment> segs_;                       // the call's segments: classes (in class order), then own tiles
    std::vector<std::uint32_t> seg_seqs_;             // the segments' call sequences
    std::vector<std::uint32_t> seg_rows_;             // (scratch: one segment's rows)
    std::vector<std::uint32_t> row_parts_;            // per row: partial states (its segments' parts)
    std::vector<std::uint32_t> row_cur_;              // per row: states assigned so far
    std::vector<kernels::tile_range> split_ranges_;   // the parts' ranges
    std::vector<std::size_t> split_first_;            // part k's ranges: [split_first_[k], split_first_[k+1])
    std::vector<detail_attn::work_item> items_;       // the call's work items
    std::vector<kernels::attn_slot> slots_;           // the items' slots, each item's M in a row
    std::vector<std::uint32_t> slot_tgt_;             // per slot: its target, row * n_head + head (npos: padding)
    std::vector<std::uint32_t> tgt_parts_;            // per target: partial states
    std::vector<std::size_t> tgt_first_;              // per target: first entry in part_off_
    std::vector<std::size_t> part_off_;               // the targets' states (offsets into partial_), in merge order
    std::vector<std::uint32_t> tgt_done_;             // per target: states written (atomic_ref)
    std::vector<float> scratch_;                      // attention(): per thread accumulators, p, transposed-V rows
    std::vector<float> partial_;                      // partial softmax states, [m, l, acc[dv]] each
    std::uint64_t items_done_ = 0;                    // attention_plan: items run (atomic_ref)
};

/// Scratch of one worker running attention_plan items (grown on first use; reuse it).
class attention_scratch {
public:
    attention_scratch() = default;
    /// Bytes currently reserved.
    [[nodiscard]] std::size_t bytes() const noexcept { return buf_.capacity() * sizeof(float); }

private:
    template <class Cache>
    friend class attention_plan;
    std::vector<float> buf_;
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
    if (cache.has_shift())
        detail::fail(errc::invalid_argument,
                     "attention: the cache has pending K-shifts (has_shift() is true: seq_add / seq_div moved cells "
                     "whose K is still rotated for the old positions); call ops::apply_k_shift first");
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

}  // namespace detail_attn

template <class Cache>
class attention_plan;

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
/// Refuses (invalid_argument, nothing written) a cache with pending K-shifts
/// (cache.has_shift(): seq_add / seq_div moved cells whose K is still rotated for the
/// old positions): call ops::apply_k_shift first. Attention never reads stale K.
///
/// Cost: rows are grouped by sequence. Work items are (KV head, group of up to 16 query
/// slots, part of one segment of tiles): the slots of one KV head (rows x the query heads
/// of the GQA group) share every K/V read, and each item visits only the tiles that hold
/// cells of its rows' sequences, so a call with many sequences (decode of a batch, or a
/// prefill chunk of one sequence next to decode rows of others: continuous batching)
/// reads what one call per sequence would, in one parallel region.
/// Shared prefixes (cascade attention): tiles whose cells several sequences share (a
/// prefix forked with seq_cp, on contiguous cells or shared paged blocks; at least 1024
/// cells with one same sequence set, see detail_attn::cascade_classes) form a segment of
/// their own, read once for the rows of every sequence of the call that shares them (16
/// slots per K/V read, GEMM-shaped like prefill); each sequence's other tiles are its own
/// segment. A long segment is cut into parts (split-K / flash-decoding). A row's partial
/// softmax states (its segments' parts) are merged by log-sum-exp, in a fixed order, by
/// the thread that finishes the last one.
///
/// Determinism (p.deterministic, the default): a row's output bits depend only on its
/// query, position and sequence, the cells and the params: not on the other rows of the
/// call (other sequences, other rows of its own sequence, prefill or decode shape), nor
/// on n_threads. A row's segments are a function of the cells alone (the cascade classes
/// come from the cells' sequence sets, never from the call's rows: a sequence alone in a
/// call splits its tiles at the same shared-prefix boundary as in a batch of its forks),
/// each segment's split is a function of its tiles (parts of >= 4096 cells), and every
/// score is summed in one order whatever the slot group's size, so cascade attention is
/// on in both modes. With
/// deterministic = false the split follows the threads (more parallelism for few KV
/// heads on many cores) and small slot groups sum scores over several FMA chains.
template <class Cache>
void attention(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos, const seq_id_t* q_seq,
               std::uint32_t n_q, const attention_params& p, float* out, attention_workspace& ws);

/// One attention() call cut into work items that the caller runs (host-driven
/// parallelism: an engine's own thread pool runs the call, no OpenMP involved).
/// Construction checks the arguments as attention() does (throws the same errors,
/// before writing anything), plans the call into ws and writes the rows that see no cell;
/// then run_item(i, scratch) for every i in [0, n_items()), in any order, on any threads
/// (each concurrent caller with its own attention_scratch), then finish(). The outputs
/// are complete after finish() (or once every item has returned), bit-identical to
/// ops::attention with the same params whatever the order and the threads
/// (p.n_threads still picks the split when p.deterministic is false: pass the size of
/// the pool). The plan keeps pointers to cache, q, q_pos, q_seq, out and ws: they must
/// outlive it and stay unchanged until finish(); one live plan per workspace.
template <class Cache>
class attention_plan {
public:
    attention_plan(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos, const seq_id_t* q_seq,
                   std::uint32_t n_q, const attention_params& p, float* out, attention_workspace& ws)
        : attention_plan(cache, layer, q, q_pos, q_seq, n_q, p, out, ws, 1) {}
    attention_plan(const attention_plan&) = delete;
    attention_plan& operator=(const attention_plan&) = delete;

    /// Work items to run (0: nothing to do).
    [[nodiscard]] std::size_t n_items() const noexcept { return n_items_; }
    /// Floats of scratch run_item(i, float*) needs.
    [[nodiscard]] std::size_t scratch_floats() const noexcept { return scratch_floats_; }

    /// Runs item i (< n_items()) on the calling thread with the caller's scratch; items
    /// may run concurrently (distinct i, distinct scratch). Throws invalid_argument for
    /// i >= n_items() (nothing run).
    void run_item(std::size_t i, attention_scratch& scratch) const {
        if (scratch.buf_.size() < scratch_floats_ + 16) scratch.buf_.resize(scratch_floats_ + 16);
        float* b = scratch.buf_.data();
        b += (16 - (reinterpret_cast<std::uintptr_t>(b) / sizeof(float)) % 16) % 16;  // 64-byte aligned
        run_item(i, b);
    }
    /// run_item with raw scratch of scratch_floats() floats.
    void run_item(std::size_t i, float* scratch) const {
        if (i >= n_items_)
            detail::fail(errc::invalid_argument, "attention_plan::run_item: i = " + std::to_string(i) +
                                                     ", must be < n_items() = " + std::to_string(n_items_));
        if (scratch == nullptr) detail::fail(errc::invalid_argument, "attention_plan::run_item: scratch is null");
        run_unchecked(i, scratch);
        std::atomic_ref<std::uint64_t>(ws_->items_done_).fetch_add(1, std::memory_order_relaxed);
    }
    /// Ends the call: checks that every item ran once (throws invalid_argument otherwise).
    void finish() {
        const std::uint64_t done = std::atomic_ref<std::uint64_t>(ws_->items_done_).load(std::memory_order_acquire);
        if (done != n_items_)
            detail::fail(errc::invalid_argument, "attention_plan::finish: " + std::to_string(done) +
                                                     " item runs for n_items() = " + std::to_string(n_items_) +
                                                     " (each item must run exactly once)");
    }

private:
    template <class C>
    friend void attention(const C&, std::uint32_t, const float*, const pos_t*, const seq_id_t*, std::uint32_t,
                          const attention_params&, float*, attention_workspace&);
    using T = typename Cache::storage_type;
    using element = typename Cache::element;

    attention_plan(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos, const seq_id_t* q_seq,
                   std::uint32_t n_q, const attention_params& p, float* out, attention_workspace& ws,
                   int setup_threads);

    void run_unchecked(std::size_t i, float* scratch) const noexcept {
        if (scalar_) {
            kernels::attention_scalar<element>(calls_.kv, scalar_args_, scratch);
            return;
        }
        if (fixed_)
            detail_attn::run_one_item<element, true>(calls_, i, scratch);
        else
            detail_attn::run_one_item<element, false>(calls_, i, scratch);
    }

    attention_workspace* ws_;
    detail_attn::call_items<T> calls_;
    kernels::scalar_attn_args<detail_attn::cell_seqs> scalar_args_{};
    std::size_t n_items_ = 0, scratch_floats_ = 0, max_m_ = 1;
    bool fixed_ = true, scalar_ = false;
};

template <class Cache>
attention_plan<Cache>::attention_plan(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos,
                                      const seq_id_t* q_seq, std::uint32_t n_q, const attention_params& p, float* out,
                                      attention_workspace& ws, int setup_threads)
    : ws_(&ws) {
    static_assert(kv_memory<Cache>, "kvcache: ops::attention needs a kvcache::kv_memory (one K/V cache; for an "
                                    "iswa_cache pass full() or swa() per layer, see kvcache/memory/memory.hpp)");
    detail_attn::check(cache, layer, q, q_pos, q_seq, n_q, p, out);
    ws.items_done_ = 0;
    fixed_ = p.deterministic;
    if (n_q == 0) return;
    const model_shape& s = cache.shape();
    calls_.kv = cache.storage().view(layer);
    if (p.path == kernel_path::scalar) {
        auto& a = scalar_args_;
        a.cell_pos = cache.cells().pos_data();
        a.cell_seqs = detail_attn::cell_seqs{cache.cells().seq_data()};
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
        scalar_ = true;
        n_items_ = 1;
        scratch_floats_ = s.dim_v();
        return;
    }
    const std::uint32_t dk = s.dim_k(), dv = s.dim_v(), hkv = s.n_head_kv, group = p.n_head / hkv;
    const int threads = resolve_threads(p.n_threads);
    kernels::attn_shape& sh = calls_.sh;
    sh.dk = dk;
    sh.dv = dv;
    sh.scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    sh.softcap = p.softcap;
    sh.window = p.window;
    const std::size_t row_floats = std::size_t{p.n_head} * dv;

    const std::uint32_t n = cache.n_window();
    const std::uint32_t n_tiles = (n + k_tile - 1) / k_tile;
    if (n_tiles == 0) {
        std::fill(out, out + std::size_t{n_q} * row_floats, 0.0f);
        return;
    }
    // Per-tile summaries, the sequences of each tile's cells and the cascade classes:
    // rebuilt only when the cells changed since the workspace last built them
    // (cell_table::stamp()), so the layers of one decode step build them once. (Building
    // them reads every cell's position and sequence set: 7-12% of a cold 16K decode call
    // on the Zen 5 VM.)
    const std::uint64_t stamp = cache.cells().stamp();
    const bool tiles_ready = ws.tiles_stamp_ == stamp && ws.tiles_n_ == n;  // (tiles_ then has n_tiles entries)
    ws.tiles_stamp_ = 0;  // (invalid until filled)
    if (!tiles_ready) {
        ws.tiles_.resize(n_tiles);
        ws.tile_seqs_.resize(n_tiles);
        const cell_table& cells = cache.cells();
        kernels::tile_meta* tiles = ws.tiles_.data();
        seq_set* tile_seqs = ws.tile_seqs_.data();
        const auto nt = static_cast<std::int64_t>(n_tiles);
        static_cast<void>(setup_threads);
        // (A parallel region only when it pays for its fork: >= 64K cells.)
        KVCACHE_OMP(parallel for num_threads(setup_threads) schedule(static) if (setup_threads > 1 && nt >= 2048))
        for (std::int64_t t = 0; t < nt; ++t)
            tiles[t] = detail_attn::summarise_tile(cells, n, static_cast<std::uint32_t>(t), tile_seqs[t]);
        ws.cls_.build(tiles, tile_seqs, n_tiles);
    }
    ws.tiles_stamp_ = stamp;
    ws.tiles_n_ = n;
    kernels::attn_meta<detail_attn::cell_seqs>& meta = calls_.meta;
    meta.pos = cache.cells().pos_data();
    meta.seqs = detail_attn::cell_seqs{cache.cells().seq_data()};
    meta.tiles = ws.tiles_.data();

    // The call's sequences (in order of their first row) and each one's rows.
    ws.seq_index_.assign(s.n_seq_max, -1);
    ws.call_seqs_.clear();
    ws.row_first_.clear();
    for (std::uint32_t i = 0; i < n_q; ++i) {
        std::int32_t& x = ws.seq_index_[static_cast<std::size_t>(q_seq[i])];
        if (x < 0) {
            x = static_cast<std::int32_t>(ws.call_seqs_.size());
            ws.call_seqs_.push_back(q_seq[i]);
            ws.row_first_.push_back(0);
        }
        ++ws.row_first_[static_cast<std::size_t>(x)];
    }
    const std::size_t n_cs = ws.call_seqs_.size();
    {
        std::uint32_t sum = 0;  // counts -> first row of each sequence
        for (auto& c : ws.row_first_) sum += std::exchange(c, sum);
        ws.row_first_.push_back(sum);
    }
    ws.rows_.resize(n_q);
    for (std::uint32_t i = 0; i < n_q; ++i)  // (row_first_[x] walks to row_first_[x+1]; shifted back below)
        ws.rows_[ws.row_first_[static_cast<std::size_t>(ws.seq_index_[static_cast<std::size_t>(q_seq[i])])]++] = i;
    for (std::size_t x = n_cs; x > 0; --x) ws.row_first_[x] = ws.row_first_[x - 1];
    ws.row_first_[0] = 0;

    // Each sequence's own tiles: those holding a cell of it and in no cascade class, as
    // ranges of consecutive tiles (a whole contiguous sequence is one range, a paged one
    // its blocks). Other sequences' tiles are never visited.
    const std::int32_t* tile_cls = ws.cls_.tile_cls.data();
    ws.ranges_.clear();
    ws.range_first_.assign(1, 0);
    for (std::size_t x = 0; x < n_cs; ++x) {
        const seq_id_t sq = ws.call_seqs_[x];
        auto own = [&](std::uint32_t t) {
            return tile_cls[t] < 0 && detail_attn::tile_has_seq(ws.tiles_[t], ws.tile_seqs_[t], sq);
        };
        for (std::uint32_t t = 0; t < n_tiles;) {
            if (!own(t)) {
                ++t;
                continue;
            }
            const std::uint32_t t0 = t;
            while (t < n_tiles && own(t)) ++t;
            ws.ranges_.push_back({t0, t});
        }
        ws.range_first_.push_back(ws.ranges_.size());
    }

    // Segments: the cascade classes some sequence of the call shares (class order), then
    // each sequence's own tiles. A row's segments, in this order, are its merge order.
    auto group_m = [](std::size_t left) -> std::uint32_t {
        return left >= 16 ? 16 : left > 4 ? (left > 8 ? 16 : 8) : left > 2 ? 4 : static_cast<std::uint32_t>(left);
    };
    auto rows_of = [&](std::size_t x) { return std::size_t{ws.row_first_[x + 1] - ws.row_first_[x]}; };
    ws.segs_.clear();
    ws.seg_seqs_.clear();
    for (std::size_t c = 0; c + 1 < ws.cls_.first.size(); ++c) {
        attention_workspace::segment sg;
        sg.seq0 = ws.seg_seqs_.size();
        for (std::size_t x = 0; x < n_cs; ++x)
            if (ws.cls_.keys[c].test(ws.call_seqs_[x])) {
                ws.seg_seqs_.push_back(static_cast<std::uint32_t>(x));
                sg.want += rows_of(x) * group;
            }
        sg.seq1 = ws.seg_seqs_.size();
        if (sg.want == 0) continue;
        sg.rg = ws.cls_.ranges.data() + ws.cls_.first[c];
        sg.n_rg = ws.cls_.first[c + 1] - ws.cls_.first[c];
        ws.segs_.push_back(sg);
    }
    for (std::size_t x = 0; x < n_cs; ++x) {
        if (ws.range_first_[x + 1] == ws.range_first_[x]) continue;
        attention_workspace::segment sg;
        sg.seq0 = ws.seg_seqs_.size();
        ws.seg_seqs_.push_back(static_cast<std::uint32_t>(x));
        sg.seq1 = sg.seq0 + 1;
        sg.want = rows_of(x) * group;
        sg.rg = ws.ranges_.data() + ws.range_first_[x];
        sg.n_rg = ws.range_first_[x + 1] - ws.range_first_[x];
        ws.segs_.push_back(sg);
    }
    std::size_t base_items = 0, total_tiles = 0;
    std::uint32_t max_m = 1;
    for (const auto& sg : ws.segs_) {
        for (std::size_t left = sg.want; left > 0;) {
            const std::uint32_t m = group_m(left);
            base_items += hkv;
            max_m = std::max(max_m, m);
            left -= std::min<std::size_t>(left, m);
        }
        for (std::size_t i = 0; i < sg.n_rg; ++i) total_tiles += sg.rg[i].t1 - sg.rg[i].t0;
    }
    {
        const std::size_t kv_bytes = total_tiles * k_tile * hkv * values_bytes<element>(dk + dv);
        detail_attn::set_prefetch(sh, p.prefetch, kv_bytes);
    }
    // Parts per segment, partial states per row (the same for each of its heads) and
    // per target (row x query head).
    ws.row_parts_.assign(n_q, 0);
    for (auto& sg : ws.segs_) {
        std::size_t seg_tiles = 0;
        for (std::size_t i = 0; i < sg.n_rg; ++i) seg_tiles += sg.rg[i].t1 - sg.rg[i].t0;
        sg.n_split = detail_attn::split_count(seg_tiles, base_items, threads, p.deterministic);
        for (std::size_t k = sg.seq0; k < sg.seq1; ++k) {
            const std::size_t x = ws.seg_seqs_[k];
            for (std::size_t r = ws.row_first_[x]; r < ws.row_first_[x + 1]; ++r)
                ws.row_parts_[ws.rows_[r]] += static_cast<std::uint32_t>(sg.n_split);
        }
    }
    const std::size_t n_tgt = std::size_t{n_q} * p.n_head;
    ws.tgt_parts_.resize(n_tgt);
    ws.tgt_first_.resize(n_tgt);
    std::size_t n_off = 0;
    for (std::uint32_t r = 0; r < n_q; ++r) {
        const std::uint32_t np = ws.row_parts_[r];
        if (np == 0)  // the row's sequence holds no cell: it sees nothing
            std::fill(out + r * row_floats, out + (r + 1) * row_floats, 0.0f);
        for (std::uint32_t hd = 0; hd < p.n_head; ++hd) {
            ws.tgt_parts_[std::size_t{r} * p.n_head + hd] = np;
            ws.tgt_first_[std::size_t{r} * p.n_head + hd] = n_off;
            if (np > 1) n_off += np;
        }
    }
    ws.part_off_.resize(n_off);
    ws.tgt_done_.assign(n_tgt, 0);
    ws.row_cur_.assign(n_q, 0);

    // Slots, parts and items.
    ws.slots_.clear();
    ws.slot_tgt_.clear();
    ws.items_.clear();
    ws.split_ranges_.clear();
    ws.split_first_.assign(1, 0);
    std::size_t n_partial = 0;
    for (const auto& sg : ws.segs_) {
        ws.seg_rows_.clear();
        for (std::size_t k = sg.seq0; k < sg.seq1; ++k) {
            const std::size_t x = ws.seg_seqs_[k];
            ws.seg_rows_.insert(ws.seg_rows_.end(), ws.rows_.begin() + ws.row_first_[x],
                                ws.rows_.begin() + ws.row_first_[x + 1]);
        }
        const std::size_t part0 = ws.split_first_.size() - 1;
        detail_attn::cut_parts(sg.rg, sg.n_rg, sg.n_split, ws.split_ranges_, ws.split_first_);
        for (std::uint32_t h = 0; h < hkv; ++h)
            for (std::size_t k0 = 0; k0 < sg.want;) {
                const std::uint32_t m = group_m(sg.want - k0);
                const std::size_t slot = ws.slots_.size();
                bool merges = false;
                for (std::size_t j = 0; j < m; ++j) {
                    kernels::attn_slot sl;
                    sl.q = q;  // padding: reads a real query, sees nothing
                    std::uint32_t tgt = detail_attn::slot_targets::npos;
                    if (k0 + j < sg.want) {
                        const std::size_t k = k0 + j;
                        const std::uint32_t row = ws.seg_rows_[k / group];
                        const std::uint32_t head = h * group + static_cast<std::uint32_t>(k % group);
                        sl.q = q + (std::size_t{row} * p.n_head + head) * dk;
                        sl.qp = q_pos[row];
                        sl.qs = q_seq[row];
                        sl.active = true;
                        tgt = row * p.n_head + head;
                        merges = merges || ws.tgt_parts_[tgt] > 1;
                    }
                    ws.slots_.push_back(sl);
                    ws.slot_tgt_.push_back(tgt);
                }
                for (std::size_t k = 0; k < sg.n_split; ++k) {
                    detail_attn::work_item w;
                    w.h = h;
                    w.m = m;
                    w.slot0 = slot;
                    w.part = part0 + k;
                    if (merges) {
                        w.partial0 = n_partial;
                        for (std::size_t j = 0; j < m; ++j) {
                            const std::uint32_t tgt = ws.slot_tgt_[slot + j];
                            if (tgt == detail_attn::slot_targets::npos || ws.tgt_parts_[tgt] < 2) continue;
                            ws.part_off_[ws.tgt_first_[tgt] + ws.row_cur_[tgt / p.n_head] + k] =
                                n_partial + j * (dv + 2);
                        }
                        n_partial += std::size_t{m} * (dv + 2);
                    }
                    ws.items_.push_back(w);
                }
                k0 += m;
            }
        for (std::uint32_t row : ws.seg_rows_) ws.row_cur_[row] += static_cast<std::uint32_t>(sg.n_split);
    }
    if (ws.partial_.size() < n_partial) ws.partial_.resize(n_partial);

    constexpr bool in_place = kvcache::detail::has_simd_storage<element>;
    const std::size_t stage = in_place ? 0 : std::size_t{k_tile} * (dk + dv);
    max_m_ = max_m;
    scratch_floats_ = detail_attn::item_scratch_floats(max_m, dk, dv, stage);
    n_items_ = ws.items_.size();
    calls_.slots = ws.slots_.data();
    calls_.items = ws.items_.data();
    calls_.n_items = n_items_;
    calls_.split_ranges = ws.split_ranges_.data();
    calls_.split_first = ws.split_first_.data();
    calls_.tg.tgt = ws.slot_tgt_.data();
    calls_.tg.parts = ws.tgt_parts_.data();
    calls_.tg.first = ws.tgt_first_.data();
    calls_.tg.off = ws.part_off_.data();
    calls_.tg.done = ws.tgt_done_.data();
    calls_.tg.partial = ws.partial_.data();
    calls_.tg.out = out;
}

/// ops::attention (see its documentation above attention_plan): the plan's items run on
/// p.n_threads OpenMP threads.
template <class Cache>
void attention(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos, const seq_id_t* q_seq,
               std::uint32_t n_q, const attention_params& p, float* out, attention_workspace& ws) {
    const int threads = p.path == kernel_path::scalar ? 1 : resolve_threads(p.n_threads);
    const attention_plan<Cache> plan(cache, layer, q, q_pos, q_seq, n_q, p, out, ws, threads);
    const std::size_t n_items = plan.n_items();
    if (n_items == 0) return;
    // Per-thread scratch: each thread's part starts on a 4 KiB boundary and ends with a
    // 4 KiB gap. Packed back to back, one core's hardware prefetchers, running past the
    // end of its own buffers, pulled in the next thread's accumulator lines, which that
    // core then had to take back on every store: 512 x 512 prefill on 2 threads of a
    // Zen 5 ran ~20% slower than two single-thread processes side by side.
    constexpr std::size_t page = 4096 / sizeof(float);
    const int used = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads), n_items));
    const std::size_t per_thread = (plan.scratch_floats() + page - 1) / page * page + page;
    if (ws.scratch_.size() < per_thread * static_cast<std::size_t>(used) + page)
        ws.scratch_.resize(per_thread * static_cast<std::size_t>(used) + page);
    float* scratch = ws.scratch_.data();
    scratch += (page - (reinterpret_cast<std::uintptr_t>(scratch) / sizeof(float)) % page) % page;
    if (used <= 1) {
        // No parallel region at all: entering one costs microseconds even with one thread.
        for (std::size_t i = 0; i < n_items; ++i) plan.run_unchecked(i, scratch);
        return;
    }
    const auto n = static_cast<std::int64_t>(n_items);
    // nowait: the region's end is the only barrier after the items. With
    // OMP_WAIT_POLICY=passive each barrier can cost a sleeping thread's wake-up; one
    // barrier less per call (two with split-K, whose merge needed one of its own) made
    // 1K-cell decode on 2 threads of the Zen 5 VM 1.12-1.18x faster, 4K 1.03x.
    KVCACHE_OMP(parallel num_threads(used))
    {
        int tid = 0;
#if defined(_OPENMP)
        tid = omp_get_thread_num();
#endif
        float* mine = scratch + static_cast<std::size_t>(tid) * per_thread;
        KVCACHE_OMP(for schedule(dynamic, 1) nowait)
        for (std::int64_t it = 0; it < n; ++it) plan.run_unchecked(static_cast<std::size_t>(it), mine);
    }
}

}  // namespace ops
KVCACHE_END_NAMESPACE
