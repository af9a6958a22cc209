// Kernel benchmarks: attention (decode, prefill) and K-shift, each against this binary's
// own measured bandwidth / FMA peak (bench_common.hpp) and against the plain scalar path.
//
// Names: attn_decode/<type>/n_kv:<cells>/threads:<t>, attn_decode/<type>/n_kv:<cells>/hkv:2/threads:<t>
// (split-K), attn_decode_prefetch/<none|burst|interleaved>/<type>/n_kv:16384/threads:<t>,
// attn_prefill/<type>/n_q:512/n_kv:512/threads:<t>, kshift/<type>/<rope>/n_cells:<cells>/threads:<t>,
// attn_decode_multi/<type>/n_seq:16/n_kv:2048/<contiguous|paged>/threads:<t> and
// attn_mixed/<type>/prefill:512/decode:15/<contiguous|paged>/threads:<t> and
// attn_decode_shared/<type>/n_seq:16/prefix:8192/own:256/<contiguous|paged>/threads:<t> (16
// forks of one prefix, cascade attention) (one call with many sequences against one call
// per sequence, same run: counter vs_separate),
// kshift_rope/<type>/<rope>/<llama3|yarn>/n_cells:16384/threads:<t> (scaled RoPE, paired with
// the plain K-shift in each iteration; counter vs_plain = scaled / plain seconds),
// attn_decode/<q8_0|q4_0>/n_kv:16384/threads:<1|2> (quantized K/V; counter vs_f16 = f16 /
// quantized seconds, both decodes in the same iterations), attn_decode_hot/<q8_0|q4_0>/
// n_kv:2048/threads:1 (the same on one layer that stays in the caches; counter cyc_cell),
// kshift/<q8_0|q4_0>/<rope>/n_cells:16384/threads:<1|2> (quantized K-shift paired with the f16
// one in each iteration; counters vs_f16 and bw_frac),
// membw_kv_pattern/threads:<t> (decode's two-stream read pattern with no arithmetic),
// membw_kv_compute/<blocked|together>/threads:<t> (the two streams with decode's FMAs per
// byte, read one after the other or together),
// and *_scalar/... for the scalar reference. Shape: head_dim 128, 32 query heads, 8 KV heads.
// Counters: bytes_per_second (decode, K-shift) or FLOP/s (prefill: unmasked query-key pairs
// x heads x 4 x head_dim), bw_frac (achieved / measured read bandwidth for attention,
// / in-place read-modify-write bandwidth for K-shift, same thread count, measured in step
// with the kernel: a paired_yardstick runs between the timed calls), peak_frac (FMA rate /
// measured FMA peak, same thread count; in step for prefill, right after the loop for the
// others), yard_GBps / yard_GFMAps (what the paired yardstick read).
// Cold cache: each iteration works on the next layer of a cache whose layers together are
// larger than bench_buffer_bytes() (1 GiB by default), so K/V come from DRAM.
#include <benchmark/benchmark.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

constexpr std::uint32_t head_dim = 128, n_head = 32, n_head_kv_default = 8;

template <class E>
using cache_t = kvcache::kv_cache<E>;

// A cache of n_cells cells with n_kv of them holding sequence 0 at positions [0, n_kv), every
// layer's K and V filled with random values (copied from a small random pattern).
// RoPE frequency scaling of a benchmark cache (K-shift rows): plain, Llama 3.1 factors, or
// YaRN as Qwen2.5 sets it (factor 4 over 32768 positions).
enum class rope_variant { plain, llama3, yarn };

kvcache::rope_params rope_of(kvcache::rope_type type, rope_variant v) {
    kvcache::rope_params r;
    r.type = type;
    if (v == rope_variant::llama3) {
        r.freq_base = 500000.0f;
        r.scaling = kvcache::rope_scaling::llama3;
        r.n_ctx_orig = 8192;
        r.llama3 = {.factor = 8.0f, .low_freq_factor = 1.0f, .high_freq_factor = 4.0f};
    } else if (v == rope_variant::yarn) {
        r.freq_base = 1000000.0f;
        r.freq_scale = 0.25f;
        r.scaling = kvcache::rope_scaling::yarn;
        r.n_ctx_orig = 32768;
        r.attn_factor = kvcache::rope_params::yarn_mscale(4.0f);
    }
    return r;
}

template <class E>
std::unique_ptr<cache_t<E>> make_cache(std::uint32_t n_cells, std::uint32_t n_kv, std::uint32_t n_layer,
                                       std::uint32_t hkv, kvcache::rope_type rope = kvcache::rope_type::normal,
                                       rope_variant variant = rope_variant::plain) {
    kvcache::model_shape s;
    s.rope = rope_of(rope, variant);
    s.n_layer = n_layer;
    s.n_head_kv = hkv;
    s.head_dim_k = head_dim;
    s.n_cells = n_cells;
    s.n_seq_max = 1;
    auto cache = std::make_unique<cache_t<E>>(s);
    std::vector<pos_t> pos(n_kv);
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<seq_id_t> seq(n_kv, 0);
    static_cast<void>(cache->place(pos, seq).value());
    static_cast<void>(cache->commit());
    using T = typename E::storage_type;
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 0.5f);
    std::vector<float> pf(65536);
    for (auto& x : pf) x = nd(rng);
    constexpr std::size_t B = kvcache::element_block_size_v<E>;  // values per storage unit
    std::vector<T> pattern(pf.size() / B);
    E::from_float(pf.data(), pattern.data(), pf.size());
    const std::size_t k_elems = std::size_t{cache->storage().n_cells_padded()} * head_dim * hkv / B;
    for (std::uint32_t l = 0; l < n_layer; ++l) {
        auto v = cache->storage().view(l);
        for (T* base : {v.k, v.v})
            for (std::size_t off = 0; off < k_elems; off += pattern.size())
                std::memcpy(base + off, pattern.data(), std::min(pattern.size(), k_elems - off) * sizeof(T));
    }
    return cache;
}

// Caches of earlier benchmarks (or repetitions) that asked for the same one: building a
// multi-GiB cache costs seconds of page faults in a VM, and with
// --benchmark_enable_random_interleaving the repetitions of different benchmarks
// alternate. The most recently used caches are kept up to KVCACHE_BENCH_HOLD_MIB
// (default 8192) in all; the benchmarks leave them usable (attention only reads a cache,
// the K-shift benchmark moves positions by +1 / -1 alternately).
struct cache_key {
    std::string type;
    std::uint32_t n_cells = 0, n_kv = 0, n_layer = 0, hkv = 0;
    kvcache::rope_type rope = kvcache::rope_type::normal;
    rope_variant variant = rope_variant::plain;
    bool operator==(const cache_key&) const = default;
};
struct held_cache {
    cache_key key;
    std::size_t bytes = 0;
    std::shared_ptr<void> cache;
};
std::vector<held_cache> held;  // most recently used last

