// Layout benchmarks.
//
// attn_decode_paged/<type>/n_kv:16384/threads:<t>
//     One decode query (32 heads, 8 KV heads, head_dim 128) over sequence 0's 16384
//     tokens in a paged<32> cache where sequence 0 and sequence 1 were appended in
//     interleaved chunks of 32 tokens (so sequence 0's blocks are scattered), against
//     the same query over a contiguous cache holding the same 16384 tokens, timed
//     alternately in the same run. Counters: bw_frac (sequence 0's K/V bytes per second
//     over measure_read_bw(t)), ratio = contiguous time / paged time (1 = as fast).
// defrag/<type>/n_cells:16384/threads:<t>
//     ops::defrag of a cache where every other 64-cell run was removed (fragmentation
//     0.5; 8 layers, 8 KV heads, head_dim 128). Counters: bytes_per_second (K/V bytes
//     moved per second), bw_frac (bytes read + written over measure_copy_bw(t)).
// memory_waste/<layout>
//     Replays a mixed serving workload (requests of random length, decode steps, forks
//     for parallel sampling, removals) on a 65536-cell cache and reports the mean of
//     waste = (held - used) / held sampled after every step (ops::memory), next to a
//     static-slot baseline (each live sequence reserving the 2048-token maximum, as a
//     server splitting n_ctx between slots does).
#include <benchmark/benchmark.h>

#include <kvcache/element/f16.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/ops/attention.hpp>
#include <kvcache/ops/defrag.hpp>
#include <kvcache/ops/memory.hpp>

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

namespace kb = kvcache::bench;
using kvcache::pos_t;
using kvcache::seq_id_t;

constexpr std::uint32_t head_dim = 128, n_head = 32, n_head_kv = 8;

kvcache::model_shape shape_for(std::uint32_t n_cells, std::uint32_t n_layer, std::uint32_t n_seq) {
    kvcache::model_shape s;
    s.n_layer = n_layer;
    s.n_head_kv = n_head_kv;
    s.head_dim_k = head_dim;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    return s;
}

