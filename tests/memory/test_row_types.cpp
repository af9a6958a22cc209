// write_k / write_v with 16-bit rows (half, bfloat16), for engines that keep activations
// in them: on every element (f32, f16, bf16, q8_0, q4_0), the contiguous, paged and ring
// layouts, both V arrangements, iswa_cache and hybrid_memory, a 16-bit row must store the
// bytes the same values store as floats (widened by the scalar reference conversion),
// special values (inf, NaN, subnormals, -0) included; refusals (null rows, a bad layer, a
// free cell after valid ones) throw before the first write and leave every byte.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "iswa_test_util.hpp"
#include "support/cache_snapshot.hpp"

namespace {

using kvcache::bfloat16;
using kvcache::half;
using kvcache::pos_t;
using kvcache::seq_id_t;

kvcache::model_shape rowt_shape(std::uint32_t n_cells) {
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 2;
    s.head_dim_k = 64;
    s.head_dim_v = 32;
    s.n_cells = n_cells;
    s.n_seq_max = 2;
    s.rope.type = kvcache::rope_type::neox;  // K rows stored in pair order
    return s;
}

/// n random 16-bit values of type R: N(0, s) with s from 1e-6 to 1e4 (subnormal halfs, large
/// values), with +-inf, NaN, -0 and the largest finite value mixed in.
template <class R>
std::vector<R> rowt_values(std::size_t n, std::mt19937& rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_real_distribution<float> lg(-6.0f, 4.0f);
    std::vector<R> out(n);
    for (std::size_t i = 0; i < n; ++i) {
        const float x = nd(rng) * std::pow(10.0f, lg(rng));
        if constexpr (std::is_same_v<R, half>)
            out[i] = kvcache::scalar::f32_to_f16(x);
        else
            out[i] = kvcache::scalar::f32_to_bf16(x);
    }
    const float specials[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN(), -0.0f, 65504.0f};
    for (std::size_t k = 0; k < std::size(specials) && n > 0; ++k) {
        const std::size_t i = (k * 37 + 11) % n;
        if constexpr (std::is_same_v<R, half>)
            out[i] = kvcache::scalar::f32_to_f16(specials[k]);
        else
            out[i] = kvcache::scalar::f32_to_bf16(specials[k]);
    }
    return out;
}

/// The reference widening: one value at a time, scalar.
template <class R>
std::vector<float> rowt_widen(const std::vector<R>& in) {
    std::vector<float> out(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
        if constexpr (std::is_same_v<R, half>)
            out[i] = kvcache::scalar::f16_to_f32(in[i]);
        else
            out[i] = kvcache::scalar::bf16_to_f32(in[i]);
    }
    return out;
}

/// Places the same batches in a (16-bit rows) and b (float rows of the same values) and
/// checks that the bytes agree after each write.
template <class Cache, class R>
void rowt_same_bytes(std::uint32_t n_cells) {
    const kvcache::model_shape sh = rowt_shape(n_cells);
    Cache a(sh), b(sh);
    std::mt19937 rng(1234 + n_cells);
    for (pos_t p0 = 0; p0 < 24; p0 += 6) {
        std::vector<pos_t> pos;
        std::vector<seq_id_t> seq;
        for (pos_t i = 0; i < 6; ++i) {
            pos.push_back(p0 + i);
            seq.push_back(static_cast<seq_id_t>(i % 2));
        }
        auto ra = a.place(pos, seq);
        auto rb = b.place(pos, seq);
        REQUIRE(ra.ok());
        REQUIRE(rb.ok());
        REQUIRE(ra.value().cells == rb.value().cells);
        const auto& cells = ra.value().cells;
        for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
            const auto k16 = rowt_values<R>(cells.size() * sh.k_row_size(), rng);
            const auto v16 = rowt_values<R>(cells.size() * sh.v_row_size(), rng);
            const auto k32 = rowt_widen(k16);
            const auto v32 = rowt_widen(v16);
            a.write_k(l, cells, k16.data());
            a.write_v(l, cells, v16.data());
            b.write_k(l, cells, k32.data());
            b.write_v(l, cells, v32.data());
        }
        REQUIRE(a.commit() == kvcache::tx_result::committed);
        REQUIRE(b.commit() == kvcache::tx_result::committed);
        CHECK(kvtest::snapshot(a) == kvtest::snapshot(b));
    }
    // What was written reads back as the float path's values (a sanity check that the
    // comparison above compares written bytes, not two untouched caches).
    std::vector<float> row(sh.k_row_size());
    a.storage().read_k(0, a.cells().first_used(), row.data());
    bool any_nonzero = false;
    for (float x : row) any_nonzero = any_nonzero || (x != 0.0f && !std::isnan(x));
    CHECK(any_nonzero);
}

