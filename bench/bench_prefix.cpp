// Prefix-cache benchmarks (F21):
//   prefix_lookup/radix    selecting an entry among 10,000 cached prompts of ~2,000 tokens
//                          that share system-prompt prefixes, through the radix index;
//                          reports the speed-up over the linear scan (below) measured in
//                          the same run as the user counter `speedup`.
//   prefix_lookup/linear   the same selection as llama-server makes it: a scan of every
//                          entry computing its common prefix with the request.
//   prefix_insert_evict    saving a prompt into the full cache: radix insert, dropping of
//                          prefix entries, and the eviction that keeps the token limit.
//   prefix_hit_load/...    moving a 2,000-token entry into a slot for a Llama-3.2-1B shape
//                          (f16, 32 KiB/token): copy_store copies the K/V bytes (reported as
//                          a fraction of this machine's copy bandwidth), shared_store shares
//                          the cells (seq_cp, no K/V bytes move).
#include <benchmark/benchmark.h>

#include <kvcache/kvcache.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "bench_common.hpp"

namespace {

using tiny_cache = kvcache::kv_cache<kvcache::f32, kvcache::reuse::global<>>;

/// Keeps no K/V at all: the lookup benchmarks measure the index, not the state copies.
struct tokens_only_store {
    struct handle {};
    kvcache::result<handle> save(tiny_cache&, kvcache::seq_id_t) { return handle{}; }
    kvcache::result<void> load(tiny_cache&, kvcache::seq_id_t, const handle&) { return {}; }
    std::size_t bytes(const tiny_cache&, const handle&) const { return 0; }
    void release(tiny_cache&, handle&) {}
};
using index_cache = kvcache::prompt_cache<tiny_cache, tokens_only_store>;

constexpr int n_entries = 10000;
constexpr int n_systems = 10;
constexpr std::size_t system_len = 1000;
constexpr std::size_t user_len = 1000;  // ~2,000 tokens per prompt

kvcache::prompt_tokens random_tokens(std::mt19937& rng, std::size_t n) {
    kvcache::prompt_tokens p;
    for (std::size_t i = 0; i < n; ++i) p.push_back(static_cast<kvcache::token_t>(rng() % 128000));
    return p;
}

/// 10,000 prompts: one of 10 system prompts + a user part of ~1,000 tokens; requests
/// continue a cached prompt (a prefix of it plus new tokens), as multi-turn traffic does.
struct lookup_world {
    std::unique_ptr<tiny_cache> cache;
    std::unique_ptr<index_cache> pc;
    std::vector<kvcache::prompt_tokens> prompts;
    std::vector<kvcache::prompt_tokens> requests;

    lookup_world() {
        kvcache::model_shape s;
        s.n_layer = 1;
        s.n_head_kv = 1;
        s.head_dim_k = 16;
        s.n_cells = 16;
        s.n_seq_max = 2;
        cache = std::make_unique<tiny_cache>(s);
        pc = std::make_unique<index_cache>(kvcache::prompt_cache_limits{0, 0});
        std::mt19937 rng(12345);
        std::vector<kvcache::prompt_tokens> systems;
        for (int i = 0; i < n_systems; ++i) systems.push_back(random_tokens(rng, system_len));
        for (int i = 0; i < n_entries; ++i) {
            kvcache::prompt_tokens p = systems[static_cast<std::size_t>(i % n_systems)];
            p.append(random_tokens(rng, user_len - 100 + rng() % 200).tokens());
            static_cast<void>(pc->save(*cache, 0, p));
            prompts.push_back(std::move(p));
        }
        for (int i = 0; i < 256; ++i) {
            kvcache::prompt_tokens r = prompts[rng() % prompts.size()];
            r.keep_first(system_len + rng() % user_len / 2);
            r.append(random_tokens(rng, 50).tokens());
            requests.push_back(std::move(r));
        }
    }
    static lookup_world& get() {
        static lookup_world w;
        return w;
    }
};

/// Mean seconds per call of f over the requests (steady_clock), for the same-run ratio.
template <class F>
double seconds_per_lookup(const lookup_world& w, F f, int rounds) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < rounds; ++r)
        for (const auto& req : w.requests) benchmark::DoNotOptimize(f(req));
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double>(t1 - t0).count() / (static_cast<double>(rounds) * w.requests.size());
}

