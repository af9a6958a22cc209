// Bookkeeping benchmarks (core): placement + commit, seq_rm and seq_add on a 64K-cell
// cache, so later work can see regressions in the metadata paths.
#include <benchmark/benchmark.h>

#include <kvcache/kvcache.hpp>

#include <numeric>
#include <vector>

namespace {

kvcache::model_shape bench_shape(std::uint32_t n_cells) {
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 16;
    s.n_cells = n_cells;
    s.n_seq_max = 4;
    return s;
}

// Place ubatches of `ub` tokens of one sequence until 64K cells are full, commit each.
void place_commit(benchmark::State& state) {
    const auto ub = static_cast<std::uint32_t>(state.range(0));
    constexpr std::uint32_t n_cells = 65536;
    kvcache::kv_cache<kvcache::f16> cache(bench_shape(n_cells));
    std::vector<kvcache::pos_t> pos(ub);
    std::vector<kvcache::seq_id_t> seq(ub, 0);
    std::int64_t tokens = 0;
    for (auto _ : state) {
        state.PauseTiming();
        cache.clear();
        state.ResumeTiming();
        for (std::uint32_t p0 = 0; p0 + ub <= n_cells; p0 += ub) {
            std::iota(pos.begin(), pos.end(), static_cast<kvcache::pos_t>(p0));
            kvcache::transaction tx(cache);
            auto r = cache.place(pos, seq);
            benchmark::DoNotOptimize(r);
            tx.commit();
            tokens += ub;
        }
    }
    state.counters["tokens_per_second"] = benchmark::Counter(static_cast<double>(tokens), benchmark::Counter::kIsRate);
}
BENCHMARK(place_commit)->Name("place_commit/n_cells:65536/ubatch")->Arg(1)->Arg(32)->Arg(512)->Unit(benchmark::kMillisecond);

// Fill 64K cells with 4 sequences, then seq_rm half of one sequence / seq_add another.
void seq_ops(benchmark::State& state, bool add) {
    constexpr std::uint32_t n_cells = 65536;
    kvcache::kv_cache<kvcache::f16> cache(bench_shape(n_cells));
    auto fill = [&] {
        cache.clear();
        std::vector<kvcache::pos_t> pos(n_cells / 4);
        std::iota(pos.begin(), pos.end(), 0);
        for (kvcache::seq_id_t s = 0; s < 4; ++s) {
            std::vector<kvcache::seq_id_t> seq(pos.size(), s);
            cache.place(pos, seq).value();
            cache.commit();
        }
    };
    for (auto _ : state) {
        state.PauseTiming();
        fill();
        state.ResumeTiming();
        if (add)
            cache.seq_add(1, 0, -1, 1000).value();
        else
            cache.seq_rm(1, 0, n_cells / 8).value();
    }
}
BENCHMARK_CAPTURE(seq_ops, rm, false)->Name("seq_rm/n_cells:65536")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(seq_ops, add, true)->Name("seq_add/n_cells:65536")->Unit(benchmark::kMillisecond);

}  // namespace
