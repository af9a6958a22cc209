// ops::attention over q8_0 / q4_0 caches (kernels/quant_decode.hpp: blocks read in place)
// against the float64 oracle on the stored values and against the scalar path. This folder
// is also built with -march=x86-64-v3 (test_kernels_avx2), so the AVX2 quantized decode
// runs here as well as the AVX-512 one (test_kernels_native) and the generic conversion
// path (test_kernels). Covered: decode rows of several sequences with holes (partial tile
// masks), GQA groups 1..16 (work items of 1..16 slots; 6: a last pass of fewer slots than
// the kernels' 4 or 8), both V layouts, a window and soft-cap, split-K on 1-3 threads.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/kernel_test_util.hpp"
#include "reference/attention_ref.hpp"

namespace {

/// 3 sequences of random K/V (N(0, 1)) placed in random runs of 1..8 cells, 3 positions
/// removed from each, the freed cells filled with huge blocks (a kernel reading one is far
/// off), returns the decode rows (position after each sequence's last).
template <class Cache>
void qattn_fill(Cache& cache, std::uint32_t seed, std::vector<kvcache::pos_t>& qp, std::vector<kvcache::seq_id_t>& qs) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const auto& s = cache.shape();
    constexpr std::uint32_t n_seq = 3;
    std::vector<kvcache::pos_t> next(n_seq, 0);
    for (int r = 0; r < 60; ++r) {
        const auto sq = static_cast<kvcache::seq_id_t>(rng() % n_seq);
        const std::uint32_t n = 1 + rng() % 8;
        std::vector<kvcache::pos_t> pos(n);
        std::vector<kvcache::seq_id_t> seq(n, sq);
        for (auto& p : pos) p = next[static_cast<std::size_t>(sq)]++;
        auto placed = cache.place(pos, seq);
        REQUIRE(placed.ok());
        std::vector<float> k(n * s.k_row_size()), v(n * s.v_row_size());
        for (auto& x : k) x = nd(rng);
        for (auto& x : v) x = nd(rng);
        cache.write_k(0, placed.value().cells, k.data());
        cache.write_v(0, placed.value().cells, v.data());
        static_cast<void>(cache.commit());
    }
    for (kvcache::seq_id_t sq = 0; sq < static_cast<kvcache::seq_id_t>(n_seq); ++sq) {
        const auto p0 = static_cast<kvcache::pos_t>(rng() % 20);
        REQUIRE(cache.seq_rm(sq, p0, p0 + 3));
        qs.push_back(sq);
        qp.push_back(next[static_cast<std::size_t>(sq)]);
    }
    using E = typename Cache::element;
    float big[32];
    for (float& x : big) x = 1e4f;
    typename Cache::storage_type bad[1];
    E::from_float(big, bad, 32);
    auto v = cache.storage().view(0);
    for (std::uint32_t cell = 0; cell < v.n_cells_pad; ++cell) {
        if (cell < cache.capacity() && !cache.cells().is_free(cell)) continue;
        for (std::uint32_t h = 0; h < s.n_head_kv; ++h) {
            for (std::uint32_t u = 0; u < v.k_units(); ++u) v.k[v.k_unit(h, cell, u)] = bad[0];
            for (std::uint32_t u = 0; u < v.v_units(); ++u) v.v[v.v_unit(h, cell, u)] = bad[0];
        }
    }
}

template <class E, class Layout>
void qattn_suite(std::uint32_t dk, std::uint32_t dv) {
    kvcache::model_shape shape;
    shape.n_layer = 1;
    shape.n_head_kv = 2;
    shape.head_dim_k = dk;
    shape.head_dim_v = dv;
    shape.n_cells = 320;
    shape.n_seq_max = 3;
    kvcache::kv_cache<E, Layout> cache(shape);
    std::vector<kvcache::pos_t> qp;
    std::vector<kvcache::seq_id_t> qs;
    qattn_fill(cache, 31337u + dk, qp, qs);
    const auto n_q = static_cast<std::uint32_t>(qs.size());
    std::mt19937 rng(2718);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    kvcache::ops::attention_workspace ws;
    for (std::uint32_t group : {1u, 2u, 4u, 6u, 16u}) {
        CAPTURE(group);
        kvcache::ops::attention_params p;
        p.n_head = shape.n_head_kv * group;
        std::vector<float> q(std::size_t{n_q} * p.n_head * dk);
        for (auto& x : q) x = nd(rng);
        auto run = [&](kvcache::ops::kernel_path path, int threads) {
            auto pp = p;
            pp.path = path;
            pp.n_threads = threads;
            std::vector<float> out(std::size_t{n_q} * p.n_head * dv, -1.0f);
            kvcache::ops::attention(cache, 0, q.data(), qp.data(), qs.data(), n_q, pp, out.data(), ws);
            return out;
        };
        for (const bool windowed : {false, true}) {
            CAPTURE(windowed);
            p.softcap = windowed ? 4.0f : 0.0f;
            p.window = windowed ? 50 : 0;
            const auto want = ref::attention(cache, 0, q, qp, qs, p);
            CHECK(kvtest::nmse(run(kvcache::ops::kernel_path::scalar, 1), want) <= 3e-9);
            for (int threads : {1, 3}) {
                CAPTURE(threads);
                const auto out = run(kvcache::ops::kernel_path::simd, threads);
                for (float x : out) REQUIRE(std::isfinite(x));
                CHECK(kvtest::nmse(out, want) <= kvtest::quant_simd_tol<E>);
            }
        }
    }
}

}  // namespace

TEST_CASE("attention, q8_0 cache: decode against the float64 oracle (row-major and transposed V, GQA 1-16)") {
    qattn_suite<kvcache::q8_0, kvcache::contiguous<>>(128, 128);
    qattn_suite<kvcache::q8_0, kvcache::paged<32, kvcache::v_layout::transposed>>(64, 96);
}

TEST_CASE("attention, q4_0 cache: decode against the float64 oracle (row-major and transposed V, GQA 1-16)") {
    qattn_suite<kvcache::q4_0, kvcache::paged<32>>(96, 64);
    qattn_suite<kvcache::q4_0, kvcache::contiguous<kvcache::v_layout::transposed>>(128, 128);
}