template <class Cache>
void rowt_both_row_types(std::uint32_t n_cells) {
    rowt_same_bytes<Cache, half>(n_cells);
    rowt_same_bytes<Cache, bfloat16>(n_cells);
}

void rowt_expect_refused(const std::function<void()>& f, const std::string& want) {
    try {
        f();
        FAIL("no error: ", want);
    } catch (const kvcache::error& e) {
        CHECK(e.code() == kvcache::errc::invalid_argument);
        CHECK(std::string(e.what()).find(want) != std::string::npos);
    }
}

}  // namespace

TEST_CASE("16-bit rows store the bytes of the same values as floats, every element (contiguous)") {
    rowt_both_row_types<kvcache::kv_cache<kvcache::f32>>(64);
    rowt_both_row_types<kvcache::kv_cache<kvcache::f16>>(64);
    rowt_both_row_types<kvcache::kv_cache<kvcache::bf16>>(64);
    rowt_both_row_types<kvcache::kv_cache<kvcache::q8_0>>(64);
    rowt_both_row_types<kvcache::kv_cache<kvcache::q4_0>>(64);
}

TEST_CASE("16-bit rows on the paged and ring layouts and the transposed V arrangement") {
    using kvcache::v_layout;
    rowt_both_row_types<kvcache::kv_cache<kvcache::f16, kvcache::paged<32>>>(96);
    rowt_both_row_types<kvcache::kv_cache<kvcache::q8_0, kvcache::paged<32, v_layout::transposed>>>(96);
    rowt_both_row_types<kvcache::kv_cache<kvcache::f16, kvcache::contiguous<v_layout::transposed>>>(64);
    rowt_both_row_types<kvcache::kv_cache<kvcache::q4_0, kvcache::ring<32>>>(kvcache::ring<32>::cells_for(2, 6));
}

TEST_CASE("16-bit rows: refusals throw before the first write and leave every byte") {
    using cache_t = kvcache::kv_cache<kvcache::q8_0>;
    const kvcache::model_shape sh = rowt_shape(64);
    cache_t c(sh);
    std::mt19937 rng(7);
    const std::vector<pos_t> pos = {0, 1, 2};
    const std::vector<seq_id_t> seq = {0, 0, 0};
    auto r = c.place(pos, seq);
    REQUIRE(r.ok());
    const auto k16 = rowt_values<half>(4 * sh.k_row_size(), rng);
    const auto v16 = rowt_values<bfloat16>(4 * sh.v_row_size(), rng);
    const auto before = kvtest::snapshot(c);

    const std::vector<std::uint32_t> cells = r.value().cells;
    rowt_expect_refused([&] { c.write_k(0, cells, static_cast<const half*>(nullptr)); }, "write_k: rows is null");
    rowt_expect_refused([&] { c.write_v(0, cells, static_cast<const bfloat16*>(nullptr)); },
                                  "write_v: rows is null");
    rowt_expect_refused([&] { c.write_k(2, cells, k16.data()); }, "write_k: layer = 2, must be < n_layer = 2");
    // The fourth cell is free: the three placed ones before it must not be written either.
    std::vector<std::uint32_t> with_free = cells;
    std::uint32_t free_cell = 0;
    while (!c.cells().is_free(free_cell)) ++free_cell;
    with_free.push_back(free_cell);
    rowt_expect_refused([&] { c.write_k(0, with_free, k16.data()); },
                              "write_k: cell " + std::to_string(free_cell) + " is free");
    rowt_expect_refused([&] { c.write_v(1, with_free, v16.data()); },
                                  "write_v: cell " + std::to_string(free_cell) + " is free");
    CHECK(kvtest::snapshot(c) == before);

    // No cells: nothing to write, any pointer (nullptr included) is accepted.
    c.write_k(0, std::span<const std::uint32_t>{}, static_cast<const half*>(nullptr));
    c.write_v(0, std::span<const std::uint32_t>{}, nullptr);
    CHECK(kvtest::snapshot(c) == before);
    CHECK(c.restore() == kvcache::tx_result::restored);
}

