// kvcache benchmarks: this machine's own yardsticks, measured by the benchmark binary.
//
// Every kernel benchmark reports its speed as a fraction of a yardstick measured by
// the same binary, with the same OpenMP thread count, close in time to the kernel:
//   measure_read_bw(t)   read-only streaming bandwidth (bytes/s): attention
//   measure_rmw_bw(t)    in-place read-modify-write bandwidth (bytes read + written / s),
//                        x[i] *= c over a large array: K-shift
//   measure_copy_bw(t)   copy bandwidth (bytes read + written / s), dst = src: state save/load, defrag
//   measure_fma_peak(t)  f32 fused multiply-adds per second (lanes, not instructions) from
//                        register-resident independent FMA chains: peak_frac of every kernel
// Buffers are far larger than the last-level cache (bench_buffer_bytes()). Results are
// cached per thread count; pass fresh = true to re-measure (the machine drifts: benchmarks
// re-measure right after their timed loop).
#pragma once

#include <xsimd/xsimd.hpp>

#include <algorithm>  // std::max, std::min, std::sort
#include <chrono>     // timing
#include <cstddef>    // std::size_t
#include <cstdint>    // std::uint64_t
#include <cstdlib>    // std::getenv, std::strtoull
#include <cstring>    // std::memset
#include <map>        // per-thread-count cache
#include <memory>     // buffers
#include <mutex>      // cache guard
#include <new>        // aligned new
#include <string>     // names

#include <kvcache/config.hpp>
#include <kvcache/layout/kv_storage.hpp>  // huge_page_bytes, detail::advise_huge_pages

