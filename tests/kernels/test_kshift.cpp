// ops::apply_k_shift and ops::rope_rows against the float64 RoPE oracle (tests/reference/rope_ref.hpp).
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "reference/rope_ref.hpp"
#include "support/rope_fill.hpp"
#include "support/result_check.hpp"
#include "kernels/kernel_test_util.hpp"

namespace {

using kvtest::all_bytes;
using kvtest::rel_l1;

using kvcache::pos_t;
using kvcache::seq_id_t;

struct rope_case {
    kvcache::rope_params rope;
    std::uint32_t dk = 64, n_head_kv = 2;
};

std::vector<rope_case> rope_cases() {
    std::vector<rope_case> out;
    for (auto type : {kvcache::rope_type::normal, kvcache::rope_type::neox}) {
        rope_case a;
        a.rope.type = type;
        out.push_back(a);
        rope_case b;  // partial rotary, other base and scale, odd-sized head
        b.rope.type = type;
        b.rope.n_rot = 32;
        b.rope.freq_base = 500000.0f;
        b.rope.freq_scale = 0.25f;
        b.dk = 72;
        b.n_head_kv = 3;
        out.push_back(b);
        rope_case c;  // tiny head
        c.rope.type = type;
        c.dk = 6;
        c.rope.n_rot = 4;
        c.n_head_kv = 1;
        out.push_back(c);
    }
    return out;
}


// Compares every cell's K with rope(x, pos_now) and returns the relative L1 error.
template <class Cache>
double error_vs_ref(const Cache& cache, const std::vector<std::vector<double>>& x, const std::vector<pos_t>& pos_now) {
    const auto& s = cache.shape();
    std::vector<float> got;
    std::vector<double> want;
    std::vector<float> row(s.k_row_size());
    for (std::uint32_t l = 0; l < s.n_layer; ++l)
        for (std::uint32_t c = 0; c < pos_now.size(); ++c) {
            cache.read_k(l, c, row.data());
            for (std::uint32_t h = 0; h < s.n_head_kv; ++h) {
                const auto r = ref::rope_head(x[c * s.n_head_kv + h], pos_now[c], s.rope);
                for (std::uint32_t d = 0; d < s.dim_k(); ++d) {
                    got.push_back(row[h * s.dim_k() + d]);
                    want.push_back(r[d] * (1.0 + 0.1 * l));
                }
            }
        }
    return rel_l1(got, want);
}

template <class E>
constexpr double kshift_tol() {
    return std::is_same_v<E, kvcache::f32> ? 1e-6 : std::is_same_v<E, kvcache::f16> ? 5e-4 : 4e-3;
}

}  // namespace

TEST_CASE_TEMPLATE("K-shift: rope(rope(x, p), d) == rope(x, p + d)", E, kvcache::f32, kvcache::f16, kvcache::bf16) {
    const std::uint32_t seed = 4242;
    MESSAGE("seed ", seed);
    std::mt19937 rng(seed);
    for (const auto& rc : rope_cases()) {
        for (auto path : {kvcache::ops::kernel_path::simd, kvcache::ops::kernel_path::scalar}) {
            for (int threads : {1, 2}) {
                CAPTURE(rc.dk);
                CAPTURE(rc.rope.n_rot);
                CAPTURE(static_cast<int>(rc.rope.type));
                CAPTURE(static_cast<int>(path));
                kvcache::model_shape s;
                s.n_layer = 2;
                s.n_head_kv = rc.n_head_kv;
                s.head_dim_k = rc.dk;
                s.rope = rc.rope;
                s.n_cells = 53;
                kvcache::kv_cache<E> cache(s);
                // Positions near 0 and near 2^31 (a shift of -d keeps them valid).
                const pos_t big = std::numeric_limits<pos_t>::max() - 100;
                std::vector<pos_t> pos;
                for (pos_t i = 0; i < 40; ++i) pos.push_back(i < 20 ? 50 + i : big - 20 + i);
                const auto x = kvtest::fill_rope(cache, pos, rng);
                const auto v_before = all_bytes(cache, true);
                // Shift the low half by +37 and the high half by -1234567 (two distinct deltas,
                // a tile with both: mixed per-lane tables).
                REQUIRE(cache.seq_add(0, 0, 1000, 37));
                REQUIRE(cache.seq_add(0, 1000, -1, -1234567));
                std::vector<pos_t> now = pos;
                for (auto& p : now) p = p < 1000 ? p + 37 : p - 1234567;
                CHECK(cache.has_shift());
                kvcache::ops::apply_k_shift(cache, threads, path);
                CHECK_FALSE(cache.has_shift());
                CHECK(error_vs_ref(cache, x, now) <= kshift_tol<E>());
                CHECK(all_bytes(cache, true) == v_before);  // V untouched
            }
        }
    }
}