void prefix_lookup_radix(benchmark::State& state) {
    auto& w = lookup_world::get();
    // Same selection both ways (sanity: abort rather than report a wrong speed-up).
    for (const auto& req : w.requests) {
        const auto a = w.pc->select(req), b = w.pc->select_linear(req);
        if (a.has_value() != b.has_value() || (a && (a->lcp != b->lcp || a->len != b->len))) {
            std::fprintf(stderr, "prefix_lookup: radix and linear selections differ\n");
            std::abort();
        }
    }
    std::size_t i = 0;
    for (auto _ : state) {
        benchmark::DoNotOptimize(w.pc->select(w.requests[i]));
        i = (i + 1) % w.requests.size();
    }
    const double radix = seconds_per_lookup(w, [&](const auto& r) { return w.pc->select(r); }, 20);
    const double linear = seconds_per_lookup(w, [&](const auto& r) { return w.pc->select_linear(r); }, 1);
    state.counters["entries"] = static_cast<double>(w.pc->size());
    state.counters["radix_us"] = radix * 1e6;
    state.counters["linear_us"] = linear * 1e6;
    state.counters["speedup"] = linear / radix;
    state.counters["tree_nodes"] = static_cast<double>(w.pc->index().node_count());
    state.SetItemsProcessed(state.iterations());
}
BENCHMARK(prefix_lookup_radix)->Name("prefix_lookup/radix/entries:10000/tokens:2000")->Unit(benchmark::kMicrosecond);

void prefix_lookup_linear(benchmark::State& state) {
    auto& w = lookup_world::get();
    std::size_t i = 0;
    for (auto _ : state) {
        benchmark::DoNotOptimize(w.pc->select_linear(w.requests[i]));
        i = (i + 1) % w.requests.size();
    }
    state.SetItemsProcessed(state.iterations());
}
BENCHMARK(prefix_lookup_linear)->Name("prefix_lookup/linear/entries:10000/tokens:2000")->Unit(benchmark::kMicrosecond);

// Steady state of a full cache: each save inserts one prompt and evicts the LRU entry.
void prefix_insert_evict(benchmark::State& state) {
    auto& w = lookup_world::get();
    std::size_t total = 0;
    for (const auto& p : w.prompts) total += p.size();
    kvcache::model_shape s = w.cache->shape();
    tiny_cache cache(s);
    index_cache pc(kvcache::prompt_cache_limits{0, total});
    for (const auto& p : w.prompts) static_cast<void>(pc.save(cache, 0, p));
    std::mt19937 rng(99);
    std::vector<kvcache::prompt_tokens> fresh;
    for (int i = 0; i < 512; ++i) {
        kvcache::prompt_tokens p = w.prompts[rng() % w.prompts.size()];
        p.keep_first(system_len);
        p.append(random_tokens(rng, user_len).tokens());
        fresh.push_back(std::move(p));
    }
    std::size_t i = 0;
    const auto ev0 = pc.metrics().evictions;
    for (auto _ : state) {
        benchmark::DoNotOptimize(pc.save(cache, 0, fresh[i]));
        i = (i + 1) % fresh.size();
        if (i == 0) {  // the same prompts come back: re-randomise their tails outside the timing
            state.PauseTiming();
            for (auto& p : fresh) {
                p.keep_first(system_len);
                p.append(random_tokens(rng, user_len).tokens());
            }
            state.ResumeTiming();
        }
    }
    state.counters["entries"] = static_cast<double>(pc.size());
    state.counters["evictions_per_insert"] =
        static_cast<double>(pc.metrics().evictions - ev0) / static_cast<double>(state.iterations());
    state.SetItemsProcessed(state.iterations());
}
BENCHMARK(prefix_insert_evict)->Name("prefix_insert_evict/entries:10000/tokens:2000")->Unit(benchmark::kMicrosecond);

