// RoPE variants (rope_params: linear, NTK-aware, YaRN, llama3, factor tables, LongRoPE;
// partial rotary dims, both pairings): rope_rows against the float64 oracle of
// tests/reference/rope_variants_ref.hpp, fixed values from llama.cpp's formulas, the
// K-shift's additivity R(p + d) = R(d) R(p) through a real cache up to 2^31 - 1, its
// refusals for LongRoPE moves across n_ctx_orig, validation of every field, and the
// state fingerprint's rope scaling word.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "reference/rope_variants_ref.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"
#include "kernels/kernel_test_util.hpp"

namespace {

using kvtest::rel_l1;

using kvcache::pos_t;
using kvcache::rope_params;
using kvcache::rope_scaling;
using kvcache::rope_type;
using kvcache::seq_id_t;

constexpr pos_t pos_max = std::numeric_limits<pos_t>::max();


kvcache::rope_factors random_factors(std::size_t n, std::mt19937& rng, float lo, float hi) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    return kvcache::rope_factors(std::span<const float>(v));
}

struct variant {
    std::string name;
    rope_params rope;
    std::uint32_t dk;
};

// Every variant, with full and partial rotary dims and both pairings.
std::vector<variant> variants() {
    std::mt19937 rng(2027);
    std::vector<variant> out;
    for (auto type : {rope_type::normal, rope_type::neox}) {
        for (std::uint32_t n_rot : {0u, 48u}) {
            const std::uint32_t dk = 64;
            const std::uint32_t n = n_rot == 0 ? dk : n_rot;
            const std::string suffix = std::string(type == rope_type::normal ? "/normal" : "/neox") + "/n_rot:" +
                                       std::to_string(n);
            rope_params base;
            base.type = type;
            base.n_rot = n_rot;
            rope_params linear = base;
            linear.freq_scale = 0.25f;
            out.push_back({"linear" + suffix, linear, dk});
            rope_params ntk = base;
            ntk.ntk_alpha = 4.0f;
            out.push_back({"ntk" + suffix, ntk, dk});
            rope_params yarn = base;
            yarn.freq_base = 1000000.0f;
            yarn.freq_scale = 0.25f;
            yarn.scaling = rope_scaling::yarn;
            yarn.n_ctx_orig = 32768;
            yarn.attn_factor = rope_params::yarn_mscale(4.0f);
            out.push_back({"yarn" + suffix, yarn, dk});
            rope_params yarn_half = yarn;  // half-weight ramp, factor table, other betas
            yarn_half.yarn = {.ext_factor = 0.5f, .beta_fast = 16.0f, .beta_slow = 2.0f};
            yarn_half.freq_factors = random_factors(n / 2, rng, 1.0f, 4.0f);
            yarn_half.n_ctx_orig = 4096;
            out.push_back({"yarn_table" + suffix, yarn_half, dk});
            rope_params llama3 = base;
            llama3.freq_base = 500000.0f;
            llama3.scaling = rope_scaling::llama3;
            llama3.n_ctx_orig = 8192;
            llama3.llama3 = {.factor = 32.0f, .low_freq_factor = 1.0f, .high_freq_factor = 4.0f};
            out.push_back({"llama3" + suffix, llama3, dk});
            rope_params table = base;
            table.freq_factors = random_factors(n / 2, rng, 1.0f, 8.0f);
            table.freq_scale = 0.5f;
            out.push_back({"freq_factors" + suffix, table, dk});
            rope_params lr = base;
            lr.scaling = rope_scaling::longrope;
            lr.n_ctx_orig = 4096;
            lr.short_factors = random_factors(n / 2, rng, 1.0f, 3.0f);
            lr.long_factors = random_factors(n / 2, rng, 1.0f, 60.0f);
            lr.attn_factor = rope_params::longrope_mscale(131072, 4096);
            out.push_back({"longrope" + suffix, lr, dk});
        }
    }
    return out;
}

std::vector<double> head_of(const std::vector<float>& x, std::size_t row_head, std::uint32_t dk) {
    return std::vector<double>(x.begin() + static_cast<std::ptrdiff_t>(row_head * dk),
                               x.begin() + static_cast<std::ptrdiff_t>((row_head + 1) * dk));
}

// Runs f and checks it throws kvcache::error(code) with `needle` in its message.
void expect_throw(const std::function<void()>& f, kvcache::errc code, const std::string& needle) {
    CAPTURE(needle);
    try {
        f();
        FAIL("no exception");
    } catch (const kvcache::error& e) {
        CHECK(e.code() == code);
        CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
    }
}

}  // namespace

TEST_CASE("rope variants: rope_rows matches the float64 formula of each variant, up to 2^31 - 1") {
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const std::vector<pos_t> pos = {0, 1, 17, 4095, 4096, 70000, 123456789, pos_max};
    for (const auto& v : variants()) {
        CAPTURE(v.name);
        const std::uint32_t n_head = 3;
        const auto n_rows = pos.size();
        std::vector<float> x(n_rows * n_head * v.dk);
        for (auto& e : x) e = nd(rng);
        auto y = x;
        kvcache::ops::rope_rows(y.data(), n_rows, n_head, v.dk, pos.data(), v.rope);
        std::vector<double> want;
        for (std::size_t r = 0; r < n_rows; ++r)
            for (std::uint32_t h = 0; h < n_head; ++h) {
                const auto o = ref::rope_variant_head(head_of(x, r * n_head + h, v.dk), pos[r], v.rope);
                want.insert(want.end(), o.begin(), o.end());
            }
        CHECK(rel_l1(y, want) <= 1e-6);
        // Dimensions past n_rot are untouched.
        const std::uint32_t n = v.rope.n_rot == 0 ? v.dk : v.rope.n_rot;
        for (std::size_t rh = 0; rh < n_rows * n_head; ++rh)
            for (std::uint32_t d = n; d < v.dk; ++d) CHECK(y[rh * v.dk + d] == x[rh * v.dk + d]);
    }
}

TEST_CASE("rope variants: the oracle is not blind (each variant differs from plain RoPE)") {
    std::mt19937 rng(5);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::vector<double> x(64);
    for (auto& e : x) e = nd(rng);
    for (const auto& v : variants()) {
        CAPTURE(v.name);
        rope_params plain;
        plain.type = v.rope.type;
        plain.n_rot = v.rope.n_rot;
        plain.freq_base = v.rope.freq_base;
        const auto a = ref::rope_variant_head(x, 70000, v.rope);
        const auto b = ref::rope_variant_head(x, 70000, plain);
        double diff = 0.0;
        for (std::size_t i = 0; i < x.size(); ++i) diff += std::abs(a[i] - b[i]);
        CHECK(diff > 1e-3);
    }
}

