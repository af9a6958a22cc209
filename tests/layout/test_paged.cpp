// paged<BlockSize>: block pool errors, placement in blocks, sharing by seq_cp,
// copy-on-write on append and on seq_add, refcounts back to the initial state,
// transactions that restore a copy-on-write exactly, refusals that change nothing.
#include <doctest/doctest.h>

#include <kvcache/element/f16.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/ops/kshift.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "layout_test_util.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;
using cache_t = kv_cache<f16, paged<32>>;

/// Raw K/V bytes (every layer) of every cell sequence s uses, by position.
std::multimap<pos_t, std::vector<cache_t::storage_type>> seq_bytes(const cache_t& cache, seq_id_t s) {
    std::multimap<pos_t, std::vector<cache_t::storage_type>> out;
    std::vector<cache_t::storage_type> tmp;
    for (std::uint32_t c : cache.cells().used_cells()) {
        if (!cache.cells().seqs(c).test(s)) continue;
        std::vector<cache_t::storage_type> all;
        for (std::uint32_t l = 0; l < cache.shape().n_layer; ++l)
            for (bool is_v : {false, true}) {
                cache.storage().cell_bytes(l, c, is_v, tmp);
                all.insert(all.end(), tmp.begin(), tmp.end());
            }
        out.emplace(cache.cells().pos(c), all);
    }
    return out;
}

template <class Cache>
void check_inv(const Cache& cache) {
    REQUIRE(cache.storage().check_invariants(cache.cells()) == "");
}

std::vector<std::uint32_t> refcounts(const cache_t& cache) {
    std::vector<std::uint32_t> r;
    for (std::uint32_t b = 0; b < cache.storage().n_blocks(); ++b) r.push_back(cache.storage().refcount(b));
    return r;
}

}  // namespace

TEST_CASE("block_pool: refcounts, double release and out-of-range ids are errors") {
    block_pool pool(4);
    CHECK(pool.free_count() == 4);
    pool.retain(2);
    pool.retain(2);
    CHECK(pool.refcount(2) == 2);
    CHECK(pool.free_count() == 3);
    CHECK(pool.check() == "");
    pool.release(2);
    pool.release(2);
    CHECK(pool.free_count() == 4);
    CHECK_THROWS_WITH_AS(pool.release(2), doctest::Contains("double release"), kvcache::error);
    CHECK_THROWS_WITH_AS(pool.retain(4), doctest::Contains("block = 4, must be < n_blocks = 4"), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(pool.refcount(99)), kvcache::error);
    CHECK(pool.check() == "");  // the refused calls changed nothing
    CHECK(pool.free_count() + pool.referenced_count() == pool.n_blocks());
}

TEST_CASE("paged: configuration errors name the parameter") {
    CHECK_THROWS_WITH_AS(cache_t(kvtest::layout_shape(100, 2)), doctest::Contains("model_shape.n_cells = 100"),
                         kvcache::error);
    cache_t cache(kvtest::layout_shape(64, 2));
    CHECK_THROWS_AS(static_cast<void>(cache.storage().block_table(2)), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(cache.storage().refcount(4)), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(cache.storage().used_in_block(4)), kvcache::error);
}

TEST_CASE("paged: sequences fill their own blocks; empty blocks return to the pool") {
    cache_t cache(kvtest::layout_shape(256, 3));
    kvtest::layout_model model(3);
    std::mt19937 rng(7);
    std::printf("paged blocks test seed 7\n");
    // interleaved appends of two sequences never mix in one block
    for (int round = 0; round < 5; ++round)
        for (seq_id_t s = 0; s < 2; ++s) {
            REQUIRE(kvtest::append(cache, model, s, round * 10, 10, rng));
            cache.commit();
            check_inv(cache);
        }
    for (std::uint32_t b = 0; b < cache.storage().n_blocks(); ++b) CHECK(cache.storage().refcount(b) <= 1);
    CHECK(cache.storage().block_table(0).size() == 2);  // 50 tokens in blocks of 32
    CHECK(cache.storage().block_table(1).size() == 2);
    CHECK(cache.storage().referenced_blocks() == 4);
    REQUIRE(cache.seq_rm(0, -1, -1));
    check_inv(cache);
    CHECK(cache.storage().referenced_blocks() == 2);
    CHECK(cache.storage().block_table(0).empty());
    // holes left by seq_rm in a sequence's own blocks are reused before a new block
    REQUIRE(cache.seq_rm(1, 0, 20));
    REQUIRE(kvtest::append(cache, model, 1, 50, 20, rng));
    cache.commit();
    CHECK(cache.storage().referenced_blocks() == 2);
    check_inv(cache);
    // tile ranges cover exactly the sequence's blocks
    std::uint32_t tiles = 0;
    for (auto [t0, t1] : cache.storage().tile_ranges(1)) tiles += t1 - t0;
    CHECK(tiles == cache.storage().block_table(1).size());
}

