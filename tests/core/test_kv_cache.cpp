// Unit tests of kv_cache<...>: shape validation, sizes, placement, transactions,
// sequence operations, and every invalid call leaving the cache bit-identical.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <numeric>
#include <string>
#include <vector>

#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using kvcache::pos_t;
using kvcache::seq_id_t;

kvcache::model_shape small_shape(std::uint32_t n_cells = 32, std::uint32_t n_seq = 4) {
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 2;
    s.head_dim_k = 8;
    s.head_dim_v = 4;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    return s;
}

std::vector<pos_t> iota_pos(pos_t from, std::size_t n) {
    std::vector<pos_t> p(n);
    std::iota(p.begin(), p.end(), from);
    return p;
}

template <class Cache>
std::vector<std::uint32_t> add_tokens(Cache& c, seq_id_t s, pos_t from, std::size_t n) {
    const auto pos = iota_pos(from, n);
    const std::vector<seq_id_t> seq(n, s);
    auto cells = c.place(pos, seq).value().cells;
    std::vector<float> k(n * c.shape().k_row_size()), v(n * c.shape().v_row_size());
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(from) + 0.25f * static_cast<float>(i % 7);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = -static_cast<float>(from) - 0.5f * static_cast<float>(i % 5);
    for (std::uint32_t l = 0; l < c.shape().n_layer; ++l) {
        c.write_k(l, cells, k.data());
        c.write_v(l, cells, v.data());
    }
    REQUIRE(c.commit() == kvcache::tx_result::committed);
    return cells;
}

/// Runs f, expects kvcache::error with `code` whose message contains `needle`, and the cache unchanged.
template <class Cache, class F>
void expect_refused(Cache& c, kvcache::errc code, const std::string& needle, F f) {
    // Thrown (programming errors) or an error result (no_space), as the error rule says.
    const auto before = kvtest::snapshot(c);
    const kvtest::refusal r = kvtest::run_refusal(f);
    REQUIRE_MESSAGE(r.kind != kvtest::refusal_kind::none, "expected a refusal containing: " << needle);
    CHECK(r.kind == kvtest::rule_kind(code));
    CHECK(r.code == code);
    CHECK_MESSAGE(r.message.find(needle) != std::string::npos, r.message);
    CHECK(kvtest::snapshot(c) == before);
}

}  // namespace

TEST_CASE("model_shape validation names the bad parameter") {
    auto expect_bad = [](kvcache::model_shape s, const std::string& field) {
        try {
            kvcache::kv_cache<> c(s);
            FAIL("accepted a bad " << field);
        } catch (const kvcache::error& e) {
            CHECK(e.code() == kvcache::errc::invalid_config);
            CHECK_MESSAGE(std::string(e.what()).find(field) != std::string::npos, e.what());
        }
    };
    auto s = small_shape();
    { auto b = s; b.n_layer = 0; expect_bad(b, "n_layer"); }
    { auto b = s; b.n_head_kv = 0; expect_bad(b, "n_head_kv"); }
    { auto b = s; b.head_dim_k = 0; expect_bad(b, "head_dim_k"); }
    { auto b = s; b.head_dim_v = 5000; expect_bad(b, "head_dim_v"); }
    { auto b = s; b.rope.n_rot = 10; expect_bad(b, "rope.n_rot"); }
    { auto b = s; b.head_dim_k = 7; expect_bad(b, "rope.n_rot"); }  // odd n_rot = head_dim
    { auto b = s; b.rope.freq_base = 0.0f; expect_bad(b, "rope.freq_base"); }
    { auto b = s; b.rope.freq_scale = -1.0f; expect_bad(b, "rope.freq_scale"); }
    { auto b = s; b.rope.type = static_cast<kvcache::rope_type>(7); expect_bad(b, "rope.type"); }
    { auto b = s; b.n_cells = 0; expect_bad(b, "n_cells"); }
    { auto b = s; b.n_cells = (1u << 30) + 1; expect_bad(b, "n_cells"); }
    { auto b = s; b.n_seq_max = 0; expect_bad(b, "n_seq_max"); }
    { auto b = s; b.n_seq_max = KVCACHE_MAX_SEQ + 1; expect_bad(b, "n_seq_max"); }
}