// Values from llama.cpp's formulas (ggml rope_yarn / rope_yarn_corr_dims / rope_yarn_ramp,
// and the rope_freqs table convert_hf_to_gguf.py writes for "llama3"), evaluated in double
// outside this project for these inputs; llama.cpp itself computes in float, hence the
// tolerances.
TEST_CASE("rope variants: fixed values from llama.cpp's formulas") {
    SUBCASE("llama3 rope_freqs of Llama-3.2-1B (base 500000, n_rot 64, factor 32, 1 / 4, 8192)") {
        rope_params r;
        r.freq_base = 500000.0f;
        r.scaling = rope_scaling::llama3;
        r.n_ctx_orig = 8192;
        r.llama3 = {.factor = 32.0f, .low_freq_factor = 1.0f, .high_freq_factor = 4.0f};
        r.validate(64);
        const std::pair<std::uint32_t, double> facts[] = {{0, 1.0},         {14, 1.0},        {15, 1.6513292},
                                                          {16, 3.2922621},  {17, 9.666729},   {18, 32.0},
                                                          {31, 32.0}};
        for (const auto& [fact_i, ff] : facts) {
            const std::uint32_t i = fact_i;  // a structured binding: Clang 14 captures none (CAPTURE)
            CAPTURE(i);
            const double plain = std::pow(500000.0, -2.0 * i / 64.0);
            CHECK(plain / kvcache::kernels::rope_inv_freq(r, 64, i) == doctest::Approx(ff).epsilon(1e-6));
        }
        // theta = p * base^(-2i/n) / ff: pair 16 at p = 5000, pair 17 at p = 70000 (unit x, neox).
        r.type = rope_type::neox;
        const std::tuple<std::uint32_t, pos_t, double, double> cs[] = {
            {16, 5000, -0.5455017409175321, 0.8381096889166367}, {17, 70000, 0.8714643752776444, 0.490458808282556}};
        for (const auto& [i, p, c, s] : cs) {
            std::vector<float> x(64, 0.0f);
            x[i] = 1.0f;
            kvcache::ops::rope_rows(x.data(), 1, 1, 64, &p, r);
            CHECK(x[i] == doctest::Approx(c).epsilon(1e-5));
            CHECK(x[i + 32] == doctest::Approx(s).epsilon(1e-5));
        }
    }
    SUBCASE("YaRN of Qwen2.5 (base 1e6, n_rot 128, factor 4, n_ctx_orig 32768, beta 32 / 1)") {
        rope_params r;
        r.type = rope_type::neox;
        r.freq_base = 1000000.0f;
        r.freq_scale = 0.25f;
        r.scaling = rope_scaling::yarn;
        r.n_ctx_orig = 32768;
        r.attn_factor = rope_params::yarn_mscale(4.0f);
        CHECK(r.attn_factor == doctest::Approx(1.138629436111989).epsilon(1e-7));  // 1 + 0.1 ln(1 / freq_scale)
        double lo = 0, hi = 0;
        kvcache::kernels::rope_yarn_corr_dims(r, 128, lo, hi);
        CHECK(lo == 23.0);  // floor(23.596)
        CHECK(hi == 40.0);  // ceil(39.651)
        // cos/sin * mscale of pairs before, inside and after the ramp.
        const std::tuple<std::uint32_t, pos_t, double, double> cs[] = {
            {10, 1000, -0.8247469917903877, 0.7850282748496467},
            {30, 1000, 0.552307146011942, 0.9957076926713229},
            {50, 1000, 1.1386144312683226, 0.00584548442991768},
            {30, 123457, 0.9742170591431033, -0.5893879150909606}};
        for (const auto& [case_i, case_p, c, s] : cs) {
            const std::uint32_t i = case_i;  // not structured bindings: Clang 14 captures none (CAPTURE)
            const pos_t p = case_p;
            CAPTURE(i);
            CAPTURE(p);
            std::vector<float> x(128, 0.0f);
            x[i] = 1.0f;
            kvcache::ops::rope_rows(x.data(), 1, 1, 128, &p, r);
            CHECK(x[i] == doctest::Approx(c).epsilon(1e-5));
            CHECK(x[i + 64] == doctest::Approx(s).epsilon(1e-5));
        }
    }
    SUBCASE("LongRoPE attention factor of Phi-3.5-mini (131072 / 4096)") {
        CHECK(rope_params::longrope_mscale(131072, 4096) == doctest::Approx(1.1902380714238083).epsilon(1e-7));
        CHECK(rope_params::longrope_mscale(4096, 4096) == 1.0f);
        CHECK(rope_params::yarn_mscale(1.0f) == 1.0f);
    }
}

namespace {

// A one-sequence f32 cache whose cells hold K = rope_rows(x, pos) (magnitude included).
struct shifted_cache {
    kvcache::model_shape shape;
    std::vector<float> x;  // [cell][head][dk] unrotated
};

template <class Cache>
std::vector<float> read_all_k(const Cache& cache, std::uint32_t n_used) {
    const auto& s = cache.shape();
    std::vector<float> out(std::size_t{n_used} * s.k_row_size() * s.n_layer);
    for (std::uint32_t l = 0; l < s.n_layer; ++l)
        for (std::uint32_t c = 0; c < n_used; ++c)
            cache.read_k(l, c, out.data() + (std::size_t{l} * n_used + c) * s.k_row_size());
    return out;
}

}  // namespace