namespace kvcache::bench {

using kvcache::huge_page_bytes;

/// Threads an OpenMP region will use for a requested count (<= 0: the OpenMP default).
using kvcache::resolve_threads;

/// Bytes of the yardstick buffer (and of the working set kernels rotate over for a cold
/// cache): 1 GiB by default, far more than the L3 one core can use on current x86 server
/// parts (32-96 MiB per CCD). Override with KVCACHE_BENCH_BUFFER_MIB (at least 64).
inline std::size_t bench_buffer_bytes() {
    if (const char* env = std::getenv("KVCACHE_BENCH_BUFFER_MIB"))
        return std::max<std::size_t>(64, std::strtoull(env, nullptr, 10)) << 20;
    return std::size_t{1} << 30;
}

namespace detail {

struct free_aligned {
    void operator()(float* p) const noexcept { ::operator delete[](p, std::align_val_t{huge_page_bytes}); }
};
using buffer = std::unique_ptr<float[], free_aligned>;

/// A buffer of n floats, every page touched (so timing sees no page faults), placed and
/// advised like the cache's K/V buffers (2 MiB aligned, huge pages where the kernel
/// allows): yardstick and kernels then pay the same for address translation.
inline buffer make_buffer(std::size_t n, float value) {
    auto* p = static_cast<float*>(::operator new[](n * sizeof(float), std::align_val_t{huge_page_bytes}));
    static_cast<void>(kvcache::detail::advise_huge_pages(p, n * sizeof(float)));
    KVCACHE_OMP(parallel for schedule(static))
    for (std::size_t i = 0; i < n; ++i) p[i] = value;
    return buffer(p);
}

inline double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Median of `reps` timings of f() (after one warm-up call), in seconds.
template <class F>
double median_time(int reps, F&& f) {
    f();
    double t[16];
    reps = std::min(reps, 16);
    for (int r = 0; r < reps; ++r) {
        const double t0 = now_s();
        f();
        t[r] = now_s() - t0;
    }
    std::sort(t, t + reps);
    return t[reps / 2];
}

using batch = xsimd::batch<float>;
constexpr std::size_t lanes = batch::size;

/// Sums [b, e) with 4 independent accumulators (keeps the loads, not the adds, the limit).
inline float read_range(const float* p, std::size_t b, std::size_t e) {
    batch a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
    for (std::size_t i = b; i < e; i += 4 * lanes) {
        a0 += batch::load_aligned(p + i);
        a1 += batch::load_aligned(p + i + lanes);
        a2 += batch::load_aligned(p + i + 2 * lanes);
        a3 += batch::load_aligned(p + i + 3 * lanes);
    }
    return xsimd::hadd((a0 + a1) + (a2 + a3));
}

/// x[i] *= f over [b, e) in place (the rmw yardstick's loop).
inline void scale_range(float* p, std::size_t b, std::size_t e, float f) {
    const batch fb(f);
    for (std::size_t i = b; i < e; i += lanes) (batch::load_aligned(p + i) * fb).store_aligned(p + i);
}

/// Independent FMA chains in registers: more than FMA latency x FMA pipes on current x86
/// cores (4 x 2), and few enough to stay in registers with the two constants: 16 with 32
/// vector registers (AVX-512), 12 with 16 (AVX2). 16 chains on AVX2 left three of them on
/// the stack, each step a load, FMA and store in a chain through memory, and the yardstick
/// read about half the FMA peak (Zen 3: 27 against 47 G lane-FMA/s), so every AVX2
/// `peak_frac` measured before 2026-11-27 reads about 1.75x too high.
constexpr int fma_chain_count = lanes >= 16 ? 16 : 12;

/// fma_chain_count chains of `iters` FMA steps each (the FMA yardstick's loop); returns
/// their sum so the compiler keeps them.
inline float fma_chains(std::uint64_t iters) {
    constexpr int chains = fma_chain_count;
    batch acc[chains];
    for (int c = 0; c < chains; ++c) acc[c] = batch(static_cast<float>(c) * 1e-3f);
    const batch a(0.999999f), b(1e-7f);
    for (std::uint64_t i = 0; i < iters; ++i)
        for (int c = 0; c < chains; ++c) acc[c] = xsimd::fma(acc[c], a, b);
    batch s(0.0f);
    for (int c = 0; c < chains; ++c) s += acc[c];
    return xsimd::hadd(s);
}

/// Splits n (a multiple of 4*lanes) into `parts` chunks that are multiples of 4*lanes.
inline void chunk(std::size_t n, int parts, int k, std::size_t& b, std::size_t& e) {
    const std::size_t blocks = n / (4 * lanes);
    b = blocks * static_cast<std::size_t>(k) / static_cast<std::size_t>(parts) * 4 * lanes;
    e = blocks * static_cast<std::size_t>(k + 1) / static_cast<std::size_t>(parts) * 4 * lanes;
}

inline int thread_id() {
#if defined(_OPENMP)
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/// Cached yardsticks per (kind, threads).
inline double cached(const std::string& kind, int threads, bool fresh, double (*measure)(int)) {
    static std::mutex m;
    static std::map<std::pair<std::string, int>, double> cache;
    const std::lock_guard<std::mutex> lock(m);
    auto key = std::make_pair(kind, threads);
    auto it = cache.find(key);
    if (!fresh && it != cache.end()) return it->second;
    const double v = measure(threads);
    cache[key] = v;
    return v;
}

/// The one yardstick buffer (allocated and touched once: page faults are not timed).
/// Holds values in {0.5, 1, 2}. n is a multiple of 8 * lanes.
inline float* yardstick(std::size_t& n) {
    static const std::size_t count = bench_buffer_bytes() / sizeof(float) / (8 * lanes) * (8 * lanes);
    static const buffer buf = make_buffer(count, 1.0f);
    n = count;
    return buf.get();
}

inline double measure_read_impl(int threads) {
    std::size_t n;
    const float* buf = yardstick(n);
    float sink = 0.0f;
    const double t = median_time(5, [&] {
        float total = 0.0f;
        KVCACHE_OMP(parallel num_threads(threads) reduction(+ : total))
        {
            std::size_t b, e;
            chunk(n, resolve_threads(threads), thread_id(), b, e);
            total += read_range(buf, b, e);
        }
        sink += total;
    });
    volatile float keep = sink;
    static_cast<void>(keep);
    return static_cast<double>(n * sizeof(float)) / t;
}

inline double measure_rmw_impl(int threads) {
    std::size_t n;
    float* const p = yardstick(n);
    // Alternating factors keep the values bounded over repetitions.
    float factor = 0.5f;
    const double t = median_time(5, [&] {
        KVCACHE_OMP(parallel num_threads(threads))
        {
            std::size_t b, e;
            chunk(n, resolve_threads(threads), thread_id(), b, e);
            scale_range(p, b, e, factor);
        }
        factor = factor == 0.5f ? 2.0f : 0.5f;
    });
    return 2.0 * static_cast<double>(n * sizeof(float)) / t;
}

inline double measure_copy_impl(int threads) {
    std::size_t n2;
    float* const src = yardstick(n2);
    const std::size_t n = n2 / 2;
    float* const dst = src + n;
    const double t = median_time(5, [&] {
        KVCACHE_OMP(parallel num_threads(threads))
        {
            std::size_t b, e;
            chunk(n, resolve_threads(threads), thread_id(), b, e);
            for (std::size_t i = b; i < e; i += lanes) batch::load_aligned(src + i).store_aligned(dst + i);
        }
    });
    return 2.0 * static_cast<double>(n * sizeof(float)) / t;
}

inline double measure_fma_impl(int threads) {
    constexpr std::uint64_t iters = 4'000'000;
    float sink = 0.0f;
    const double t = median_time(5, [&] {
        float total = 0.0f;
        KVCACHE_OMP(parallel num_threads(threads) reduction(+ : total))
        total += fma_chains(iters);
        sink += total;
    });
    volatile float keep = sink;
    static_cast<void>(keep);
    return static_cast<double>(iters) * fma_chain_count * lanes * resolve_threads(threads) / t;
}

/// Runs body(b, e) on every thread's part of [0, count) (multiples of 4 * lanes) and
/// returns the seconds from the moment every thread is running to the moment the last one
/// is done: the bandwidth of `threads` busy threads, without waking them up.
template <class Body>
double timed_parts(int threads, std::size_t count, Body&& body) {
    double t0 = 0.0, t1 = 0.0;
    KVCACHE_OMP(parallel num_threads(threads))
    {
        KVCACHE_OMP(barrier)
        KVCACHE_OMP(master)
        t0 = now_s();
        std::size_t b, e;
        chunk(count, resolve_threads(threads), thread_id(), b, e);
        body(b, e);
        KVCACHE_OMP(barrier)
        KVCACHE_OMP(master)
        t1 = now_s();
    }
    return t1 - t0;
}

}  // namespace detail

/// Which yardstick a paired_yardstick runs.
enum class yardstick_kind { read, rmw, fma };

/// A yardstick measured in step with a kernel, so that both see the same moment of a
/// machine whose memory rate drifts by up to 2x between minutes. After each timed kernel
/// call the benchmark calls add(work) with the kernel's work (bytes for read / rmw, lane
/// FMAs for fma); once the work since the last run reaches a minimum chunk (64 MiB of
/// traffic, or 2^28 lane FMAs) the yardstick does that much work itself, on the next part
/// of the yardstick buffer (cold: the buffer and the kernel's data together exceed the
/// last-level cache many times over). rate() is the yardstick's work per second over all
/// its runs; a kernel's fraction is its own rate over rate(). Call it outside the
/// kernel's timed region (PauseTiming). Timing starts once every thread is running, so
/// a kernel that pays for waking its threads is not credited with that cost.
class paired_yardstick {
public:
    paired_yardstick(yardstick_kind kind, int threads) : kind_(kind), threads_(threads) {}

