// ops on an ISWA cache: context shift and Self-Extend change both parts or neither (a
// refusal by the ring leaves both bit-identical), and the memory report sums both parts.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "memory/iswa_test_util.hpp"
#include "support/result_check.hpp"

namespace {
using namespace kvcache;
using kvtest::iswa16;

/// The positions of s in the ring are the last ones of s in the full cache.
void parts_agree(const iswa16& c, seq_id_t s) {
    const auto full = kvtest::positions_of(c.full(), s);
    const auto ring = kvtest::positions_of(c.swa(), s);
    REQUIRE(ring.size() <= full.size());
    CHECK(std::vector<pos_t>(full.end() - static_cast<std::ptrdiff_t>(ring.size()), full.end()) == ring);
}
}  // namespace

TEST_CASE("iswa: context_shift moves both parts") {
    iswa16 c(kvtest::iswa_test_shape());
    std::mt19937 rng(1);
    kvtest::iswa_fill(c, 0, 0, 12, rng);  // within the window: nothing pruned
    const auto r = ops::context_shift(c, 0, 2, 4).value();
    CHECK(r.n_past_after == 8);
    CHECK(c.full().seq_pos_max(0) == 7);
    CHECK(c.swa().seq_pos_max(0) == 7);
    CHECK(kvtest::positions_of(c.full(), 0) == kvtest::positions_of(c.swa(), 0));
    CHECK(c.full().has_shift());
    CHECK(c.swa().has_shift());
    ops::apply_k_shift(c);
    CHECK_FALSE(c.has_shift());
}

TEST_CASE("iswa: context_shift refused by the ring leaves both parts bit-identical") {
    iswa16 c(kvtest::iswa_test_shape());
    std::mt19937 rng(2);
    kvtest::iswa_fill(c, 0, 0, 40, rng);  // the ring pruned: a shift needs dropped positions
    kvtest::iswa_fill(c, 1, 0, 5, rng);
    const auto before = kvtest::iswa_snap(c);
    CHECK(kvtest::refused_result(ops::context_shift(c, 0, 4), "unsupported"));
    CHECK(kvtest::iswa_snap(c) == before);
    CHECK(kvtest::refused_result(ops::context_shift(c, 0, 4, 36), "unsupported"));
    CHECK(kvtest::iswa_snap(c) == before);
    // Invalid arguments too.
    CHECK_THROWS_AS(static_cast<void>(ops::context_shift(c, 0, -1)), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(ops::context_shift(c, 5, 0)), kvcache::error);
    CHECK(kvtest::iswa_snap(c) == before);
    parts_agree(c, 0);
}

TEST_CASE("iswa: self_extend groups both parts, or neither") {
    SUBCASE("accepted within the window") {
        iswa16 c(kvtest::iswa_test_shape());
        std::mt19937 rng(3);
        kvtest::iswa_fill(c, 0, 0, 12, rng);
        ops::self_extend_state st{2, 8, 0};
        const pos_t np = ops::self_extend(c, 0, st, 12).value();
        CHECK(np == 8);
        CHECK(st.ga_i == 4);
        CHECK(kvtest::positions_of(c.full(), 0) == kvtest::positions_of(c.swa(), 0));
        CHECK(c.has_shift());
    }
    SUBCASE("refused by the ring: nothing changes") {
        iswa16 c(kvtest::iswa_test_shape());
        std::mt19937 rng(4);
        kvtest::iswa_fill(c, 0, 0, 40, rng);
        ops::self_extend_state st{2, 8, 0};
        const auto before = kvtest::iswa_snap(c);
        CHECK(kvtest::refused_result(ops::self_extend(c, 0, st, 40), "unsupported"));
        CHECK(kvtest::iswa_snap(c) == before);
        CHECK(st.ga_i == 0);
        ops::self_extend_state bad{3, 8, 0};  // ga_w not a multiple of ga_n
        CHECK_THROWS_AS(static_cast<void>(ops::self_extend(c, 0, bad, 40)), kvcache::error);
        CHECK(kvtest::iswa_snap(c) == before);
    }
}

TEST_CASE("iswa: the memory report sums both parts") {
    iswa16 c(kvtest::iswa_test_shape());
    std::mt19937 rng(5);
    kvtest::iswa_fill(c, 0, 0, 30, rng);
    const auto m = ops::memory(c);
    const auto f = ops::memory(c.full());
    const auto s = ops::memory(c.swa());
    CHECK(m.reserved_bytes == c.total_bytes());
    CHECK(m.reserved_bytes == f.reserved_bytes + s.reserved_bytes);
    CHECK(m.used_bytes == f.used_bytes + s.used_bytes);
    CHECK(m.held_bytes == f.held_bytes + s.held_bytes);
    CHECK(m.used_bytes == std::size_t{30} * c.full().bytes_per_token() + std::size_t{c.swa().used()} * c.swa().bytes_per_token());
    CHECK(m.held_bytes >= m.used_bytes);
}