/// Fills every layer's K/V buffer with small pseudo-random values (the whole buffer:
/// content does not matter for timing, but must be finite).
template <class Cache>
void fill_kv(Cache& c) {
    using T = typename Cache::storage_type;
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> tmp(4096);
    for (auto& x : tmp) x = u(rng);
    std::vector<T> conv(tmp.size());
    Cache::element::from_float(tmp.data(), conv.data(), tmp.size());
    for (std::uint32_t l = 0; l < c.shape().n_layer; ++l) {
        auto v = c.storage().view(l);
        const std::size_t nk = v.k_head_stride * v.n_head_kv, nv = v.v_head_stride * v.n_head_kv;
        for (std::size_t i = 0; i < nk; ++i) v.k[i] = conv[i % conv.size()];
        for (std::size_t i = 0; i < nv; ++i) v.v[i] = conv[(i * 7) % conv.size()];
    }
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// ------------------------------------------------------------- attention, paged vs contiguous

template <class E>
void attn_decode_paged(benchmark::State& state, std::uint32_t n_kv, int threads) {
    using T = typename E::storage_type;
    const std::size_t seq_bytes = std::size_t{n_kv} * n_head_kv * head_dim * 2 * sizeof(T);  // K + V of seq 0
    // Enough layers that the paged cache's working set exceeds the yardstick buffer (cold).
    const auto n_layer = static_cast<std::uint32_t>(std::clamp<std::size_t>(kb::bench_buffer_bytes() / (2 * seq_bytes) + 1, 2, 16));
    constexpr std::uint32_t chunk = 32;
    kvcache::kv_cache<E, kvcache::paged<32>> paged(shape_for(2 * n_kv, n_layer, 2));
    kvcache::kv_cache<E> contig(shape_for(n_kv, n_layer, 1));
    std::vector<pos_t> pos(chunk);
    for (std::uint32_t p0 = 0; p0 < n_kv; p0 += chunk) {
        std::iota(pos.begin(), pos.end(), static_cast<pos_t>(p0));
        for (seq_id_t s = 0; s < 2; ++s) {
            std::vector<seq_id_t> seq(chunk, s);
            static_cast<void>(paged.place(pos, seq).value());
            paged.commit();
        }
        std::vector<seq_id_t> seq(chunk, 0);
        static_cast<void>(contig.place(pos, seq).value());
        contig.commit();
    }
    fill_kv(paged);
    fill_kv(contig);
    std::vector<float> q(std::size_t{n_head} * head_dim);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& x : q) x = u(rng);
    std::vector<float> out(q.size());
    const pos_t qp = static_cast<pos_t>(n_kv);
    const seq_id_t qs = 0;
    kvcache::ops::attention_params p;
    p.n_head = n_head;
    p.n_threads = threads;
    kvcache::ops::attention_workspace ws_p, ws_c;
    kvcache::ops::attention(paged, 0, q.data(), &qp, &qs, 1, p, out.data(), ws_p);
    kvcache::ops::attention(contig, 0, q.data(), &qp, &qs, 1, p, out.data(), ws_c);
    double t_paged = 0.0, t_contig = 0.0;
    std::uint32_t layer = 0;
    for (auto _ : state) {
        const double t0 = now_s();
        kvcache::ops::attention(paged, layer, q.data(), &qp, &qs, 1, p, out.data(), ws_p);
        const double t1 = now_s();
        benchmark::DoNotOptimize(out.data());
        kvcache::ops::attention(contig, layer, q.data(), &qp, &qs, 1, p, out.data(), ws_c);
        const double t2 = now_s();
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        t_paged += t1 - t0;
        t_contig += t2 - t1;
        state.SetIterationTime(t1 - t0);
        layer = layer + 1 == n_layer ? 0 : layer + 1;
    }
    const double iters = static_cast<double>(state.iterations());
    state.SetBytesProcessed(static_cast<std::int64_t>(static_cast<double>(seq_bytes) * iters));
    state.counters["threads"] = threads;
    state.counters["bw_frac"] = static_cast<double>(seq_bytes) * iters / t_paged / kb::measure_read_bw(threads, true);
    state.counters["ratio"] = t_contig / t_paged;
}

// ------------------------------------------------------------- defrag

template <class E>
void defrag_bench(benchmark::State& state, int threads) {
    constexpr std::uint32_t n_cells = 16384, run = 64, n_layer = 8;
    kvcache::kv_cache<E> cache(shape_for(n_cells, n_layer, 2));
    fill_kv(cache);
    std::vector<pos_t> pos(run);
    std::size_t moved = 0;
    double secs = 0.0;
    for (auto _ : state) {
        state.PauseTiming();
        cache.clear();
        for (std::uint32_t p0 = 0; p0 < n_cells / 2; p0 += run) {
            std::iota(pos.begin(), pos.end(), static_cast<pos_t>(p0));
            for (seq_id_t s = 0; s < 2; ++s) {
                std::vector<seq_id_t> seq(run, s);
                static_cast<void>(cache.place(pos, seq).value());
                cache.commit();
            }
        }
        cache.seq_rm(1, -1, -1).value();  // every other run of 64 cells is a hole
        state.ResumeTiming();
        kvcache::ops::defrag_params p;
        p.n_threads = threads;
        const double t0 = now_s();
        const auto r = kvcache::ops::defrag(cache, p);
        secs += now_s() - t0;
        moved += r.bytes_moved;
    }
    state.counters["threads"] = threads;
    state.counters["bytes_per_second"] = static_cast<double>(moved) / secs;  // wall clock of the defrag calls
    state.counters["bw_frac"] = 2.0 * static_cast<double>(moved) / secs / kb::measure_copy_bw(threads, true);
}

// ------------------------------------------------------------- memory waste replay

struct waste_stats {
    double layout = 0.0, static_slots = 0.0;
};