TEST_CASE_TEMPLATE("K-shift: large deltas, queued shifts add up, zero shift is the identity", E, kvcache::f32,
                   kvcache::f16, kvcache::bf16) {
    std::mt19937 rng(99);
    kvcache::model_shape s;
    s.n_layer = 3;
    s.n_head_kv = 2;
    s.head_dim_k = 128;
    s.rope.type = kvcache::rope_type::neox;
    s.n_cells = 100;
    s.n_seq_max = 2;
    std::vector<pos_t> pos;
    for (pos_t i = 0; i < 37; ++i) pos.push_back(3 + i);
    SUBCASE("a delta near 2^31") {
        kvcache::kv_cache<E> cache(s);
        const auto x = kvtest::fill_rope(cache, pos, rng);
        const pos_t d = std::numeric_limits<pos_t>::max() - 100;
        REQUIRE(cache.seq_add(0, 0, -1, d));
        kvcache::ops::apply_k_shift(cache);
        std::vector<pos_t> now = pos;
        for (auto& p : now) p += d;
        CHECK(error_vs_ref(cache, x, now) <= kshift_tol<E>());
    }
    SUBCASE("two queued shifts equal one combined shift") {
        kvcache::kv_cache<E> a(s), b(s);
        std::mt19937 r2 = rng;
        kvtest::fill_rope(a, pos, rng);
        kvtest::fill_rope(b, pos, r2);
        REQUIRE(a.seq_add(0, 0, -1, 1000));
        REQUIRE(a.seq_add(0, 0, -1, -250));
        REQUIRE(b.seq_add(0, 0, -1, 750));
        kvcache::ops::apply_k_shift(a);
        kvcache::ops::apply_k_shift(b);
        CHECK(all_bytes(a, false) == all_bytes(b, false));
    }
    SUBCASE("seq_div shifts by new - old position") {
        kvcache::kv_cache<E> cache(s);
        const auto x = kvtest::fill_rope(cache, pos, rng);
        REQUIRE(cache.seq_div(0, 10, 30, 4));
        std::vector<pos_t> now = pos;
        for (auto& p : now)
            if (p >= 10 && p < 30) p /= 4;
        kvcache::ops::apply_k_shift(cache);
        CHECK(error_vs_ref(cache, x, now) <= kshift_tol<E>());
    }
    SUBCASE("a net shift of zero and no pending shift change no byte") {
        kvcache::kv_cache<E> cache(s);
        kvtest::fill_rope(cache, pos, rng);
        const auto k0 = all_bytes(cache, false);
        kvcache::ops::apply_k_shift(cache);
        CHECK(all_bytes(cache, false) == k0);
        REQUIRE(cache.seq_add(0, 0, -1, 5));
        REQUIRE(cache.seq_add(0, 0, -1, -5));
        kvcache::ops::apply_k_shift(cache);
        CHECK(all_bytes(cache, false) == k0);
    }
    SUBCASE("only moving cells are written; free cells keep their bytes") {
        kvcache::kv_cache<E> cache(s);
        kvtest::fill_rope(cache, pos, rng);
        // Poison the free cells' K.
        const float nan = std::numeric_limits<float>::quiet_NaN();
        typename kvcache::kv_cache<E>::storage_type bad;
        E::from_float(&nan, &bad, 1);
        for (std::uint32_t l = 0; l < s.n_layer; ++l) {
            auto v = cache.storage().view(l);
            for (std::uint32_t c = 37; c < v.n_cells_pad; ++c)
                for (std::uint32_t h = 0; h < s.n_head_kv; ++h)
                    for (std::uint32_t d = 0; d < s.dim_k(); ++d) v.k[v.k_offset(h, c, d)] = bad;
        }
        const auto k0 = all_bytes(cache, false);
        REQUIRE(cache.seq_add(0, 20, -1, 3));  // cells 17.. move; cells 0..16 do not
        kvcache::ops::apply_k_shift(cache);
        const auto k1 = all_bytes(cache, false);
        const std::size_t per_cell = std::size_t{s.n_head_kv} * s.dim_k();
        for (std::uint32_t l = 0; l < s.n_layer; ++l)
            for (std::uint32_t c = 0; c < s.n_cells; ++c) {
                const bool moved = c >= 17 && c < 37;
                const std::size_t off = (std::size_t{l} * s.n_cells + c) * per_cell;
                const bool same = std::memcmp(&k0[off], &k1[off], per_cell * sizeof(k0[0])) == 0;
                CHECK(same != moved);
            }
    }
}