std::size_t hold_budget() {
    if (const char* env = std::getenv("KVCACHE_BENCH_HOLD_MIB")) return std::strtoull(env, nullptr, 10) << 20;
    return std::size_t{8192} << 20;
}

template <class E>
cache_t<E>& shared_cache(std::uint32_t n_cells, std::uint32_t n_kv, std::uint32_t n_layer, std::uint32_t hkv,
                         kvcache::rope_type rope = kvcache::rope_type::normal,
                         rope_variant variant = rope_variant::plain) {
    const cache_key key{std::string(E::name), n_cells, n_kv, n_layer, hkv, rope, variant};
    auto it = std::find_if(held.begin(), held.end(), [&](const held_cache& h) { return h.key == key; });
    if (it != held.end()) {
        std::rotate(it, it + 1, held.end());
        return *static_cast<cache_t<E>*>(held.back().cache.get());
    }
    const std::size_t bytes = std::size_t{n_cells} * hkv * kvcache::values_bytes<E>(head_dim * 2) * n_layer;
    std::size_t total = bytes;
    for (const auto& h : held) total += h.bytes;
    while (!held.empty() && total > hold_budget()) {  // free the oldest before allocating
        total -= held.front().bytes;
        held.erase(held.begin());
    }
    held.push_back(
        {key, bytes, std::shared_ptr<cache_t<E>>(make_cache<E>(n_cells, n_kv, n_layer, hkv, rope, variant))});
    return *static_cast<cache_t<E>*>(held.back().cache.get());
}

// Enough layers that the working set exceeds the yardstick buffer (cold cache).
std::uint32_t cold_layers(std::size_t bytes_per_layer) {
    return static_cast<std::uint32_t>(std::max<std::size_t>(2, kb::bench_buffer_bytes() / bytes_per_layer + 1));
}

std::vector<float> random_q(std::size_t n) {
    std::mt19937 rng(2);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(n);
    for (auto& x : q) x = nd(rng);
    return q;
}

// Wall-clock seconds spent in the kernel calls of the timed loop (bookkeeping excluded).
struct kernel_timer {
    double total = 0.0;
    template <class F>
    void run(F&& f) {
        const double t0 = kb::detail::now_s();
        f();
        total += kb::detail::now_s() - t0;
    }
};

// Per-iteration work -> counters. Rates use the kernel's own wall-clock time.
// yardstick_bw: bytes/s of the paired read or rmw yardstick (0 when bytes is 0);
// fma_peak: lane FMAs/s (0: measure it now).
void report(benchmark::State& state, const kernel_timer& timer, double bytes, double flops, double fmas,
            double yardstick_bw, double fma_peak, int threads) {
    const double iters = static_cast<double>(state.iterations());
    const double secs = timer.total > 0.0 ? timer.total : 1e-30;
    state.counters["threads"] = threads;
    if (bytes > 0) {
        state.SetBytesProcessed(static_cast<std::int64_t>(bytes * iters));
        state.counters["bw_frac"] = bytes * iters / secs / yardstick_bw;
        state.counters["yard_GBps"] = yardstick_bw * 1e-9;
    }
    if (flops > 0) state.counters["FLOP/s"] = flops * iters / secs;
    if (fma_peak <= 0.0) fma_peak = kb::measure_fma_peak(threads, true);
    else state.counters["yard_GFMAps"] = fma_peak * 1e-9;
    state.counters["peak_frac"] = fmas * iters / secs / fma_peak;
}

// Decode tokens per second that attention alone would allow in a 32-layer model of the
// benchmark's shape (32 query heads, 8 KV heads, head dim 128: Llama 3 8B): `tokens`
// sequences each get one token per step, a step runs one call like this per layer.
// Attention only: the weights' matrix products come on top (they read ~16 GB per step
// at f16 for 8B parameters, so a real engine's rate is far lower until the context is
// long); next to bw_frac it says what the GB/s mean for a user.
double tokens_per_s_32_layers(double tokens, double seconds_per_call) {
    return tokens / (32.0 * (seconds_per_call > 0.0 ? seconds_per_call : 1e-30));
}

// Runs the paired yardstick on `work` outside the benchmark's timed region.
void pair(benchmark::State& state, kb::paired_yardstick& yard, double work) {
    state.PauseTiming();
    yard.add(work);
    state.ResumeTiming();
}

// ---------------------------------------------------------------- attention decode

template <class E>
void attn_decode(benchmark::State& state, std::uint32_t n_kv, int threads, std::uint32_t hkv, kvcache::ops::kernel_path path,
                 kvcache::ops::prefetch_mode pm = kvcache::ops::prefetch_mode::automatic) {
    using T = typename E::storage_type;
    const std::size_t layer_bytes = std::size_t{n_kv} * hkv * head_dim * 2 * sizeof(T);
    const std::uint32_t n_layer = path == kvcache::ops::kernel_path::scalar ? 2 : cold_layers(layer_bytes);
    cache_t<E>* const cache = &shared_cache<E>(n_kv, n_kv, n_layer, hkv);
    const std::uint32_t nh = hkv * (n_head / n_head_kv_default);
    const auto q = random_q(std::size_t{nh} * head_dim);
    std::vector<float> out(std::size_t{nh} * head_dim);
    const pos_t qp = static_cast<pos_t>(n_kv);
    const seq_id_t qs = 0;
    kvcache::ops::attention_params p;
    p.n_head = nh;
    p.n_threads = threads;
    p.path = path;
    p.prefetch = pm;
    kvcache::ops::attention_workspace ws;
    kvcache::ops::attention(*cache, 0, q.data(), &qp, &qs, 1, p, out.data(), ws);  // size the workspace
    std::uint32_t layer = 0;
    kernel_timer timer;
    kb::paired_yardstick yard(kb::yardstick_kind::read, threads);
    const double bytes = static_cast<double>(layer_bytes);
    for (auto _ : state) {
        timer.run([&] { kvcache::ops::attention(*cache, layer, q.data(), &qp, &qs, 1, p, out.data(), ws); });
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        layer = layer + 1 == n_layer ? 0 : layer + 1;
        pair(state, yard, bytes);
    }
    const double fmas = 2.0 * n_kv * nh * head_dim;
    report(state, timer, bytes, 0.0, fmas, yard.rate(), 0.0, threads);
    if (path == kvcache::ops::kernel_path::simd && hkv == n_head_kv_default)
        state.counters["attn_tok_s_32l"] = tokens_per_s_32_layers(1.0, timer.total / static_cast<double>(state.iterations()));
}

