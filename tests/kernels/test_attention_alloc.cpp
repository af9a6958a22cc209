// attention() allocates nothing once its workspace has seen a call of the same shape
// (issue: kernels never allocate on the hot path), for the contiguous and the paged
// layout (whose per-sequence tile ranges go into the workspace). Counted with a
// replacement of the global (unaligned) operator new / delete, every form, for this test binary.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>

#include <atomic>
#include <cstdlib>
#include <new>
#include <numeric>
#include <vector>

#include "../layout/layout_test_util.hpp"

// The replacements below pair malloc with free; GCC, seeing them inlined into new /
// delete expressions, reports a mismatch that is not one.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace {
std::atomic<long> g_news{0};
}  // namespace

void* operator new(std::size_t n) {
    g_news.fetch_add(1, std::memory_order_relaxed);
    if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
// The nothrow forms too (std::stable_sort's temporary buffer uses them): every unaligned
// allocation then comes from malloc and goes back through free.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
    g_news.fetch_add(1, std::memory_order_relaxed);
    return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return ::operator new(n, t); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

template <class Cache>
void check_no_alloc(int threads) {
    CAPTURE(threads);
    const kvcache::model_shape s = kvtest::layout_shape(512, 2, 3, 2, 64);
    Cache cache(s);
    for (kvcache::seq_id_t sq = 0; sq < 2; ++sq) {  // two sequences, their blocks interleaved
        for (int part = 0; part < 4; ++part) {
            std::vector<kvcache::pos_t> pos(40);
            std::iota(pos.begin(), pos.end(), part * 40);
            std::vector<kvcache::seq_id_t> seq(pos.size(), sq);
            auto placed = cache.place(pos, seq);
            REQUIRE(placed.ok());
            std::vector<float> k(pos.size() * s.k_row_size(), 0.5f), v(pos.size() * s.v_row_size(), 0.25f);
            for (std::uint32_t l = 0; l < s.n_layer; ++l) {
                cache.write_k(l, placed.value().cells, k.data());
                cache.write_v(l, placed.value().cells, v.data());
            }
            static_cast<void>(cache.commit());
        }
    }
    kvcache::ops::attention_params p;
    p.n_head = 8;
    p.n_threads = threads;
    std::vector<float> q(std::size_t{p.n_head} * s.dim_k(), 0.1f), out(std::size_t{p.n_head} * s.dim_v());
    const kvcache::pos_t qp = 159;
    const kvcache::seq_id_t qs = 1;
    kvcache::ops::attention_workspace ws;
    kvcache::ops::attention(cache, 0, q.data(), &qp, &qs, 1, p, out.data(), ws);  // sizes the workspace
    const long before = g_news.load();
    for (int step = 0; step < 3; ++step)
        for (std::uint32_t l = 0; l < s.n_layer; ++l) kvcache::ops::attention(cache, l, q.data(), &qp, &qs, 1, p, out.data(), ws);
    CHECK(g_news.load() - before == 0);
    CHECK(out[0] == doctest::Approx(0.25f));  // every visible V row is 0.25
}

}  // namespace

TEST_CASE("attention allocates nothing once the workspace is sized") {
    check_no_alloc<kvcache::kv_cache<kvcache::f16>>(1);
    check_no_alloc<kvcache::kv_cache<kvcache::f16, kvcache::paged<32>>>(1);
    check_no_alloc<kvcache::kv_cache<kvcache::f16, kvcache::paged<32>>>(2);
}