template <class Cache>
waste_stats replay(std::uint32_t seed) {
    constexpr std::uint32_t n_cells = 65536, n_seq = 64, max_len = 2048;
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 16;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    Cache cache(s);
    std::mt19937 rng(seed);
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    std::vector<std::uint32_t> target(n_seq, 0);  // tokens the sequence will reach; 0 = idle slot
    double sum_layout = 0.0, sum_static = 0.0;
    int samples = 0;
    for (int step = 0; step < 4000; ++step) {
        const int op = pick(0, 99);
        const seq_id_t sid = pick(0, n_seq - 1);
        const auto s_idx = static_cast<std::size_t>(sid);
        if (op < 10 && target[s_idx] == 0) {  // new request: prefill a prompt of random length
            const auto len = static_cast<std::uint32_t>(pick(16, 1500));
            std::vector<pos_t> pos(len);
            std::iota(pos.begin(), pos.end(), 0);
            std::vector<seq_id_t> seq(len, sid);
            if (cache.place(pos, seq).ok()) {
                cache.commit();
                target[s_idx] = std::min<std::uint32_t>(max_len, len + static_cast<std::uint32_t>(pick(1, 500)));
            }
        } else if (op < 14 && target[s_idx] != 0) {  // fork for parallel sampling into an idle slot
            for (seq_id_t d = 0; d < static_cast<seq_id_t>(n_seq); ++d)
                if (target[static_cast<std::size_t>(d)] == 0) {
                    cache.seq_cp(sid, d, -1, -1).value();
                    target[static_cast<std::size_t>(d)] = target[s_idx];
                    break;
                }
        } else if (op < 16 && target[s_idx] != 0) {  // cancelled request
            cache.seq_rm(sid, -1, -1).value();
            target[s_idx] = 0;
        } else {  // one decode step for every live sequence; finished ones leave
            for (seq_id_t q = 0; q < static_cast<seq_id_t>(n_seq); ++q) {
                auto& t = target[static_cast<std::size_t>(q)];
                if (t == 0) continue;
                const pos_t p = cache.seq_pos_max(q) + 1;
                if (static_cast<std::uint32_t>(p) >= t) {
                    cache.seq_rm(q, -1, -1).value();
                    t = 0;
                    continue;
                }
                const seq_id_t one = q;
                if (cache.place(std::span<const pos_t>(&p, 1), std::span<const seq_id_t>(&one, 1)).ok()) cache.commit();
            }
        }
        const auto m = kvcache::ops::memory(cache);
        std::uint32_t live = 0;
        for (auto t : target) live += t != 0;
        if (live == 0 || m.used_bytes == 0) continue;
        sum_layout += m.waste_fraction();
        const double reserved = static_cast<double>(live) * max_len * static_cast<double>(cache.bytes_per_token());
        sum_static += std::max(0.0, 1.0 - static_cast<double>(m.used_bytes) / reserved);
        ++samples;
    }
    return {sum_layout / samples, sum_static / samples};
}

template <class Cache>
void memory_waste(benchmark::State& state) {
    waste_stats w;
    for (auto _ : state) w = replay<Cache>(7);
    state.counters["waste"] = w.layout;
    state.counters["waste_static_slots"] = w.static_slots;
}

void register_all() {
    using kvcache::f16;
    for (int th : {1, 2}) {
        const std::string ts = "/threads:" + std::to_string(th);
        benchmark::RegisterBenchmark(("attn_decode_paged/f16/n_kv:16384" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_decode_paged<f16>(st, 16384, th); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("defrag/f16/n_cells:16384" + ts).c_str(),
                                     [th](benchmark::State& st) { defrag_bench<f16>(st, th); })
            ->Unit(benchmark::kMillisecond);
    }
    benchmark::RegisterBenchmark("memory_waste/contiguous", memory_waste<kvcache::kv_cache<f16>>)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("memory_waste/paged:32", memory_waste<kvcache::kv_cache<f16, kvcache::paged<32>>>)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("memory_waste/paged:64", memory_waste<kvcache::kv_cache<f16, kvcache::paged<64>>>)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
}

const int registered = (register_all(), 0);

}  // namespace
