// ops::attention with NaN / inf in Q, K or V: the affected output rows are NaN (never a
// silent finite value), the unaffected ones match the float64 oracle, the SIMD and scalar
// paths agree on which outputs are NaN, and a row that sees no cell stays zeros.
// Covered: prefill and decode shapes, GQA, split-K, both V layouts, paged, f32/f16/bf16.
// (test_kernels runs the generic build's SIMD path, test_kernels_native the native one.)
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "reference/attention_ref.hpp"
#include "kernels/kernel_test_util.hpp"

namespace {

using kvtest::layout_combo;

using kvcache::pos_t;
using kvcache::seq_id_t;

constexpr float qnan = std::numeric_limits<float>::quiet_NaN();
constexpr float pinf = std::numeric_limits<float>::infinity();

struct setup {
    std::uint32_t n_head_kv = 2, dk = 64, dv = 64, n_cells = 160, group = 4;
};

// Sequence 0 at positions [0, n_used) in cells [0, n_used), random K / V (normal(0, 1)).
template <class Cache>
void fill(Cache& cache, std::uint32_t n_used, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<pos_t> pos(n_used);
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<seq_id_t> seq(n_used, 0);
    auto placed = cache.place(pos, seq);
    REQUIRE(placed.ok());
    const auto& s = cache.shape();
    for (std::uint32_t l = 0; l < s.n_layer; ++l) {
        std::vector<float> k(std::size_t{n_used} * s.k_row_size()), v(std::size_t{n_used} * s.v_row_size());
        for (auto& x : k) x = nd(rng);
        for (auto& x : v) x = nd(rng);
        cache.write_k(l, placed.value().cells, k.data());
        cache.write_v(l, placed.value().cells, v.data());
    }
    static_cast<void>(cache.commit());
}

// Sets one stored K (or V) element of layer 0 to x.
template <class Cache>
void poke(Cache& cache, bool is_k, std::uint32_t h, std::uint32_t cell, std::uint32_t d, float x) {
    using T = typename Cache::storage_type;
    T b;
    Cache::element::from_float(&x, &b, 1);
    auto v = cache.storage().view(0);
    if (is_k)
        v.k[v.k_offset(h, cell, d)] = b;
    else
        v.v[v.v_offset(h, cell, d)] = b;
}

// Every output: NaN exactly where the oracle is NaN, the oracle's inf where it is inf;
// elsewhere finite and close to it.
void check_like_oracle(const std::vector<float>& got, const std::vector<double>& want, double tol) {
    REQUIRE(got.size() == want.size());
    std::size_t nan_seen = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
        CAPTURE(i);
        if (std::isnan(want[i])) {
            CHECK(std::isnan(got[i]));
            ++nan_seen;
        } else if (std::isinf(want[i])) {  // an inf in V
            CHECK(static_cast<double>(got[i]) == want[i]);
        } else {
            CHECK(std::isfinite(got[i]));
            CHECK(std::fabs(got[i] - want[i]) <= tol * (1.0 + std::fabs(want[i])));
        }
    }
}

enum class where { q, k, v };

// One case: a fresh cache of `cfg`, one non-finite value `x` put at `w`, attention of n_q
// rows (prefill: positions [0, n_q) of sequence 0; decode: one row past the end), plus a
// row of an empty sequence (must stay zeros). Both kernel paths against the oracle.
template <class Cache>
void run_case(const setup& cfg, where w, float x, bool decode, int threads, std::uint32_t seed) {
    CAPTURE(static_cast<int>(w));
    CAPTURE(x);
    CAPTURE(decode);
    CAPTURE(threads);
    CAPTURE(seed);
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = cfg.n_head_kv;
    s.head_dim_k = cfg.dk;
    s.head_dim_v = cfg.dv;
    s.n_cells = cfg.n_cells;
    s.n_seq_max = 2;
    Cache cache(s);
    const std::uint32_t n_used = cfg.n_cells - 7;
    fill(cache, n_used, seed);
    std::mt19937 rng(seed + 1);
    const std::uint32_t n_head = cfg.n_head_kv * cfg.group;
    const std::uint32_t n_q = decode ? 1 : 40;
    std::vector<pos_t> qp;
    std::vector<seq_id_t> qs;
    for (std::uint32_t i = 0; i < n_q; ++i) {
        qp.push_back(decode ? static_cast<pos_t>(n_used) : static_cast<pos_t>(n_used - n_q + i));
        qs.push_back(0);
    }
    qp.push_back(3);  // a row of the empty sequence 1: sees nothing
    qs.push_back(1);
    const std::uint32_t rows = n_q + 1;
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(std::size_t{rows} * n_head * cfg.dk);
    for (auto& v : q) v = nd(rng);
    // The poisoned element: in the middle of the prefill rows' cells, so that some rows
    // see it and the rows before it do not (the same slot group holds both).
    const std::uint32_t h = static_cast<std::uint32_t>(rng() % cfg.n_head_kv);
    const pos_t target = static_cast<pos_t>(n_used - n_q / 2 - 1);
    std::uint32_t cell = 0;
    while (cache.cells().pos(cell) != target) ++cell;  // (a paged layout may place cells anywhere)
    switch (w) {
        case where::q: q[(std::size_t{n_q / 2} * n_head + h * cfg.group + 1) * cfg.dk + 5] = x; break;
        case where::k: poke(cache, true, h, cell, 3, x); break;
        case where::v: poke(cache, false, h, cell, 7, x); break;
    }
    const auto want = ref::attention(cache, 0, q, qp, qs, [&] {
        kvcache::ops::attention_params p;
        p.n_head = n_head;
        return p;
    }());
    bool any_nan = false;
    for (double v : want) any_nan = any_nan || std::isnan(v);
    if (x != x) CHECK(any_nan);  // a NaN always reaches some row (the test can fail)
    for (auto path : {kvcache::ops::kernel_path::simd, kvcache::ops::kernel_path::scalar}) {
        CAPTURE(static_cast<int>(path));
        kvcache::ops::attention_params p;
        p.n_head = n_head;
        p.n_threads = threads;
        p.path = path;
        std::vector<float> out(std::size_t{rows} * n_head * cfg.dv, 7.0f);
        kvcache::ops::attention_workspace ws;
        kvcache::ops::attention(cache, 0, q.data(), qp.data(), qs.data(), rows, p, out.data(), ws);
        check_like_oracle(out, want, 2e-3);
        for (std::size_t i = std::size_t{n_q} * n_head * cfg.dv; i < out.size(); ++i) CHECK(out[i] == 0.0f);
        if (w == where::v && x != x) {
            // Only dimension 7 of the rows that see the cell, in KV head h's query heads.
            for (std::uint32_t r = 0; r < n_q; ++r)
                for (std::uint32_t g = 0; g < n_head; ++g)
                    for (std::uint32_t d = 0; d < cfg.dv; ++d) {
                        const bool hit = qp[r] >= target && g / cfg.group == h && d == 7;
                        CHECK(std::isnan(out[(std::size_t{r} * n_head + g) * cfg.dv + d]) == hit);
                    }
        }
        if (w == where::q && x != x) {
            // Exactly the poisoned (row, head): all of its dv outputs.
            for (std::uint32_t r = 0; r < n_q; ++r)
                for (std::uint32_t g = 0; g < n_head; ++g) {
                    const bool hit = r == n_q / 2 && g == h * cfg.group + 1;
                    for (std::uint32_t d = 0; d < cfg.dv; ++d)
                        CHECK(std::isnan(out[(std::size_t{r} * n_head + g) * cfg.dv + d]) == hit);
                }
        }
    }
}