TEST_CASE("16-bit rows through iswa_cache and hybrid_memory") {
    std::mt19937 rng(99);
    {  // iswa: the sliding-window layers go to the ring part, the others to the full part
        using iswa_t = kvcache::iswa_cache<kvtest::iswa_w, kvcache::q8_0>;
        kvcache::iswa_shape s = kvtest::iswa_test_shape();
        s.shape.head_dim_k = 32;
        iswa_t a(s), b(s);
        const std::vector<pos_t> pos = {0, 1, 2, 3};
        const std::vector<seq_id_t> seq = {0, 1, 0, 1};
        auto ra = a.place(pos, seq);
        auto rb = b.place(pos, seq);
        REQUIRE(ra.ok());
        REQUIRE(rb.ok());
        for (std::uint32_t l = 0; l < s.shape.n_layer; ++l) {
            const auto k16 = rowt_values<bfloat16>(pos.size() * s.shape.k_row_size(), rng);
            const auto v16 = rowt_values<half>(pos.size() * s.shape.v_row_size(), rng);
            a.write_k(l, ra.value(), k16.data());
            a.write_v(l, ra.value(), v16.data());
            b.write_k(l, rb.value(), rowt_widen(k16).data());
            b.write_v(l, rb.value(), rowt_widen(v16).data());
        }
        CHECK(kvtest::snapshot(a.full()) == kvtest::snapshot(b.full()));
        CHECK(kvtest::snapshot(a.swa()) == kvtest::snapshot(b.swa()));
        const auto full_before = kvtest::snapshot(a.full());
        rowt_expect_refused([&] { a.write_k(4, ra.value(), static_cast<const half*>(nullptr)); },
                                  "write_k: layer = 4, must be < n_layer = 4");
        CHECK(kvtest::snapshot(a.full()) == full_before);
    }
    {  // hybrid: attention layers take 16-bit rows; a recurrent layer is refused
        using hyb_t = kvcache::hybrid_memory<kvcache::kv_cache<kvcache::f16>>;
        kvcache::model_shape as = rowt_shape(32);
        kvcache::recurrent_shape rs;
        rs.n_layer = 1;
        rs.n_seq_max = 2;
        rs.d_conv = 3;
        rs.d_inner = 4;
        rs.ssm_size = 6;
        const std::vector<bool> layers = {false, true, false};
        hyb_t a(as, rs, layers), b(as, rs, layers);
        const std::vector<pos_t> pos = {0, 1};
        const std::vector<seq_id_t> seq = {0, 1};
        auto ra = a.place(pos, seq);
        auto rb = b.place(pos, seq);
        REQUIRE(ra.ok());
        REQUIRE(rb.ok());
        for (std::uint32_t l : {0u, 2u}) {
            const auto k16 = rowt_values<half>(pos.size() * as.k_row_size(), rng);
            const auto v16 = rowt_values<bfloat16>(pos.size() * as.v_row_size(), rng);
            a.write_k(l, ra.value(), k16.data());
            a.write_v(l, ra.value(), v16.data());
            b.write_k(l, rb.value(), rowt_widen(k16).data());
            b.write_v(l, rb.value(), rowt_widen(v16).data());
        }
        CHECK(kvtest::snapshot(a.attention()) == kvtest::snapshot(b.attention()));
        const auto k16 = rowt_values<half>(pos.size() * as.k_row_size(), rng);
        rowt_expect_refused([&] { a.write_k(1, ra.value(), k16.data()); },
                                  "write_k: layer 1 is a recurrent layer, not attention");
        CHECK(kvtest::snapshot(a.attention()) == kvtest::snapshot(b.attention()));
    }
}
