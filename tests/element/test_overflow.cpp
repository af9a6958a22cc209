// What each built-in element stores for a value out of its range (the rule documented in
// element/f16.hpp, bf16.hpp, f32.hpp): f16 rounds to nearest even and overflows to inf
// from 65520 on; bf16 overflows to inf only above the f32 range it shares (from
// 0x7f7f8000, ~3.3961e38); f32 stores every float as is. NaN stays NaN. Checked on the
// scalar, the vector and the cache's write_k / read_k paths.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();

template <class E>
std::vector<float> round_trip(const std::vector<float>& in) {
    std::vector<typename E::storage_type> st(in.size());
    E::from_float(in.data(), st.data(), in.size());
    std::vector<float> out(in.size());
    E::to_float(st.data(), out.data(), in.size());
    return out;
}

// The values x, repeated so that the vector paths (8 / 16 lanes) and the scalar tail both see them.
std::vector<float> spread(std::initializer_list<float> xs) {
    std::vector<float> v;
    for (int r = 0; r < 5; ++r) v.insert(v.end(), xs.begin(), xs.end());
    return v;
}

}  // namespace

TEST_CASE("f16: overflow rounds to inf (IEEE round to nearest even), the largest finite value is 65504") {
    const auto in = spread({65504.0f, 65519.0f, 65520.0f, 1e6f, -1e6f, 3e38f, -65519.9f, std::nextafter(65520.0f, 0.0f)});
    const auto out = round_trip<kvcache::f16>(in);
    for (std::size_t i = 0; i < in.size(); i += 8) {
        CHECK(out[i + 0] == 65504.0f);
        CHECK(out[i + 1] == 65504.0f);  // below the midpoint to 2^16: rounds down
        CHECK(out[i + 2] == inf);       // the midpoint: ties to even (inf)
        CHECK(out[i + 3] == inf);
        CHECK(out[i + 4] == -inf);
        CHECK(out[i + 5] == inf);
        CHECK(out[i + 6] == -65504.0f);
        CHECK(out[i + 7] == 65504.0f);
    }
    for (std::size_t i = 0; i < in.size(); ++i)
        CHECK(std::bit_cast<std::uint16_t>(kvcache::scalar::f32_to_f16(in[i])) ==
              std::bit_cast<std::uint16_t>(kvcache::scalar::f32_to_f16(out[i] == inf || out[i] == -inf ? out[i] : in[i])));
}

TEST_CASE("bf16: no overflow inside the f32 range but for its last half ulp; NaN stays NaN") {
    const float max_bf16 = std::bit_cast<float>(0x7f7f0000u);        // largest finite bf16
    const float below_mid = std::bit_cast<float>(0x7f7f7fffu);       // rounds down to it
    const float mid = std::bit_cast<float>(0x7f7f8000u);             // tie: to even, inf
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const auto in = spread({1e6f, max_bf16, below_mid, mid, std::numeric_limits<float>::max(), -mid, nan, 65520.0f});
    const auto out = round_trip<kvcache::bf16>(in);
    for (std::size_t i = 0; i < in.size(); i += 8) {
        CHECK(std::isfinite(out[i + 0]));
        CHECK(std::fabs(out[i + 0] - 1e6f) <= 1e6f / 256.0f);
        CHECK(out[i + 1] == max_bf16);
        CHECK(out[i + 2] == max_bf16);
        CHECK(out[i + 3] == inf);
        CHECK(out[i + 4] == inf);
        CHECK(out[i + 5] == -inf);
        CHECK(std::isnan(out[i + 6]));
        CHECK(out[i + 7] == 65536.0f);
    }
}

TEST_CASE("f32: every float is stored as is, inf and NaN included") {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const auto in = spread({1e6f, std::numeric_limits<float>::max(), -inf, inf, 65520.0f, -3e38f, 1e-45f, 0.5f});
    const auto out = round_trip<kvcache::f32>(in);
    for (std::size_t i = 0; i < in.size(); ++i) CHECK(out[i] == in[i]);
    const auto n = round_trip<kvcache::f32>({nan});
    CHECK(std::isnan(n[0]));
}

TEST_CASE("write_k of a value beyond f16's range stores inf (documented, not silent: read_k shows it)") {
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 16;
    s.n_cells = 32;
    kvcache::kv_cache<kvcache::f16> cache(s);
    const std::vector<kvcache::pos_t> pos = {0};
    const std::vector<kvcache::seq_id_t> seq = {0};
    auto placed = cache.place(pos, seq);
    REQUIRE(placed.ok());
    std::vector<float> k(16, 1.0f), v(16, 2.0f), back(16);
    k[3] = 1e6f;
    k[4] = -70000.0f;
    v[5] = 65504.0f;
    cache.write_k(0, placed.value().cells, k.data());
    cache.write_v(0, placed.value().cells, v.data());
    static_cast<void>(cache.commit());
    cache.read_k(0, placed.value().cells[0], back.data());
    CHECK(back[3] == inf);
    CHECK(back[4] == -inf);
    CHECK(back[2] == 1.0f);
    cache.read_v(0, placed.value().cells[0], back.data());
    CHECK(back[5] == 65504.0f);
}
