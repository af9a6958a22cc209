// ISWA: a mixed full / sliding-window model's attention per layer equals the float64
// reference for its layer type; placement and sequence ops (seq_add / seq_div too,
// refused by either cache) are atomic across the two caches. Memory accounting:
// reserved / used / held bytes per layout.
#include <doctest/doctest.h>

#include <kvcache/element/f16.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/memory/iswa_cache.hpp>
#include <kvcache/ops/kshift.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>
#include <kvcache/ops/attention.hpp>
#include <kvcache/ops/memory.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "layout_test_util.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;
constexpr std::uint32_t W = 16;

iswa_shape mixed_shape(std::uint32_t n_seq) {
    iswa_shape s;
    s.shape = kvtest::layout_shape(512, n_seq, 6, 2, 16);
    s.swa_layers = iswa_shape::every_nth_full(6, 3);  // layers 2 and 5 full
    s.swa_n_cells = ring<W>::cells_for(n_seq, 16);
    return s;
}

/// Places n tokens of s at p0.. in the ISWA cache and in a full-history model (per model layer).
template <class Iswa>
bool iswa_append(Iswa& c, kvtest::layout_model& model, seq_id_t s, pos_t p0, std::uint32_t n, std::mt19937& rng) {
    std::vector<pos_t> pos(n);
    std::vector<seq_id_t> seq(n, s);
    for (std::uint32_t i = 0; i < n; ++i) pos[i] = p0 + static_cast<pos_t>(i);
    auto r = c.place(pos, seq);
    if (!r) return false;
    const auto& sh = c.full().shape();
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<kvtest::model_token> toks(n);
    for (std::uint32_t l = 0; l < c.n_layer(); ++l) {
        std::vector<float> k(n * sh.k_row_size()), v(n * sh.v_row_size());
        for (auto& x : k) x = u(rng);
        for (auto& x : v) x = u(rng);
        c.write_k(l, r.value(), k.data());
        c.write_v(l, r.value(), v.data());
        for (std::uint32_t i = 0; i < n; ++i) {
            std::vector<float> kr(k.begin() + i * sh.k_row_size(), k.begin() + (i + 1) * sh.k_row_size());
            std::vector<float> vr(v.begin() + i * sh.v_row_size(), v.begin() + (i + 1) * sh.v_row_size());
            toks[i].k.push_back(kr);
            toks[i].v.push_back(vr);
        }
    }
    model.begin_place();
    for (std::uint32_t i = 0; i < n; ++i) model.put(s, pos[i], toks[i]);
    return true;
}

}  // namespace

TEST_CASE("iswa: configuration errors") {
    auto s = mixed_shape(2);
    s.swa_layers.pop_back();
    CHECK_THROWS_WITH_AS(iswa_cache<W>{s}, doctest::Contains("swa_layers has 5 entries"), kvcache::error);
    s = mixed_shape(2);
    s.swa_layers.assign(6, true);
    CHECK_THROWS_WITH_AS(iswa_cache<W>{s}, doctest::Contains("no full-attention layer"), kvcache::error);
    s = mixed_shape(2);
    s.swa_n_cells = W;
    CHECK_THROWS_AS(iswa_cache<W>{s}, kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(iswa_shape::every_nth_full(6, 0)), kvcache::error);
    iswa_cache<W> ok(mixed_shape(2));
    CHECK(ok.is_swa(0));
    CHECK_FALSE(ok.is_swa(2));
    CHECK(ok.local_layer(5) == 1);
    CHECK(ok.local_layer(4) == 3);
    CHECK_THROWS_AS(static_cast<void>(ok.is_swa(6)), kvcache::error);
}