TEST_CASE("rope_rows matches the float64 oracle, near 2^31 too") {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (const auto& rc : rope_cases()) {
        const std::uint32_t n_head = 3, n_rows = 5;
        std::vector<float> x(std::size_t{n_rows} * n_head * rc.dk);
        for (auto& v : x) v = nd(rng);
        const std::vector<pos_t> pos = {0, 1, 4095, std::numeric_limits<pos_t>::max(), 123456789};
        auto y = x;
        kvcache::ops::rope_rows(y.data(), n_rows, n_head, rc.dk, pos.data(), rc.rope);
        std::vector<double> want;
        for (std::uint32_t r = 0; r < n_rows; ++r)
            for (std::uint32_t h = 0; h < n_head; ++h) {
                std::vector<double> head(x.begin() + (r * n_head + h) * rc.dk, x.begin() + (r * n_head + h + 1) * rc.dk);
                const auto o = ref::rope_head(head, pos[r], rc.rope);
                want.insert(want.end(), o.begin(), o.end());
            }
        CHECK(rel_l1(y, want) <= 1e-6);
    }
}

TEST_CASE("rope_rows: bad arguments throw and change nothing") {
    std::vector<float> x(8, 1.0f);
    const pos_t pos = 3;
    kvcache::rope_params r;
    auto expect = [&](auto f, const char* what) {
        CAPTURE(what);
        try {
            f();
            FAIL("no exception");
        } catch (const kvcache::error& e) {
            CHECK(e.code() == kvcache::errc::invalid_argument);
            CHECK(std::string(e.what()).find(what) != std::string::npos);
        }
        for (float v : x) CHECK(v == 1.0f);
    };
    expect([&] { kvcache::ops::rope_rows(x.data(), 1, 0, 8, &pos, r); }, "n_head = 0");
    expect([&] { kvcache::ops::rope_rows(x.data(), 1, 1, 0, &pos, r); }, "head_dim = 0");
    expect([&] { kvcache::ops::rope_rows(nullptr, 1, 1, 8, &pos, r); }, "x is null");
    expect([&] { kvcache::ops::rope_rows(x.data(), 1, 1, 8, nullptr, r); }, "pos is null");
    auto odd = r;
    odd.n_rot = 3;
    expect([&] { kvcache::ops::rope_rows(x.data(), 1, 1, 8, &pos, odd); }, "n_rot = 3");
    auto wide = r;
    wide.n_rot = 10;
    expect([&] { kvcache::ops::rope_rows(x.data(), 1, 1, 8, &pos, wide); }, "n_rot = 10");
    auto base = r;
    base.freq_base = -1.0f;
    expect([&] { kvcache::ops::rope_rows(x.data(), 1, 1, 8, &pos, base); }, "freq_base");
    auto scale = r;
    scale.freq_scale = std::numeric_limits<float>::infinity();
    expect([&] { kvcache::ops::rope_rows(x.data(), 1, 1, 8, &pos, scale); }, "freq_scale");
}

TEST_CASE_TEMPLATE("rotate_tile: asking for a later tile ahead changes no byte", E, kvcache::f32, kvcache::f16,
                   kvcache::bf16) {
    // apply_k_shift passes the tile after next only on Intel; uniform and per-lane tables, full
    // and partial masks here (the kernel sees rows in pair order for either pair layout).
    using T = typename E::storage_type;
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    constexpr std::uint32_t dk = 128, n_rot = 96;
    std::vector<float> f(std::size_t{kvcache::k_tile} * dk * 3);
    for (auto& x : f) x = nd(rng);
    std::vector<T> base(f.size());
    E::from_float(f.data(), base.data(), f.size());
    std::vector<float> cs(n_rot / 2), sn(n_rot / 2), lc(n_rot / 2 * kvcache::k_tile), ls(lc.size());
    for (std::size_t i = 0; i < cs.size(); ++i) cs[i] = std::cos(0.1f * i), sn[i] = std::sin(0.1f * i);
    for (std::size_t i = 0; i < lc.size(); ++i) lc[i] = std::cos(0.01f * i), ls[i] = std::sin(0.01f * i);
    for (bool uniform : {true, false})
        for (std::uint16_t mask : {std::uint16_t{0xffff}, std::uint16_t{0x0f3c}}) {
            kvcache::kernels::tile_rotation rot;
            rot.mask = mask;
            rot.uniform = uniform;
            rot.lane_cos = lc.data();
            rot.lane_sin = ls.data();
            std::vector<T> a = base, b = base;
            const std::size_t tile = std::size_t{kvcache::k_tile} * dk;
            kvcache::kernels::rotate_tile(a.data(), n_rot, rot, cs.data(), sn.data());
            kvcache::kernels::rotate_tile(b.data(), n_rot, rot, cs.data(), sn.data(),
                                          reinterpret_cast<const char*>(b.data() + 2 * tile));
            CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
            CHECK(a != base);  // the tile did move
        }
}