TEST_CASE("bytes per token and total bytes (F1, F2)") {
    // Llama-3.2-1B: 16 layers, 8 KV heads, head_dim 64, f16 -> 32 KiB per token.
    kvcache::model_shape s;
    s.n_layer = 16;
    s.n_head_kv = 8;
    s.head_dim_k = 64;
    s.n_cells = 100;  // not a multiple of the 32-cell K tile
    kvcache::kv_cache<kvcache::f16> c(s);
    CHECK(c.bytes_per_token() == 32768);
    CHECK(c.total_bytes() == std::size_t{32768} * 128);  // padded to 4 tiles
    kvcache::kv_cache<kvcache::f32> c32(s);
    CHECK(c32.bytes_per_token() == 65536);
    // Different K and V head dims.
    auto t = small_shape();
    kvcache::kv_cache<kvcache::bf16> cb(t);
    CHECK(cb.bytes_per_token() == (8 + 4) * 2 * 2 * 2);
}

TEST_CASE("storage is zero-initialised (F2)") {
    kvcache::kv_cache<kvcache::f16> c(small_shape());
    const auto snap = kvtest::snapshot(c);
    for (unsigned char b : snap.bytes) REQUIRE(b == 0);
}

TEST_CASE_TEMPLATE("K/V round trip through every element type", E, kvcache::f32, kvcache::f16, kvcache::bf16) {
    for (auto vl : {0, 1}) {
        auto s = small_shape(64);
        std::vector<float> k(s.k_row_size()), v(s.v_row_size()), back_k(k.size()), back_v(v.size());
        for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i) * 0.5f - 3.0f;  // exact in bf16
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = 2.0f - static_cast<float>(i) * 0.25f;
        auto run = [&](auto& c) {
            auto cells = add_tokens(c, 0, 0, 40);  // crosses a 32-cell tile
            c.write_k(1, std::span(cells).subspan(33, 1), k.data());
            c.write_v(1, std::span(cells).subspan(33, 1), v.data());
            c.read_k(1, cells[33], back_k.data());
            c.read_v(1, cells[33], back_v.data());
            CHECK(back_k == k);
            CHECK(back_v == v);
        };
        if (vl == 0) {
            kvcache::kv_cache<E> c(s);
            run(c);
        } else {
            kvcache::kv_cache<kvcache::contiguous<kvcache::v_layout::transposed>, E> c(s);
            run(c);
        }
    }
}

TEST_CASE("policies in any order, defaults for kinds left out") {
    using a = kvcache::kv_cache<kvcache::f16, kvcache::contiguous<>>;
    using b = kvcache::kv_cache<kvcache::contiguous<>, kvcache::f16>;
    static_assert(std::is_same_v<a::element, b::element> && std::is_same_v<a::layout, b::layout>);
    using d = kvcache::kv_cache<>;
    static_assert(std::is_same_v<d::element, kvcache::f32>);
    static_assert(std::is_same_v<d::layout, kvcache::contiguous<>>);
    static_assert(std::is_same_v<d::reuse, kvcache::reuse::none>);
    CHECK(std::string(a::layout::name) == "contiguous");
}