TEST_CASE("rope variants: K-shift through a cache equals rotating directly at p + d (R(p + d) = R(d) R(p))") {
    std::mt19937 rng(31337);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (const auto& v : variants()) {
        for (auto path : {kvcache::ops::kernel_path::simd, kvcache::ops::kernel_path::scalar}) {
            CAPTURE(v.name);
            CAPTURE(static_cast<int>(path));
            kvcache::model_shape s;
            s.n_layer = 2;
            s.n_head_kv = 2;
            s.head_dim_k = v.dk;
            s.rope = v.rope;
            s.n_cells = 80;
            kvcache::kv_cache<kvcache::f32> cache(s);
            // Low positions moved up to just below 2^31 - 1, high ones (up to 2^31 - 1) moved
            // down; for LongRoPE both stay on the long side, and a third group moves on the
            // short side, so tiles mix deltas and tables.
            const pos_t up = pos_max - 100 - 5000;
            std::vector<pos_t> pos, now;
            for (pos_t i = 0; i < 24; ++i) {
                pos.push_back(5000 + i);
                now.push_back(5000 + i + up);
            }
            for (pos_t i = 0; i < 24; ++i) {
                pos.push_back(pos_max - 23 + i);
                now.push_back(pos_max - 23 + i - 1234567);
            }
            for (pos_t i = 0; i < 24; ++i) {
                pos.push_back(100 + i);
                now.push_back(100 + i + 3000);
            }
            const auto n = static_cast<std::uint32_t>(pos.size());
            std::vector<float> x(std::size_t{n} * s.k_row_size());
            for (auto& e : x) e = nd(rng);
            std::vector<seq_id_t> seq(n, 0);
            auto pl = cache.place(pos, seq).value();
            std::vector<float> k = x;
            kvcache::ops::rope_rows(k.data(), n, s.n_head_kv, s.head_dim_k, pos.data(), s.rope);
            std::vector<float> vv(std::size_t{n} * s.v_row_size(), 0.25f);
            for (std::uint32_t l = 0; l < s.n_layer; ++l) {
                cache.write_k(l, pl.cells, k.data());
                cache.write_v(l, pl.cells, vv.data());
            }
            static_cast<void>(cache.commit());
            REQUIRE(cache.seq_add(0, 5000, 5024, up));
            REQUIRE(cache.seq_add(0, pos_max - 23, -1, -1234567));
            REQUIRE(cache.seq_add(0, 100, 124, 3000));
            kvcache::ops::apply_k_shift(cache, 1, path);
            CHECK_FALSE(cache.has_shift());
            const auto got = read_all_k(cache, n);
            // Rotated directly at p + d by the library and by the oracle.
            std::vector<float> direct = x;
            kvcache::ops::rope_rows(direct.data(), n, s.n_head_kv, s.head_dim_k, now.data(), s.rope);
            std::vector<double> want;
            std::vector<float> got_l0(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(direct.size()));
            for (std::uint32_t c = 0; c < n; ++c)
                for (std::uint32_t h = 0; h < s.n_head_kv; ++h) {
                    const auto o = ref::rope_variant_head(head_of(x, c * s.n_head_kv + h, v.dk), now[c], s.rope);
                    want.insert(want.end(), o.begin(), o.end());
                }
            CHECK(rel_l1(got_l0, want) <= 2e-6);
            double num = 0.0, den = 0.0;
            for (std::size_t i = 0; i < direct.size(); ++i) {
                num += std::abs(got_l0[i] - direct[i]);
                den += std::abs(direct[i]);
            }
            CHECK(num / den <= 2e-6);
            // The shift is a pure rotation: it keeps each head's norm (the magnitude
            // attn_factor is in K once; a shift applying it again would scale by it).
            for (std::uint32_t rh = 0; rh < n * s.n_head_kv; ++rh) {
                double a = 0.0, b = 0.0;
                for (std::uint32_t d = 0; d < v.dk; ++d) {
                    a += double(k[rh * v.dk + d]) * k[rh * v.dk + d];
                    b += double(got_l0[rh * v.dk + d]) * got_l0[rh * v.dk + d];
                }
                CHECK(std::sqrt(b / a) == doctest::Approx(1.0).epsilon(1e-5));
            }
        }
    }
}

TEST_CASE("rope variants: a K-shift rotating with the magnitude would not be additive (YaRN)") {
    // The rule of ops/kshift.hpp checked on the oracle: m R(d) applied to m R(p) x gives
    // m^2 R(p + d) x, not m R(p + d) x; R(d) without m gives it exactly.
    rope_params r;
    r.freq_base = 1000000.0f;
    r.freq_scale = 0.25f;
    r.scaling = rope_scaling::yarn;
    r.n_ctx_orig = 32768;
    r.attn_factor = rope_params::yarn_mscale(4.0f);
    std::vector<double> x(64);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(1.0 + static_cast<double>(i));
    const auto at_p = ref::rope_variant_head(x, 1000, r);
    const auto direct = ref::rope_variant_head(x, 1000 + 77777, r);
    const auto shifted = ref::rope_variant_head(at_p, 77777, r, false);
    const auto shifted_m = ref::rope_variant_head(at_p, 77777, r, true);
    for (std::size_t i = 0; i < x.size(); ++i) {
        CHECK(shifted[i] == doctest::Approx(direct[i]).epsilon(1e-9));
        CHECK(shifted_m[i] == doctest::Approx(direct[i] * r.attn_factor).epsilon(1e-9));
    }
}

TEST_CASE("rope variants: LongRoPE refuses moves across n_ctx_orig and leaves the cache bit-identical") {
    std::mt19937 rng(4);
    rope_params lr;
    lr.type = rope_type::neox;
    lr.scaling = rope_scaling::longrope;
    lr.n_ctx_orig = 4096;
    lr.short_factors = random_factors(16, rng, 1.0f, 3.0f);
    lr.long_factors = random_factors(16, rng, 1.0f, 60.0f);
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 32;
    s.rope = lr;
    s.n_cells = 32;
    s.n_seq_max = 2;
    kvcache::kv_cache<kvcache::f32> cache(s);
    std::vector<pos_t> pos = {3000, 3001, 4094, 4095, 4096, 4097, 9000};
    std::vector<seq_id_t> seq(pos.size(), 0);
    auto pl = cache.place(pos, seq).value();
    std::vector<float> k(pos.size() * 32, 0.5f), v = k;
    cache.write_k(0, pl.cells, k.data());
    cache.write_v(0, pl.cells, v.data());
    static_cast<void>(cache.commit());
    const auto before = kvtest::snapshot(cache);
    auto refused = [&](kvcache::result<void> r, const char* fn) {
        CAPTURE(fn);
        CHECK(kvtest::refused_with(r, kvcache::errc::unsupported, "n_ctx_orig = 4096"));
        CHECK(kvtest::snapshot(cache) == before);
    };
    refused(cache.seq_add(0, 4094, 4096, 1), "seq_add up across");        // 4095 -> 4096
    refused(cache.seq_add(0, 4096, -1, -1), "seq_add down across");       // 4096 -> 4095
    refused(cache.seq_add(-1, 0, -1, 5000), "seq_add every sequence");    // 3000 -> 8000
    refused(cache.seq_div(0, 4096, -1, 2), "seq_div");                    // 4096 -> 2048
    // Moves on one side are fine, and so is a cell moved below 0 (it is removed).
    REQUIRE(cache.seq_add(0, 3000, 3002, 1000));  // 3000..3001 -> 4000..4001
    REQUIRE(cache.seq_add(0, 9000, -1, 1000));    // 9000 -> 10000
    // A second move judged from where K was rotated (3000), not from the current 4000.
    CHECK(kvtest::refused_with(cache.seq_add(0, 4000, 4001, 96), kvcache::errc::unsupported, "K rotated at 3000"));
    REQUIRE(cache.seq_add(0, 4000, 4001, -1000));  // back to 3000: no net move
    {
        // A pending move across the boundary can only be made by hand (cells_for_update);
        // apply_k_shift refuses it before changing anything.
        kvcache::kv_cache<kvcache::f32> hand(s);
        auto p3 = hand.place(pos, seq).value();
        hand.write_k(0, p3.cells, k.data());
        hand.write_v(0, p3.cells, v.data());
        static_cast<void>(hand.commit());
        auto& cells = hand.cells_for_update(kvcache::detail::internal_access{});
        cells.move_pos(p3.cells[3], 4100);  // K rotated at 4095; pending shift 5
        const auto held = kvtest::snapshot(hand);
        expect_throw([&] { kvcache::ops::apply_k_shift(hand); }, kvcache::errc::unsupported, "from position 4095 to 4100");
        CHECK(kvtest::snapshot(hand) == held);
    }
    kvcache::ops::apply_k_shift(cache);
    CHECK_FALSE(cache.has_shift());
    // LongRoPE with every position on one side (or another scaling) never refuses.
    kvcache::model_shape plain = s;
    plain.rope.scaling = rope_scaling::yarn;
    plain.rope.short_factors = {};
    plain.rope.long_factors = {};
    plain.rope.n_ctx_orig = 4096;
    kvcache::kv_cache<kvcache::f32> other(plain);
    auto pl2 = other.place(pos, seq).value();
    other.write_k(0, pl2.cells, k.data());
    other.write_v(0, pl2.cells, v.data());
    static_cast<void>(other.commit());
    CHECK(other.seq_add(0, 0, -1, 1));
    CHECK(other.seq_div(0, 0, -1, 3));
    CHECK_FALSE(rope_params{}.uses_long_factors(pos_max));
    CHECK(lr.shift_exact(0, 4095));
    CHECK(lr.shift_exact(4096, pos_max));
    CHECK_FALSE(lr.shift_exact(4095, 4096));
}

