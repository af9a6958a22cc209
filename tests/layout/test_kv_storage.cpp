// The K/V arrangement of layout/kv_storage.hpp: every (cell, dimension) of a head has its
// own element inside the head's run, row-major V keeps the pieces the kernels read
// together contiguous, and rows written come back unchanged.
#include <doctest/doctest.h>

#include <kvcache/element/f32.hpp>
#include <kvcache/layout/kv_storage.hpp>

#include <cstdint>
#include <random>
#include <vector>

#include "layout_test_util.hpp"

namespace {

using namespace kvcache;

template <v_layout VL>
void check_offsets(std::uint32_t dk, std::uint32_t dv, std::uint32_t n_cells) {
    CAPTURE(dk);
    CAPTURE(dv);
    CAPTURE(n_cells);
    model_shape s = kvtest::layout_shape(n_cells, 1, 1, 3, dk);
    s.head_dim_v = dv;
    tiled_kv_storage<f32, VL> st(s);
    const auto v = st.view(0);
    const std::uint32_t cp = st.n_cells_padded();
    REQUIRE(cp % k_tile == 0);
    for (std::uint32_t h = 0; h < s.n_head_kv; ++h) {
        std::vector<int> k_hits(std::size_t{cp} * dk, 0), v_hits(std::size_t{cp} * dv, 0);
        for (std::uint32_t c = 0; c < cp; ++c) {
            for (std::uint32_t d = 0; d < dk; ++d) {
                const std::size_t o = v.k_offset(h, c, d) - h * v.k_head_stride;
                REQUIRE(o < k_hits.size());
                ++k_hits[o];
            }
            for (std::uint32_t d = 0; d < dv; ++d) {
                const std::size_t o = v.v_offset(h, c, d) - h * v.v_head_stride;
                REQUIRE(o < v_hits.size());
                ++v_hits[o];
                if constexpr (VL == v_layout::row_major) {
                    // a cell's piece of one V block is contiguous, tiles are v_tile_ptr apart
                    if (d % v_block != 0) CHECK(v.v_offset(h, c, d) == v.v_offset(h, c, d - 1) + 1);
                    CHECK(v.v + v.v_offset(h, c, d) == v.v_tile_ptr(h, c / k_tile) + v.v_in_tile(c % k_tile, d));
                    // block b of cell j + 1 follows block b of cell j
                    const std::uint32_t d0 = d / v_block * v_block;
                    if (c % k_tile + 1 < k_tile && d == d0)
                        CHECK(v.v_offset(h, c + 1, d) == v.v_offset(h, c, d) + std::min(v_block, dv - d0));
                }
            }
        }
        for (int x : k_hits) REQUIRE(x == 1);
        for (int x : v_hits) REQUIRE(x == 1);
    }
}

}  // namespace

TEST_CASE("kv_storage: every (cell, dimension) of a head has one element of its own") {
    for (std::uint32_t dv : {1u, 5u, 24u, 32u, 40u, 72u, 80u, 128u, 200u}) {
        check_offsets<v_layout::row_major>(16, dv, 70);
        check_offsets<v_layout::transposed>(16, dv, 70);
    }
    check_offsets<v_layout::row_major>(128, 0, 33);  // dv 0: head_dim_k
}

TEST_CASE("kv_storage: rows written come back unchanged (f32, both V layouts, narrow last V block)") {
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-3.0f, 3.0f);
    auto run = [&](auto tag) {
        constexpr v_layout VL = decltype(tag)::value;
        for (std::uint32_t dv : {5u, 40u, 72u, 128u}) {
            model_shape s = kvtest::layout_shape(100, 1, 2, 2, 24);
            s.head_dim_v = dv;
            tiled_kv_storage<f32, VL> st(s);
            std::vector<std::vector<float>> rows(s.n_cells, std::vector<float>(std::size_t{2} * dv));
            for (std::uint32_t c = 0; c < s.n_cells; ++c) {
                for (auto& x : rows[c]) x = u(rng);
                st.write_v(1, c, rows[c].data());
            }
            std::vector<float> back(std::size_t{2} * dv);
            for (std::uint32_t c = 0; c < s.n_cells; ++c) {
                st.read_v(1, c, back.data());
                CHECK(back == rows[c]);
            }
        }
    };
    run(std::integral_constant<v_layout, v_layout::row_major>{});
    run(std::integral_constant<v_layout, v_layout::transposed>{});
}