TEST_CASE_TEMPLATE("iswa: attention per layer equals the reference for its layer type", Iswa, iswa_cache<W, f32>,
                   iswa_cache<W, f32, paged<32>>) {
    const std::uint32_t seed = 41;
    std::printf("iswa test seed %u\n", seed);
    std::mt19937 rng(seed);
    Iswa c(mixed_shape(2));
    kvtest::layout_model full(2);
    pos_t next[2] = {0, 0};
    ops::attention_workspace ws;
    const std::uint32_t n_head = 4, dk = 16, dv = 16;
    for (int step = 0; step < 40; ++step) {
        const seq_id_t s = step % 2;
        const auto n = static_cast<std::uint32_t>(std::uniform_int_distribution<int>(1, 12)(rng));
        REQUIRE(iswa_append(c, full, s, next[s], n, rng));
        next[s] += static_cast<pos_t>(n);
        CHECK(c.commit() == tx_result::committed);
        full.commit();
        CHECK(c.swa().used() <= 2 * W);
        CHECK(c.seq_pos_max(s) == next[s] - 1);
        std::vector<float> q(n_head * dk);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (auto& x : q) x = u(rng);
        const pos_t qp = next[s] - 1;
        for (std::uint32_t l = 0; l < c.n_layer(); ++l)
          for (ops::kernel_path path : {ops::kernel_path::scalar, ops::kernel_path::simd}) {
            ops::attention_params ap;
            ap.n_head = n_head;
            ap.path = path;
            std::vector<float> out(n_head * dv);
            if (c.is_swa(l)) {
                ap.window = static_cast<std::int32_t>(W);
                ops::attention(c.swa(), c.local_layer(l), q.data(), &qp, &s, 1, ap, out.data(), ws);
            } else {
                ops::attention(c.full(), c.local_layer(l), q.data(), &qp, &s, 1, ap, out.data(), ws);
            }
            for (std::uint32_t g = 0; g < n_head; ++g) {
                const auto ref = kvtest::attention_ref(full.seqs[static_cast<std::size_t>(s)], l, g / 2, dk, dv,
                                                       q.data() + g * dk, qp,
                                                       c.is_swa(l) ? static_cast<std::int32_t>(W) : 0);
                for (std::uint32_t d = 0; d < dv; ++d) REQUIRE(std::abs(out[g * dv + d] - ref[d]) < 1e-4);
            }
        }
    }
}

TEST_CASE("iswa: placement and sequence ops are atomic across both caches") {
    std::mt19937 rng(42);
    iswa_cache<W> c(mixed_shape(2));
    kvtest::layout_model model(2);
    REQUIRE(iswa_append(c, model, 0, 0, 30, rng));  // 30 > W: pruned at commit
    c.commit();
    model.commit();
    const auto full_before = kvtest::observe(c.full());
    const auto swa_before = kvtest::observe(c.swa());
    auto unchanged = [&] {
        CHECK(kvtest::diff(kvtest::observe(c.full()), full_before) == "");
        CHECK(kvtest::diff(kvtest::observe(c.swa()), swa_before) == "");
    };
    // a batch the ring region cannot take (W + 16 = 32 cells, 16 held): refused in both
    std::vector<pos_t> pos(17);
    std::vector<seq_id_t> seq(17, 0);
    for (int i = 0; i < 17; ++i) pos[static_cast<std::size_t>(i)] = 30 + i;
    auto r = c.place(pos, seq);
    REQUIRE_FALSE(r.ok());
    CHECK(r.code() == errc::no_space);
    CHECK_FALSE(c.in_transaction());
    unchanged();
    // a batch the full cache refuses after the ring dry run: a position sequence 0 holds
    std::vector<pos_t> dup = {30, 5};
    std::vector<seq_id_t> seq2 = {0, 0};
    CHECK_THROWS_AS(static_cast<void>(c.place(dup, seq2)), kvcache::error);
    CHECK_FALSE(c.in_transaction());
    unchanged();
    // a refusal of the ring (pruned positions) leaves the full cache unchanged too
    CHECK(kvtest::refused_result(c.seq_rm(0, 2, 5), "unsupported"));
    unchanged();
    CHECK(kvtest::refused_result(c.seq_add(0, -1, -1, 2), "unsupported"));
    unchanged();
    // staged placements from an earlier micro-batch survive a refused one, and restore drops both
    REQUIRE(iswa_append(c, model, 1, 0, 4, rng));
    CHECK_FALSE(c.place(pos, seq).ok());
    CHECK(c.in_transaction());
    CHECK(c.restore() == tx_result::restored);
    model.restore();
    unchanged();
    // allowed ops apply to both
    REQUIRE(c.seq_cp(0, 1, 20, -1));
    REQUIRE(c.seq_rm(0, 29, -1));
    CHECK(c.seq_pos_max(0) == 28);
    CHECK(c.swa().seq_pos_max(0) == 28);
    CHECK(c.full().seq_pos_max(1) == 29);
    CHECK(c.swa().seq_pos_max(1) == 29);
    c.seq_keep(1);
    CHECK(c.seq_pos_max(0) == -1);
    CHECK(c.swa().seq_pos_max(0) == -1);
    c.clear();
    CHECK(c.full().used() == 0);
    CHECK(c.swa().used() == 0);
}

