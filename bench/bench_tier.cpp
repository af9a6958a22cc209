// Storage-tier benchmarks (prompt-cache tiers, tier/): put and get of one entry's blob per
// tier, and a whole tier_cache fetch (probe, verify, io::load_seq) of that entry.
//
// Entry: 1,000 tokens of 8 layers, 8 KV heads, head_dim 128, f16 (32 KiB per token: a
// 32 MiB blob), single-threaded. Names: tier_put/<tier>/tokens:1000,
// tier_get/<tier>/tokens:1000, tier_fetch/<tier>/tokens:1000 with tier memory, disk
// (disk: the page cache warm, files in ./bench_tier_dir; disk_sync: put with fsync).
// Redis rows (tier_put/redis, tier_get/redis, tier_fetch/redis) need the binary built with
// -DKVCACHE_BENCH_HIREDIS and -lhiredis, and a server named by KVCACHE_BENCH_REDIS_PORT
// (127.0.0.1; e.g. `redis-server --port 6390 --save '' --appendonly no`); else they skip.
// redis_whole rows: the blob as one value (chunk_bytes = 0) instead of 1 MiB chunks.
// Counters: bytes_per_second (blob bytes / s); bw_frac = (bytes read + written) / s divided
// by this binary's single-thread copy bandwidth (bench_common.hpp), measured right after the
// timed loop: a put or get copies the blob once (2 passes); a fetch reads it twice
// (checksums of blob and state) and copies it into the cache (4 passes, counted as 4).
// first_touch_frac: the same rate divided by the copy bandwidth into freshly allocated
// memory (page faults included), the bound of a transport that allocates per value.
// Same-run comparisons (each iteration times both variants, alternating; counters in ms per
// fetch and their ratio):
//   tier_fetch_mapped_vs_copied/disk: fetch through disk_tier::map (the file mapped, read in
//     place) against the same tier behind a wrapper with get() only (the file read into a
//     buffer); counters mapped_ms, copied_ms, copied_over_mapped.
//   tier_fetch_promotion/disk: a memory -> disk chain, the disk hit promoted into the memory
//     tier inside the fetch (immediate) against queued (deferred; promote_pending() runs
//     untimed); counters immediate_ms, deferred_ms, immediate_over_deferred.
#include <benchmark/benchmark.h>
#include <sys/mman.h>  // first_touch_copy_bw: fresh pages

#include <kvcache/kvcache.hpp>
#include <kvcache/tier/disk_tier.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "bench_common.hpp"

#if defined(KVCACHE_BENCH_HIREDIS)
#include <kvcache/tier/redis_tier.hpp>
#endif

namespace {

namespace kb = kvcache::bench;
using tier_cache_t = kvcache::kv_cache<kvcache::f16>;
constexpr std::uint32_t tier_tokens = 1000;

kvcache::model_shape tier_bench_shape() {
    kvcache::model_shape s;
    s.n_layer = 8;
    s.n_head_kv = 8;
    s.head_dim_k = 128;
    s.n_cells = 2048;  // the entry and its fetched copy
    s.n_seq_max = 2;
    return s;
}

/// A cache whose sequence 0 holds tier_tokens random positions, and their prompt.
std::unique_ptr<tier_cache_t> tier_bench_cache(kvcache::prompt_tokens& p) {
    auto c = std::make_unique<tier_cache_t>(tier_bench_shape());
    std::vector<kvcache::pos_t> pos(tier_tokens);
    std::vector<kvcache::seq_id_t> seq(tier_tokens, 0);
    for (std::uint32_t i = 0; i < tier_tokens; ++i) pos[i] = static_cast<kvcache::pos_t>(i);
    c->place(pos, seq).value();
    c->commit();
    std::mt19937 rng(3);
    for (std::uint32_t l = 0; l < c->shape().n_layer; ++l) {
        const auto v = c->storage().view(l);
        auto* k = reinterpret_cast<std::uint16_t*>(v.k);
        auto* vv = reinterpret_cast<std::uint16_t*>(v.v);
        for (std::size_t i = 0; i < v.k_head_stride * v.n_head_kv; ++i) k[i] = static_cast<std::uint16_t>(rng() & 0x3bff);
        for (std::size_t i = 0; i < v.v_head_stride * v.n_head_kv; ++i) vv[i] = static_cast<std::uint16_t>(rng() & 0x3bff);
    }
    p.clear();
    for (std::uint32_t i = 0; i < tier_tokens; ++i) p.push_back(static_cast<kvcache::token_t>(rng() % 32000));
    return c;
}

/// Copy bandwidth (bytes read + written / s) into freshly allocated memory, first-touch page
/// faults included (best of 3 copies of `bytes`): what a transport pays that allocates a new
/// buffer per value, as hiredis does per request and reply; on some VMs this is two orders
/// of magnitude below measure_copy_bw.
double first_touch_copy_bw(std::size_t bytes) {
    static const double bw = [bytes] {
        std::vector<std::byte> src(bytes, std::byte{1});
        double best = 1e30;
        for (int i = 0; i < 3; ++i) {
            const double t0 = kb::detail::now_s();
            // fresh pages, as malloc gives them above its mmap threshold (an operator new of
            // the size may reuse warm heap pages instead)
            void* dst = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (dst == MAP_FAILED) return 0.0;
            std::memcpy(dst, src.data(), bytes);
            benchmark::DoNotOptimize(dst);
            best = std::min(best, kb::detail::now_s() - t0);
            ::munmap(dst, bytes);
        }
        return 2.0 * static_cast<double>(bytes) / best;
    }();
    return bw;
}

void tier_report(benchmark::State& state, double bytes, double secs, double passes) {
    const double iters = static_cast<double>(state.iterations());
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes * iters));
    state.counters["bw_frac"] = passes * bytes * iters / secs / kb::measure_copy_bw(1, true);
    if (const double ft = first_touch_copy_bw(static_cast<std::size_t>(bytes)); ft > 0)
        state.counters["first_touch_frac"] = passes * bytes * iters / secs / ft;
}

