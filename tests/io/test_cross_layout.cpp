// Cross-layout loads (F15): a state saved from one layout loads into another with the
// same model shape and element type and gives the same cells (position, shift,
// sequences, K/V bytes) and the same attention; a layout that cannot place the cells
// refuses and the cache stays bit-identical.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <random>
#include <vector>

#include "io/io_test_util.hpp"
#include "support/cache_snapshot.hpp"

#if __has_include(<kvcache/layout/paged.hpp>) && __has_include(<kvcache/layout/ring.hpp>)
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>
#include "support/result_check.hpp"

namespace {

using namespace kvtest;
namespace io = kvcache::io;
using kvcache::errc;
using contig = kvcache::kv_cache<kvcache::f16>;
using contig_vt = kvcache::kv_cache<kvcache::f16, kvcache::contiguous<kvcache::v_layout::transposed>>;
using paged = kvcache::kv_cache<kvcache::f16, kvcache::paged<32>>;
using paged_vt = kvcache::kv_cache<kvcache::f16, kvcache::paged<32, kvcache::v_layout::transposed>>;
using ring = kvcache::kv_cache<kvcache::f16, kvcache::ring<8>>;

template <class A, class B>
void same_cells_and_attention(const A& a, const B& b, pos_t window = 0) {
    REQUIRE(picture(a) == picture(b));
    std::vector<float> q(a.shape().k_row_size());
    std::mt19937 rng(17);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (seq_id_t s = 0; s < static_cast<seq_id_t>(a.shape().n_seq_max); ++s) {
        if (a.seq_pos_max(s) < 0) continue;
        for (auto& x : q) x = u(rng);
        CHECK(attention_oracle(a, s, a.seq_pos_max(s), q, window) == attention_oracle(b, s, b.seq_pos_max(s), q, window));
    }
}

template <class Paged>
void paged_ok(const Paged& p) {
    CHECK(p.storage().check_invariants(p.cells()) == "");
}

}  // namespace

TEST_CASE_TEMPLATE("contiguous <-> paged, whole cache and one sequence", Paged, paged, paged_vt) {
    for (std::uint32_t seed = 1; seed <= 10; ++seed) {
        INFO("seed " << seed);
        std::mt19937 rng(seed);
        contig c(io_shape(256, 4));
        random_history(c, rng, 14);
        Paged p(io_shape(256, 4));
        auto r = io::load_state(p, io::save_state(c));
        REQUIRE_MESSAGE(r.ok(), r.message());
        paged_ok(p);
        same_cells_and_attention(c, p);
        contig_vt back(io_shape(256, 4));
        REQUIRE(io::load_state(back, io::save_state(p)).ok());
        same_cells_and_attention(c, back);

        for (seq_id_t s = 0; s < 4; ++s) {
            Paged q(io_shape(256, 4));
            std::mt19937 other(seed + 1000);
            random_history(q, other, 6);
            const seq_id_t dst = 3 - s;
            std::vector<std::vector<cell_picture>> before;
            for (seq_id_t t = 0; t < 4; ++t) before.push_back(picture(q, t, t));
            const auto snap = snapshot(q);
            auto rs = io::load_seq(q, dst, io::save_seq(c, s));
            paged_ok(q);
            if (!rs) {
                CHECK(rs.code() == errc::no_space);
                CHECK(snapshot(q) == snap);
                continue;
            }
            CHECK(picture(q, dst, dst) == picture(c, s, dst));
            for (seq_id_t t = 0; t < 4; ++t)
                if (t != dst) CHECK(picture(q, t, t) == before[static_cast<std::size_t>(t)]);
        }
    }
}

TEST_CASE("paged refuses a state whose sequences need more blocks than it has; nothing changes") {
    contig c(io_shape(64, 3));
    std::mt19937 rng(5);
    for (seq_id_t s = 0; s < 3; ++s) append(c, s, 5, rng);  // 15 cells, but 3 sequences need 3 blocks
    paged p(io_shape(64, 3));                                  // 2 blocks of 32
    append(p, 0, 4, rng);
    const auto snap = snapshot(p);
    auto r = io::load_state(p, io::save_state(c));
    REQUIRE_FALSE(r.ok());
    CHECK_MESSAGE(r.code() == errc::no_space, r.message());
    CHECK(snapshot(p) == snap);
    paged_ok(p);
    CHECK(append(p, 0, 2, rng));  // still usable
}

TEST_CASE("contiguous <-> ring: windowed sequences load, shifted ones too, colliding positions too; more cells than it has are refused unchanged") {
    const auto sh = io_shape(ring::layout::cells_for(2, 4), 2);
    contig c(sh);
    std::mt19937 rng(9);
    append(c, 0, 6, rng);
    append(c, 1, 8, rng);
    ring w(sh);
    auto r = io::load_state(w, io::save_state(c));
    REQUIRE_MESSAGE(r.ok(), r.message());
    same_cells_and_attention(c, w, 8);
    contig back(sh);
    REQUIRE(io::load_state(back, io::save_state(w)).ok());
    same_cells_and_attention(c, back, 8);
    CHECK(append(w, 0, 2, rng));

    // Positions 0 and 12 of one sequence map to the same ring cell (region 12): the 13th
    // cell goes to a free cell of another region, as a ring that held them would have it.
    contig thirteen(io_shape(64, 2));
    append(thirteen, 0, 13, rng);
    ring w13(sh);
    auto r13 = io::load_state(w13, io::save_state(thirteen));
    REQUIRE_MESSAGE(r13.ok(), r13.message());
    CHECK(picture(w13) == picture(thirteen));
    CHECK(w13.storage().check_invariants(w13.cells()) == "");
    // More cells than the ring has: refused, unchanged.
    contig big(io_shape(64, 2));
    append(big, 0, sh.n_cells + 1, rng);
    ring w2(sh);
    append(w2, 1, 3, rng);
    const auto snap = snapshot(w2);
    auto r2 = io::load_state(w2, io::save_state(big));
    REQUIRE_FALSE(r2.ok());
    CHECK_MESSAGE(r2.code() == errc::no_space, r2.message());
    CHECK(snapshot(w2) == snap);
    auto r3 = io::load_seq(w2, 0, io::save_seq(big, 0));
    CHECK(r3.code() == errc::no_space);
    CHECK(snapshot(w2) == snap);
    REQUIRE(big.seq_add(0, 0, -1, 1));  // still colliding after a shift
    CHECK(io::load_state(w2, io::save_state(big)).code() == errc::no_space);
    CHECK(snapshot(w2) == snap);
    // The ring can move positions: pending shifts and duplicate positions load and come back.
    contig moved(sh);
    append(moved, 0, 6, rng);
    append(moved, 1, 5, rng);
    REQUIRE(moved.seq_add(0, 2, -1, 3));
    REQUIRE(moved.seq_div(1, 0, -1, 2));  // positions 0 0 1 1 2
    ring w3(sh);
    auto r4 = io::load_state(w3, io::save_state(moved));
    REQUIRE_MESSAGE(r4.ok(), r4.message());
    CHECK(w3.has_shift());
    same_cells_and_attention(moved, w3, 8);
    contig back3(sh);
    REQUIRE(io::load_state(back3, io::save_state(w3)).ok());
    same_cells_and_attention(moved, back3, 8);
}
#endif