// attn_decode/<q8_0|q4_0>/n_kv:<cells>/threads:<t>: decode over a quantized cache (blocks
// read in place: integer q.K on a 16-bit query, p.V with the scale folded into p;
// kernels/quant_decode.hpp); counter
// vs_f16 = f16 decode seconds / quantized decode seconds, the f16 decode of the same shape
// run in the same iterations outside the timed region; GBps: quantized bytes read per second;
// f16_GBps: the f16 side's bytes read per second.
// attn_decode_hot/<q8_0|q4_0>/n_kv:2048/threads:1: the same on one layer read again and
// again (in the caches, not DRAM): what the kernels cost in instructions, the bound when
// memory is not; counter cyc_cell = quantized seconds x the host's clock (KVCACHE_BENCH_GHZ,
// default 4.1) / (cells x KV heads), and vs_f16 as above.
template <class E>
void attn_decode_quant(benchmark::State& state, std::uint32_t n_kv, int threads, bool hot = false) {
    const std::uint32_t hkv = n_head_kv_default;
    const std::size_t layer_bytes = std::size_t{n_kv} * hkv * kvcache::values_bytes<E>(head_dim * 2);
    const std::size_t f16_layer_bytes = std::size_t{n_kv} * hkv * kvcache::values_bytes<kvcache::f16>(head_dim * 2);
    const std::uint32_t n_layer = hot ? 1 : cold_layers(layer_bytes), n_layer16 = hot ? 1 : cold_layers(f16_layer_bytes);
    cache_t<kvcache::f16>* const c16 = &shared_cache<kvcache::f16>(n_kv, n_kv, n_layer16, hkv);
    cache_t<E>* const cache = &shared_cache<E>(n_kv, n_kv, n_layer, hkv);
    const std::uint32_t nh = n_head;
    const auto q = random_q(std::size_t{nh} * head_dim);
    std::vector<float> out(std::size_t{nh} * head_dim);
    const pos_t qp = static_cast<pos_t>(n_kv);
    const seq_id_t qs = 0;
    kvcache::ops::attention_params p;
    p.n_head = nh;
    p.n_threads = threads;
    kvcache::ops::attention_workspace ws, ws16;
    kvcache::ops::attention(*cache, 0, q.data(), &qp, &qs, 1, p, out.data(), ws);
    kvcache::ops::attention(*c16, 0, q.data(), &qp, &qs, 1, p, out.data(), ws16);
    std::uint32_t layer = 0, layer16 = 0;
    kernel_timer timer, timer16;
    for (auto _ : state) {
        timer.run([&] { kvcache::ops::attention(*cache, layer, q.data(), &qp, &qs, 1, p, out.data(), ws); });
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        layer = layer + 1 == n_layer ? 0 : layer + 1;
        state.PauseTiming();
        timer16.run([&] { kvcache::ops::attention(*c16, layer16, q.data(), &qp, &qs, 1, p, out.data(), ws16); });
        benchmark::DoNotOptimize(out.data());
        layer16 = layer16 + 1 == n_layer16 ? 0 : layer16 + 1;
        state.ResumeTiming();
    }
    const double iters = static_cast<double>(state.iterations());
    state.counters["threads"] = threads;
    state.counters["vs_f16"] = timer16.total / (timer.total > 0.0 ? timer.total : 1e-30);
    state.counters["GBps"] = static_cast<double>(layer_bytes) * iters / (timer.total > 0.0 ? timer.total : 1e-30) * 1e-9;
    // The f16 side's own rate: compared across the threads:1 and threads:2 rows it shows
    // whether the host gave the VM its full bandwidth (f16 about 2x on two threads) or held
    // it back, which moves vs_f16 on two threads (bench/README.md, 2026-11-27, night).
    state.counters["f16_GBps"] =
        static_cast<double>(f16_layer_bytes) * iters / (timer16.total > 0.0 ? timer16.total : 1e-30) * 1e-9;
    if (hot) {
        const char* ghz = std::getenv("KVCACHE_BENCH_GHZ");
        const double hz = (ghz != nullptr ? std::strtod(ghz, nullptr) : 4.1) * 1e9;
        state.counters["cyc_cell"] = timer.total / iters * hz * threads / (static_cast<double>(n_kv) * hkv);
        state.counters["cyc_cell_f16"] = timer16.total / iters * hz * threads / (static_cast<double>(n_kv) * hkv);
    }
}

// ---------------------------------------------------------------- decode's access pattern, no arithmetic

// Reads the yardstick buffer the way decode reads one KV head: each thread's part is cut
// into two halves ("K" and "V") read alternately 8 KiB at a time (one f16 K tile, then
// the 32 V rows of the same cells). bw_frac against the plain read yardstick says how much
// of it this access pattern alone can reach on this machine, before any compute.
// Counters of the two-stream reads below: each thread reads its chunk of the yardstick
// buffer as two halves, `step` floats at a time.
void report_two_streams(benchmark::State& state, std::size_t n, std::size_t step, int threads, double seconds,
                        double yard_bw) {
    namespace kd = kb::detail;
    const std::size_t parts = static_cast<std::size_t>(kb::resolve_threads(threads));
    double bytes = 0.0;
    for (std::size_t k = 0; k < parts; ++k) {
        std::size_t b, e;
        kd::chunk(n, static_cast<int>(parts), static_cast<int>(k), b, e);
        bytes += 2.0 * static_cast<double>((e - b) / 2 / step * step * sizeof(float));
    }
    const double iters = static_cast<double>(state.iterations());
    state.counters["threads"] = threads;
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes * iters));
    state.counters["bw_frac"] = bytes * iters / (seconds > 0.0 ? seconds : 1e-30) / yard_bw;
    state.counters["yard_GBps"] = yard_bw * 1e-9;
}

