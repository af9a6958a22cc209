// The demo engine's logits against a plain double-precision forward pass without a cache
// (reference_llama.hpp): prefill in several micro-batches, decode steps, interleaved
// sequences, shared prefixes, shifted positions, and bad input leaving the cache unchanged.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

#include "../../examples/demo/engine/engine.hpp"
#include "reference_llama.hpp"
#include "support/result_check.hpp"

namespace {

using cache_t = kvcache::kv_cache<kvcache::f32>;
using engine_t = demo::llama_engine<cache_t>;

demo::llama_config tiny_config(bool shared) {
    demo::llama_config c;
    c.dim = 32;
    c.hidden_dim = 48;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.vocab_size = 40;
    c.seq_len = 256;
    c.shared_classifier = shared;
    return c;
}

std::vector<int> random_tokens(demo::splitmix64& rng, std::size_t n, int vocab) {
    std::vector<int> t(n);
    for (auto& x : t) x = static_cast<int>(rng.next() % static_cast<std::uint64_t>(vocab));
    return t;
}

std::vector<int> iota(int from, std::size_t n) {
    std::vector<int> p(n);
    std::iota(p.begin(), p.end(), from);
    return p;
}

/// Max |engine - reference| over one row of logits.
double max_diff(const float* got, const demo_ref::vec& want) {
    double m = 0;
    for (std::size_t i = 0; i < want.size(); ++i) m = std::max(m, std::abs(static_cast<double>(got[i]) - want[i]));
    return m;
}

constexpr double tol = 1e-4;

}  // namespace

TEST_CASE("engine prefill and decode match the cache-free reference") {
    for (bool shared : {false, true}) {
        const std::uint64_t seed = shared ? 11 : 12;
        std::printf("engine vs reference: seed %llu, shared classifier %d\n", static_cast<unsigned long long>(seed),
                    shared ? 1 : 0);
        const auto w = demo::make_random_model(tiny_config(shared), seed);
        demo::splitmix64 rng(seed * 7 + 1);
        const std::vector<int> tokens = random_tokens(rng, 30, w.config.vocab_size);
        const auto ref = demo_ref::forward_all(w, tokens, iota(0, tokens.size()));

        engine_t::options opt;
        opt.n_ubatch = 7;  // 23 prompt tokens -> micro-batches of 7, 7, 7, 2
        engine_t eng(w, opt);
        cache_t cache(eng.cache_shape(64, 2));
        std::vector<float> logits;
        const std::vector<int> prompt(tokens.begin(), tokens.begin() + 23);
        eng.eval(cache, prompt, 0, 0, logits, true);
        REQUIRE(logits.size() == 23 * static_cast<std::size_t>(w.config.vocab_size));
        for (std::size_t t = 0; t < 23; ++t) CHECK(max_diff(logits.data() + t * 40, ref[t]) <= tol);
        for (std::size_t t = 23; t < tokens.size(); ++t) {  // decode one token at a time
            const std::vector<int> one{tokens[t]};
            eng.eval(cache, one, static_cast<int>(t), 0, logits);
            REQUIRE(logits.size() == 40u);
            CHECK(max_diff(logits.data(), ref[t]) <= tol);
        }
        CHECK(cache.used() == tokens.size());
        CHECK(cache.seq_pos_max(0) == static_cast<int>(tokens.size()) - 1);
    }
}