    void add(double work) {
        pending_ += work;
        const double min_chunk = kind_ == yardstick_kind::fma ? double(1u << 28) : double(64u << 20);
        if (pending_ >= min_chunk) run(pending_);
    }
    /// Runs what is pending (at least one minimum chunk's worth overall) and returns work/s.
    double rate() {
        if (pending_ > 0.0 || seconds_ == 0.0) run(std::max(pending_, 64.0 * (1u << 20)));
        return seconds_ > 0.0 ? work_ / seconds_ : 0.0;
    }

private:
    void run(double work) {
        namespace d = detail;
        pending_ = 0.0;
        if (kind_ == yardstick_kind::fma) {
            run_fma(work);
            return;
        }
        std::size_t n;
        float* const buf = d::yardstick(n);
        const std::size_t unit = 4 * d::lanes * 64;  // whole blocks for every thread
        // rmw moves every byte twice (read + write).
        const double per_float = kind_ == yardstick_kind::rmw ? 2.0 * sizeof(float) : double(sizeof(float));
        std::size_t count = static_cast<std::size_t>(work / per_float) / unit * unit;
        count = std::clamp<std::size_t>(count, unit, n / unit * unit);
        if (offset_ + count > n) offset_ = 0;
        float* const p = buf + offset_;
        double secs;
        if (kind_ == yardstick_kind::read) {
            float sink = 0.0f;
            secs = d::timed_parts(threads_, count, [&](std::size_t b, std::size_t e) {
                const float s = d::read_range(p, b, e);
                KVCACHE_OMP(atomic)
                sink += s;
            });
            volatile float keep = sink;
            static_cast<void>(keep);
        } else {
            secs = d::timed_parts(threads_, count, [&](std::size_t b, std::size_t e) { d::scale_range(p, b, e, factor_); });
            factor_ = factor_ == 0.5f ? 2.0f : 0.5f;  // keeps the values bounded
        }
        offset_ += count;
        work_ += per_float * static_cast<double>(count);
        seconds_ += secs;
    }