// Reads each thread's chunk of the read yardstick's buffer as two streams (its halves),
// body(x, y, half, step) per thread, against a paired read yardstick.
template <class Body>
void two_stream_read(benchmark::State& state, int threads, Body body) {
    namespace kd = kb::detail;
    std::size_t n;
    const float* buf = kd::yardstick(n);
    constexpr std::size_t step = std::size_t{kvcache::k_tile} * head_dim * 2 / sizeof(float);  // one f16 K tile
    float sink = 0.0f;
    kernel_timer timer;
    kb::paired_yardstick yard(kb::yardstick_kind::read, threads);
    for (auto _ : state) {
        pair(state, yard, static_cast<double>(n * sizeof(float)));  // before: the pattern's pass would be cached otherwise
        timer.run([&] {
            float total = 0.0f;
            KVCACHE_OMP(parallel num_threads(threads) reduction(+ : total))
            {
                std::size_t b, e;
                kd::chunk(n, kb::resolve_threads(threads), kd::thread_id(), b, e);
                const std::size_t half = (e - b) / 2 / step * step;
                total += body(buf + b, buf + b + half, half, step);
            }
            sink += total;
        });
    }
    benchmark::DoNotOptimize(sink);
    report_two_streams(state, n, step, threads, timer.total, yard.rate());
}

void membw_kv_pattern(benchmark::State& state, int threads) {
    two_stream_read(state, threads, [](const float* x, const float* y, std::size_t half, std::size_t step) {
        float total = 0.0f;
        for (std::size_t o = 0; o < half; o += step) {
            total += kb::detail::read_range(x, o, o + step);
            total += kb::detail::read_range(y, o, o + step);
        }
        return total;
    });
}

// Decode's two streams with decode's arithmetic per byte (8 FMAs of 16 lanes per 64-byte
// line, as f16 K rows and V pieces get with 4 query heads), in two orders: `blocked`
// (8 KiB of one stream, then 8 KiB of the other: what a kernel that scores a tile and
// then accumulates its V reads) and `together` (one line of each in turn: the fused
// decode kernel). No kernel; shows what the order alone costs once there is compute.
struct fma8 {
    kb::detail::batch acc[8];
    fma8() {
        for (auto& a : acc) a = kb::detail::batch(0.0f);
    }
    void line(const float* p) {  // one 64-byte line
        for (std::size_t l = 0; l < 16; l += kb::detail::batch::size) {
            const kb::detail::batch x = kb::detail::batch::load_aligned(p + l);
            for (std::size_t i = 0; i < 8; ++i) acc[i] = xsimd::fma(x, kb::detail::batch(1.0f + 0.125f * static_cast<float>(i)), acc[i]);
        }
    }
    float sum() const {
        kb::detail::batch t(0.0f);
        for (const auto& a : acc) t += a;
        return xsimd::hadd(t);
    }
};

void membw_kv_compute(benchmark::State& state, bool together, int threads) {
    two_stream_read(state, threads, [together](const float* x, const float* y, std::size_t half, std::size_t step) {
        constexpr std::size_t line = 64 / sizeof(float);
        fma8 f;
        for (std::size_t o = 0; o < half; o += step) {
            if (together) {
                for (std::size_t i = o; i < o + step; i += line) {
                    f.line(x + i);
                    f.line(y + i);
                }
            } else {
                for (std::size_t i = o; i < o + step; i += line) f.line(x + i);
                for (std::size_t i = o; i < o + step; i += line) f.line(y + i);
            }
        }
        return f.sum();
    });
}

// ---------------------------------------------------------------- attention prefill

template <class E>
void attn_prefill(benchmark::State& state, std::uint32_t n_q, int threads, kvcache::ops::kernel_path path) {
    const std::uint32_t n_layer = 8;
    cache_t<E>* const cache = &shared_cache<E>(n_q, n_q, n_layer, n_head_kv_default);
    const auto q = random_q(std::size_t{n_q} * n_head * head_dim);
    std::vector<float> out(q.size());
    std::vector<pos_t> qp(n_q);
    std::iota(qp.begin(), qp.end(), 0);
    std::vector<seq_id_t> qs(n_q, 0);
    kvcache::ops::attention_params p;
    p.n_head = n_head;
    p.n_threads = threads;
    p.path = path;
    kvcache::ops::attention_workspace ws;
    kvcache::ops::attention(*cache, 0, q.data(), qp.data(), qs.data(), n_q, p, out.data(), ws);
    std::uint32_t layer = 0;
    kernel_timer timer;
    kb::paired_yardstick yard(kb::yardstick_kind::fma, threads);
    const double pairs = static_cast<double>(n_q) * (n_q + 1) / 2.0;  // causal: unmasked pairs only
    const double flops = pairs * n_head * 4.0 * head_dim;
    for (auto _ : state) {
        timer.run([&] { kvcache::ops::attention(*cache, layer, q.data(), qp.data(), qs.data(), n_q, p, out.data(), ws); });
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        layer = layer + 1 == n_layer ? 0 : layer + 1;
        if (path == kvcache::ops::kernel_path::simd) pair(state, yard, flops / 2.0);
    }
    report(state, timer, 0.0, flops, flops / 2.0, 0.0, path == kvcache::ops::kernel_path::simd ? yard.rate() : 0.0,
           threads);
}

// ---------------------------------------------------------------- many sequences per call (issue 26)

// A cache (Layout) holding sequence s at positions [0, cells[s]) in one run of cells per
// sequence (sequence 0 first), every layer's K and V random (a small pattern, copied).
// prefix > 0: sequence 0's first `prefix` positions are written first and shared by every
// sequence (seq_cp: a system prompt forked), whose own cells[s] follow at positions
// [prefix, prefix + cells[s]).
template <class E, class Layout>
std::unique_ptr<kvcache::kv_cache<E, Layout>> make_multi_cache(const std::vector<std::uint32_t>& cells,
                                                               std::uint32_t n_layer, std::uint32_t prefix = 0) {
    kvcache::model_shape s;
    s.n_layer = n_layer;
    s.n_head_kv = n_head_kv_default;
    s.head_dim_k = head_dim;
    std::uint32_t total = 0;
    for (auto c : cells) total += (c + 255) / 256 * 256;
    s.n_cells = total + (prefix + 255) / 256 * 256;
    s.n_seq_max = static_cast<std::uint32_t>(cells.size());
    auto cache = std::make_unique<kvcache::kv_cache<E, Layout>>(s);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    constexpr std::uint32_t chunk = 256;
    std::vector<float> pat(std::size_t{chunk} * s.k_row_size() + 4096);
    for (auto& x : pat) x = nd(rng);
    auto write = [&](std::size_t sq, std::uint32_t p0, std::uint32_t end) {
        for (; p0 < end; p0 += chunk) {
            const std::uint32_t n = std::min(chunk, end - p0);
            std::vector<pos_t> pos(n);
            std::iota(pos.begin(), pos.end(), static_cast<pos_t>(p0));
            std::vector<seq_id_t> seq(n, static_cast<seq_id_t>(sq));
            const auto pl = cache->place(pos, seq).value();
            for (std::uint32_t l = 0; l < n_layer; ++l) {
                const float* src = pat.data() + (l * 61u + sq * 17u + p0 / chunk) % 4096;
                cache->write_k(l, pl.cells, src);
                cache->write_v(l, pl.cells, src);
            }
            static_cast<void>(cache->commit());
        }
    };
    if (prefix > 0) {
        write(0, 0, prefix);
        for (std::size_t sq = 1; sq < cells.size(); ++sq)
            if (!cache->seq_cp(0, static_cast<seq_id_t>(sq), 0, static_cast<pos_t>(prefix)).ok()) std::abort();
    }
    for (std::size_t sq = 0; sq < cells.size(); ++sq) write(sq, prefix, prefix + cells[sq]);
    return cache;
}