#if defined(KVCACHE_BENCH_HIREDIS)
int tier_redis_port() {
    const char* e = std::getenv("KVCACHE_BENCH_REDIS_PORT");
    return e == nullptr ? 0 : std::atoi(e);
}
#endif

template <class Tier>
Tier make_tier(int kind) {
    if constexpr (std::is_same_v<Tier, kvcache::tier::memory_tier>) {
        static_cast<void>(kind);
        return Tier();
#if defined(KVCACHE_BENCH_HIREDIS)
    } else if constexpr (std::is_same_v<Tier, kvcache::tier::redis_tier>) {
        kvcache::tier::redis_tier_options o;
        o.nodes = {{"127.0.0.1", tier_redis_port()}};
        o.prefix = "kvbench:";
        o.io_timeout_ms = 5000;
        o.pipeline = 1;
        if (kind == 1) o.chunk_bytes = 0;  // the whole blob as one value (the redis_whole rows)
        return Tier(o);
#endif
    } else {
        std::filesystem::remove_all("bench_tier_dir");
        return Tier("bench_tier_dir", {.sync = kind == 2});
    }
}

/// What: 0 put, 1 get, 2 tier_cache fetch.
template <class Tier>
void tier_bench(benchmark::State& state, int what, int kind) {
    kvcache::prompt_tokens p;
    auto c = tier_bench_cache(p);
    kvcache::tier::tier_cache<tier_cache_t, Tier> tc({.block_tokens = 64}, make_tier<Tier>(kind));
    const auto fp = kvcache::tier::memory_fingerprint(*c);
    const auto pk = kvcache::tier::block_keys(p, 64, fp, 0).back();
    const auto blob = kvcache::tier::make_blob(pk.k, fp, 0, pk.n_tokens, p, kvcache::io::save_seq(*c, 0));
    Tier& t = tc.template get<0>();
    if (!t.put(pk.k, blob)) state.SkipWithError("put failed");
    std::vector<std::byte> out(blob.size());
    double secs = 0;
    for (auto _ : state) {
        const double t0 = kb::detail::now_s();
        if (what == 0) {
            if (!t.put(pk.k, blob)) state.SkipWithError("put failed");
        } else if (what == 1) {
            if (!t.get(pk.k, out)) state.SkipWithError("get missed");
        } else {
            const auto f = tc.fetch(*c, 1, p);
            if (f.n_tokens == 0) state.SkipWithError("fetch missed");
            secs += kb::detail::now_s() - t0;
            c->seq_rm(1, -1, -1).value();
            continue;
        }
        secs += kb::detail::now_s() - t0;
        benchmark::DoNotOptimize(out.data());
    }
    tier_report(state, static_cast<double>(blob.size()), secs, what == 2 ? 4.0 : 2.0);
    if constexpr (std::is_same_v<Tier, kvcache::tier::disk_tier>) std::filesystem::remove_all("bench_tier_dir");
}

/// The disk tier with get() only (no map()): the copying fetch path.
struct get_only_disk {
    kvcache::tier::disk_tier inner;
    kvcache::result<void> put(const kvcache::tier::key& k, std::span<const std::byte> b) { return inner.put(k, b); }
    bool get(const kvcache::tier::key& k, std::vector<std::byte>& out) { return inner.get(k, out); }
    bool contains(const kvcache::tier::key& k) const { return inner.contains(k); }
    bool erase(const kvcache::tier::key& k) { return inner.erase(k); }
    std::size_t bytes() const { return inner.bytes(); }
    std::string_view name() const { return inner.name(); }
};

/// Seconds of one fetch of p into sequence 1 of c (emptied afterwards).
template <class Chain>
double timed_fetch(benchmark::State& state, Chain& tc, tier_cache_t& c, const kvcache::prompt_tokens& p,
                   kvcache::tier::promotion promote = kvcache::tier::promotion::immediate) {
    const double t0 = kb::detail::now_s();
    const auto f = tc.fetch(c, 1, p, 0, SIZE_MAX, promote);
    const double dt = kb::detail::now_s() - t0;
    if (f.n_tokens == 0) state.SkipWithError("fetch missed");
    c.seq_rm(1, -1, -1).value();
    return dt;
}