// Loading a 2,000-token entry for Llama-3.2-1B (16 layers, 8 KV heads, head_dim 64, f16).
using llama_cache = kvcache::kv_cache<kvcache::f16, kvcache::reuse::global<>>;

kvcache::model_shape llama_1b(std::uint32_t n_cells) {
    kvcache::model_shape s;
    s.n_layer = 16;
    s.n_head_kv = 8;
    s.head_dim_k = 64;
    s.n_cells = n_cells;
    s.n_seq_max = 4;
    return s;
}

/// Places positions [0, n) of sequence 0 (K/V left as allocated).
void place_seq0(llama_cache& cache, std::uint32_t n) {
    std::vector<kvcache::pos_t> pos(n);
    for (std::uint32_t i = 0; i < n; ++i) pos[i] = static_cast<kvcache::pos_t>(i);
    std::vector<kvcache::seq_id_t> seq(n, 0);
    static_cast<void>(cache.place(pos, seq).value());
    static_cast<void>(cache.commit());
}

template <class Store>
void prefix_hit_load(benchmark::State& state, Store store) {
    constexpr std::uint32_t n_tok = 2000;
    llama_cache cache(llama_1b(2 * n_tok + 64));
    kvcache::prompt_cache<llama_cache, Store> pc(kvcache::prompt_cache_limits{0, 0}, std::move(store));
    std::mt19937 rng(7);
    const kvcache::prompt_tokens p = random_tokens(rng, n_tok);
    place_seq0(cache, n_tok);
    double load_s = 0;
    for (auto _ : state) {
        state.PauseTiming();
        cache.seq_rm(1, -1, -1).value();
        const auto id = pc.save(cache, 0, p).value();
        state.ResumeTiming();
        const auto t0 = std::chrono::steady_clock::now();
        auto got = pc.load(cache, 1, id);
        benchmark::DoNotOptimize(got);
        load_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const double bytes = static_cast<double>(n_tok) * static_cast<double>(cache.bytes_per_token());
    state.counters["entry_MiB"] = bytes / (1 << 20);
    if constexpr (!std::is_same_v<Store, kvcache::shared_store<llama_cache>>) {
        // K/V bytes read + written per load, against this machine's copy bandwidth with the
        // same (OpenMP default) thread count: copy_store moves layers in parallel
        const double achieved = 2 * bytes * static_cast<double>(state.iterations()) / load_s;
        const int threads = kvcache::bench::resolve_threads(0);
        state.counters["threads"] = threads;
        state.counters["copy_bw_frac"] = achieved / kvcache::bench::measure_copy_bw(threads);
    }
}
// Saving a 1,000-token entry with shared_store into a 16K-cell cache (Llama-3.2-1B shape):
// what the strong guarantee's undo record (a checkpoint of the cache, i.e. a copy of its
// cell table, and of the store's free list) costs inside prompt_cache::save, timed in the
// same run on the same cache state: undo_ms (one record) against save_ms (the whole save,
// which takes one record), undo_frac = undo_ms / save_ms.
void prefix_save_shared(benchmark::State& state) {
    using store_t = kvcache::shared_store<llama_cache>;
    constexpr std::uint32_t n_tok = 1000;
    llama_cache cache(llama_1b(16384));
    kvcache::prompt_cache<llama_cache, store_t> pc(kvcache::prompt_cache_limits{0, 0}, store_t(2, 2));
    std::mt19937 rng(11);
    const kvcache::prompt_tokens p = random_tokens(rng, n_tok);
    place_seq0(cache, n_tok);
    double save_s = 0, undo_s = 0;
    for (auto _ : state) {
        const auto t0 = std::chrono::steady_clock::now();
        const auto id = pc.save(cache, 0, p);
        const auto t1 = std::chrono::steady_clock::now();
        save_s += std::chrono::duration<double>(t1 - t0).count();
        state.PauseTiming();
        {
            const auto u0 = std::chrono::steady_clock::now();
            store_t::undo_record u;
            pc.store().save_undo(cache, u);
            benchmark::DoNotOptimize(u);
            undo_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - u0).count();
        }
        pc.erase(cache, id.value());
        state.ResumeTiming();
    }
    const auto n = static_cast<double>(state.iterations());
    state.counters["save_ms"] = save_s * 1e3 / n;
    state.counters["undo_ms"] = undo_s * 1e3 / n;
    state.counters["undo_frac"] = undo_s / save_s;
}
BENCHMARK(prefix_save_shared)
    ->Name("prefix_save/shared_store/tokens:1000/cells:16384/llama-3.2-1b-f16")
    ->Unit(benchmark::kMillisecond);