// One call holding every row against one call per sequence, on the same cache, in the
// same run: `multi` and `separate` alternate (their order flips every iteration), each
// on the next layer (cold K/V). Counters: vs_separate = time of the separate calls /
// time of the one call; GBps (K/V bytes the rows' sequences hold / time of the one
// call); ms_multi, ms_separate. rows_of(s): the rows of sequence s (q positions).
// prefix > 0: the sequences share a prefix (make_multi_cache); GBps then counts the
// prefix once per sequence (what separate calls read), layers are sized by what is held.
template <class E, class Layout>
void attn_multi_vs_separate(benchmark::State& state, const std::vector<std::uint32_t>& cells,
                            const std::vector<std::vector<pos_t>>& rows_of, int threads, double fmas,
                            std::uint32_t prefix = 0) {
    using T = typename E::storage_type;
    std::size_t seq_bytes = 0, held = std::size_t{prefix} * n_head_kv_default * head_dim * 2 * sizeof(T);
    for (auto c : cells) seq_bytes += std::size_t{c + prefix} * n_head_kv_default * head_dim * 2 * sizeof(T);
    for (auto c : cells) held += std::size_t{c} * n_head_kv_default * head_dim * 2 * sizeof(T);
    const std::uint32_t n_layer = cold_layers(held);
    const auto cache = make_multi_cache<E, Layout>(cells, n_layer, prefix);
    std::vector<pos_t> qp;
    std::vector<seq_id_t> qs;
    std::vector<std::uint32_t> first;  // sequence s's rows: [first[s], first[s+1])
    for (std::size_t sq = 0; sq < rows_of.size(); ++sq) {
        first.push_back(static_cast<std::uint32_t>(qp.size()));
        for (pos_t p : rows_of[sq]) {
            qp.push_back(p);
            qs.push_back(static_cast<seq_id_t>(sq));
        }
    }
    first.push_back(static_cast<std::uint32_t>(qp.size()));
    const auto n_q = static_cast<std::uint32_t>(qp.size());
    const auto q = random_q(std::size_t{n_q} * n_head * head_dim);
    std::vector<float> out(q.size()), out_sep(q.size());
    kvcache::ops::attention_params p;
    p.n_head = n_head;
    p.n_threads = threads;
    kvcache::ops::attention_workspace ws;
    auto one_call = [&](std::uint32_t layer) {
        kvcache::ops::attention(*cache, layer, q.data(), qp.data(), qs.data(), n_q, p, out.data(), ws);
    };
    auto separate = [&](std::uint32_t layer) {
        for (std::size_t sq = 0; sq + 1 < first.size(); ++sq) {
            const std::uint32_t b = first[sq], e = first[sq + 1];
            if (b == e) continue;
            kvcache::ops::attention(*cache, layer, q.data() + std::size_t{b} * n_head * head_dim, qp.data() + b,
                                    qs.data() + b, e - b, p, out_sep.data() + std::size_t{b} * n_head * head_dim, ws);
        }
    };
    one_call(0);  // size the workspace
    separate(0);
    kernel_timer t_multi, t_sep;
    std::uint32_t layer = 0;
    bool multi_first = true;
    for (auto _ : state) {
        if (multi_first) {
            t_multi.run([&] { one_call(layer); });
            layer = layer + 1 == n_layer ? 0 : layer + 1;
            t_sep.run([&] { separate(layer); });
        } else {
            t_sep.run([&] { separate(layer); });
            layer = layer + 1 == n_layer ? 0 : layer + 1;
            t_multi.run([&] { one_call(layer); });
        }
        layer = layer + 1 == n_layer ? 0 : layer + 1;
        multi_first = !multi_first;
        benchmark::DoNotOptimize(out.data());
        benchmark::DoNotOptimize(out_sep.data());
        benchmark::ClobberMemory();
    }
    // The two results agree bit for bit (deterministic mode): a wrong schedule shows here.
    one_call(0);
    separate(0);
    if (std::memcmp(out.data(), out_sep.data(), out.size() * sizeof(float)) != 0)
        state.SkipWithError("one call and separate calls differ");
    const double iters = static_cast<double>(state.iterations());
    const double tm = t_multi.total > 0.0 ? t_multi.total : 1e-30;
    state.counters["threads"] = threads;
    state.counters["vs_separate"] = t_sep.total / tm;
    state.counters["ms_multi"] = tm / iters * 1e3;
    state.counters["ms_separate"] = t_sep.total / iters * 1e3;
    state.counters["GBps"] = static_cast<double>(seq_bytes) * iters / tm * 1e-9;
    if (fmas > 0.0) state.counters["peak_frac"] = fmas * iters / tm / kb::measure_fma_peak(threads, true);
    state.counters["attn_tok_s_32l"] = tokens_per_s_32_layers(static_cast<double>(rows_of.size()), tm / iters);
}

// attn_decode_multi: n_seq sequences of n_kv cells, one decode row each.
template <class E, class Layout>
void attn_decode_multi(benchmark::State& state, std::uint32_t n_seq, std::uint32_t n_kv, int threads) {
    std::vector<std::uint32_t> cells(n_seq, n_kv);
    std::vector<std::vector<pos_t>> rows(n_seq, std::vector<pos_t>{static_cast<pos_t>(n_kv)});
    attn_multi_vs_separate<E, Layout>(state, cells, rows, threads, 0.0);
}