TEST_CASE("rope variants: every bad field is refused, naming it (model_shape and rope_rows)") {
    const std::uint32_t dk = 16;  // 8 pairs
    auto base = [] {
        rope_params r;
        return r;
    };
    struct bad_case {
        const char* field;  // the field named first in the message, as "<prefix><field> = "
        std::function<void(rope_params&)> make;
        const char* why = "";  // and this in the message
    };
    const std::vector<bad_case> cases = {
        {"n_rot", [](rope_params& r) { r.n_rot = 5; }, "= 5: must be even"},
        {"n_rot", [](rope_params& r) { r.n_rot = 18; }, "= 18: must not exceed head_dim_k = 16"},
        {"freq_base", [](rope_params& r) { r.freq_base = 0.0f; }},
        {"freq_scale", [](rope_params& r) { r.freq_scale = std::nanf(""); }},
        {"type", [](rope_params& r) { r.type = static_cast<rope_type>(7); }},
        {"ntk_alpha", [](rope_params& r) { r.ntk_alpha = -2.0f; }},
        {"attn_factor", [](rope_params& r) { r.attn_factor = std::numeric_limits<float>::infinity(); }},
        {"scaling", [](rope_params& r) { r.scaling = static_cast<rope_scaling>(9); }},
        {"n_ctx_orig", [](rope_params& r) { r.scaling = rope_scaling::yarn; }, "= 0"},
        {"n_ctx_orig", [](rope_params& r) { r.scaling = rope_scaling::llama3; }, "= 0"},
        {"n_ctx_orig", [](rope_params& r) { r.scaling = rope_scaling::longrope; }, "= 0"},
        {"yarn.ext_factor", [](rope_params& r) { r.scaling = rope_scaling::yarn, r.n_ctx_orig = 4096, r.yarn.ext_factor = 1.5f; }},
        {"yarn.beta_fast", [](rope_params& r) { r.scaling = rope_scaling::yarn, r.n_ctx_orig = 4096, r.yarn.beta_fast = 0.0f; }},
        {"yarn.beta_slow", [](rope_params& r) { r.scaling = rope_scaling::yarn, r.n_ctx_orig = 4096, r.yarn.beta_slow = std::nanf(""); }},
        {"yarn.beta_fast", [](rope_params& r) { r.scaling = rope_scaling::yarn, r.n_ctx_orig = 4096, r.yarn.beta_fast = 1.0f; }, "must be > yarn.beta_slow"},
        {"llama3.factor", [](rope_params& r) { r.scaling = rope_scaling::llama3, r.n_ctx_orig = 8192, r.llama3.factor = 0.5f; }},
        {"llama3.low_freq_factor", [](rope_params& r) { r.scaling = rope_scaling::llama3, r.n_ctx_orig = 8192, r.llama3.low_freq_factor = 0.0f; }},
        {"llama3.high_freq_factor", [](rope_params& r) { r.scaling = rope_scaling::llama3, r.n_ctx_orig = 8192, r.llama3.high_freq_factor = 1.0f; }},
        {"freq_factors", [](rope_params& r) { r.freq_factors = {1, 1, 1, 1, 1, 1, 1}; }, "a table of 7: must hold n_rot / 2 = 8"},
        {"freq_factors[2]", [](rope_params& r) { r.freq_factors = {1, 1, -1, 1, 1, 1, 1, 1}; }},
        {"freq_factors", [](rope_params& r) { r.scaling = rope_scaling::llama3, r.n_ctx_orig = 8192, r.freq_factors = {1, 1, 1, 1, 1, 1, 1, 1}; }, "must be empty with scaling llama3"},
        {"freq_factors", [](rope_params& r) { r.scaling = rope_scaling::longrope, r.n_ctx_orig = 4096, r.freq_factors = {1, 1, 1, 1, 1, 1, 1, 1}; }, "must be empty with scaling longrope"},
        {"short_factors", [](rope_params& r) { r.scaling = rope_scaling::longrope, r.n_ctx_orig = 4096, r.long_factors = {1, 1, 1, 1, 1, 1, 1, 1}; }},
        {"long_factors", [](rope_params& r) { r.scaling = rope_scaling::longrope, r.n_ctx_orig = 4096, r.short_factors = {1, 1, 1, 1, 1, 1, 1, 1}; }},
        {"long_factors", [](rope_params& r) { r.scaling = rope_scaling::longrope, r.n_ctx_orig = 4096, r.short_factors = {1, 1, 1, 1, 1, 1, 1, 1}, r.long_factors = {1, 1, 1, 1, 1, 1, 1, 1, 1}; }, "a table of 9"},
        {"short_factors[0]", [](rope_params& r) { r.scaling = rope_scaling::longrope, r.n_ctx_orig = 4096, r.short_factors = {0, 1, 1, 1, 1, 1, 1, 1}, r.long_factors = {1, 1, 1, 1, 1, 1, 1, 1}; }},
        {"short_factors", [](rope_params& r) { r.short_factors = {1, 1, 1, 1, 1, 1, 1, 1}; }, "only for scaling longrope"},
        {"long_factors", [](rope_params& r) { r.scaling = rope_scaling::yarn, r.n_ctx_orig = 4096, r.long_factors = {1, 1, 1, 1, 1, 1, 1, 1}; }, "only for scaling longrope"},
    };
    for (const auto& c : cases) {
        CAPTURE(c.field);
        rope_params r = base();
        c.make(r);
        kvcache::model_shape s;
        s.n_layer = 1;
        s.n_head_kv = 1;
        s.head_dim_k = dk;
        s.n_cells = 16;
        s.rope = r;
        const std::string field = std::string(c.field) + " = ";
        expect_throw([&] { s.validate(); }, kvcache::errc::invalid_config, "model_shape.rope." + field);
        expect_throw([&] { s.validate(); }, kvcache::errc::invalid_config, c.why);
        expect_throw([&] { kvcache::kv_cache<kvcache::f32> cache(s); }, kvcache::errc::invalid_config,
                     "model_shape.rope." + field);
        std::vector<float> x(dk, 1.0f);
        const pos_t p = 3;
        expect_throw([&] { kvcache::ops::rope_rows(x.data(), 1, 1, dk, &p, r); }, kvcache::errc::invalid_argument,
                     "rope_rows: rope." + field);
        expect_throw([&] { kvcache::ops::rope_rows(x.data(), 1, 1, dk, &p, r); }, kvcache::errc::invalid_argument, c.why);
        for (float e : x) CHECK(e == 1.0f);
    }
    // Fields of a scaling not selected are ignored.
    rope_params ignored;
    ignored.yarn.beta_fast = -1.0f;
    ignored.llama3.factor = 0.0f;
    ignored.n_ctx_orig = 0;
    CHECK_NOTHROW(ignored.validate(dk));
}

