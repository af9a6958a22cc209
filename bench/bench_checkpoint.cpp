// The cost of the strong guarantee (issue 25): every mutating sequence operation and every
// placement saves a checkpoint of the cache's metadata (cell table, the layout's tables,
// the slot-search head) before it changes anything, so that a refusal or a throw puts
// everything back. There is no bare path to compare with, so each row times the
// operation (checkpoint included) and, in the same run, the checkpoint step alone
// (save_checkpoint into a reused checkpoint, what the operation does), and reports
// ckpt_frac = checkpoints per operation x checkpoint time / operation time.
//
// checkpoint/<op>/<layout>/n_cells:4096
//     A 32-layer f16 cache (1 KV head, head_dim 64: the checkpoint holds no K/V, so the
//     head shape only sizes the copies of seq_cp's copy-on-write) with 4 sequences of 768
//     tokens (sequence 3 shares 0's first 512 cells), on the contiguous and paged<32>
//     layouts. Every timed iteration runs a pair of operations that returns the cache to
//     where it was:
//       seq_cp_rm:    seq_cp(0 -> 4, all) + seq_rm(4, all)
//       seq_add:      seq_add(1, 256, end, +8) + seq_add(1, 256, end, -8)
//       place_commit: place 16 tokens after sequence 2's end + commit + seq_rm of them
//     Counters (thread CPU time, not wall time): op_us (the pair), ckpt_us (one checkpoint,
//     timed right after), n_ckpt (checkpoints the pair takes), ckpt_frac = n_ckpt x
//     ckpt_us / op_us: the share of the pair's time the guarantee costs.
//
// checkpoint/decode_step/<layout>/n_cells:N
//     One decode step's bookkeeping on a 1-layer f16 cache whose cells are nearly all used
//     by 4 sequences (N / 4 - 64 tokens each): place one token for each sequence + commit,
//     then seq_rm of the four (the cache returns to where it was). A checkpoint is now a
//     rollback point whose changes are journaled (cell_table::mark); until 2026-11-29 it
//     was a copy of the cell table, which is timed in the same run: copy_us (one copy into
//     a reused table, as the checkpoints did), step_us (the step: 6 checkpoints),
//     vs_copy = copy_us / step_us (how many whole steps one old checkpoint paid for).
#include <benchmark/benchmark.h>

#include <kvcache/element/f16.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/memory/kv_cache.hpp>

#include <algorithm>

#include <cstdint>
#include <ctime>
#include <numeric>
#include <vector>

