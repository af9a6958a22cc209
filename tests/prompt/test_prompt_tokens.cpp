// F18: prompt tokens with media chunks: keep_first refuses to cut a chunk,
// common_prefix compares media by (id, n_pos) a whole chunk at a time,
// malformed lists are refused with a clear error.
#include <doctest/doctest.h>

#include <kvcache/tokens/prompt_tokens.hpp>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "prompt/toy_model.hpp"

using kvcache::media_chunk;
using kvcache::null_token;
using kvcache::prompt_tokens;
using kvcache::token_t;

namespace {

// Reference LCP: compare position by position, a media position by (chunk id, n_pos,
// offset); a mismatch inside a chunk moves back to the chunk's start.
std::size_t reference_lcp(const prompt_tokens& a, const prompt_tokens& b) {
    const std::size_t n = std::min(a.size(), b.size());
    auto sym = [](const prompt_tokens& p, std::size_t i) {
        struct s {
            token_t t;
            std::uint64_t id;
            std::uint32_t n_pos, off;
            bool operator==(const s&) const = default;
        };
        if (p[i] != null_token) return s{p[i], 0, 0, 0};
        const media_chunk* c = p.chunk_at(i);
        return s{null_token, c->id, c->n_pos, static_cast<std::uint32_t>(i - c->begin)};
    };
    std::size_t i = 0;
    while (i < n && sym(a, i) == sym(b, i)) ++i;
    if (i < n || i == n) {
        // never end inside a chunk of either list
        if (a.cuts_chunk(i)) i = a.chunk_at(i)->begin;
        if (b.cuts_chunk(i)) i = b.chunk_at(i)->begin;
    }
    return i;
}

prompt_tokens with_image(std::size_t before, std::uint64_t id, std::uint32_t n_img, std::size_t after) {
    prompt_tokens p = toy::text(before);
    p.push_media(id, n_img);
    for (std::size_t i = 0; i < after; ++i) p.push_back(static_cast<token_t>(5000 + i));
    return p;
}

}  // namespace

TEST_CASE("prompt_tokens: text LCP, the seed's 1000 vs 1003 example") {
    const prompt_tokens base = toy::text(1000);
    prompt_tokens ext = base;
    ext.append(std::vector<token_t>{7, 8, 9});
    CHECK(ext.size() == 1003);
    CHECK(base.common_prefix(ext) == 1000);
    CHECK(kvcache::common_prefix(ext, base) == 1000);
    prompt_tokens gen = base;
    gen.push_back(42);  // a generated token, then the next request diverges at 1000
    CHECK(gen.common_prefix(ext) == 1000);
    CHECK(base.common_prefix(base) == 1000);
    CHECK(prompt_tokens{}.common_prefix(base) == 0);
    prompt_tokens x = base;
    x.keep_first(3);
    CHECK(x == prompt_tokens{1000, 1001, 1002});
}

TEST_CASE("prompt_tokens: an image in the middle") {
    const prompt_tokens a = with_image(5, 77, 3, 2);  // [T T T T T I I I U U]
    CHECK(a.size() == 10);
    CHECK(a.has_media());
    CHECK(a[5] == null_token);
    REQUIRE(a.chunk_at(6) != nullptr);
    CHECK(a.chunk_at(6)->begin == 5);
    CHECK(a.chunk_at(4) == nullptr);

    SUBCASE("same image: the whole list matches") {
        prompt_tokens b = with_image(5, 77, 3, 2);
        b.push_back(9);
        CHECK(a.common_prefix(b) == 10);
    }
    SUBCASE("other image id: LCP stops at the chunk start") {
        CHECK(a.common_prefix(with_image(5, 78, 3, 2)) == 5);
    }
    SUBCASE("same id, other length: stops at the chunk start") {
        CHECK(a.common_prefix(with_image(5, 77, 4, 2)) == 5);
    }
    SUBCASE("text where the other has the image") {
        CHECK(a.common_prefix(toy::text(9)) == 5);
    }
    SUBCASE("keep_first at chunk boundaries works, inside a chunk is refused") {
        prompt_tokens b = a;
        b.keep_first(8);
        CHECK(b.size() == 8);
        CHECK(b.media().size() == 1);
        b.keep_first(5);
        CHECK(!b.has_media());
        for (std::size_t n : {6u, 7u}) {
            prompt_tokens c = a;
            CHECK_THROWS_WITH_AS(c.keep_first(n), doctest::Contains("cuts through media chunk [5, 8)"), kvcache::error);
            CHECK(c == a);  // unchanged
            CHECK(c.cuts_chunk(n));
            CHECK(c.chunk_floor(n) == 5);
        }
        prompt_tokens c = a;
        CHECK_THROWS_WITH_AS(c.keep_first(11), doctest::Contains("n = 11 exceeds size 10"), kvcache::error);
        CHECK(c == a);
    }
}