TEST_CASE("rope variants: rope_factors share storage and compare by value") {
    const std::vector<float> v = {1.0f, 2.0f, 4.0f};
    kvcache::rope_factors a{std::span<const float>(v)};
    kvcache::rope_factors b = a;
    kvcache::rope_factors c{1.0f, 2.0f, 4.0f};
    CHECK(a.data() == b.data());
    CHECK(a == c);
    CHECK(a.size() == 3);
    CHECK(c[2] == 4.0f);
    CHECK_FALSE(a == kvcache::rope_factors{1.0f, 2.0f});
    CHECK(kvcache::rope_factors{}.empty());
    CHECK(kvcache::rope_factors{} == kvcache::rope_factors(std::span<const float>()));
}

TEST_CASE("rope variants: a state saved with one RoPE scaling is refused by a cache with another") {
    namespace io = kvcache::io;
    auto make = [](const rope_params& r) {
        kvcache::model_shape s;
        s.n_layer = 1;
        s.n_head_kv = 1;
        s.head_dim_k = 16;
        s.n_cells = 8;
        s.rope = r;
        auto c = std::make_unique<kvcache::kv_cache<kvcache::f32>>(s);
        std::vector<pos_t> pos = {0, 1, 2};
        std::vector<seq_id_t> seq(3, 0);
        auto pl = c->place(pos, seq).value();
        std::vector<float> k(3 * 16, 0.5f);
        c->write_k(0, pl.cells, k.data());
        c->write_v(0, pl.cells, k.data());
        static_cast<void>(c->commit());
        return c;
    };
    rope_params plain;
    rope_params yarn;
    yarn.scaling = rope_scaling::yarn;
    yarn.n_ctx_orig = 4096;  // freq_scale as plain: only the scaling word tells them apart
    rope_params yarn_other_beta = yarn;
    yarn_other_beta.yarn.beta_slow = 2.0f;
    rope_params llama3;
    llama3.scaling = rope_scaling::llama3;
    llama3.n_ctx_orig = 8192;
    rope_params table;
    table.freq_factors = {1, 2, 3, 4, 5, 6, 7, 8};
    rope_params table2 = table;
    table2.freq_factors = {1, 2, 3, 4, 5, 6, 7, 9};
    rope_params table_same;
    table_same.freq_factors = {1, 2, 3, 4, 5, 6, 7, 8};  // other storage, same values
    rope_params mag;
    mag.attn_factor = 1.5f;
    rope_params plain_unused = plain;  // unused fields of another scaling
    plain_unused.yarn.beta_fast = 64.0f;
    plain_unused.llama3.factor = 16.0f;

    const auto plain_state = io::save_state(*make(plain));
    CHECK(io::detail::load_le<std::uint32_t>(plain_state.data() + io::detail::off::rope_ext) == 0u);
    const std::vector<std::pair<rope_params, rope_params>> refused = {
        {plain, yarn}, {yarn, plain}, {yarn, yarn_other_beta}, {yarn, llama3}, {table, table2}, {plain, table}, {plain, mag}};
    for (const auto& [saved, loader] : refused) {
        auto src = make(saved);
        auto dst = make(loader);
        const auto before = kvtest::snapshot(*dst);
        const auto bytes = io::save_state(*src);
        auto r = io::load_state(*dst, bytes);
        CHECK_MESSAGE(kvtest::refused_with(r, kvcache::errc::shape_mismatch, "rope scaling word"), r);
        CHECK(kvtest::snapshot(*dst) == before);
    }
    const std::vector<std::pair<rope_params, rope_params>> loaded = {
        {plain, plain}, {plain, plain_unused}, {yarn, yarn}, {table, table_same}, {llama3, llama3}};
    for (const auto& [saved, loader] : loaded) {
        auto dst = make(loader);
        CHECK(io::load_state(*dst, io::save_state(*make(saved))));
    }
}

// ---------------------------------------------------------------- M-RoPE (Qwen2-VL)