TEST_CASE("placement: head heuristic, window, full cache") {
    kvcache::kv_cache<kvcache::f16> c(small_shape(64));
    auto a = add_tokens(c, 0, 0, 10);
    CHECK(a.front() == 0);
    CHECK(a.back() == 9);
    CHECK(c.n_window() == 32);
    CHECK(c.n_window(256) == 64);  // capped at capacity
    CHECK(c.n_window(1) == 10);
    auto b = add_tokens(c, 1, 0, 10);
    CHECK(b.front() == 10);  // continues at the head
    REQUIRE(c.seq_rm(0, -1, -1));     // cells 0..9 free again
    // head (20) <= used (10) + 2n (20): search continues from the head.
    auto d = add_tokens(c, 2, 0, 5);
    CHECK(d.front() == 20);
    // head (25) > used (15) + 2n (2): restart from 0.
    auto e = add_tokens(c, 3, 0, 1);
    CHECK(e.front() == 0);

    // Cache full: clear error result, nothing changed.
    kvcache::kv_cache<kvcache::f16> f(small_shape(16));
    add_tokens(f, 0, 0, 12);
    const auto before = kvtest::snapshot(f);
    const auto pos = iota_pos(100, 5);
    const std::vector<seq_id_t> seq(5, 1);
    auto r = f.place(pos, seq);
    CHECK_FALSE(r.ok());
    CHECK(r.code() == kvcache::errc::no_space);
    CHECK(r.message().find("4 free") != std::string::npos);
    CHECK(kvtest::snapshot(f) == before);
    CHECK(f.commit() == kvcache::tx_result::nothing_staged);
    CHECK_THROWS_AS(r.value(), kvcache::error);
    const auto big = iota_pos(0, 17);
    const std::vector<seq_id_t> bigseq(17, 1);
    auto r2 = f.place(big, bigseq);
    CHECK(r2.code() == kvcache::errc::batch_too_large);
    CHECK(kvtest::snapshot(f) == before);
}

TEST_CASE("placement of tokens shared by several sequences") {
    kvcache::kv_cache<> c(small_shape());
    kvcache::seq_set both;
    both.set(0);
    both.set(2);
    const std::vector<pos_t> pos{0, 1};
    const std::vector<kvcache::seq_set> seqs{both, both};
    auto p = c.place(pos, std::span<const kvcache::seq_set>(seqs));
    REQUIRE(p.ok());
    c.commit();
    CHECK(c.used() == 2);
    CHECK(c.seq_pos_max(0) == 1);
    CHECK(c.seq_pos_max(2) == 1);
    CHECK(c.seq_pos_max(1) == -1);
}

TEST_CASE("transactions: multi-ubatch restore, guard, nothing staged (F4)") {
    kvcache::kv_cache<kvcache::f16> c(small_shape(32));
    add_tokens(c, 0, 0, 4);
    const auto before = kvtest::snapshot(c);
    CHECK(c.restore() == kvcache::tx_result::nothing_staged);
    CHECK(c.commit() == kvcache::tx_result::nothing_staged);
    {
        kvcache::transaction tx(c);
        const std::vector<seq_id_t> seq(8, 1);
        auto u0 = c.place(iota_pos(0, 8), seq);
        auto u1 = c.place(iota_pos(8, 8), seq);
        REQUIRE(u0.ok());
        REQUIRE(u1.ok());
        CHECK(c.used() == 20);
        CHECK(c.in_transaction());
        // ubatch 2 does not fit: the guard restores ubatches 0 and 1.
        auto u2 = c.place(iota_pos(16, 20), std::vector<seq_id_t>(20, 1));
        CHECK(u2.code() == kvcache::errc::no_space);
    }
    CHECK(kvtest::snapshot(c) == before);
    // An exception thrown by the host between ubatches also restores.
    try {
        kvcache::transaction tx(c);
        c.place(iota_pos(0, 3), std::vector<seq_id_t>(3, 2)).value();
        throw std::runtime_error("host failure");
    } catch (const std::runtime_error&) {
    }
    CHECK(kvtest::snapshot(c) == before);
    // Committed guard keeps the cells; the head continues after them.
    {
        kvcache::transaction tx(c);
        c.place(iota_pos(0, 3), std::vector<seq_id_t>(3, 2)).value();
        CHECK(tx.commit() == kvcache::tx_result::committed);
        CHECK(tx.commit() == kvcache::tx_result::nothing_staged);
    }
    CHECK(c.used() == 7);
    CHECK(c.seq_pos_max(2) == 2);
}