TEST_CASE("prompt_tokens: malformed input is refused with a message naming the problem") {
    using V = std::vector<token_t>;
    using M = std::vector<media_chunk>;
    const V ok = {1, 2, null_token, null_token, 3};
    CHECK_NOTHROW(prompt_tokens::from(ok, M{{9, 2, 2}}));
    CHECK(prompt_tokens::from(ok, M{{9, 2, 2}}).common_prefix(prompt_tokens::from(ok, M{{9, 2, 2}})) == 5);
    auto bad = [](const V& t, const M& m, const char* what) {
        CHECK_THROWS_WITH_AS(prompt_tokens::from(t, m), doctest::Contains(what), kvcache::error);
    };
    bad(ok, M{}, "token[2] is null_token but no media chunk covers it");
    bad(ok, M{{9, 2, 1}}, "token[3] is null_token but no media chunk covers it");
    bad(ok, M{{9, 1, 2}}, "covers position 1 which holds text token 2");
    bad(ok, M{{9, 2, 0}}, "media[0].n_pos = 0");
    bad(ok, M{{9, 4, 2}}, "beyond the 5 tokens");
    bad(V{null_token, null_token, null_token}, M{{1, 0, 2}, {2, 1, 2}}, "overlaps or precedes");
    bad(V{1, -5}, M{}, "token[1] = -5, must be >= 0 or null_token");
    CHECK_THROWS_WITH_AS(prompt_tokens(V{1, -1}), doctest::Contains("token[1] = -1"), kvcache::error);
    prompt_tokens p{1, 2};
    CHECK_THROWS_AS(p.push_back(-3), kvcache::error);
    CHECK_THROWS_WITH_AS(p.push_media(4, 0), doctest::Contains("n_pos = 0"), kvcache::error);
    CHECK_THROWS_AS(p.append(V{4, -2}), kvcache::error);
    CHECK(p == prompt_tokens{1, 2});
}

TEST_CASE("prompt_tokens: random lists against the reference LCP") {
    const unsigned seed = 20261122;
    std::printf("prompt_tokens random LCP seed %u\n", seed);
    std::mt19937 rng(seed);
    auto random_prompt = [&](const prompt_tokens& start) {
        prompt_tokens p = start;
        p.keep_first(p.chunk_floor(std::uniform_int_distribution<std::size_t>(0, p.size())(rng)));
        const int n = std::uniform_int_distribution<int>(0, 12)(rng);
        for (int i = 0; i < n; ++i) {
            if (rng() % 5 == 0)
                p.push_media(rng() % 3, 1 + static_cast<std::uint32_t>(rng() % 3));
            else
                p.push_back(static_cast<token_t>(rng() % 4));
        }
        return p;
    };
    for (int it = 0; it < 3000; ++it) {
        const prompt_tokens a = random_prompt({});
        const prompt_tokens b = random_prompt(rng() % 2 ? a : prompt_tokens{});
        const std::size_t got = a.common_prefix(b);
        REQUIRE(got == reference_lcp(a, b));
        REQUIRE(got == b.common_prefix(a));
        REQUIRE(!a.cuts_chunk(got));
        REQUIRE(!b.cuts_chunk(got));
        // round trip through from()
        REQUIRE(prompt_tokens::from(a.tokens(), a.media()) == a);
    }
}