namespace {

// M-RoPE variants: Qwen2-VL / Qwen2.5-VL (contiguous sections 16, 24, 24 of 64 pairs,
// NeoX, base 1e6), Qwen3-VL (interleaved 24, 20, 20), and one with all four sections
// summing to less than the pairs (the pattern repeats), GPT-J pairing, partial rotary
// dims and YaRN on top.
std::vector<variant> mrope_variants() {
    std::vector<variant> out;
    rope_params q2;
    q2.type = rope_type::neox;
    q2.freq_base = 1000000.0f;
    q2.mrope.sections = {16, 24, 24, 0};
    out.push_back({"qwen2-vl", q2, 128});
    rope_params q3 = q2;
    q3.freq_base = 5000000.0f;
    q3.mrope.sections = {24, 20, 20, 0};
    q3.mrope.interleaved = true;
    out.push_back({"qwen3-vl interleaved", q3, 128});
    rope_params odd;
    odd.type = rope_type::normal;
    odd.n_rot = 24;
    odd.mrope.sections = {2, 1, 2, 1};  // 6 of 12 pairs: repeats twice
    odd.scaling = rope_scaling::yarn;
    odd.freq_scale = 0.25f;
    odd.n_ctx_orig = 4096;
    odd.attn_factor = rope_params::yarn_mscale(4.0f);
    out.push_back({"4 sections repeated, normal, partial, yarn", odd, 32});
    rope_params odd_i = odd;
    odd_i.mrope.interleaved = true;
    odd_i.mrope.sections = {1, 2, 1, 2};
    out.push_back({"interleaved with extra slots", odd_i, 32});
    return out;
}

std::vector<kvcache::mrope_pos> mrope_random_ext(std::size_t n, std::mt19937& rng) {
    std::uniform_int_distribution<pos_t> u(0, pos_max);
    std::vector<kvcache::mrope_pos> e(n);
    for (auto& x : e) x = {u(rng), u(rng) % 1000, u(rng) % 3 == 0 ? 0 : u(rng)};
    return e;
}

}  // namespace

TEST_CASE("M-RoPE: section components are llama.cpp's (fixed facts)") {
    kvcache::rope_mrope_params q2;
    q2.sections = {16, 24, 24, 0};  // Qwen2-VL: pairs 0..15 t, 16..39 h, 40..63 w
    CHECK(q2.component(0) == 0);
    CHECK(q2.component(15) == 0);
    CHECK(q2.component(16) == 1);
    CHECK(q2.component(39) == 1);
    CHECK(q2.component(40) == 2);
    CHECK(q2.component(63) == 2);
    kvcache::rope_mrope_params q3;
    q3.sections = {24, 20, 20, 0};  // Qwen3-VL imrope: t h w t h w ... up to 3 * 20, then t / extra
    q3.interleaved = true;
    CHECK(q3.component(0) == 0);
    CHECK(q3.component(1) == 1);
    CHECK(q3.component(2) == 2);
    CHECK(q3.component(57) == 0);
    CHECK(q3.component(58) == 1);
    CHECK(q3.component(59) == 2);
    CHECK(q3.component(60) == 0);
    CHECK(q3.component(61) == 3);  // llama.cpp: neither h (61 >= 60) nor t (61 % 3 != 0)
    CHECK_FALSE(kvcache::rope_mrope_params{}.on());
    for (const auto& v : mrope_variants()) {  // the library's rule and the oracle's pattern agree
        CAPTURE(v.name);
        const std::uint32_t n_pairs = (v.rope.n_rot == 0 ? v.dk : v.rope.n_rot) / 2;
        const auto comp = ref::mrope_components(v.rope.mrope, n_pairs);
        for (std::uint32_t i = 0; i < n_pairs; ++i) CHECK(static_cast<int>(v.rope.mrope.component(i)) == comp[i]);
    }
}

TEST_CASE("M-RoPE: rope_rows matches the float64 M-RoPE formula, up to 2^31 - 1") {
    std::mt19937 rng(777);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<pos_t> upos(0, pos_max);
    for (const auto& v : mrope_variants()) {
        CAPTURE(v.name);
        const std::size_t n_rows = 9;
        const std::uint32_t n_head = 2;
        std::vector<pos_t> pos(n_rows);
        for (auto& p : pos) p = upos(rng);
        pos[0] = pos_max;
        auto ext = mrope_random_ext(n_rows, rng);
        ext[1] = {pos_max, 0, pos_max};
        std::vector<float> x(n_rows * n_head * v.dk);
        for (auto& e : x) e = nd(rng);
        std::vector<float> y = x;
        kvcache::ops::rope_rows(y.data(), n_rows, n_head, v.dk, pos.data(), ext.data(), v.rope);
        std::vector<double> want;
        for (std::size_t r = 0; r < n_rows; ++r)
            for (std::uint32_t h = 0; h < n_head; ++h) {
                const std::int64_t p4[4] = {pos[r], ext[r].h, ext[r].w, ext[r].e};
                const auto o = ref::mrope_variant_head(head_of(x, r * n_head + h, v.dk), p4, v.rope);
                want.insert(want.end(), o.begin(), o.end());
            }
        CHECK(rel_l1(y, want) <= 1e-6);
        // Not blind: equal positions give plain RoPE at that position; different ones do not.
        std::vector<kvcache::mrope_pos> same(n_rows);
        for (std::size_t r = 0; r < n_rows; ++r) same[r] = {pos[r], pos[r], pos[r]};
        std::vector<float> a = x, b = x;
        kvcache::ops::rope_rows(a.data(), n_rows, n_head, v.dk, pos.data(), same.data(), v.rope);
        rope_params plain = v.rope;
        plain.mrope = {};
        kvcache::ops::rope_rows(b.data(), n_rows, n_head, v.dk, pos.data(), plain);
        CHECK(a == b);
        CHECK(y != b);
    }
}