namespace {

using kvcache::pos_t;
using kvcache::seq_id_t;

constexpr std::uint32_t ckpt_n_cells = 4096, ckpt_n_layer = 32, ckpt_tokens = 768;

kvcache::model_shape ckpt_shape() {
    kvcache::model_shape s;
    s.n_layer = ckpt_n_layer;
    s.n_head_kv = 1;
    s.head_dim_k = 64;
    s.n_cells = ckpt_n_cells;
    s.n_seq_max = 8;
    return s;
}

/// Places positions [from, to) of sequence s (one micro-batch) and commits.
template <class Cache>
void ckpt_append(Cache& c, seq_id_t s, pos_t from, pos_t to) {
    std::vector<pos_t> pos(static_cast<std::size_t>(to - from));
    std::iota(pos.begin(), pos.end(), from);
    const std::vector<seq_id_t> seqs(pos.size(), s);
    static_cast<void>(c.place(pos, seqs).value());
    static_cast<void>(c.commit());
}

/// Sequences 0, 1, 2 of ckpt_tokens tokens each, sequence 3 sharing 0's first 512 cells.
template <class Cache>
void ckpt_fill(Cache& c) {
    for (pos_t p = 0; p < static_cast<pos_t>(ckpt_tokens); p += 64)  // interleaved chunks: realistic tables
        for (seq_id_t s = 0; s < 3; ++s) ckpt_append(c, s, p, p + 64);
    c.seq_cp(0, 3, 0, 512).value();
}

/// CPU seconds of this thread: both sides of the ratio, so that other processes on a
/// shared machine do not count (wall time ran 6x CPU time on the contended 2-core VM).
double ckpt_cpu_now() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

enum class ckpt_op { seq_cp_rm, seq_add, place_commit };

/// Seconds of one save_checkpoint into a reused checkpoint (what an operation does).
template <class Cache>
double ckpt_time(const Cache& c) {
    typename Cache::checkpoint cp;
    c.save_checkpoint(cp, kvcache::detail::internal_access{});  // first: allocates
    constexpr int reps = 200;
    const double t0 = ckpt_cpu_now();
    for (int i = 0; i < reps; ++i) {
        c.save_checkpoint(cp, kvcache::detail::internal_access{});
        benchmark::DoNotOptimize(cp);
    }
    return (ckpt_cpu_now() - t0) / reps;
}

template <class Cache, ckpt_op Op>
void BM_checkpoint(benchmark::State& state) {
    Cache c(ckpt_shape());
    ckpt_fill(c);
    std::vector<pos_t> pos(16);
    std::iota(pos.begin(), pos.end(), static_cast<pos_t>(ckpt_tokens));
    const std::vector<seq_id_t> seqs(pos.size(), 2);
    // seq_cp + seq_rm, seq_add + seq_add, place (the transaction's checkpoint) + seq_rm
    // (commit takes none on these layouts)
    const double n_ckpt = 2;
    const double t0 = ckpt_cpu_now();
    std::int64_t n = 0;
    for (auto _ : state) {
        if constexpr (Op == ckpt_op::seq_cp_rm) {
            c.seq_cp(0, 4, -1, -1).value();
            c.seq_rm(4, -1, -1).value();
        } else if constexpr (Op == ckpt_op::seq_add) {
            c.seq_add(1, 256, -1, 8).value();
            c.seq_add(1, 256 + 8, -1, -8).value();
        } else {
            static_cast<void>(c.place(pos, seqs).value());
            static_cast<void>(c.commit());
            c.seq_rm(2, static_cast<pos_t>(ckpt_tokens), -1).value();
        }
        ++n;
    }
    const double op_s = (ckpt_cpu_now() - t0) / double(n);
    const double ck_s = ckpt_time(c);
    state.counters["op_us"] = op_s * 1e6;
    state.counters["ckpt_us"] = ck_s * 1e6;
    state.counters["n_ckpt"] = n_ckpt;
    state.counters["ckpt_frac"] = n_ckpt * ck_s / op_s;
}

template <class Cache>
void BM_decode_step(benchmark::State& state) {
    const auto n_cells = static_cast<std::uint32_t>(state.range(0));
    kvcache::model_shape s = ckpt_shape();
    s.n_layer = 1;
    s.n_cells = n_cells;
    Cache c(s);
    const pos_t per = static_cast<pos_t>(n_cells / 4 - 64);
    for (pos_t p = 0; p < per; p += 512)
        for (seq_id_t q = 0; q < 4; ++q) ckpt_append(c, q, p, std::min<pos_t>(p + 512, per));
    const std::vector<pos_t> pos(4, per);
    const std::vector<seq_id_t> seqs = {0, 1, 2, 3};
    const double t0 = ckpt_cpu_now();
    std::int64_t n = 0;
    for (auto _ : state) {
        static_cast<void>(c.place(pos, seqs).value());
        static_cast<void>(c.commit());
        for (seq_id_t q = 0; q < 4; ++q) c.seq_rm(q, per, -1).value();
        ++n;
    }
    const double step_s = (ckpt_cpu_now() - t0) / double(n);
    kvcache::cell_table copy = c.cells();  // first copy allocates; the timed ones reuse nodes
    constexpr int reps = 20;
    const double t1 = ckpt_cpu_now();
    for (int i = 0; i < reps; ++i) {
        copy = c.cells();
        benchmark::DoNotOptimize(copy);
    }
    const double copy_s = (ckpt_cpu_now() - t1) / reps;
    state.counters["step_us"] = step_s * 1e6;
    state.counters["copy_us"] = copy_s * 1e6;
    state.counters["vs_copy"] = copy_s / step_s;
}

using ckpt_contig = kvcache::kv_cache<kvcache::f16>;
using ckpt_paged = kvcache::kv_cache<kvcache::f16, kvcache::paged<32>>;

BENCHMARK(BM_checkpoint<ckpt_contig, ckpt_op::seq_cp_rm>)->Name("checkpoint/seq_cp_rm/contiguous/n_cells:4096");
BENCHMARK(BM_checkpoint<ckpt_paged, ckpt_op::seq_cp_rm>)->Name("checkpoint/seq_cp_rm/paged<32>/n_cells:4096");
BENCHMARK(BM_checkpoint<ckpt_contig, ckpt_op::seq_add>)->Name("checkpoint/seq_add/contiguous/n_cells:4096");
BENCHMARK(BM_checkpoint<ckpt_paged, ckpt_op::seq_add>)->Name("checkpoint/seq_add/paged<32>/n_cells:4096");
BENCHMARK(BM_checkpoint<ckpt_contig, ckpt_op::place_commit>)->Name("checkpoint/place_commit/contiguous/n_cells:4096");
BENCHMARK(BM_checkpoint<ckpt_paged, ckpt_op::place_commit>)->Name("checkpoint/place_commit/paged<32>/n_cells:4096");
BENCHMARK(BM_decode_step<ckpt_contig>)->Name("checkpoint/decode_step/contiguous")->ArgName("n_cells")->Arg(4096)->Arg(32768)->Arg(131072);
BENCHMARK(BM_decode_step<ckpt_paged>)->Name("checkpoint/decode_step/paged<32>")->ArgName("n_cells")->Arg(4096)->Arg(32768)->Arg(131072);

}  // namespace