    void run_fma(double work) {
        namespace d = detail;
        const int t = resolve_threads(threads_);
        const auto iters = std::max<std::uint64_t>(
            1, static_cast<std::uint64_t>(work / (double(d::fma_chain_count) * d::lanes * t)));
        float sink = 0.0f;
        const double secs = d::timed_parts(threads_, 4 * d::lanes * t, [&](std::size_t, std::size_t) {
            const float v = d::fma_chains(iters);
            KVCACHE_OMP(atomic)
            sink += v;
        });
        volatile float keep = sink;
        static_cast<void>(keep);
        work_ += static_cast<double>(iters) * d::fma_chain_count * d::lanes * t;
        seconds_ += secs;
    }

    yardstick_kind kind_;
    int threads_;
    double pending_ = 0.0, work_ = 0.0, seconds_ = 0.0;
    std::size_t offset_ = 0;
    float factor_ = 0.5f;
};

/// Read-only bandwidth in bytes/s with `threads` OpenMP threads.
inline double measure_read_bw(int threads, bool fresh = false) {
    return detail::cached("read", resolve_threads(threads), fresh, detail::measure_read_impl);
}
/// In-place read-modify-write bandwidth (bytes read + bytes written per second).
inline double measure_rmw_bw(int threads, bool fresh = false) {
    return detail::cached("rmw", resolve_threads(threads), fresh, detail::measure_rmw_impl);
}
/// Copy bandwidth (bytes read + bytes written per second).
inline double measure_copy_bw(int threads, bool fresh = false) {
    return detail::cached("copy", resolve_threads(threads), fresh, detail::measure_copy_impl);
}
/// Peak f32 FMA rate (lane FMAs per second; one FMA = 2 FLOP).
inline double measure_fma_peak(int threads, bool fresh = false) {
    return detail::cached("fma", resolve_threads(threads), fresh, detail::measure_fma_impl);
}

}  // namespace kvcache::bench