TEST_CASE("M-RoPE: the K-shift moves the temporal sections only (R(p + d) = R(d) R(p) on t; h, w, e kept)") {
    std::mt19937 rng(4242);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (const auto& v : mrope_variants()) {
        CAPTURE(v.name);
        kvcache::model_shape s;
        s.n_layer = 1;
        s.n_head_kv = 2;
        s.head_dim_k = v.dk;
        s.rope = v.rope;
        s.n_cells = 64;
        kvcache::kv_cache<kvcache::f32> cache(s);
        const pos_t up = pos_max - 200;
        std::vector<pos_t> pos, now;
        for (pos_t i = 0; i < 20; ++i) {  // moved up to just below 2^31 - 1
            pos.push_back(100 + i);
            now.push_back(100 + i + up);
        }
        for (pos_t i = 0; i < 20; ++i) {  // divided (Self-Extend): 1000..1019 / 3
            pos.push_back(1000 + i);
            now.push_back((1000 + i) / 3);
        }
        const auto n = static_cast<std::uint32_t>(pos.size());
        const auto ext = mrope_random_ext(n, rng);
        std::vector<float> x(std::size_t{n} * s.k_row_size());
        for (auto& e : x) e = nd(rng);
        std::vector<seq_id_t> seq(n, 0);
        auto pl = cache.place(pos, seq, ext).value();
        std::vector<float> k = x;
        kvcache::ops::rope_rows(k.data(), n, s.n_head_kv, s.head_dim_k, pos.data(), ext.data(), s.rope);
        cache.write_k(0, pl.cells, k.data());
        cache.write_v(0, pl.cells, k.data());
        static_cast<void>(cache.commit());
        REQUIRE(cache.seq_add(0, 100, 120, up));
        REQUIRE(cache.seq_div(0, 1000, 1020, 3));
        kvcache::ops::apply_k_shift(cache);
        CHECK_FALSE(cache.has_shift());
        std::vector<float> got(k.size());
        for (std::uint32_t i = 0; i < n; ++i) {
            CHECK(cache.cells().ext(pl.cells[i]) == ext[i]);  // extra positions never move
            CHECK(cache.cells().pos(pl.cells[i]) == now[i]);
            cache.read_k(0, pl.cells[i], got.data() + std::size_t{i} * s.k_row_size());
        }
        std::vector<double> want;
        for (std::uint32_t c = 0; c < n; ++c)
            for (std::uint32_t h = 0; h < s.n_head_kv; ++h) {
                const std::int64_t p4[4] = {now[c], ext[c].h, ext[c].w, ext[c].e};
                const auto o = ref::mrope_variant_head(head_of(x, c * s.n_head_kv + h, v.dk), p4, s.rope);
                want.insert(want.end(), o.begin(), o.end());
            }
        CHECK(rel_l1(got, want) <= 2e-6);
        // The pairs of the h / w / e sections are bit-identical to the K as written.
        const std::uint32_t n_pairs = s.n_rot() / 2;
        for (std::uint32_t r = 0; r < n * s.n_head_kv; ++r)
            for (std::uint32_t i = 0; i < n_pairs; ++i) {
                if (s.rope.mrope.component(i) == 0) continue;
                const std::size_t d0 = s.rope.type == rope_type::normal ? 2 * i : i;
                const std::size_t d1 = s.rope.type == rope_type::normal ? 2 * i + 1 : i + n_pairs;
                CHECK(got[r * v.dk + d0] == k[r * v.dk + d0]);
                CHECK(got[r * v.dk + d1] == k[r * v.dk + d1]);
            }
    }
}

TEST_CASE("M-RoPE: extra positions stay with their cells through sequence ops, defrag, restore and states") {
    namespace io = kvcache::io;
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 1;
    s.head_dim_k = 16;
    s.rope.type = rope_type::neox;
    s.rope.mrope.sections = {2, 3, 3, 0};
    s.n_cells = 40;
    s.n_seq_max = 3;
    kvcache::kv_cache<kvcache::f32> cache(s);
    std::mt19937 rng(9);
    // Each token's extra positions derive from its position: every check below can name
    // the expected value of any cell from its (position, sequence).
    auto ext_of = [](pos_t p, seq_id_t q) { return kvcache::mrope_pos{p * 3 + q, p + 1000 * q, q == 1 ? 7 : 0}; };
    auto place = [&](seq_id_t q, pos_t p0, pos_t n) {
        std::vector<pos_t> pos;
        std::vector<seq_id_t> seq;
        std::vector<kvcache::mrope_pos> ext;
        for (pos_t p = p0; p < p0 + n; ++p) {
            pos.push_back(p);
            seq.push_back(q);
            ext.push_back(ext_of(p, q));
        }
        auto pl = cache.place(pos, seq, ext).value();
        std::vector<float> k(pos.size() * 16);
        for (auto& e : k) e = std::normal_distribution<float>(0.0f, 1.0f)(rng);
        for (std::uint32_t l = 0; l < 2; ++l) {
            cache.write_k(l, pl.cells, k.data());
            cache.write_v(l, pl.cells, k.data());
        }
        static_cast<void>(cache.commit());
    };
    // origin[q]: the sequence whose placement made q's cells (seq_cp copies keep it).
    auto check_all = [&](const auto& c, const std::vector<seq_id_t>& origin, pos_t moved_from, pos_t delta) {
        const auto& ct = c.cells();
        for (std::uint32_t i = 0; i < ct.size(); ++i) {
            if (ct.is_free(i)) {
                CHECK(ct.ext(i) == kvcache::mrope_pos{});
                continue;
            }
            seq_id_t first = -1;
            ct.seqs(i).for_each([&](seq_id_t t) { first = first < 0 ? t : first; });
            const seq_id_t q = origin[static_cast<std::size_t>(first)];
            const pos_t p = ct.pos(i) >= moved_from ? ct.pos(i) - delta : ct.pos(i);  // where it was placed
            CHECK(ct.ext(i) == ext_of(p, q));
        }
    };
    place(0, 0, 10);
    place(1, 0, 8);
    std::vector<seq_id_t> origin = {0, 1, 0};
    check_all(cache, origin, pos_max, 0);
    REQUIRE(cache.seq_cp(0, 2, 0, -1));  // 2 shares 0's cells
    REQUIRE(cache.seq_rm(1, 2, 5));      // holes in 1
    REQUIRE(cache.seq_add(2, 5, -1, 20));  // splits shared cells: 2's copies keep the extra positions
    check_all(cache, origin, 25, 20);
    // A staged placement restored, and a refused one, leave every extra position as it was.
    const auto before = kvtest::snapshot(cache);
    {
        std::vector<pos_t> pos = {50};
        std::vector<seq_id_t> seq = {0};
        std::vector<kvcache::mrope_pos> ext = {{1, 2, 3}};
        REQUIRE(cache.place(pos, seq, ext));
        CHECK(cache.restore() == kvcache::tx_result::restored);
    }
    CHECK(kvtest::snapshot(cache) == before);
    // Defragmentation moves cells and their extra positions together.
    REQUIRE(cache.seq_rm(1, 0, 2));  // holes below used cells
    const auto res = kvcache::ops::defrag(cache, {.threshold = 0.0f, .min_cells = 0});
    CHECK(res.moves > 0);
    check_all(cache, origin, 25, 20);
    kvcache::ops::apply_k_shift(cache);
    // State round trip (whole cache and one sequence).
    const auto bytes = io::save_state(cache);
    CHECK((io::detail::load_le<std::uint32_t>(bytes.data() + io::detail::off::flags) & io::state_flag_mrope) != 0);
    kvcache::kv_cache<kvcache::f32> back(s);
    REQUIRE(io::load_state(back, bytes));
    check_all(back, origin, 25, 20);
    CHECK(io::save_state(back) == bytes);
    const auto seq1 = io::save_seq(cache, 1);
    kvcache::kv_cache<kvcache::f32> one(s);
    REQUIRE(io::load_seq(one, 0, seq1));
    std::vector<seq_id_t> origin1 = {1, 1, 1};
    check_all(one, origin1, pos_max, 0);
    {  // the prompt cache's copy_store keeps them too
        kvcache::copy_store<kvcache::kv_cache<kvcache::f32>> store;
        auto h = store.save(cache, 1).value();
        CHECK(h.ext.size() == h.pos.size());
        kvcache::kv_cache<kvcache::f32> copy(s);
        REQUIRE(store.load(copy, 0, h));
        check_all(copy, origin1, pos_max, 0);
        h.ext.pop_back();  // malformed entry: refused, nothing placed
        kvcache::kv_cache<kvcache::f32> bad(s);
        CHECK(kvtest::refused_with(store.load(bad, 0, h), kvcache::errc::shape_mismatch));
        CHECK(bad.used() == 0);
    }
    cache.seq_keep(2);
    check_all(cache, origin, 25, 20);
    CHECK(cache.used() == 10);
}

