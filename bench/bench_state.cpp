// State save/load benchmarks (F15), in-memory buffers.
//
// Names: state_save/<type>/cells:<n>/<fill>, state_load/<type>/cells:<n>/<fill>, where
// fill is "one_seq" (every cell used by sequence 0: whole K tiles, single memcpys) or
// "interleaved" (two sequences alternate cell by cell; the benchmark saves / loads
// sequence 0 alone, so every K tile is gathered / scattered lane by lane).
// Shape: 8 layers, 8 KV heads, head_dim 128, f16: 32 KiB per token, 256 MiB for 8192 cells,
// far larger than the last-level cache. Single-threaded (the save streams one checksum).
// Counters: bytes_per_second (state bytes / s); bw_frac = (state bytes read + written) / s
// divided by this binary's measured single-thread copy bandwidth (bench_common.hpp),
// measured right after the timed loop. A save reads the cache and writes the buffer; a
// load reads the buffer twice (checksum, then copy) and writes the cache.
#include <benchmark/benchmark.h>

#include <kvcache/kvcache.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "bench_common.hpp"

namespace {

namespace kb = kvcache::bench;
using cache_t = kvcache::kv_cache<kvcache::f16>;

kvcache::model_shape state_shape(std::uint32_t n_cells) {
    kvcache::model_shape s;
    s.n_layer = 8;
    s.n_head_kv = 8;
    s.head_dim_k = 128;
    s.n_cells = n_cells;
    s.n_seq_max = 2;
    return s;
}

/// A full cache: one sequence, or two alternating cell by cell; raw K/V bytes random.
std::unique_ptr<cache_t> make_full(std::uint32_t n_cells, bool interleaved) {
    auto c = std::make_unique<cache_t>(state_shape(n_cells));
    std::vector<kvcache::pos_t> pos(n_cells);
    std::vector<kvcache::seq_id_t> seq(n_cells);
    for (std::uint32_t i = 0; i < n_cells; ++i) {
        pos[i] = static_cast<kvcache::pos_t>(interleaved ? i / 2 : i);
        seq[i] = interleaved ? static_cast<kvcache::seq_id_t>(i % 2) : 0;
    }
    c->place(pos, seq).value();
    c->commit();
    std::mt19937 rng(1);
    for (std::uint32_t l = 0; l < c->shape().n_layer; ++l) {
        const auto v = c->storage().view(l);
        auto* k = reinterpret_cast<std::uint16_t*>(v.k);
        auto* vv = reinterpret_cast<std::uint16_t*>(v.v);
        for (std::size_t i = 0; i < v.k_head_stride * v.n_head_kv; ++i) k[i] = static_cast<std::uint16_t>(rng() & 0x3bff);
        for (std::size_t i = 0; i < v.v_head_stride * v.n_head_kv; ++i) vv[i] = static_cast<std::uint16_t>(rng() & 0x3bff);
    }
    return c;
}

void report(benchmark::State& state, double bytes, double secs, double passes) {
    const double iters = static_cast<double>(state.iterations());
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes * iters));
    state.counters["bw_frac"] = passes * bytes * iters / secs / kb::measure_copy_bw(1, true);
}

void state_save(benchmark::State& state, std::uint32_t n_cells, bool interleaved) {
    const auto c = make_full(n_cells, interleaved);
    std::vector<std::byte> buf(interleaved ? kvcache::io::seq_state_size(*c, 0) : kvcache::io::state_size(*c));
    std::memset(buf.data(), 1, buf.size());  // pages touched: the timed loop sees no page faults
    double secs = 0;
    for (auto _ : state) {
        const double t0 = kb::detail::now_s();
        if (interleaved)
            kvcache::io::save_seq_into(*c, 0, buf);
        else
            kvcache::io::save_state_into(*c, buf);
        secs += kb::detail::now_s() - t0;
        benchmark::DoNotOptimize(buf.data());
    }
    report(state, static_cast<double>(buf.size()), secs, 2.0);
}

void state_load(benchmark::State& state, std::uint32_t n_cells, bool interleaved) {
    const auto src = make_full(n_cells, interleaved);
    const auto bytes = interleaved ? kvcache::io::save_seq(*src, 0) : kvcache::io::save_state(*src);
    auto c = make_full(n_cells, interleaved);  // destination pages already touched
    double secs = 0;
    for (auto _ : state) {
        const double t0 = kb::detail::now_s();
        auto r = interleaved ? kvcache::io::load_seq(*c, 0, bytes) : kvcache::io::load_state(*c, bytes);
        secs += kb::detail::now_s() - t0;
        if (!r) state.SkipWithError(r.message().c_str());
        benchmark::DoNotOptimize(r);
    }
    report(state, static_cast<double>(bytes.size()), secs, 2.0);
}

constexpr std::uint32_t bench_cells = 8192;  // 256 MiB of K/V

}  // namespace

BENCHMARK_CAPTURE(state_save, one_seq, bench_cells, false)
    ->Name("state_save/f16/cells:8192/one_seq")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(state_load, one_seq, bench_cells, false)
    ->Name("state_load/f16/cells:8192/one_seq")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(state_save, interleaved, bench_cells, true)
    ->Name("state_save/f16/cells:8192/interleaved")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(state_load, interleaved, bench_cells, true)
    ->Name("state_load/f16/cells:8192/interleaved")->Unit(benchmark::kMillisecond)->UseRealTime();