/// tier_fetch_mapped_vs_copied/disk (see the top).
void tier_bench_mapped_vs_copied(benchmark::State& state) {
    kvcache::prompt_tokens p;
    auto c = tier_bench_cache(p);
    std::filesystem::remove_all("bench_tier_dir");
    kvcache::tier::tier_cache<tier_cache_t, kvcache::tier::disk_tier> mapped(
        {.block_tokens = 64}, kvcache::tier::disk_tier("bench_tier_dir", {.sync = false}));
    kvcache::tier::tier_cache<tier_cache_t, get_only_disk> copied(
        {.block_tokens = 64}, get_only_disk{kvcache::tier::disk_tier("bench_tier_dir", {.sync = false})});
    if (!mapped.publish(*c, 0, p).stored) state.SkipWithError("publish failed");
    double t_map = 0, t_copy = 0;
    for (auto _ : state) {
        t_map += timed_fetch(state, mapped, *c, p);
        t_copy += timed_fetch(state, copied, *c, p);
    }
    const double n = static_cast<double>(state.iterations());
    state.counters["mapped_ms"] = 1e3 * t_map / n;
    state.counters["copied_ms"] = 1e3 * t_copy / n;
    state.counters["copied_over_mapped"] = t_copy / t_map;
    std::filesystem::remove_all("bench_tier_dir");
}

/// tier_fetch_promotion/disk (see the top).
void tier_bench_promotion(benchmark::State& state) {
    using namespace kvcache::tier;
    kvcache::prompt_tokens p;
    auto c = tier_bench_cache(p);
    std::filesystem::remove_all("bench_tier_dir");
    tier_cache<tier_cache_t, memory_tier, disk_tier> tc({.block_tokens = 64}, memory_tier(),
                                                        disk_tier("bench_tier_dir", {.sync = false}));
    if (!tc.publish(*c, 0, p).stored) state.SkipWithError("publish failed");
    const key k = block_keys(p, 64, memory_fingerprint(*c), 0).back().k;
    double t_imm = 0, t_def = 0;
    for (auto _ : state) {
        tc.get<0>().erase(k);
        t_imm += timed_fetch(state, tc, *c, p, promotion::immediate);
        tc.get<0>().erase(k);
        t_def += timed_fetch(state, tc, *c, p, promotion::deferred);
        state.PauseTiming();
        tc.promote_pending();
        state.ResumeTiming();
    }
    if (tc.metrics().tiers[0].promotions != static_cast<std::uint64_t>(2 * state.iterations())) state.SkipWithError("promotions missing");
    const double n = static_cast<double>(state.iterations());
    state.counters["immediate_ms"] = 1e3 * t_imm / n;
    state.counters["deferred_ms"] = 1e3 * t_def / n;
    state.counters["immediate_over_deferred"] = t_imm / t_def;
    std::filesystem::remove_all("bench_tier_dir");
}

void tier_bench_memory(benchmark::State& state, int what) { tier_bench<kvcache::tier::memory_tier>(state, what, 0); }
void tier_bench_disk(benchmark::State& state, int what, int kind) { tier_bench<kvcache::tier::disk_tier>(state, what, kind); }
void tier_bench_redis(benchmark::State& state, int what, int kind) {
#if defined(KVCACHE_BENCH_HIREDIS)
    if (tier_redis_port() > 0) {
        tier_bench<kvcache::tier::redis_tier>(state, what, kind);
        return;
    }
#endif
    static_cast<void>(what);
    static_cast<void>(kind);
    state.SkipWithError("no Redis: build with KVCACHE_BENCH_HIREDIS and set KVCACHE_BENCH_REDIS_PORT");
    for (auto _ : state) {
    }
}

}  // namespace

BENCHMARK_CAPTURE(tier_bench_memory, put_memory, 0)->Name("tier_put/memory/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_memory, get_memory, 1)->Name("tier_get/memory/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_memory, fetch_memory, 2)->Name("tier_fetch/memory/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_disk, put_disk, 0, 1)->Name("tier_put/disk/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_disk, put_disk_sync, 0, 2)->Name("tier_put/disk_sync/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_disk, get_disk, 1, 1)->Name("tier_get/disk/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_disk, fetch_disk, 2, 1)->Name("tier_fetch/disk/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_redis, put_redis, 0, 0)->Name("tier_put/redis/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_redis, get_redis, 1, 0)->Name("tier_get/redis/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_redis, fetch_redis, 2, 0)->Name("tier_fetch/redis/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(tier_bench_mapped_vs_copied)->Name("tier_fetch_mapped_vs_copied/disk/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(tier_bench_promotion)->Name("tier_fetch_promotion/disk/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
// One 32 MiB value (chunk_bytes = 0), the layout before chunks: compare with the rows above.
BENCHMARK_CAPTURE(tier_bench_redis, put_redis_whole, 0, 1)->Name("tier_put/redis_whole/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(tier_bench_redis, get_redis_whole, 1, 1)->Name("tier_get/redis_whole/tokens:1000")->Unit(benchmark::kMillisecond)->UseRealTime();