TEST_CASE("paged: fork shares blocks; copy-on-write keeps the other sequence's bytes; refcounts return") {
    for (std::uint32_t prompt : {32u, 36u, 69u}) {
        CAPTURE(prompt);
        cache_t cache(kvtest::layout_shape(512, 4));
        kvtest::layout_model model(4);
        std::mt19937 rng(prompt);
        const auto initial = refcounts(cache);
        REQUIRE(kvtest::append(cache, model, 0, 0, prompt, rng));
        cache.commit();
        const auto blocks0 = cache.storage().referenced_blocks();
        // fork the prompt into three more sequences (parallel sampling): no new blocks
        for (seq_id_t s = 1; s < 4; ++s) {
            REQUIRE(cache.seq_cp(0, s, -1, -1));
            model.seq_cp(0, s, -1, -1);
            check_inv(cache);
        }
        CHECK(cache.storage().referenced_blocks() == blocks0);
        for (std::uint32_t b : cache.storage().block_table(0)) CHECK(cache.storage().refcount(b) == 4);
        const auto prompt_bytes = seq_bytes(cache, 0);
        // each sequence samples its own continuation
        for (int step = 0; step < 20; ++step)
            for (seq_id_t s = 0; s < 4; ++s) {
                const auto others_before = [&] {
                    std::vector<decltype(seq_bytes(cache, 0))> v;
                    for (seq_id_t t = 0; t < 4; ++t) v.push_back(t == s ? decltype(seq_bytes(cache, 0)){} : seq_bytes(cache, t));
                    return v;
                }();
                REQUIRE(kvtest::append(cache, model, s, static_cast<pos_t>(prompt) + step, 1, rng));
                cache.commit();
                check_inv(cache);
                for (seq_id_t t = 0; t < 4; ++t)
                    if (t != s) REQUIRE(seq_bytes(cache, t) == others_before[static_cast<std::size_t>(t)]);
            }
        REQUIRE(kvtest::diff(kvtest::observe(cache), model.seqs) == "");
        // full prompt blocks stay shared; a partial last block was copied per sequence
        const std::uint32_t full = prompt / 32;
        std::uint32_t shared = 0;
        for (std::uint32_t b = 0; b < cache.storage().n_blocks(); ++b) shared += cache.storage().refcount(b) == 4;
        CHECK(shared == full);
        // every sequence still sees the prompt bit for bit
        for (seq_id_t s = 0; s < 4; ++s) {
            auto bytes = seq_bytes(cache, s);
            for (const auto& [p, b] : prompt_bytes) {
                auto it = bytes.find(p);
                REQUIRE(it != bytes.end());
                CHECK(it->second == b);
            }
        }
        for (seq_id_t s = 0; s < 4; ++s) {
            REQUIRE(cache.seq_rm(s, -1, -1));
            check_inv(cache);
        }
        CHECK(refcounts(cache) == initial);
        CHECK(cache.storage().free_blocks() == cache.storage().n_blocks());
    }
}

TEST_CASE("paged: copy-on-write inside a transaction is undone exactly by restore") {
    cache_t cache(kvtest::layout_shape(128, 2));
    kvtest::layout_model model(2);
    std::mt19937 rng(11);
    REQUIRE(kvtest::append(cache, model, 0, 0, 10, rng));
    cache.commit();
    REQUIRE(cache.seq_cp(0, 1, -1, -1));
    const auto before = kvtest::observe(cache);
    const auto rc = refcounts(cache);
    const auto tables = cache.storage().block_table(1);
    REQUIRE(kvtest::append(cache, model, 1, 10, 3, rng));  // copy-on-write of the shared partial block
    CHECK(cache.storage().referenced_blocks() == 2);
    CHECK(cache.restore() == tx_result::restored);
    check_inv(cache);
    CHECK(kvtest::diff(kvtest::observe(cache), before) == "");
    CHECK(refcounts(cache) == rc);
    CHECK(cache.storage().block_table(1) == tables);
}

