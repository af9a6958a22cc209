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
        return tiles_.capacity() * sizeof(kernels::tile_meta) + tile_seqs_.capacity() * sizeof(seq_set) +
               slots_.capacity() * sizeof(kernels::attn_slot) + ranges_.capacity() * sizeof(kernels::tile_range) +
               range_first_.capacity() * sizeof(std::size_t) + split_ranges_.capacity() * sizeof(kernels::tile_range) +
               split_first_.capacity() * sizeof(std::size_t) + items_.capacity() * sizeof(detail_attn::work_item) +
               seq_index_.capacity() * sizeof(std::int32_t) + call_seqs_.capacity() * sizeof(seq_id_t) +
               row_first_.capacity() * sizeof(std::uint32_t) + rows_.capacity() * sizeof(std::uint32_t) +
               scratch_.capacity() * sizeof(float) + partial_.capacity() * sizeof(float) +
               parts_done_.capacity() * sizeof(std::uint32_t) + out_rows_.capacity() * sizeof(float*);
    }

private:
    template <class Cache>
    friend void attention(const Cache&, std::uint32_t, const float*, const pos_t*, const seq_id_t*, std::uint32_t,
                          const attention_params&, float*, attention_workspace&);

    std::vector<kernels::tile_meta> tiles_;           // per tile of [0, n): occupancy / position / sequence summary
    std::vector<seq_set> tile_seqs_;                  // per tile: the sequences of its cells
    std::uint64_t tiles_stamp_ = 0;                   // cell_table::stamp() tiles_ was built from (0: none)
    std::uint32_t tiles_n_ = 0;                       // ... and the n it covered
    std::vector<std::int32_t> seq_index_;             // per sequence id: its index in call_seqs_ (-1: not in the call)
    std::vector<seq_id_t> call_seqs_;                 // the call's sequences, in order of first row
    std::vector<std::uint32_t> row_first_;            // sequence i's rows: rows_[row_first_[i], row_first_[i+1])
    std::vector<std::uint32_t> rows_;                 // the rows grouped by sequence (in row order within one)
    std::vector<kernels::tile_range> ranges_;         // sequence i's tiles: ranges_[range_first_[i], [i+1])
    std::vector<std::size_t> range_first_;
    std::vector<kernels::tile_range> split_ranges_;   // the parts' ranges
    std::vector<std::size_t> split_first_;            // part k's ranges: [split_first_[k], split_first_[k+1])
    std::vector<detail_attn::work_item> items_;       // the call's work items
    std::vector<kernels::attn_slot> slots_;           // the items' slots, each item's M in a row
    std::vector<float*> out_rows_;                    // per slot: where its output row goes (null: padding)
    std::vector<float> scratch_;                      // per thread: accumulators, p, transposed-V rows
    std::vector<float> partial_;                      // split-K: per group n_split x M x (dv + 2) partial states
    std::vector<std::uint32_t> parts_done_;           // split-K: per group, parts finished (atomic_ref)
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
/// Refuses (invalid_argument, nothing written) a cache with pending K-shifts
/// (cache.has_shift(): seq_add / seq_div moved cells whose K is still rotated for the
/// old positions): call ops::apply_k_shift first. Attention never reads stale K.
///
/// Cost: rows are grouped by sequence. Work items are (KV head, group of up to 16 query
/// slots of one sequence, part of that sequence's tiles): the slots of one sequence and
/// KV head (its rows x the query heads of the GQA group) share every K/V read, and each
/// item visits only the tiles that hold cells of its sequence, so a call with many
/// sequences (decode of a batch, or a prefill chunk of one sequence next to decode rows
/// of others: continuous batching) reads what one call per sequence would, in one
/// parallel region. A long sequence's tiles are cut into parts whose partial softmax
/// states are merged by the thread that finishes the last one (split-K / flash-decoding).
///
/// Determinism (p.deterministic, the default): a row's output bits depend only on its
/// query, position and sequence, the cells and the params: not on the other rows of the
/// call (other sequences, other rows of its own sequence, prefill or decode shape), nor
/// on n_threads. Each sequence's split is a function of its own tiles (parts of >= 4096
/// cells), and every score is summed in one order whatever the slot group's size. With
/// deterministic = false the split follows the threads (more parallelism for few KV
/// heads on many cores) and small slot groups sum scores over several FMA chains.
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
    const std::size_t row_floats = std::size_t{p.n_head} * dv;

    const std::uint32_t n = cache.n_window();
    const std::uint32_t n_tiles = (n + k_tile - 1) / k_tile;
    if (n_tiles == 0) {
        std::fill(out, out + std::size_t{n_q} * row_floats, 0.0f);
        return;
    }
    // Per-tile summaries and the sequences of each tile's cells: rebuilt only when the
    // cells changed since the workspace last built them (cell_table::stamp()), so the
    // layers of one decode step build them once. (Building them reads every cell's
    // position and sequence set: 7-12% of a cold 16K decode call on the Zen 5 VM.)
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
        // (A parallel region only when it pays for its fork: >= 64K cells.)
        KVCACHE_OMP(parallel for num_threads(threads) schedule(static) if (threads > 1 && nt >= 2048))
        for (std::int64_t t = 0; t < nt; ++t)
            tiles[t] = detail_attn::summarise_tile(cells, n, static_cast<std::uint32_t>(t), tile_seqs[t]);
    }
    kernels::attn_meta<detail_attn::cell_seqs> meta;
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

    // Each sequence's tiles: those holding a cell of it, as ranges of consecutive tiles
    // (a whole contiguous sequence is one range, a paged one its blocks). Other
    // sequences' tiles are never visited.
    ws.ranges_.clear();
    ws.range_first_.assign(1, 0);
    std::size_t total_tiles = 0;
    for (std::size_t x = 0; x < n_cs; ++x) {
        const seq_id_t sq = ws.call_seqs_[x];
        std::size_t count = 0;
        for (std::uint32_t t = 0; t < n_tiles;) {
            if (!detail_attn::tile_has_seq(ws.tiles_[t], ws.tile_seqs_[t], sq)) {
                ++t;
                continue;
            }
            const std::uint32_t t0 = t;
            while (t < n_tiles && detail_attn::tile_has_seq(ws.tiles_[t], ws.tile_seqs_[t], sq)) ++t;
            ws.ranges_.push_back({t0, t});
            count += t - t0;
        }
        ws.range_first_.push_back(ws.ranges_.size());
        total_tiles += count;
    }

    // Groups (sequence, KV head, up to 16 slots): a sequence's slots (its rows x the
    // query heads of the GQA group) in groups of 16, the last one of 1, 2, 4, 8 or 16.
    auto group_m = [](std::size_t left) -> std::uint32_t {
        return left >= 16 ? 16 : left > 4 ? (left > 8 ? 16 : 8) : left > 2 ? 4 : static_cast<std::uint32_t>(left);
    };
    std::size_t base_items = 0, n_slots = 0;
    std::uint32_t max_m = 1;
    for (std::size_t x = 0; x < n_cs; ++x) {
        if (ws.range_first_[x + 1] == ws.range_first_[x]) continue;  // no cell: zeros (below)
        for (std::size_t left = std::size_t{ws.row_first_[x + 1] - ws.row_first_[x]} * group; left > 0;) {
            const std::uint32_t m = group_m(left);
            base_items += hkv;
            n_slots += std::size_t{m} * hkv;
            max_m = std::max(max_m, m);
            left -= std::min<std::size_t>(left, m);
        }
    }
    {
        const std::size_t kv_bytes = total_tiles * k_tile * hkv * (dk + dv) * sizeof(T);
        const prefetch_mode pm = detail_attn::resolve_prefetch(p.prefetch, max_m, kv_bytes);
        sh.burst_prefetch = pm == prefetch_mode::burst;
        sh.interleaved_prefetch = pm == prefetch_mode::interleaved;
    }

    // Slots, parts and items.
    ws.slots_.assign(n_slots, kernels::attn_slot{});
    ws.out_rows_.assign(n_slots, nullptr);
    ws.items_.clear();
    ws.split_ranges_.clear();
    ws.split_first_.assign(1, 0);
    std::size_t n_groups = 0, n_partial = 0, slot = 0;
    for (std::size_t x = 0; x < n_cs; ++x) {
        const std::uint32_t* rows = ws.rows_.data() + ws.row_first_[x];
        const std::size_t want = std::size_t{ws.row_first_[x + 1] - ws.row_first_[x]} * group;
        const kernels::tile_range* rg = ws.ranges_.data() + ws.range_first_[x];
        const std::size_t n_rg = ws.range_first_[x + 1] - ws.range_first_[x];
        if (n_rg == 0) {  // the sequence holds no cell: its rows see nothing
            for (std::size_t r = ws.row_first_[x]; r < ws.row_first_[x + 1]; ++r)
                std::fill(out + ws.rows_[r] * row_floats, out + (ws.rows_[r] + 1) * row_floats, 0.0f);
            continue;
        }
        std::size_t seq_tiles = 0;
        for (std::size_t i = 0; i < n_rg; ++i) seq_tiles += rg[i].t1 - rg[i].t0;
        const std::size_t n_split = detail_attn::split_count(seq_tiles, base_items, threads, p.deterministic);
        const std::size_t part0 = ws.split_first_.size() - 1;
        detail_attn::cut_parts(rg, n_rg, n_split, ws.split_ranges_, ws.split_first_);
        for (std::uint32_t h = 0; h < hkv; ++h)
            for (std::size_t k0 = 0; k0 < want;) {
                const std::uint32_t m = group_m(want - k0);
                for (std::size_t j = 0; j < m && k0 + j < want; ++j) {
                    const std::size_t k = k0 + j;
                    const std::uint32_t row = rows[k / group];
                    const std::uint32_t head = h * group + static_cast<std::uint32_t>(k % group);
                    kernels::attn_slot& sl = ws.slots_[slot + j];
                    sl.q = q + (std::size_t{row} * p.n_head + head) * dk;
                    sl.qp = q_pos[row];
                    sl.qs = q_seq[row];
                    sl.active = true;
                    ws.out_rows_[slot + j] = out + row * row_floats + std::size_t{head} * dv;
                }
                for (std::size_t j = want - k0 < m ? want - k0 : m; j < m; ++j)
                    ws.slots_[slot + j].q = q;  // padding: reads a real query, sees nothing
                for (std::size_t k = 0; k < n_split; ++k) {
                    detail_attn::work_item w;
                    w.h = h;
                    w.m = m;
                    w.slot0 = slot;
                    w.part = part0 + k;
                    w.k = static_cast<std::uint32_t>(k);
                    w.n_split = static_cast<std::uint32_t>(n_split);
                    w.group = n_groups;
                    w.partial0 = n_partial;
                    ws.items_.push_back(w);
                }
                ++n_groups;
                if (n_split > 1) n_partial += n_split * m * (dv + 2);
                slot += m;
                k0 += m;
            }
    }

    // Per-thread scratch: each thread's part starts on a 4 KiB boundary and ends with a
    // 4 KiB gap. Packed back to back, one core's hardware prefetchers, running past the
    // end of its own buffers, pulled in the next thread's accumulator lines, which that
    // core then had to take back on every store: 512 x 512 prefill on 2 threads of a
    // Zen 5 ran ~20% slower than two single-thread processes side by side.
    constexpr std::size_t page = 4096 / sizeof(float);
    // (+ the generic path's two converted tiles, k_tile x (dk + dv) floats; 0 for f32/f16/bf16)
    constexpr bool in_place = kvcache::detail::has_simd_storage<typename Cache::element>;
    const std::size_t stage = in_place ? 0 : std::size_t{k_tile} * (dk + dv);
    const std::size_t M = max_m;
    const std::size_t need = M * dv + M * k_tile + std::size_t{k_tile} * dv + M * dk + 16 + stage;
    const std::size_t per_thread = (need + page - 1) / page * page + page;
    if (ws.scratch_.size() < per_thread * static_cast<std::size_t>(threads) + page)
        ws.scratch_.resize(per_thread * static_cast<std::size_t>(threads) + page);
    float* scratch = ws.scratch_.data();
    scratch += (page - (reinterpret_cast<std::uintptr_t>(scratch) / sizeof(float)) % page) % page;
    if (ws.partial_.size() < n_partial) ws.partial_.resize(n_partial);
    ws.parts_done_.assign(n_groups, 0);

    const kv_layer_view<const T> kv = cache.storage().view(layer);
    auto run = [&](auto fixed) {
        detail_attn::run_items<typename Cache::element, decltype(fixed)::value>(
            kv, meta, sh, ws.slots_.data(), ws.out_rows_.data(), ws.items_.data(), ws.items_.size(),
            ws.split_ranges_.data(), ws.split_first_.data(), scratch, per_thread, ws.partial_.data(),
            ws.parts_done_.data(), threads);
    };
    if (p.deterministic)
        run(std::true_type{});
    else
        run(std::false_type{});
    ws.tiles_stamp_ = stamp;
    ws.tiles_n_ = n;
}

}  // namespace ops
KVCACHE_END_NAMESPACE