// attn_mixed: a prefill chunk of n_pre rows of sequence 0 (its K/V already written, as
// a prefill step does before attention) next to one decode row of each of n_dec other
// sequences of n_kv cells: continuous batching. peak_frac counts the chunk's unmasked
// pairs and the decode rows' cells.
template <class E, class Layout>
void attn_mixed(benchmark::State& state, std::uint32_t n_pre, std::uint32_t n_dec, std::uint32_t n_kv, int threads) {
    std::vector<std::uint32_t> cells(n_dec + 1, n_kv);
    cells[0] = n_pre;
    std::vector<std::vector<pos_t>> rows(n_dec + 1, std::vector<pos_t>{static_cast<pos_t>(n_kv)});
    rows[0].resize(n_pre);
    std::iota(rows[0].begin(), rows[0].end(), 0);
    const double pairs = static_cast<double>(n_pre) * (n_pre + 1) / 2.0 + static_cast<double>(n_dec) * n_kv;
    attn_multi_vs_separate<E, Layout>(state, cells, rows, threads, pairs * n_head * 2.0 * head_dim);
}

// attn_decode_shared: n_seq forks of one prefix of `prefix` cells (seq_cp), each with
// `own` cells of its own, one decode row each: the prefix is read once for all rows
// (cascade). peak_frac counts every row's cells (prefix + own) x heads x (dk + dv) FMAs.
template <class E, class Layout>
void attn_decode_shared(benchmark::State& state, std::uint32_t n_seq, std::uint32_t prefix, std::uint32_t own,
                        int threads) {
    std::vector<std::uint32_t> cells(n_seq, own);
    std::vector<std::vector<pos_t>> rows(n_seq, std::vector<pos_t>{static_cast<pos_t>(prefix + own)});
    const double fmas = static_cast<double>(n_seq) * (prefix + own) * n_head * 2.0 * head_dim;
    attn_multi_vs_separate<E, Layout>(state, cells, rows, threads, fmas, prefix);
}

// The cost of deterministic mode (issue 26, item 6): one decode row of one sequence,
// each iteration running the call once with p.deterministic = true (timed) and once with
// false (timed on its own), on the same cache, one after the other in alternating order,
// so both see the same machine state. Counter det_cost: deterministic seconds / non-deterministic seconds (1.0: free).
// The two modes differ in the split-K rule (deterministic: parts of >= 4096 cells, a
// function of the cells; otherwise: parts chosen for the threads) and in how a small slot
// group sums its scores; bw_frac is the deterministic run's.
template <class E>
void attn_decode_det(benchmark::State& state, std::uint32_t n_kv, int threads) {
    using T = typename E::storage_type;
    const std::size_t layer_bytes = std::size_t{n_kv} * n_head_kv_default * head_dim * 2 * sizeof(T);
    const std::uint32_t n_layer = cold_layers(layer_bytes);
    cache_t<E>* const cache = &shared_cache<E>(n_kv, n_kv, n_layer, n_head_kv_default);
    const auto q = random_q(std::size_t{n_head} * head_dim);
    std::vector<float> out(std::size_t{n_head} * head_dim), out_free(out.size());
    const pos_t qp = static_cast<pos_t>(n_kv);
    const seq_id_t qs = 0;
    kvcache::ops::attention_params det, free_p;
    det.n_head = free_p.n_head = n_head;
    det.n_threads = free_p.n_threads = threads;
    det.deterministic = true;
    free_p.deterministic = false;
    kvcache::ops::attention_workspace ws, ws_free;
    kvcache::ops::attention(*cache, 0, q.data(), &qp, &qs, 1, det, out.data(), ws);  // size the workspaces
    kvcache::ops::attention(*cache, 0, q.data(), &qp, &qs, 1, free_p, out_free.data(), ws_free);
    std::uint32_t layer = 0;
    kernel_timer timer, free_timer;
    kb::paired_yardstick yard(kb::yardstick_kind::read, threads);
    const double bytes = static_cast<double>(layer_bytes);
    // Each call reads a layer the other did not just read (the next one; the cache holds
    // enough layers that none is still in L3), and the two alternate which goes first.
    auto next = [&] { layer = layer + 1 == n_layer ? 0 : layer + 1; };
    auto run_det = [&] { timer.run([&] { kvcache::ops::attention(*cache, layer, q.data(), &qp, &qs, 1, det, out.data(), ws); }); };
    auto run_free = [&] {
        free_timer.run([&] { kvcache::ops::attention(*cache, layer, q.data(), &qp, &qs, 1, free_p, out_free.data(), ws_free); });
    };
    bool det_first = true;
    for (auto _ : state) {
        if (det_first) {
            run_det();
            state.PauseTiming();
            next();
            run_free();
        } else {
            state.PauseTiming();
            run_free();
            next();
            state.ResumeTiming();
            run_det();
            state.PauseTiming();
        }
        benchmark::DoNotOptimize(out_free.data());
        yard.add(bytes);
        state.ResumeTiming();
        det_first = !det_first;
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
        next();
    }
    report(state, timer, bytes, 0.0, 2.0 * n_kv * n_head * head_dim, yard.rate(), 0.0, threads);
    state.counters["det_cost"] = timer.total / (free_timer.total > 0.0 ? free_timer.total : 1e-30);
}