TEST_CASE("placement rejects invalid batches and changes nothing") {
    kvcache::kv_cache<kvcache::f16> c(small_shape(32, 2));
    add_tokens(c, 0, 0, 4);
    using E = kvcache::errc;
    expect_refused(c, E::invalid_argument, "pos has 2 entries but seq has 1",
                   [&] { (void)c.place(std::vector<pos_t>{5, 6}, std::vector<seq_id_t>{0}); });
    expect_refused(c, E::invalid_argument, "seq[0] = 2",
                   [&] { (void)c.place(std::vector<pos_t>{5}, std::vector<seq_id_t>{2}); });
    expect_refused(c, E::invalid_argument, "seq[1] = -1",
                   [&] { (void)c.place(std::vector<pos_t>{5, 6}, std::vector<seq_id_t>{0, -1}); });
    expect_refused(c, E::invalid_argument, "pos[0] = -3",
                   [&] { (void)c.place(std::vector<pos_t>{-3}, std::vector<seq_id_t>{1}); });
    expect_refused(c, E::invalid_argument, "already holds position 2",
                   [&] { (void)c.place(std::vector<pos_t>{9, 2}, std::vector<seq_id_t>{0, 0}); });
    expect_refused(c, E::invalid_argument, "at position 7 twice",
                   [&] { (void)c.place(std::vector<pos_t>{7, 7}, std::vector<seq_id_t>{1, 1}); });
    expect_refused(c, E::invalid_argument, "has no sequence", [&] {
        const std::vector<kvcache::seq_set> none(1);
        (void)c.place(std::vector<pos_t>{7}, std::span<const kvcache::seq_set>(none));
    });
    std::vector<float> row(c.shape().k_row_size());
    const std::vector<std::uint32_t> free_cell{20};
    expect_refused(c, E::invalid_argument, "cell 20 is free", [&] { c.write_k(0, free_cell, row.data()); });
    const std::vector<std::uint32_t> far{40};
    expect_refused(c, E::invalid_argument, "cell = 40", [&] { c.write_v(0, far, row.data()); });
    const std::vector<std::uint32_t> ok{0};
    expect_refused(c, E::invalid_argument, "layer = 2", [&] { c.write_k(2, ok, row.data()); });
    expect_refused(c, E::invalid_argument, "rows is null", [&] { c.write_k(0, ok, nullptr); });
    expect_refused(c, E::invalid_argument, "layer = 9", [&] { c.read_k(9, 0, row.data()); });
}

