// State I/O of the ring layout's pruning points (F10 + F15): a sequence saved from a
// ring that pruned below w and loaded back into a ring refuses again what needs the
// positions below w; whole caches keep every sequence's point; states without pruning
// are byte-for-byte the earlier version 1 format (flags 0); a sequence loaded over cells
// it shared moves them to their other holders' regions; other layouts load the cells
// and ignore the table; a refused load keeps the ring's points; every malformed table
// is refused with its error code and the cache bit-identical.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#if __has_include(<kvcache/layout/ring.hpp>)
#include <kvcache/layout/ring.hpp>

#include <random>
#include <string>
#include <vector>

#include "io/io_test_util.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvtest;
namespace io = kvcache::io;
namespace off = kvcache::io::detail::off;
using kvcache::errc;
using ring8 = kvcache::kv_cache<kvcache::f16, kvcache::ring<8>>;
using contig = kvcache::kv_cache<kvcache::f16>;

/// Regions of 8 + 4 cells for 4 sequences; one layer, one head of 4: small states.
kvcache::model_shape ring_shape() { return io_shape(kvcache::ring<8>::cells_for(4, 4), 4, 1, 1, 4); }

/// Sequence 0: positions [0, 20) (pruned below 12); 1: [0, 5) (nothing pruned);
/// 2: a fork of 0 (inherits 12); 3: empty.
ring8 pruned_ring(std::uint32_t seed) {
    ring8 c(ring_shape());
    std::mt19937 rng(seed);
    for (int i = 0; i < 5; ++i) REQUIRE(append(c, 0, 4, rng));
    REQUIRE(append(c, 1, 5, rng));
    REQUIRE(c.seq_cp(0, 2, -1, -1));
    REQUIRE(c.storage().pruned_below(0) == 12);
    REQUIRE(c.storage().pruned_below(1) == 0);
    REQUIRE(c.storage().pruned_below(2) == 12);
    return c;
}

std::vector<kvcache::pos_t> points(const ring8& c) {
    std::vector<kvcache::pos_t> p;
    for (seq_id_t s = 0; s < 4; ++s) p.push_back(c.storage().pruned_below(s));
    return p;
}

/// Offset of the pruning table: after the header, tokens, media and cell records.
std::size_t table_offset(const std::vector<std::byte>& b) {
    std::size_t at = io::state_header_size + 4 * peek<std::uint64_t>(b, off::n_tokens) +
                     16 * peek<std::uint64_t>(b, off::n_media);
    for (std::uint64_t i = 0; i < peek<std::uint64_t>(b, off::n_cells); ++i)
        at += 12 + 4 * std::size_t{peek<std::uint32_t>(b, at + 8)};
    return at;
}

/// Loads `bytes` into a pruned ring (whole, or one sequence into 3) and checks the refusal:
/// code, message, and the cache (cells, K/V bytes, pruning points) unchanged.
void expect_refused(const std::vector<std::byte>& bytes, bool whole, errc code, const std::string& needle = {}) {
    ring8 d = pruned_ring(99);
    const auto snap = snapshot(d);
    const auto pts = points(d);
    auto r = whole ? io::load_state(d, bytes) : io::load_seq(d, 3, bytes);
    REQUIRE_FALSE(r.ok());
    CHECK_MESSAGE(r.code() == code, r.message());
    if (!needle.empty()) CHECK_MESSAGE(r.message().find(needle) != std::string::npos, r.message());
    CHECK(snapshot(d) == snap);
    CHECK(points(d) == pts);
}

}  // namespace