TEST_CASE("iswa: seq_add / seq_div move both caches or neither, whichever refuses; K-shift in both") {
    std::mt19937 rng(44);
    iswa_shape sh = mixed_shape(2);
    sh.shape.n_cells = 40;                     // a small full cache: splits can run out of cells
    sh.swa_n_cells = ring<W>::cells_for(2, 1);  // ring regions of W + 1 = 17
    iswa_cache<W> c(sh);
    kvtest::layout_model model(2);
    auto both = [&] { return std::make_pair(kvtest::snapshot(c.full()), kvtest::snapshot(c.swa())); };
    auto refused = [&](auto op, errc code, const char* needle) {
        const auto before = both();
        const kvtest::refusal r = kvtest::run_refusal(op);  // arguments throw; no room / pruned: a result
        REQUIRE_MESSAGE(r.kind != kvtest::refusal_kind::none, "not refused: " << needle);
        CHECK(r.kind == kvtest::rule_kind(code));
        CHECK(r.code == code);
        CHECK_MESSAGE(r.message.find(needle) != std::string::npos, r.message);
        CHECK(both() == before);
    };
    // nothing pruned yet: moves apply to both caches and leave a K-shift in both
    REQUIRE(iswa_append(c, model, 0, 0, 12, rng));
    c.commit();
    REQUIRE(c.seq_add(0, 6, -1, 2));
    REQUIRE(c.seq_div(0, 0, 4, 2));
    CHECK(c.full().cells().seq_positions(0) == c.swa().cells().seq_positions(0));
    CHECK(c.full().has_shift());
    CHECK(c.swa().has_shift());
    kvcache::ops::apply_k_shift(c);
    CHECK_FALSE(c.has_shift());
    c.clear();
    // the ring refuses (its window pruned positions 0..3): the full cache stays unchanged
    REQUIRE(iswa_append(c, model, 0, 0, 16, rng));
    c.commit();
    REQUIRE(iswa_append(c, model, 0, 16, 1, rng));
    c.commit();
    REQUIRE(iswa_append(c, model, 0, 17, 1, rng));
    c.commit();
    REQUIRE(iswa_append(c, model, 0, 18, 1, rng));
    c.commit();
    REQUIRE(c.swa().storage().pruned_below(0) == 3);
    refused([&] { return c.seq_add(0, 2, -1, 1); }, errc::unsupported, "cannot move the range [2, end)");
    refused([&] { return c.seq_add(0, 10, -1, -2); }, errc::unsupported, "would end at 16");
    refused([&] { return c.seq_div(0, -1, -1, 2); }, errc::unsupported, "no positions below 3");
    // the full cache refuses (no free cell to split 10 shared cells): the ring stays unchanged
    REQUIRE(c.seq_cp(0, 1, -1, -1));
    REQUIRE(iswa_append(c, model, 1, 19, 16, rng));
    c.commit();
    REQUIRE(c.full().capacity() - c.full().used() < 10);
    refused([&] { return c.seq_add(0, 9, -1, 1); }, errc::no_space, "free cells");
    // the ring refuses (no free cell to split its shared cells) before the full cache moves
    c.clear();
    REQUIRE(iswa_append(c, model, 0, 0, 16, rng));
    c.commit();
    REQUIRE(iswa_append(c, model, 1, 100, 16, rng));
    c.commit();
    REQUIRE(c.seq_cp(0, 1, -1, -1));  // 16 shared cells; the ring has 2 free
    refused([&] { return c.seq_add(1, 0, 16, 1); }, errc::no_space, "sliding-window cache");
    // invalid arguments are refused by the full cache first, with its usual message
    refused([&] { return c.seq_add(5, 0, 16, 1); }, errc::invalid_argument, "seq_id = 5");
    refused([&] { return c.seq_div(0, 0, -1, 0); }, errc::invalid_argument, "d = 0");
    refused([&] { return c.seq_add(0, 9, 3, 1); }, errc::invalid_argument, "reversed range");
    // and a move both accept
    REQUIRE(c.seq_add(1, 100, -1, 4));
    CHECK(c.full().seq_pos_max(1) == 119);
    CHECK(c.swa().seq_pos_max(1) == 119);
    kvcache::ops::apply_k_shift(c);
    CHECK_FALSE(c.has_shift());
}

