// F19, F20: reuse plans (LCP, chunk shift, cache_prompt = false) and applying them
// to a cache: reused cells hold exactly what a fresh computation of the same prefix
// would (LCP) or the same within the K-shift tolerance (moved chunks).
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cstdio>
#include <random>
#include <vector>

#include "prompt/toy_model.hpp"
#include "support/result_check.hpp"

using kvcache::prompt_tokens;
using kvcache::token_t;
namespace reuse = kvcache::reuse;
using cache_t = kvcache::kv_cache<kvcache::f32, reuse::chunk_shift<32>>;

namespace {

prompt_tokens cat(std::initializer_list<prompt_tokens> parts) {
    prompt_tokens out;
    for (const auto& p : parts) {
        if (p.has_media()) {
            for (std::size_t i = 0; i < p.size();) {
                if (const auto* c = p.chunk_at(i)) {
                    out.push_media(c->id, c->n_pos);
                    i += c->n_pos;
                } else {
                    out.push_back(p[i++]);
                }
            }
        } else {
            out.append(p.tokens());
        }
    }
    return out;
}

reuse::plan_options chunks(std::uint32_t n) {
    reuse::plan_options o;
    o.min_chunk = n;
    return o;
}

// Positions sequence s holds, in order.
std::vector<kvcache::pos_t> positions(const cache_t& c, kvcache::seq_id_t s) {
    std::vector<kvcache::pos_t> out;
    for (const auto& [p, n] : c.cells().seq_positions(s))
        for (std::uint32_t i = 0; i < n; ++i) out.push_back(p);
    return out;
}

std::vector<kvcache::pos_t> iota(std::size_t n) {
    std::vector<kvcache::pos_t> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<kvcache::pos_t>(i);
    return v;
}

}  // namespace

TEST_CASE("plan: LCP of the seed's 1000-token prompt growing by 3 tokens, K/V equal a fresh computation") {
    const prompt_tokens base = toy::text(1000);
    const prompt_tokens cached = cat({base, prompt_tokens{7}});  // base + one generated token
    const prompt_tokens request = cat({base, prompt_tokens{1, 2, 3}});
    const auto p = reuse::make_plan(cached, request);
    CHECK(p.n_lcp == 1000);
    CHECK(p.n_past == 1000);
    CHECK(p.moves.empty());
    CHECK(p.n_compute() == 3);

    cache_t cache(toy::shape(2048));
    toy::fill(cache, 0, cached, 0, cached.size());
    REQUIRE(reuse::apply_plan(cache, 0, p));
    CHECK(positions(cache, 0) == iota(1000));
    toy::fill(cache, 0, request, p.n_past, request.size());
    CHECK(toy::max_error(cache, 0, request, request.size()) == 0.0);  // bit-exact reuse
}

TEST_CASE("plan: an exact repeat recomputes its last token (logits), cache_prompt = false recomputes all") {
    const prompt_tokens a = toy::text(100);
    auto p = reuse::make_plan(a, a);
    CHECK(p.n_past == 99);
    CHECK(p.n_compute() == 1);
    reuse::plan_options no_logits;
    no_logits.need_logits = false;
    CHECK(reuse::make_plan(a, a, no_logits).n_past == 100);
    reuse::plan_options off;
    off.cache_prompt = false;
    p = reuse::make_plan(a, a, off);
    CHECK(p.n_past == 0);
    CHECK(p.n_compute() == 100);

    cache_t cache(toy::shape(256));
    toy::fill(cache, 0, a, 0, a.size());
    REQUIRE(reuse::apply_plan(cache, 0, p));
    CHECK(cache.seq_pos_max(0) == -1);
    CHECK(cache.used() == 0);
}

TEST_CASE("plan: chunk reuse moves >= 32 matching tokens after a divergence into place by K-shift") {
    const prompt_tokens A = toy::text(100, 0), X = toy::text(10, 500), B = toy::text(40, 1000), C = toy::text(5, 2000);
    const prompt_tokens cached = cat({A, X, B});
    const prompt_tokens request = cat({A, B, C});

    SUBCASE("plan") {
        const auto p = reuse::make_plan(cached, request, chunks(32));
        CHECK(p.n_lcp == 100);
        REQUIRE(p.moves.size() == 1);
        CHECK(p.moves[0] == reuse::chunk_move{110, 100, 40});
        CHECK(p.n_past == 140);
        CHECK(p.n_shifted() == 40);
        CHECK(p.n_compute() == 5);
        // threshold not met: 40 < 41
        CHECK(reuse::make_plan(cached, request, chunks(41)).moves.empty());
        // chunk shifting off (lcp policy), or the layout cannot shift
        CHECK(reuse::make_plan(cached, request).n_past == 100);
        auto no_shift = chunks(32);
        no_shift.can_shift = false;
        CHECK(reuse::make_plan(cached, request, no_shift).moves.empty());
    }
    SUBCASE("applied: K within the K-shift tolerance of a fresh computation, V exact") {
        cache_t cache(toy::shape(512));
        toy::fill(cache, 0, cached, 0, cached.size(), /*context_free=*/true);
        const auto p = reuse::make_plan(cached, request, chunks(32));
        REQUIRE(reuse::apply_plan(cache, 0, p));
        CHECK(positions(cache, 0) == iota(140));
        CHECK(cache.has_shift());
        kvcache::ops::apply_k_shift(cache);
        CHECK(!cache.has_shift());
        toy::fill(cache, 0, request, p.n_past, request.size(), true);
        const double err = toy::max_error(cache, 0, request, request.size(), true);
        CHECK(err < 1e-5);
        std::printf("chunk shift: max |K/V - fresh| = %.3g\n", err);
    }
    SUBCASE("exact repeat through a moved chunk keeps one token to compute") {
        const auto p = reuse::make_plan(cached, cat({A, B}), chunks(32));
        REQUIRE(p.moves.size() == 1);
        CHECK(p.moves[0].n == 39);
        CHECK(p.n_past == 139);
        CHECK(p.n_compute() == 1);
    }
    SUBCASE("two chunks") {
        const prompt_tokens D = toy::text(33, 3000);
        const auto p = reuse::make_plan(cat({A, X, B, X, D}), cat({A, B, D, C}), chunks(32));
        REQUIRE(p.moves.size() == 2);
        CHECK(p.moves[0] == reuse::chunk_move{110, 100, 40});
        CHECK(p.moves[1] == reuse::chunk_move{160, 140, 33});
        CHECK(p.n_past == 173);
    }
}