TEST_CASE("sequence ops: llama.cpp semantics") {
    kvcache::kv_cache<kvcache::f16> c(small_shape(64, 4));
    add_tokens(c, 0, 0, 10);
    SUBCASE("seq_rm ranges") {
        REQUIRE(c.seq_rm(0, 8, -1));
        CHECK(c.seq_pos_max(0) == 7);
        REQUIRE(c.seq_rm(0, -1, 2));
        CHECK(c.seq_pos_min(0) == 2);
        REQUIRE(c.seq_rm(0, 5, 5));  // empty range
        CHECK(c.used() == 6);
        REQUIRE(c.seq_rm(-1, -1, -1));
        CHECK(c.used() == 0);
        CHECK(c.n_window() == 0);
    }
    SUBCASE("seq_cp shares cells, seq_keep drops the others") {
        REQUIRE(c.seq_cp(0, 1, 0, 5));
        CHECK(c.used() == 10);
        CHECK(c.seq_pos_max(1) == 4);
        REQUIRE(c.seq_rm(0, -1, -1));
        CHECK(c.used() == 5);  // cells still used by sequence 1
        REQUIRE(c.seq_cp(1, 2, -1, -1));
        c.seq_keep(2);
        CHECK(c.seq_pos_max(1) == -1);
        CHECK(c.seq_pos_max(2) == 4);
        CHECK(c.used() == 5);
    }
    SUBCASE("seq_add shifts, removes below 0, accumulates the delta") {
        REQUIRE(c.seq_add(0, 5, -1, -7));  // 5..9 -> -2..2: 5 and 6 removed
        CHECK(c.used() == 8);
        CHECK(c.seq_pos_min(0) == 0);
        CHECK(c.seq_pos_max(0) == 4);
        CHECK(c.has_shift());
        REQUIRE(c.seq_add(0, 0, 3, 100));  // positions 0,1,2 (cells 0..2 and the moved 7..9)
        std::int32_t max_shift = 0;
        for (std::uint32_t i = 0; i < c.capacity(); ++i) max_shift = std::max(max_shift, c.cells().shift(i));
        CHECK(max_shift == 100);
        // a cell moved -7 then +100 carries 93
        bool found93 = false;
        for (std::uint32_t i = 0; i < c.capacity(); ++i) found93 |= c.cells().shift(i) == 93;
        CHECK(found93);
        c.clear_shifts();
        CHECK_FALSE(c.has_shift());
    }
    SUBCASE("seq_div") {
        REQUIRE(c.seq_div(0, 4, 10, 2));  // 4..9 -> 2,2,3,3,4,4
        CHECK(c.seq_pos_max(0) == 4);
        CHECK(c.used() == 10);  // duplicates of one sequence are allowed here (Self-Extend)
        CHECK(c.cells().seq_positions(0).at(2) == 3);  // 2, and 4 and 5 divided
    }
    SUBCASE("sequences are independent after seq_cp (split on seq_add/seq_div)") {
        REQUIRE(c.seq_cp(0, 1, -1, -1));
        std::vector<float> before(c.shape().k_row_size()), after(before.size());
        c.read_k(0, 3, before.data());
        REQUIRE(c.seq_add(1, 0, -1, 50));
        CHECK(c.seq_pos_min(0) == 0);
        CHECK(c.seq_pos_max(0) == 9);
        CHECK(c.seq_pos_min(1) == 50);
        CHECK(c.used() == 20);
        for (std::uint32_t i = 0; i < 10; ++i) CHECK(c.cells().shift(i) == 0);  // sequence 0 untouched
        // The split copies carry sequence 1's K/V, identical to the originals.
        for (std::uint32_t i = 10; i < 20; ++i) {
            CHECK(c.cells().seqs(i).test(1));
            CHECK(c.cells().shift(i) == 50);
        }
        c.read_k(0, 13, after.data());
        CHECK(after == before);
        REQUIRE(c.seq_div(0, -1, -1, 3));
        CHECK(c.seq_pos_max(1) == 59);
    }
}

TEST_CASE("sequence ops reject invalid arguments and change nothing") {
    kvcache::kv_cache<kvcache::bf16> c(small_shape(24, 3));
    add_tokens(c, 0, 0, 10);
    REQUIRE(c.seq_cp(0, 1, 0, 10));
    add_tokens(c, 2, 0, 4);
    using E = kvcache::errc;
    expect_refused(c, E::invalid_argument, "seq_rm: seq_id = 3", [&] { return c.seq_rm(3, 0, -1); });
    expect_refused(c, E::invalid_argument, "reversed range", [&] { return c.seq_rm(0, 5, 2); });
    expect_refused(c, E::invalid_argument, "seq_cp: src = -1", [&] { return c.seq_cp(-1, 1, 0, -1); });
    expect_refused(c, E::invalid_argument, "seq_cp: dst = 7", [&] { return c.seq_cp(0, 7, 0, -1); });
    expect_refused(c, E::invalid_argument, "already holds position 0", [&] { return c.seq_cp(0, 2, 0, -1); });
    expect_refused(c, E::invalid_argument, "seq_keep: seq_id = -1", [&] { c.seq_keep(-1); });
    expect_refused(c, E::invalid_argument, "beyond the largest position",
                   [&] { return c.seq_add(0, 0, -1, std::numeric_limits<pos_t>::max()); });
    expect_refused(c, E::invalid_argument, "reversed range", [&] { return c.seq_add(0, 9, 1, 1); });
    expect_refused(c, E::invalid_argument, "seq_div: d = 0", [&] { return c.seq_div(0, 0, -1, 0); });
    expect_refused(c, E::invalid_argument, "seq_div: d = -2", [&] { return c.seq_div(0, 0, -1, -2); });
    expect_refused(c, E::invalid_argument, "seq_pos_max: seq_id = 5", [&] { (void)c.seq_pos_max(5); });
    // Splitting 10 shared cells needs 10 free cells; only 10 free cells minus... make it short.
    add_tokens(c, 2, 4, 5);  // 19 used, 5 free
    expect_refused(c, E::no_space, "needs 10 free cells", [&] { return c.seq_add(1, 0, -1, 3); });
    expect_refused(c, E::no_space, "needs 8 free cells", [&] { return c.seq_div(0, 2, -1, 2); });
    // Sequence ops are refused while placements are staged.
    auto p = c.place(std::vector<pos_t>{c.seq_pos_max(2) + 1}, std::vector<seq_id_t>{2});  // batches continue
    REQUIRE(p.ok());
    expect_refused(c, E::transaction_open, "commit() or restore() first", [&] { return c.seq_rm(0, 0, -1); });
    CHECK(c.restore() == kvcache::tx_result::restored);
    // Moving every sequence at once needs no split.
    REQUIRE(c.seq_add(-1, 0, -1, 3));
    CHECK(c.seq_pos_min(1) == 3);
}