template <class E>
void register_multi() {
    const std::string t(E::name);
    using contiguous = kvcache::contiguous<>;
    using paged = kvcache::paged<>;
    for (int th : {1, 2, 4, 8, 16}) {
        const std::string ts = "/threads:" + std::to_string(th);
        benchmark::RegisterBenchmark(("attn_decode_multi/" + t + "/n_seq:16/n_kv:2048/contiguous" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_decode_multi<E, contiguous>(st, 16, 2048, th); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("attn_decode_multi/" + t + "/n_seq:16/n_kv:2048/paged" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_decode_multi<E, paged>(st, 16, 2048, th); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("attn_mixed/" + t + "/prefill:512/decode:15/contiguous" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_mixed<E, contiguous>(st, 512, 15, 2048, th); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("attn_mixed/" + t + "/prefill:512/decode:15/paged" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_mixed<E, paged>(st, 512, 15, 2048, th); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("attn_decode_shared/" + t + "/n_seq:16/prefix:8192/own:256/contiguous" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_decode_shared<E, contiguous>(st, 16, 8192, 256, th); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("attn_decode_shared/" + t + "/n_seq:16/prefix:8192/own:256/paged" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_decode_shared<E, paged>(st, 16, 8192, 256, th); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
        for (std::uint32_t n : {2048u, 16384u})
            benchmark::RegisterBenchmark(("attn_decode_det/" + t + "/n_kv:" + std::to_string(n) + ts).c_str(),
                                         [n, th](benchmark::State& st) { attn_decode_det<E>(st, n, th); })
                ->UseRealTime()->Unit(benchmark::kMicrosecond);
    }
}

// ---------------------------------------------------------------- K-shift

template <class E>
void kshift(benchmark::State& state, kvcache::rope_type type, int threads, kvcache::ops::kernel_path path) {
    using T = typename E::storage_type;
    constexpr std::uint32_t n_cells = 16384;
    const std::size_t k_layer_bytes = std::size_t{n_cells} * n_head_kv_default * head_dim * sizeof(T);
    const std::uint32_t n_layer = path == kvcache::ops::kernel_path::scalar ? 1 : cold_layers(k_layer_bytes);
    cache_t<E>* const cache = &shared_cache<E>(n_cells, n_cells, n_layer, n_head_kv_default, type);
    std::int32_t delta = 1;
    kernel_timer timer;
    kb::paired_yardstick yard(kb::yardstick_kind::rmw, threads);
    const double bytes = 2.0 * static_cast<double>(k_layer_bytes) * n_layer;  // read + write, every layer
    for (auto _ : state) {
        state.PauseTiming();
        cache->seq_add(0, 0, -1, delta).value();  // bookkeeping, not timed
        delta = -delta;
        if (path == kvcache::ops::kernel_path::simd) yard.add(bytes);
        state.ResumeTiming();
        timer.run([&] { kvcache::ops::apply_k_shift(*cache, threads, path); });
    }
    const double fmas = 2.0 * static_cast<double>(n_cells) * n_head_kv_default * head_dim * n_layer;
    report(state, timer, bytes, 0.0, fmas, path == kvcache::ops::kernel_path::simd ? yard.rate() : kb::measure_rmw_bw(threads, true),
           0.0, threads);
}

// K-shift of a cache with scaled RoPE (llama3 or YaRN), paired with the plain K-shift of a
// cache of the same size: each iteration shifts the plain cache, then the scaled one, each
// timed on its own, so both see the same machine state (a contended host drifts). Counter
// vs_plain: scaled seconds / plain seconds (target <= 1.10: only the per-delta tables
// differ, computed once per distinct delta; the rotation kernel is the same).
template <class E>
void kshift_scaled(benchmark::State& state, kvcache::rope_type type, rope_variant variant, int threads) {
    using T = typename E::storage_type;
    constexpr std::uint32_t n_cells = 16384;
    const std::size_t k_layer_bytes = std::size_t{n_cells} * n_head_kv_default * head_dim * sizeof(T);
    const std::uint32_t n_layer = cold_layers(k_layer_bytes);
    cache_t<E>* const plain = &shared_cache<E>(n_cells, n_cells, n_layer, n_head_kv_default, type);
    cache_t<E>* const scaled = &shared_cache<E>(n_cells, n_cells, n_layer, n_head_kv_default, type, variant);
    std::int32_t delta = 1;
    kernel_timer timer, plain_timer;
    for (auto _ : state) {
        state.PauseTiming();
        plain->seq_add(0, 0, -1, delta).value();  // bookkeeping, not timed
        scaled->seq_add(0, 0, -1, delta).value();
        delta = -delta;
        plain_timer.run([&] { kvcache::ops::apply_k_shift(*plain, threads); });
        state.ResumeTiming();
        timer.run([&] { kvcache::ops::apply_k_shift(*scaled, threads); });
    }
    const double bytes = 2.0 * static_cast<double>(k_layer_bytes) * n_layer;
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes * static_cast<double>(state.iterations())));
    state.counters["threads"] = threads;
    state.counters["vs_plain"] = timer.total / (plain_timer.total > 0.0 ? plain_timer.total : 1e-30);
}

// kshift/<q8_0|q4_0>/<rope>/n_cells:16384/threads:<t>: the K-shift of a quantized K
// (dequantize, rotate with the exact angles, requantize the moved cells), paired with the
// f16 K-shift of a cache with the same cells, each timed on its own in every iteration.
// Counters: vs_f16 = f16 seconds / quantized seconds (target >= 0.8), f16_GBps = the f16
// K-shift's bytes read and written per second, bw_frac = quantized K
// bytes read and written per second over the read-modify-write yardstick.
template <class E>
void kshift_quant(benchmark::State& state, kvcache::rope_type type, int threads) {
    constexpr std::uint32_t n_cells = 16384;
    const std::size_t k_layer_bytes = std::size_t{n_cells} * n_head_kv_default * kvcache::values_bytes<E>(head_dim);
    const std::size_t f16_layer_bytes =
        std::size_t{n_cells} * n_head_kv_default * kvcache::values_bytes<kvcache::f16>(head_dim);
    const std::uint32_t n_layer = cold_layers(k_layer_bytes), n_layer16 = cold_layers(f16_layer_bytes);
    cache_t<E>* const cache = &shared_cache<E>(n_cells, n_cells, n_layer, n_head_kv_default, type);
    cache_t<kvcache::f16>* const c16 = &shared_cache<kvcache::f16>(n_cells, n_cells, n_layer16, n_head_kv_default, type);
    std::int32_t delta = 1;
    kernel_timer timer, timer16;
    kb::paired_yardstick yard(kb::yardstick_kind::rmw, threads);
    const double bytes = 2.0 * static_cast<double>(k_layer_bytes) * n_layer;
    for (auto _ : state) {
        state.PauseTiming();
        cache->seq_add(0, 0, -1, delta).value();  // bookkeeping, not timed
        c16->seq_add(0, 0, -1, delta).value();
        delta = -delta;
        yard.add(bytes);
        timer16.run([&] { kvcache::ops::apply_k_shift(*c16, threads); });
        state.ResumeTiming();
        timer.run([&] { kvcache::ops::apply_k_shift(*cache, threads); });
    }
    const double fmas = 2.0 * static_cast<double>(n_cells) * n_head_kv_default * head_dim * n_layer;
    report(state, timer, bytes, 0.0, fmas, yard.rate(), 0.0, threads);
    // per-layer times: the two caches may hold a different number of layers (cold_layers)
    const double t = timer.total / static_cast<double>(n_layer), t16 = timer16.total / static_cast<double>(n_layer16);
    state.counters["vs_f16"] = t16 / (t > 0.0 ? t : 1e-30);
    // the f16 K-shift's own read + write rate (see attn_decode_quant's f16_GBps)
    state.counters["f16_GBps"] = 2.0 * static_cast<double>(f16_layer_bytes) * static_cast<double>(state.iterations()) /
                                 (t16 > 0.0 ? t16 : 1e-30) * 1e-9;
}

template <class E>
void register_type() {
    using kvcache::ops::kernel_path;
    const std::string t(E::name);
    for (int th : {1, 2, 4, 8, 16}) {
        const std::string ts = "/threads:" + std::to_string(th);
        for (std::uint32_t n : {1024u, 4096u, 16384u, 65536u})
            benchmark::RegisterBenchmark(("attn_decode/" + t + "/n_kv:" + std::to_string(n) + ts).c_str(),
                                         [n, th](benchmark::State& st) { attn_decode<E>(st, n, th, n_head_kv_default, kernel_path::simd); })
                ->UseRealTime()->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(("attn_decode/" + t + "/n_kv:16384/hkv:2" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_decode<E>(st, 16384, th, 2, kernel_path::simd); })
            ->UseRealTime()->Unit(benchmark::kMicrosecond);
        // The prefetch strategies side by side (the plain rows use prefetch_mode::automatic).
        for (auto pm : {kvcache::ops::prefetch_mode::none, kvcache::ops::prefetch_mode::burst,
                        kvcache::ops::prefetch_mode::interleaved}) {
            const std::string pn = pm == kvcache::ops::prefetch_mode::none    ? "none"
                                   : pm == kvcache::ops::prefetch_mode::burst ? "burst"
                                                                              : "interleaved";
            benchmark::RegisterBenchmark(("attn_decode_prefetch/" + pn + "/" + t + "/n_kv:16384" + ts).c_str(),
                                         [th, pm](benchmark::State& st) {
                                             attn_decode<E>(st, 16384, th, n_head_kv_default, kernel_path::simd, pm);
                                         })
                ->UseRealTime()->Unit(benchmark::kMicrosecond);
        }
        benchmark::RegisterBenchmark(("attn_prefill/" + t + "/n_q:512/n_kv:512" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_prefill<E>(st, 512, th, kernel_path::simd); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
        for (auto rt : {kvcache::rope_type::normal, kvcache::rope_type::neox}) {
            const std::string rn = rt == kvcache::rope_type::normal ? "normal" : "neox";
            benchmark::RegisterBenchmark(("kshift/" + t + "/" + rn + "/n_cells:16384" + ts).c_str(),
                                         [rt, th](benchmark::State& st) { kshift<E>(st, rt, th, kernel_path::simd); })
                ->UseRealTime()->Unit(benchmark::kMillisecond);
            for (auto v : {rope_variant::llama3, rope_variant::yarn}) {
                const std::string vn = v == rope_variant::llama3 ? "llama3" : "yarn";
                benchmark::RegisterBenchmark(("kshift_rope/" + t + "/" + rn + "/" + vn + "/n_cells:16384" + ts).c_str(),
                                             [rt, v, th](benchmark::State& st) { kshift_scaled<E>(st, rt, v, th); })
                    ->UseRealTime()->Unit(benchmark::kMillisecond);
            }
        }
    }
    // Scalar reference (single thread).
    benchmark::RegisterBenchmark(("attn_decode_scalar/" + t + "/n_kv:16384/threads:1").c_str(),
                                 [](benchmark::State& st) { attn_decode<E>(st, 16384, 1, n_head_kv_default, kernel_path::scalar); })
        ->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("attn_prefill_scalar/" + t + "/n_q:512/n_kv:512/threads:1").c_str(),
                                 [](benchmark::State& st) { attn_prefill<E>(st, 512, 1, kernel_path::scalar); })
        ->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(2);
    for (auto rt : {kvcache::rope_type::normal, kvcache::rope_type::neox}) {
        const std::string rn = rt == kvcache::rope_type::normal ? "normal" : "neox";
        benchmark::RegisterBenchmark(("kshift_scalar/" + t + "/" + rn + "/n_cells:16384/threads:1").c_str(),
                                     [rt](benchmark::State& st) { kshift<E>(st, rt, 1, kernel_path::scalar); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
    }
}

const bool registered = [] {
    for (int th : {1, 2, 4, 8, 16})
        benchmark::RegisterBenchmark(("membw_kv_pattern/threads:" + std::to_string(th)).c_str(),
                                     [th](benchmark::State& st) { membw_kv_pattern(st, th); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
    for (int th : {1, 2, 4, 8, 16})
        for (bool together : {false, true})
            benchmark::RegisterBenchmark(
                ("membw_kv_compute/" + std::string(together ? "together" : "blocked") + "/threads:" + std::to_string(th))
                    .c_str(),
                [th, together](benchmark::State& st) { membw_kv_compute(st, together, th); })
                ->UseRealTime()
                ->Unit(benchmark::kMillisecond);
    register_type<kvcache::f16>();
    register_multi<kvcache::f16>();
    for (int th : {1, 2, 4, 8, 16}) {
        const std::string ts = "/n_kv:16384/threads:" + std::to_string(th);
        benchmark::RegisterBenchmark(("attn_decode/q8_0" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_decode_quant<kvcache::q8_0>(st, 16384, th); })
            ->UseRealTime()->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(("attn_decode/q4_0" + ts).c_str(),
                                     [th](benchmark::State& st) { attn_decode_quant<kvcache::q4_0>(st, 16384, th); })
            ->UseRealTime()->Unit(benchmark::kMicrosecond);
        if (th == 1) {
            benchmark::RegisterBenchmark("attn_decode_hot/q8_0/n_kv:2048/threads:1",
                                         [](benchmark::State& st) { attn_decode_quant<kvcache::q8_0>(st, 2048, 1, true); })
                ->UseRealTime()->Unit(benchmark::kMicrosecond);
            benchmark::RegisterBenchmark("attn_decode_hot/q4_0/n_kv:2048/threads:1",
                                         [](benchmark::State& st) { attn_decode_quant<kvcache::q4_0>(st, 2048, 1, true); })
                ->UseRealTime()->Unit(benchmark::kMicrosecond);
        }
        for (auto rt : {kvcache::rope_type::normal, kvcache::rope_type::neox}) {
            const std::string rn = rt == kvcache::rope_type::normal ? "normal" : "neox";
            const std::string ks = "/" + rn + "/n_cells:16384/threads:" + std::to_string(th);
            benchmark::RegisterBenchmark(("kshift/q8_0" + ks).c_str(),
                                         [rt, th](benchmark::State& st) { kshift_quant<kvcache::q8_0>(st, rt, th); })
                ->UseRealTime()->Unit(benchmark::kMillisecond);
            benchmark::RegisterBenchmark(("kshift/q4_0" + ks).c_str(),
                                         [rt, th](benchmark::State& st) { kshift_quant<kvcache::q4_0>(st, rt, th); })
                ->UseRealTime()->Unit(benchmark::kMillisecond);
        }
    }
    register_type<kvcache::f32>();
    register_type<kvcache::bf16>();
    return true;
}();

}  // namespace