TEST_CASE("interleaved sequences and a shared prefix (seq_cp) match the reference") {
    const std::uint64_t seed = 21;
    std::printf("interleaved sequences: seed %llu\n", static_cast<unsigned long long>(seed));
    const auto w = demo::make_random_model(tiny_config(false), seed);
    demo::splitmix64 rng(seed);
    const auto a = random_tokens(rng, 20, 40), b = random_tokens(rng, 17, 40);
    const auto ref_a = demo_ref::forward_all(w, a, iota(0, a.size()));
    const auto ref_b = demo_ref::forward_all(w, b, iota(0, b.size()));
    engine_t eng(w);
    cache_t cache(eng.cache_shape(96, 3));
    std::vector<float> logits;
    // Alternate chunks of a (seq 0) and b (seq 1) so their cells interleave.
    std::size_t ia = 0, ib = 0;
    while (ia < a.size() || ib < b.size()) {
        if (ia < a.size()) {
            const std::size_t n = std::min<std::size_t>(3, a.size() - ia);
            eng.eval(cache, std::span<const int>(a).subspan(ia, n), static_cast<int>(ia), 0, logits);
            ia += n;
            CHECK(max_diff(logits.data(), ref_a[ia - 1]) <= tol);
        }
        if (ib < b.size()) {
            const std::size_t n = std::min<std::size_t>(4, b.size() - ib);
            eng.eval(cache, std::span<const int>(b).subspan(ib, n), static_cast<int>(ib), 1, logits);
            ib += n;
            CHECK(max_diff(logits.data(), ref_b[ib - 1]) <= tol);
        }
    }
    // Sequence 2 reuses the first 12 tokens of a (shared cells, no recomputation), then diverges.
    REQUIRE(cache.seq_cp(0, 2, 0, 12));
    std::vector<int> c(a.begin(), a.begin() + 12);
    const auto tail = random_tokens(rng, 6, 40);
    c.insert(c.end(), tail.begin(), tail.end());
    const auto ref_c = demo_ref::forward_all(w, c, iota(0, c.size()));
    eng.eval(cache, std::span<const int>(c).subspan(12), 12, 2, logits, true);
    for (std::size_t t = 0; t < tail.size(); ++t) CHECK(max_diff(logits.data() + t * 40, ref_c[12 + t]) <= tol);
    // a and b are unaffected.
    const std::vector<int> next{5};
    auto a2 = a;
    a2.push_back(5);
    eng.eval(cache, next, static_cast<int>(a.size()), 0, logits);
    CHECK(max_diff(logits.data(), demo_ref::forward_all(w, a2, iota(0, a2.size())).back()) <= tol);
}

TEST_CASE("shifted positions: K-shift after seq_add gives the same logits as computing at the new positions") {
    const std::uint64_t seed = 31;
    std::printf("K-shift: seed %llu\n", static_cast<unsigned long long>(seed));
    const auto w = demo::make_random_model(tiny_config(false), seed);
    demo::splitmix64 rng(seed);
    const auto t = random_tokens(rng, 16, 40);
    engine_t eng(w);
    cache_t cache(eng.cache_shape(32, 1));
    std::vector<float> logits;
    const std::span<const int> all(t);
    eng.eval(cache, all.first(15), 1000, 0, logits);  // positions 1000..1014
    REQUIRE(cache.seq_add(0, 1000, -1, -997));                 // now 3..17
    CHECK(cache.has_shift());
    eng.eval(cache, all.subspan(15), 18, 0, logits);  // the engine applies the pending K-shift first
    CHECK_FALSE(cache.has_shift());
    const auto ref = demo_ref::forward_all(w, t, iota(3, t.size()));
    CHECK(max_diff(logits.data(), ref.back()) <= tol);
}