TEST_CASE("ring states keep their pruning points: one sequence and the whole cache") {
    const ring8 a = pruned_ring(1);
    const auto seq0 = io::save_seq(a, 0);
    CHECK(peek<std::uint32_t>(seq0, off::flags) == io::state_flag_pruning);
    ring8 b(ring_shape());
    auto r = io::load_seq(b, 1, seq0);
    REQUIRE_MESSAGE(r.ok(), r.message());
    CHECK(b.storage().pruned_below(1) == 12);
    CHECK(picture(b, 1, 1) == picture(a, 0, 1));
    // the loaded copy refuses what the original refuses, and allows what it allows
    CHECK(kvtest::refused_result(b.seq_rm(1, 15, -1), "below 12"));
    CHECK(kvtest::refused_result(b.seq_add(1, 5, -1, 1), "cannot move the range [5, end)"));
    CHECK(kvtest::refused_result(b.seq_cp(1, 0, 0, 10), "unsupported"));
    REQUIRE(b.seq_rm(1, 19, -1));  // ends at 18: 18 + 2 - 8 = 12
    CHECK(b.storage().pruned_below(1) == 12);

    const auto whole = io::save_state(a);
    CHECK(peek<std::uint32_t>(whole, off::flags) == io::state_flag_pruning);
    ring8 c(ring_shape());
    REQUIRE(io::load_state(c, whole).ok());
    CHECK(points(c) == points(a));
    CHECK(picture(c) == picture(a));
    std::vector<float> q(4, 0.5f);
    for (seq_id_t s = 0; s < 3; ++s)
        CHECK(attention_oracle(c, s, a.seq_pos_max(s), q, 8) == attention_oracle(a, s, a.seq_pos_max(s), q, 8));
    ring8 twice(ring_shape());
    REQUIRE(io::load_state(twice, io::save_state(c)).ok());
    CHECK(points(twice) == points(a));

    // a state without pruning points clears the destination's; the cells sequence 0 shared
    // with its fork 2 stay with 2 and move to 2's region to make room (as a commit would)
    const auto unpruned = io::save_seq(a, 1);
    CHECK(peek<std::uint32_t>(unpruned, off::flags) == 0u);  // the first version 1 format, byte for byte
    const auto fork = picture(c, 2, 2);
    auto rs = io::load_seq(c, 0, unpruned);
    REQUIRE_MESSAGE(rs.ok(), rs.message());
    CHECK(c.storage().pruned_below(0) == 0);
    CHECK(c.storage().pruned_below(2) == 12);
    CHECK(picture(c, 2, 2) == fork);
    CHECK(picture(c, 0, 0) == picture(a, 1, 0));
    CHECK(c.storage().foreign_cells(0) == 0);
    CHECK(c.storage().check_invariants(c.cells()) == "");
    contig plain(ring_shape());
    std::mt19937 rng(2);
    REQUIRE(append(plain, 2, 6, rng));
    REQUIRE(io::load_state(c, io::save_state(plain)).ok());
    CHECK(points(c) == std::vector<kvcache::pos_t>{0, 0, 0, 0});
}

TEST_CASE("a ring state whose sequence holds more cells than its region loads, also into a fresh ring") {
    // Regions of 12 cells. Sequence 0: 8 tokens collapsed to position 0 by seq_div, then 4
    // more (its region full); sequence 1 keeps positions 5..7, copies them to 0 and leaves them:
    // 0 then holds 15 cells, 3 of them foreign in region 1 (region 0 has no room for them).
    ring8 a(ring_shape());
    std::mt19937 rng(5);
    REQUIRE(append(a, 0, 8, rng));
    REQUIRE(a.seq_div(0, 0, 8, 8));
    REQUIRE(append(a, 0, 4, rng));
    REQUIRE(append(a, 1, 8, rng));
    REQUIRE(a.seq_rm(1, 0, 5));  // keeps 5, 6, 7: positions 0 does not hold
    REQUIRE(a.seq_cp(1, 0, -1, -1));
    REQUIRE(a.seq_rm(1, -1, -1));
    static_cast<void>(a.commit());
    REQUIRE(a.cells().seq_cell_count(0) == 15);
    REQUIRE(a.storage().check_invariants(a.cells()) == "");
    const auto whole = io::save_state(a);
    ring8 b(ring_shape());
    auto r = io::load_state(b, whole);
    REQUIRE_MESSAGE(r.ok(), r.message());
    CHECK(picture(b) == picture(a));
    CHECK(b.storage().check_invariants(b.cells()) == "");
    std::vector<float> q(4, 0.5f);
    CHECK(attention_oracle(b, 0, a.seq_pos_max(0), q, 8) == attention_oracle(a, 0, a.seq_pos_max(0), q, 8));
    // one sequence into another id of a fresh ring, and the cache still places and commits
    ring8 c(ring_shape());
    auto rs = io::load_seq(c, 2, io::save_seq(a, 0));
    REQUIRE_MESSAGE(rs.ok(), rs.message());
    CHECK(picture(c, 2, 0) == picture(a, 0, 0));
    CHECK(append(c, 3, 4, rng));
    CHECK(c.storage().check_invariants(c.cells()) == "");
    // 15 cells to place and 12 free (sequences 0..2 fill their regions): refused, nothing changed
    ring8 full(ring_shape());
    for (seq_id_t s = 0; s < 3; ++s) {
        REQUIRE(append(full, s, 8, rng));
        REQUIRE(full.seq_div(s, 0, 8, 8));
        REQUIRE(append(full, s, 4, rng));
    }
    const auto snap = snapshot(full);
    auto rf = io::load_seq(full, 3, io::save_seq(a, 0));
    CHECK_FALSE(rf.ok());
    CHECK(snapshot(full) == snap);
}

