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
        for (const auto& [i, ff] : facts) {
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
        for (const auto& [i, p, c, s] : cs) {
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
