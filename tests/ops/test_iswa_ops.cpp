// ops on an ISWA cache: context shift and Self-Extend change both parts or neither (a
// refusal by the ring leaves both bit-identical), and the memory report sums both parts.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <random>
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
    CHECK_THROWS_AS(ops::context_shift(c, 0, -1), kvcache::error);
    CHECK_THROWS_AS(ops::context_shift(c, 5, 0), kvcache::error);
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