TEST_CASE("other layouts load a pruned ring's cells and ignore its pruning points") {
    const ring8 a = pruned_ring(3);
    contig c(io_shape(64, 4, 1, 1, 4));
    auto r = io::load_state(c, io::save_state(a));
    REQUIRE_MESSAGE(r.ok(), r.message());
    CHECK(picture(c) == picture(a));
    REQUIRE(c.seq_rm(0, 15, -1));  // a contiguous cache holds what it was given and refuses nothing
    const auto back = io::save_state(c);
    CHECK(peek<std::uint32_t>(back, off::flags) == 0u);
    ring8 d(ring_shape());
    REQUIRE(io::load_state(d, back).ok());
    CHECK(d.storage().pruned_below(0) == 0);  // the table did not survive the contiguous cache
    contig one(io_shape(64, 4, 1, 1, 4));
    REQUIRE(io::load_seq(one, 3, io::save_seq(a, 2)).ok());
    CHECK(picture(one, 3, 3) == picture(a, 2, 3));
}

TEST_CASE("a refused load leaves the ring's pruning points as they were") {
    ring8 a = pruned_ring(4);
    const auto snap = snapshot(a);
    const auto pts = points(a);
    contig big(io_shape(64, 4, 1, 1, 4));  // more cells than the ring has
    std::mt19937 rng(5);
    REQUIRE(append(big, 0, a.capacity() + 1, rng));
    auto r = io::load_state(a, io::save_state(big));
    CHECK(r.code() == errc::no_space);
    CHECK(snapshot(a) == snap);
    CHECK(points(a) == pts);
    r = io::load_seq(a, 0, io::save_seq(big, 0));
    CHECK(r.code() == errc::no_space);
    CHECK(snapshot(a) == snap);
    CHECK(points(a) == pts);
    CHECK(kvtest::refused_result(a.seq_rm(0, 15, -1), "unsupported"));  // still refused
}

TEST_CASE("malformed pruning tables are refused with their error code, the cache bit-identical") {
    const ring8 a = pruned_ring(6);
    const auto whole = io::save_state(a);
    const auto one = io::save_seq(a, 0);
    const std::size_t tw = table_offset(whole), t1 = table_offset(one);
    REQUIRE(peek<std::uint32_t>(whole, tw) == 2);  // sequences 0 and 2
    REQUIRE(peek<std::uint32_t>(one, t1) == 1);
    for (const bool is_whole : {true, false}) {
        const auto& b = is_whole ? whole : one;
        const std::size_t t = is_whole ? tw : t1;
        INFO((is_whole ? "whole" : "one sequence"));
        expect_refused(patched<std::uint32_t>(b, t, 0), is_whole, errc::invalid_cell, "holds 0 sequences");
        expect_refused(patched<std::uint32_t>(b, t, 5), is_whole, errc::invalid_cell, "holds 5 sequences");
        expect_refused(patched<std::uint32_t>(b, t, 0xFFFFFFFFu), is_whole, errc::invalid_cell, "must be in [1, ");
        expect_refused(patched<std::int32_t>(b, t + 4, 9), is_whole, errc::invalid_cell, "sequence 9");
        expect_refused(patched<std::int32_t>(b, t + 4, -1), is_whole, errc::invalid_cell, "sequence -1");
        expect_refused(patched<std::int32_t>(b, t + 8, 0), is_whole, errc::invalid_cell, "pruned_below = 0");
        expect_refused(patched<std::int32_t>(b, t + 8, -5), is_whole, errc::invalid_cell, "pruned_below = -5");
        expect_refused(patched<std::int32_t>(b, t + 8, 21), is_whole, errc::invalid_cell, "must be in [1, 20]");
        expect_refused(patched<std::uint32_t>(b, off::flags, 0), is_whole, errc::trailing_bytes);  // table read as data
        for (std::size_t n = t; n < b.size(); ++n) {  // truncated inside or after the table
            auto x = std::vector<std::byte>(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
            patch<std::uint64_t>(x, off::total_size, x.size());
            reseal(x);
            expect_refused(x, is_whole, errc::truncated);
        }
    }
    expect_refused(patched<std::int32_t>(whole, tw + 12, 0), true, errc::invalid_cell, "not above the previous");
    expect_refused(patched<std::int32_t>(whole, tw + 12, 3), true, errc::invalid_cell, "holds no cell");
    expect_refused(patched<std::int32_t>(one, t1 + 4, 2), false, errc::invalid_cell, "holds only sequence 0");
    // a flag without a table reads the K/V data as one: refused, whatever the bytes say
    ring8 b = pruned_ring(7);
    auto plain = io::save_seq(b, 1);
    REQUIRE(peek<std::uint32_t>(plain, off::flags) == 0u);
    ring8 d = pruned_ring(8);
    const auto snap = snapshot(d);
    CHECK_FALSE(io::load_seq(d, 3, patched<std::uint32_t>(plain, off::flags, io::state_flag_pruning)).ok());
    CHECK(snapshot(d) == snap);
}
#endif