TEST_CASE("paged: restore puts back a shared cell that copy-on-write emptied and a later placement reused") {
    // Sequences 1 and 2 share cells 0-1; both append in one transaction (each copies them
    // to a block of its own, which empties block 0), then sequence 0's first token is given
    // a cell of block 0 and its K/V are written there. restore() must bring back the shared
    // cells' bytes, not only their metadata (found by the API fuzzer).
    cache_t cache(kvtest::layout_shape(128, 3));
    kvtest::layout_model model(3);
    std::mt19937 rng(5);
    REQUIRE(kvtest::append(cache, model, 1, 0, 2, rng));
    cache.commit();
    REQUIRE(cache.seq_cp(1, 2, -1, -1));
    const auto before = kvtest::observe(cache);
    const auto rc = refcounts(cache);
    const std::vector<pos_t> pos{2, 2};
    const std::vector<seq_id_t> seq{1, 2};
    REQUIRE(cache.place(std::span<const pos_t>(pos), std::span<const seq_id_t>(seq)));  // one batch: both copy
    CHECK(cache.cells().is_free(0));  // both sequences left the shared cells
    REQUIRE(kvtest::append(cache, model, 0, 0, 1, rng));
    CHECK(cache.cells().seqs(0).test(0));  // ... and the placement reused one of them
    CHECK(cache.restore() == tx_result::restored);
    check_inv(cache);
    CHECK(kvtest::diff(kvtest::observe(cache), before) == "");
    CHECK(refcounts(cache) == rc);
}

TEST_CASE("paged: seq_add on a shared prefix gives the moving sequence blocks of its own") {
    cache_t cache(kvtest::layout_shape(128, 2));
    kvtest::layout_model model(2);
    std::mt19937 rng(12);
    REQUIRE(kvtest::append(cache, model, 0, 0, 64, rng));
    cache.commit();
    REQUIRE(cache.seq_cp(0, 1, -1, -1));
    model.seq_cp(0, 1, -1, -1);
    const auto bytes0 = seq_bytes(cache, 0);
    REQUIRE(cache.seq_add(1, 16, -1, 100));
    model.seq_add(1, 16, -1, 100);
    check_inv(cache);
    CHECK(kvtest::diff(kvtest::observe(cache), model.seqs) == "");
    CHECK(seq_bytes(cache, 0) == bytes0);
    for (std::uint32_t b : cache.storage().block_table(1)) {
        // every block of sequence 1 is either still the shared original or its own
        const auto rc = cache.storage().refcount(b);
        CHECK((rc == 1 || rc == 2));
    }
    // the moved cells of sequence 1 live only in blocks sequence 0 does not use
    const auto t0 = cache.storage().block_table(0);
    for (std::uint32_t c : cache.cells().used_cells())
        if (cache.cells().seqs(c).test(1) && !cache.cells().seqs(c).test(0))
            CHECK(std::find(t0.begin(), t0.end(), c / 32) == t0.end());
}