BENCHMARK_CAPTURE(prefix_hit_load, copy_store, kvcache::copy_store<llama_cache>{})
    ->Name("prefix_hit_load/copy_store/tokens:2000/llama-3.2-1b-f16")
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(prefix_hit_load, shared_store, kvcache::shared_store<llama_cache>(2, 2))
    ->Name("prefix_hit_load/shared_store/tokens:2000/llama-3.2-1b-f16")
    ->Unit(benchmark::kMillisecond);

}  // namespace

namespace {
// slot_manager::prepare of a global hit (a 2,000-token shared_store entry loaded into an
// idle slot, Llama-3.2-1B f16, 16,384 cells): with the strong guarantee (the undo journal:
// the cell table's journal, the byte guard, the prompt cache's batch) against the
// compound prepare (slot_options::strong_prepare = false), both timed in the same run on
// twin caches, alternately. vs_compound = compound time / strong time.
void prepare_hit(benchmark::State& state) {
    using store_t = kvcache::shared_store<llama_cache>;
    using slots_t = kvcache::slot_manager<llama_cache, store_t>;
    constexpr std::uint32_t n_tok = 2000;
    std::mt19937 rng(13);
    const kvcache::prompt_tokens p = random_tokens(rng, n_tok);
    kvcache::prompt_tokens req = p;
    for (kvcache::token_t t = 0; t < 16; ++t) req.push_back(90000 + t);
    struct twin {
        llama_cache cache;
        slots_t slots;
        twin(bool strong, const kvcache::prompt_tokens& p)
            : cache(llama_1b(16384)), slots(cache, [strong] {
                  kvcache::slot_options o;
                  o.n_slots = 2;
                  o.strong_prepare = strong;
                  return o;
              }(), store_t(2, 2)) {
            kvcache::request_options ro;
            ro.slot_id = 0;
            auto r = slots.prepare(p, ro).value();
            std::vector<kvcache::pos_t> pos(n_tok);
            for (std::uint32_t i = 0; i < n_tok; ++i) pos[i] = static_cast<kvcache::pos_t>(i);
            std::vector<kvcache::seq_id_t> seq(n_tok, r.seq);
            static_cast<void>(cache.place(pos, seq).value());
            static_cast<void>(cache.commit());
            slots.commit_prompt(0);
            slots.release(0);  // the entry
            slots.clear_slot(0);
        }
        double run(const kvcache::prompt_tokens& req) {
            kvcache::request_options ro;
            ro.slot_id = 1;
            const auto t0 = std::chrono::steady_clock::now();
            auto r = slots.prepare(req, ro);
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            benchmark::DoNotOptimize(r);
            slots.release(1);  // saves the kept 2,000 tokens back as the entry
            slots.clear_slot(1);
            return s;
        }
    };
    twin strong(true, p), compound(false, p);
    double strong_s = 0, compound_s = 0;
    std::uint64_t hits = 0;
    for (auto _ : state) {
        strong_s += strong.run(req);
        compound_s += compound.run(req);
        hits += strong.slots.last_metrics().from_global;
    }
    const auto n = static_cast<double>(state.iterations());
    state.counters["strong_ms"] = strong_s * 1e3 / n;
    state.counters["compound_ms"] = compound_s * 1e3 / n;
    state.counters["vs_compound"] = compound_s / strong_s;
    state.counters["from_global"] = static_cast<double>(hits) / n;
}
BENCHMARK(prepare_hit)->Name("prepare_hit/shared_store/tokens:2000/cells:16384/llama-3.2-1b-f16")->Unit(benchmark::kMillisecond);
}  // namespace