TEST_CASE("M-RoPE: bad inputs are refused with a clear error and change nothing") {
    namespace io = kvcache::io;
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 16;
    s.rope.mrope.sections = {2, 3, 3, 0};
    s.n_cells = 8;
    kvcache::model_shape plain_shape = s;
    plain_shape.rope.mrope = {};
    kvcache::kv_cache<kvcache::f32> m(s), plain(plain_shape);
    std::vector<pos_t> pos = {0, 1};
    std::vector<seq_id_t> seq = {0, 0};
    std::vector<kvcache::mrope_pos> ext = {{0, 0, 0}, {1, 1, 0}};
    const auto m0 = kvtest::snapshot(m), p0 = kvtest::snapshot(plain);
    expect_throw([&] { static_cast<void>(m.place(pos, seq)); }, kvcache::errc::invalid_argument,
                 "M-RoPE sections (rope.mrope), so every token needs its extra positions");
    expect_throw([&] { static_cast<void>(m.place(pos, seq, std::span(ext).first(1))); },
                 kvcache::errc::invalid_argument, "ext has 1 entries for 2 tokens");
    std::vector<kvcache::mrope_pos> negative = {{0, -1, 0}, {1, 1, 0}};
    expect_throw([&] { static_cast<void>(m.place(pos, seq, negative)); }, kvcache::errc::invalid_argument,
                 "ext[0] = (0, -1, 0)");
    expect_throw([&] { static_cast<void>(plain.place(pos, seq, ext)); }, kvcache::errc::invalid_argument,
                 "no M-RoPE sections");
    CHECK(kvtest::snapshot(m) == m0);
    CHECK(kvtest::snapshot(plain) == p0);
    std::vector<float> x(32, 1.0f), x0 = x;
    expect_throw([&] { kvcache::ops::rope_rows(x.data(), 2, 1, 16, pos.data(), s.rope); },
                 kvcache::errc::invalid_argument, "pass each row's extra positions");
    expect_throw([&] { kvcache::ops::rope_rows(x.data(), 2, 1, 16, pos.data(), ext.data(), plain_shape.rope); },
                 kvcache::errc::invalid_argument, "rope.mrope has no sections");
    expect_throw([&] { kvcache::ops::rope_rows(x.data(), 2, 1, 16, pos.data(), nullptr, s.rope); },
                 kvcache::errc::invalid_argument, "ext is null");
    CHECK(x == x0);
    // Validation of the sections.
    kvcache::model_shape wide = s;
    wide.rope.mrope.sections = {4, 3, 2, 0};  // 9 > 8 pairs
    expect_throw([&] { wide.validate(); }, kvcache::errc::invalid_config, "model_shape.rope.mrope.sections = 9");
    kvcache::model_shape lr = s;
    lr.rope.scaling = rope_scaling::longrope;
    lr.rope.n_ctx_orig = 64;
    lr.rope.short_factors = {1, 1, 1, 1, 1, 1, 1, 1};
    lr.rope.long_factors = {2, 2, 2, 2, 2, 2, 2, 2};
    expect_throw([&] { lr.validate(); }, kvcache::errc::invalid_config, "longrope is not supported");
    // States: M-RoPE and plain caches refuse each other's states (the rope scaling word
    // hashes the sections), and so do caches with other sections or layouts.
    REQUIRE(m.place(pos, seq, ext));
    static_cast<void>(m.commit());
    REQUIRE(plain.place(pos, seq));
    static_cast<void>(plain.commit());
    const auto m_bytes = io::save_state(m), p_bytes = io::save_state(plain);
    kvcache::model_shape other = s;
    other.rope.mrope.sections = {3, 2, 3, 0};
    kvcache::model_shape inter = s;
    inter.rope.mrope.interleaved = true;
    kvcache::kv_cache<kvcache::f32> c_other(other), c_inter(inter), c_plain(plain_shape), c_m(s);
    for (auto* c : {&c_other, &c_inter}) {
        const auto b = kvtest::snapshot(*c);
        CHECK(kvtest::refused_with(io::load_state(*c, m_bytes), kvcache::errc::shape_mismatch, "rope scaling word"));
        CHECK(kvtest::snapshot(*c) == b);
    }
    CHECK(kvtest::refused_with(io::load_state(c_plain, m_bytes), kvcache::errc::shape_mismatch, "rope scaling word"));
    CHECK(kvtest::refused_with(io::load_state(c_m, p_bytes), kvcache::errc::shape_mismatch, "rope scaling word"));
    // Bad bytes with a valid checksum: the M-RoPE flag cleared, a negative position.
    auto reseal = [](std::vector<std::byte> b) {
        io::detail::store_le<std::uint64_t>(b.data() + b.size() - 8,
                                            io::checksum(std::span<const std::byte>(b).first(b.size() - 8)));
        return b;
    };
    auto no_flag = m_bytes;
    io::detail::store_le<std::uint32_t>(no_flag.data() + io::detail::off::flags, 0u);
    const auto cm0 = kvtest::snapshot(c_m);
    CHECK(kvtest::refused_with(io::load_state(c_m, reseal(no_flag)), kvcache::errc::invalid_cell, "flags bit 1 is clear"));
    auto neg = m_bytes;
    const std::size_t ext_at = io::state_header_size + 2 * 16;  // after two 16-byte cell records
    CHECK(io::detail::load_le<std::int32_t>(neg.data() + ext_at + 12) == 1);  // cell 1's h
    io::detail::store_le<std::int32_t>(neg.data() + ext_at + 12, -5);
    CHECK(kvtest::refused_with(io::load_state(c_m, reseal(neg)), kvcache::errc::invalid_cell,
                               "cell 1: M-RoPE positions (-5, 1, 0)"));
    CHECK(kvtest::snapshot(c_m) == cm0);
    REQUIRE(io::load_state(c_m, m_bytes));
    CHECK(c_m.cells().ext(c_m.cells().first_used() + 1) == ext[1]);
}