TEST_CASE("paged: a full pool refuses placement and splits with no_space, nothing changed") {
    cache_t cache(kvtest::layout_shape(128, 4));
    kvtest::layout_model model(4);
    std::mt19937 rng(13);
    for (seq_id_t s = 0; s < 4; ++s) {
        REQUIRE(kvtest::append(cache, model, s, 0, 3, rng));  // one block each, 29 free cells in each
        cache.commit();
    }
    CHECK(cache.storage().free_blocks() == 0);
    CHECK(cache.used() == 12);
    const auto before = kvtest::observe(cache);
    // sequence 0 cannot open a block, even with 87 free cells in other sequences' blocks
    std::vector<pos_t> pos(30);
    std::vector<seq_id_t> seq(30, 0);
    for (int i = 0; i < 30; ++i) pos[static_cast<std::size_t>(i)] = 3 + i;
    auto r = cache.place(pos, seq);
    REQUIRE_FALSE(r.ok());
    CHECK(r.code() == errc::no_space);
    CHECK(r.message().find("free blocks") != std::string::npos);
    CHECK_FALSE(cache.in_transaction());
    CHECK(kvtest::diff(kvtest::observe(cache), before) == "");
    check_inv(cache);
    // a fork whose sequence then moves needs new blocks too: refused, unchanged
    REQUIRE(cache.seq_rm(1, -1, -1));
    REQUIRE(cache.seq_cp(0, 1, -1, -1));
    REQUIRE(kvtest::append(cache, model, 2, 3, 29, rng));  // fill sequence 2's block
    cache.commit();
    REQUIRE(cache.storage().free_blocks() == 1);
    REQUIRE(kvtest::append(cache, model, 3, 3, 29, rng));
    REQUIRE(kvtest::append(cache, model, 3, 32, 1, rng));  // takes the last free block
    cache.commit();
    const auto before3 = kvtest::observe(cache);
    CHECK(cache.storage().free_blocks() == 0);
    CHECK(kvtest::refused_result(cache.seq_add(1, -1, -1, 5), "no_space"));
    CHECK(kvtest::diff(kvtest::observe(cache), before3) == "");
    check_inv(cache);
}

TEST_CASE("paged: moving the cache keeps the block tables attached") {
    cache_t a(kvtest::layout_shape(128, 2));
    kvtest::layout_model model(2);
    std::mt19937 rng(14);
    REQUIRE(kvtest::append(a, model, 0, 0, 40, rng));
    a.commit();
    cache_t b(std::move(a));
    REQUIRE(kvtest::append(b, model, 1, 0, 5, rng));
    b.commit();
    check_inv(b);
    cache_t c(kvtest::layout_shape(128, 2));
    c = std::move(b);
    REQUIRE(c.seq_rm(0, -1, -1));
    check_inv(c);
    CHECK(c.storage().referenced_blocks() == 1);
    c.clear();
    check_inv(c);
    CHECK(c.storage().free_blocks() == 4);
}

TEST_CASE("paged: K-shift over blocks gives every sequence the same K as on the contiguous layout") {
    const std::uint32_t seed = 15;
    std::printf("paged K-shift test seed %u\n", seed);
    using contig_t = kv_cache<f32>;
    using paged_t = kv_cache<f32, paged<32>>;
    const auto shape = kvtest::layout_shape(256, 3, 2, 2, 16);
    contig_t a(shape);
    paged_t b(shape);
    kvtest::layout_model ma(3), mb(3);
    std::mt19937 ra(seed), rb(seed);  // same random rows in both caches
    for (int round = 0; round < 6; ++round)
        for (seq_id_t s = 0; s < 3; ++s) {
            REQUIRE(kvtest::append(a, ma, s, round * 7, 7, ra));
            REQUIRE(kvtest::append(b, mb, s, round * 7, 7, rb));
            a.commit();
            b.commit();
        }
    REQUIRE(a.seq_rm(2, 0, 10));
    REQUIRE(b.seq_rm(2, 0, 10));
    REQUIRE(a.seq_cp(0, 2, 0, 10));
    REQUIRE(b.seq_cp(0, 2, 0, 10));
    REQUIRE(a.seq_rm(1, 5, 20));
    REQUIRE(b.seq_rm(1, 5, 20));
    REQUIRE(a.seq_add(1, 20, -1, -15));
    REQUIRE(b.seq_add(1, 20, -1, -15));
    REQUIRE(a.seq_add(0, 3, -1, 4));  // splits the cells shared with sequence 2
    REQUIRE(b.seq_add(0, 3, -1, 4));
    REQUIRE(a.seq_div(2, 30, -1, 2));
    REQUIRE(b.seq_div(2, 30, -1, 2));
    REQUIRE(b.has_shift());
    REQUIRE(kvtest::diff(kvtest::observe(a), kvtest::observe(b)) == "");
    const auto before_a = kvtest::observe(a);
    ops::apply_k_shift(a);
    ops::apply_k_shift(b);
    CHECK_FALSE(b.has_shift());
    CHECK(kvtest::diff(kvtest::observe(a), before_a) != "");  // K did rotate
    const auto oa = kvtest::observe(a), ob = kvtest::observe(b);
    CHECK(kvtest::same(oa, ob));  // same kernel, same rows: bit-identical per sequence
    check_inv(b);
}