TEST_CASE("plan: media disables chunk shifting and plans never end inside a chunk") {
    prompt_tokens img;
    img.push_media(42, 4);
    const prompt_tokens A = toy::text(50, 0), X = toy::text(3, 500), B = toy::text(40, 1000);
    CHECK(reuse::make_plan(cat({A, img, X, B}), cat({A, img, B}), chunks(32)).moves.empty());
    CHECK(reuse::make_plan(cat({A, X, B}), cat({A, B, img}), chunks(32)).moves.empty());
    // exact repeat ending with an image: the whole image is recomputed
    const prompt_tokens e = cat({A, img});
    const auto p = reuse::make_plan(e, e);
    CHECK(p.n_past == 50);
    CHECK(p.n_compute() == 4);
    // a differing image stops the prefix at its start
    prompt_tokens img2;
    img2.push_media(43, 4);
    CHECK(reuse::make_plan(cat({A, img, X}), cat({A, img2, X})).n_past == 50);
}

TEST_CASE("apply_plan: bad arguments and impossible moves change nothing") {
    const prompt_tokens A = toy::text(40, 0), X = toy::text(4, 500), B = toy::text(40, 1000);
    const prompt_tokens cached = cat({A, X, B});
    const auto p = reuse::make_plan(cached, cat({A, B}), chunks(32));
    REQUIRE(!p.moves.empty());
    cache_t cache(toy::shape(cached.size() + 10));  // 10 free cells
    toy::fill(cache, 0, cached, 0, cached.size());
    REQUIRE(cache.seq_cp(0, 1, -1, -1));  // every cell shared: moving 39 of them needs 39 free cells
    const auto before = positions(cache, 0);
    CHECK(kvtest::refused_result(reuse::apply_plan(cache, 0, p), "needs 39 free cells"));
    CHECK(positions(cache, 0) == before);
    CHECK(positions(cache, 1) == before);
    CHECK_THROWS_WITH_AS(static_cast<void>(reuse::apply_plan(cache, 9, p)),
                         doctest::Contains("seq = 9"), kvcache::error);
    CHECK_THROWS_WITH_AS(static_cast<void>(reuse::apply_plan(cache, -1, p)),
                         doctest::Contains("seq = -1"), kvcache::error);
    CHECK(positions(cache, 0) == before);
}

TEST_CASE("plan: random prompts against a direct simulation; other sequences never change") {
    const unsigned seed = 7771;
    std::printf("reuse plan random seed %u\n", seed);
    std::mt19937 rng(seed);
    for (int it = 0; it < 60; ++it) {
        // prompts over a tiny alphabet with repeated blocks so that chunks match
        std::vector<prompt_tokens> blocks;
        for (int b = 0; b < 4; ++b) blocks.push_back(toy::text(4 + rng() % 12, static_cast<token_t>(100 * b)));
        auto make = [&] {
            prompt_tokens p;
            const int n = 1 + static_cast<int>(rng() % 6);
            for (int i = 0; i < n; ++i) p.append(blocks[rng() % blocks.size()].tokens());
            return p;
        };
        const prompt_tokens cached = make(), request = make();
        const std::uint32_t min_chunk = 1 + rng() % 8;
        const auto p = reuse::make_plan(cached, request, chunks(min_chunk));
        // the reused prefix of the request equals the cached tokens it came from
        REQUIRE(p.n_lcp == std::min<std::size_t>(cached.common_prefix(request), request.size() - 1));
        std::uint32_t expect_dst = p.n_lcp;
        for (const auto& m : p.moves) {
            REQUIRE(m.dst == static_cast<kvcache::pos_t>(expect_dst));
            REQUIRE(m.src >= m.dst);
            for (std::uint32_t k = 0; k < m.n; ++k) REQUIRE(cached[m.src + k] == request[m.dst + k]);
            expect_dst += m.n;
        }
        REQUIRE(p.n_past == expect_dst);
        REQUIRE(p.n_past < request.size());

        cache_t cache(toy::shape(256, 4));
        toy::fill(cache, 0, cached, 0, cached.size(), true);
        toy::fill(cache, 2, request, 0, request.size(), true);  // another sequence, not shared
        if (rng() % 2) REQUIRE(cache.seq_cp(0, 1, 0, static_cast<kvcache::pos_t>(cached.size() / 2)));  // partly shared
        const auto other = positions(cache, 1);
        const double err2 = toy::max_error(cache, 2, request, request.size(), true);
        REQUIRE(reuse::apply_plan(cache, 0, p));
        kvcache::ops::apply_k_shift(cache);
        REQUIRE(positions(cache, 0) == iota(p.n_past));
        REQUIRE(toy::max_error(cache, 0, request, p.n_past, true) < 1e-5);
        REQUIRE(positions(cache, 1) == other);
        REQUIRE(toy::max_error(cache, 1, cached, other.size(), true) < 1e-6);
        REQUIRE(toy::max_error(cache, 2, request, request.size(), true) == err2);
    }
}