using cv = kvcache::contiguous<kvcache::v_layout::row_major>;
using ct = kvcache::contiguous<kvcache::v_layout::transposed>;

}  // namespace

TEST_CASE_TEMPLATE("attention: NaN / inf in Q, K or V gives NaN in exactly the affected outputs", C,
                   layout_combo<kvcache::f32, cv>, layout_combo<kvcache::f16, cv>, layout_combo<kvcache::bf16, cv>, layout_combo<kvcache::f16, ct>,
                   layout_combo<kvcache::f32, ct>, layout_combo<kvcache::f16, kvcache::paged<32>>) {
    std::uint32_t seed = 100;
    for (bool decode : {false, true})
        for (where w : {where::q, where::k, where::v})
            for (float x : {qnan, pinf, -pinf}) {
                // dk = dv = 128 and GQA 4: the fused decode loop (AVX-512); 40 / 24: tails.
                setup a;
                a.dk = 128;
                a.dv = 128;
                run_case<typename C::cache>(a, w, x, decode, 1, ++seed);
                setup b;
                b.dk = 40;
                b.dv = 24;
                b.group = 2;
                b.n_head_kv = 3;
                run_case<typename C::cache>(b, w, x, decode, 2, ++seed);
            }
}

TEST_CASE_TEMPLATE("attention: a NaN reaches the output through the split-K merge", C, layout_combo<kvcache::f32, cv>,
                   layout_combo<kvcache::f16, cv>, layout_combo<kvcache::f16, kvcache::paged<64>>) {
    // 9000 cells on 3 threads: decode splits the KV range into parts merged by log-sum-exp.
    setup a;
    a.n_head_kv = 1;
    a.dk = 128;
    a.dv = 128;
    a.n_cells = 9024;
    for (where w : {where::q, where::k, where::v}) run_case<typename C::cache>(a, w, qnan, true, 3, 7);
    run_case<typename C::cache>(a, where::k, pinf, true, 3, 8);
}

TEST_CASE("attention: a row whose cells all have -inf logits is NaN (0 / 0), a row that sees none is zeros") {
    // K = -inf in every dimension 0 of sequence 0 and q[0] > 0: every logit is -inf.
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 16;
    s.n_cells = 64;
    s.n_seq_max = 2;
    kvcache::kv_cache<kvcache::f32> cache(s);
    fill(cache, 40, 3);
    for (std::uint32_t c = 0; c < 40; ++c) poke(cache, true, 0, c, 0, -pinf);
    std::vector<float> q(2 * 16, 0.5f);
    const std::vector<pos_t> qp = {50, 50};
    const std::vector<seq_id_t> qs = {0, 1};
    for (auto path : {kvcache::ops::kernel_path::simd, kvcache::ops::kernel_path::scalar}) {
        kvcache::ops::attention_params p;
        p.n_head = 1;
        p.path = path;
        std::vector<float> out(2 * 16, 7.0f);
        kvcache::ops::attention_workspace ws;
        kvcache::ops::attention(cache, 0, q.data(), qp.data(), qs.data(), 2, p, out.data(), ws);
        for (std::size_t d = 0; d < 16; ++d) {
            CHECK(std::isnan(out[d]));
            CHECK(out[16 + d] == 0.0f);
        }
    }
}