TEST_CASE("memory accounting: reserved, used, held and waste per layout") {
    std::mt19937 rng(43);
    const auto shape = kvtest::layout_shape(256, 4);
    kv_cache<f16> contig(shape);
    kv_cache<f16, paged<32>> paged_c(shape);
    kvtest::layout_model m1(4), m2(4);
    const std::uint32_t lens[4] = {5, 32, 33, 80};
    for (seq_id_t s = 0; s < 4; ++s) {
        REQUIRE(kvtest::append(contig, m1, s, 0, lens[s], rng));
        REQUIRE(kvtest::append(paged_c, m2, s, 0, lens[s], rng));
        contig.commit();
        paged_c.commit();
    }
    const std::size_t bpt = contig.bytes_per_token();
    const auto a = ops::memory(contig);
    CHECK(a.reserved_bytes == contig.total_bytes());
    CHECK(a.used_bytes == 150 * bpt);
    CHECK(a.held_bytes == a.used_bytes);
    CHECK(a.waste_fraction() == 0.0);
    const auto b = ops::memory(paged_c);
    CHECK(b.used_bytes == 150 * bpt);
    CHECK(b.held_bytes == (1 + 1 + 2 + 3) * 32 * bpt);  // blocks per sequence: ceil(len / 32)
    CHECK(b.waste_bytes() == (224 - 150) * bpt);
    // forks share blocks: used and held do not grow
    REQUIRE(paged_c.seq_rm(0, -1, -1));
    REQUIRE(paged_c.seq_cp(3, 0, -1, -1));
    CHECK(ops::memory(paged_c).used_bytes == b.used_bytes - 5 * bpt);
    CHECK(ops::memory(paged_c).held_bytes == b.held_bytes - 32 * bpt);
    kv_cache<f16, ring<W>> r(kvtest::layout_shape(ring<W>::cells_for(4, 8), 4));
    kvtest::layout_model m3(4);
    REQUIRE(kvtest::append(r, m3, 2, 0, 8, rng));
    r.commit();
    const auto c = ops::memory(r);
    CHECK(c.used_bytes == 8 * bpt);
    CHECK(c.held_bytes == (W + 8) * bpt);
    CHECK(kv_cache<f16>(shape).total_bytes() == ops::memory(contig).reserved_bytes);
}