TEST_CASE("iswa: Gemma 3 RoPE per layer group (local base 1e4, global base 1e6 with linear 8): K-shift and states") {
    auto gemma3 = [](std::optional<rope_params> swa_rope) {
        iswa_shape s = kvtest::iswa_test_shape(1);
        s.shape.rope.type = rope_type::neox;
        s.shape.rope.freq_base = 1000000.0f;
        s.shape.rope.freq_scale = 0.125f;
        s.swa_rope = swa_rope;
        return s;
    };
    rope_params local;
    local.type = rope_type::neox;
    local.freq_base = 10000.0f;
    const iswa_shape shape = gemma3(local);
    iswa16 c(shape);
    CHECK(c.rope(0) == local);  // layers 0 and 2 are SWA, 1 and 3 full (period 2)
    CHECK(c.rope(1).freq_base == 1000000.0f);
    CHECK(c.rope(1).freq_scale == 0.125f);
    CHECK(c.swa().shape().rope == local);
    const auto& sh = c.full().shape();
    std::mt19937 rng(17);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<pos_t> pos(12);
    for (pos_t i = 0; i < 12; ++i) pos[static_cast<std::size_t>(i)] = i;
    std::vector<seq_id_t> seq(12, 0);
    auto pl = c.place(pos, seq).value();
    std::vector<std::vector<float>> x(c.n_layer());  // unrotated K per model layer
    for (std::uint32_t l = 0; l < c.n_layer(); ++l) {
        x[l].resize(12 * sh.k_row_size());
        for (auto& e : x[l]) e = nd(rng);
        std::vector<float> k = x[l];
        ops::rope_rows(k.data(), 12, sh.n_head_kv, sh.head_dim_k, pos.data(), c.rope(l));
        c.write_k(l, pl, k.data());
        c.write_v(l, pl, k.data());
    }
    static_cast<void>(c.commit());
    REQUIRE(c.seq_add(0, 4, -1, 3));  // 4..11 -> 7..14: within the window
    ops::apply_k_shift(c);
    std::vector<pos_t> now = pos;
    for (std::size_t i = 4; i < 12; ++i) now[i] += 3;
    for (std::uint32_t l = 0; l < c.n_layer(); ++l) {
        CAPTURE(l);
        std::vector<float> want = x[l], other = x[l];
        ops::rope_rows(want.data(), 12, sh.n_head_kv, sh.head_dim_k, now.data(), c.rope(l));
        ops::rope_rows(other.data(), 12, sh.n_head_kv, sh.head_dim_k, now.data(), c.rope(l ^ 1u));  // the other group's
        const auto& cells = c.is_swa(l) ? pl.swa.cells : pl.full.cells;
        double err = 0.0, err_other = 0.0;
        std::vector<float> row(sh.k_row_size());
        for (std::size_t i = 0; i < 12; ++i) {
            if (c.is_swa(l))
                c.swa().read_k(c.local_layer(l), cells[i], row.data());
            else
                c.full().read_k(c.local_layer(l), cells[i], row.data());
            for (std::size_t d = 0; d < row.size(); ++d) {
                err = std::max(err, static_cast<double>(std::abs(row[d] - want[i * row.size() + d])));
                err_other = std::max(err_other, static_cast<double>(std::abs(row[d] - other[i * row.size() + d])));
            }
        }
        CHECK(err <= 1e-5);
        CHECK(err_other > 1e-2);  // the group's own RoPE matters
    }
    // States: the SWA part's fingerprint carries its RoPE.
    const auto bytes = io::save_state(c);
    iswa16 same(shape);
    REQUIRE(io::load_state(same, bytes));
    CHECK(io::save_state(same) == bytes);
    for (const iswa_shape& other : {gemma3(std::nullopt), gemma3([] {
                                        rope_params r;
                                        r.type = rope_type::neox;
                                        r.freq_base = 10000.0f;
                                        r.freq_scale = 0.5f;
                                        return r;
                                    }())}) {
        iswa16 d(other);
        const auto before = kvtest::iswa_snap(d);
        CHECK(kvtest::refused_with(io::load_state(d, bytes), errc::shape_mismatch));
        CHECK(kvtest::iswa_snap(d) == before);
    }
    // A bad SWA RoPE is refused naming it.
    rope_params odd = local;
    odd.n_rot = 3;
    try {
        iswa16 bad(gemma3(odd));
        FAIL("no exception");
    } catch (const kvcache::error& e) {
        CHECK(e.code() == errc::invalid_config);
        CHECK(std::string(e.what()).find("iswa_shape.swa_rope.n_rot = 3") != std::string::npos);
    }
    rope_params mr = local;
    mr.mrope.sections = {1, 1, 2, 0};
    CHECK_THROWS_AS(iswa16(gemma3(mr)), kvcache::error);
}