TEST_CASE("rollback points end with their operation: no mark is left live between calls") {
    // A live mark journals every later change; one left behind would make the cache record
    // (and keep index nodes) forever. The transaction's lives from the first placement to
    // commit / restore; every operation's ends with it, refused or not.
    auto check_layout = [](auto cache) {
        const auto marks = [&] { return cache.cells().live_marks(); };
        REQUIRE(marks() == 0);
        CHECK(cache.place(std::vector<pos_t>{}, std::vector<seq_id_t>{}).ok());  // an empty batch
        CHECK(marks() == 0);
        CHECK(cache.commit() == kvcache::tx_result::nothing_staged);
        add_tokens(cache, 0, 0, 5);
        CHECK(marks() == 0);
        static_cast<void>(cache.place(iota_pos(5, 3), std::vector<seq_id_t>(3, 0)).value());
        CHECK(marks() == 1);  // the transaction's
        static_cast<void>(cache.place(iota_pos(8, 2), std::vector<seq_id_t>(2, 0)).value());
        CHECK(marks() == 1);
        CHECK(cache.restore() == kvcache::tx_result::restored);
        CHECK(marks() == 0);
        CHECK(cache.seq_cp(0, 1, 0, 3).ok());
        CHECK(cache.seq_add(1, 0, -1, 4).ok());
        CHECK(cache.seq_rm(0, 2, 4).ok());
        cache.seq_keep(1);
        CHECK(marks() == 0);
        // Refused placements (more tokens than free cells; paged: more blocks than free,
        // refused by the layout's plan after the checkpoint) and a throwing call.
        CHECK_FALSE(cache.place(iota_pos(100, 126), std::vector<seq_id_t>(126, 2)).ok());
        CHECK(marks() == 0);
        if (cache.place(iota_pos(100, 100), std::vector<seq_id_t>(100, 2)).ok())
            CHECK(cache.restore() == kvcache::tx_result::restored);
        CHECK(marks() == 0);
        CHECK_THROWS_AS(static_cast<void>(cache.place(iota_pos(0, 1), std::vector<seq_id_t>{1})), kvcache::error);
        CHECK(marks() == 0);
        static_cast<void>(cache.place(iota_pos(50, 1), std::vector<seq_id_t>{2}).value());
        cache.clear();  // with placements staged: the transaction ends too
        CHECK(marks() == 0);
        CHECK_FALSE(cache.in_transaction());
    };
    check_layout(kvcache::kv_cache<kvcache::f32>(small_shape(128)));
    check_layout(kvcache::kv_cache<kvcache::f32, kvcache::paged<32>>(small_shape(128)));
}