TEST_CASE("bad input throws and leaves the cache unchanged") {
    const auto w = demo::make_random_model(tiny_config(false), 41);
    engine_t::options opt;
    opt.n_ubatch = 4;
    engine_t eng(w, opt);
    cache_t cache(eng.cache_shape(10, 1));
    std::vector<float> logits;
    const std::vector<int> p{1, 2, 3};
    eng.eval(cache, p, 0, 0, logits);
    auto unchanged = [&] {
        CHECK(cache.used() == 3);
        CHECK(cache.seq_pos_max(0) == 2);
        CHECK_FALSE(cache.in_transaction());
    };
    SUBCASE("token id out of range") {
        const std::vector<int> bad{4, 40};
        CHECK_THROWS_WITH_AS(eng.eval(cache, bad, 3, 0, logits), doctest::Contains("tokens[1] = 40"), demo::model_error);
        unchanged();
    }
    SUBCASE("negative token id") {
        const std::vector<int> bad{-1};
        CHECK_THROWS_AS(eng.eval(cache, bad, 3, 0, logits), demo::model_error);
        unchanged();
    }
    SUBCASE("no room: the second micro-batch does not fit, the first goes back too") {
        const std::vector<int> big(8, 5);  // 4 + 4 tokens, 7 free cells
        CHECK_THROWS_WITH_AS(eng.eval(cache, big, 3, 0, logits), doctest::Contains("cannot place"), demo::model_error);
        unchanged();
    }
    SUBCASE("position already held by the sequence") {
        const std::vector<int> one{5};
        CHECK_THROWS_AS(eng.eval(cache, one, 1, 0, logits), kvcache::error);
        unchanged();
    }
    SUBCASE("empty input and mismatched positions") {
        CHECK_THROWS_AS(eng.eval(cache, std::span<const int>(), 3, 0, logits), demo::model_error);
        const std::vector<int> pos{3};
        CHECK_THROWS_AS(eng.eval(cache, p, std::span<const int>(pos), 0, logits), demo::model_error);
        unchanged();
    }
    SUBCASE("cache of another shape") {
        cache_t other(kvcache::model_shape{3, 2, 8, 8, {}, 16, 1});
        CHECK_THROWS_WITH_AS(eng.eval(other, p, 0, 0, logits), doctest::Contains("does not match"),
                             demo::model_error);
        CHECK(other.used() == 0);
    }
    // After the failures the engine still works and agrees with a fresh run.
    const std::vector<int> next{7};
    eng.eval(cache, next, 3, 0, logits);
    cache_t fresh(eng.cache_shape(10, 1));
    std::vector<float> want;
    const std::vector<int> all{1, 2, 3, 7};
    eng.eval(fresh, all, 0, 0, want);
    REQUIRE(want.size() == logits.size());
    for (std::size_t i = 0; i < want.size(); ++i) CHECK(std::abs(logits[i] - want[i]) <= 1e-4f);
}

namespace {

/// Greedy continuation of `prompt` by n tokens on a cache of K/V element E.
template <class E>
std::vector<int> engine_quant_greedy(const demo::llama_weights& w, const std::vector<int>& prompt, std::size_t n) {
    using qcache_t = kvcache::kv_cache<E>;
    demo::llama_engine<qcache_t> eng(w);
    qcache_t cache(eng.cache_shape(static_cast<std::uint32_t>(prompt.size() + n + 8), 1));
    std::vector<float> logits;
    eng.eval(cache, prompt, 0, 0, logits);
    std::vector<int> out;
    for (std::size_t i = 0; i < n; ++i) {
        const int t = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        out.push_back(t);
        const std::vector<int> one{t};
        eng.eval(cache, one, static_cast<int>(prompt.size() + i), 0, logits);
    }
    return out;
}

}  // namespace

TEST_CASE("greedy tokens with q8_0 / q4_0 K/V against f32 (random model, head dim 32)") {
    // Quantized blocks need head dims that are multiples of 32 (stories260K's are 8: see
    // real_model). Counted: tokens equal to the f32 run's up to its first difference; the
    // lower bounds are what this model and seed give (measured), so a regression that makes
    // the quantized caches diverge earlier fails.
    demo::llama_config c = tiny_config(false);
    c.dim = 128;
    c.hidden_dim = 256;
    c.n_heads = 4;  // head dim 32
    c.n_kv_heads = 2;
    c.vocab_size = 64;
    const auto w = demo::make_random_model(c, 29);
    demo::splitmix64 rng(290);
    const std::vector<int> prompt = random_tokens(rng, 24, c.vocab_size);
    constexpr std::size_t n = 100;
    const auto ref = engine_quant_greedy<kvcache::f32>(w, prompt, n);
    auto prefix = [&](const std::vector<int>& got) {
        std::size_t i = 0;
        while (i < n && got[i] == ref[i]) ++i;
        return i;
    };
    const std::size_t m16 = prefix(engine_quant_greedy<kvcache::f16>(w, prompt, n));
    const std::size_t m8 = prefix(engine_quant_greedy<kvcache::q8_0>(w, prompt, n));
    const std::size_t m4 = prefix(engine_quant_greedy<kvcache::q4_0>(w, prompt, n));
    MESSAGE("greedy tokens equal to f32's before the first difference (of " << n << "): f16 " << m16 << ", q8_0 " << m8
                                                                           << ", q4_0 " << m4);
    // Measured (GCC, x86-64): 100, 100, 100.
    CHECK(m16 >= 95);
    CHECK(m8 >= 90);
    CHECK(m4 >= 75);
}
