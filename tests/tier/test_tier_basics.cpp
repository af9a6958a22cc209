// Storage tiers: SHA-256 against the published test vectors, the key chain, the blob
// format and its verification (every refusal reason), memory_tier's LRU limit.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <string>
#include <vector>

#include "tier_test_util.hpp"

using namespace kvcache;

namespace {
std::string basics_sha_hex(std::string_view s) { return tier::to_hex(tier::sha256_of(s)); }
}  // namespace

TEST_SUITE("tier_keys") {
TEST_CASE("sha256: FIPS 180-4 / NIST test vectors") {
    CHECK(basics_sha_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(basics_sha_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    CHECK(basics_sha_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
          "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    CHECK(basics_sha_hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu") ==
          "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
    // One million 'a', fed in uneven pieces (buffering across block boundaries).
    tier::sha256 h;
    const std::string a(1000, 'a');
    for (int i = 0; i < 1000; ++i) h.update(a.data(), a.size());
    CHECK(tier::to_hex(h.final()) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    tier::sha256 g;
    const std::string s = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    for (char ch : s) g.update(&ch, 1);
    CHECK(tier::to_hex(g.final()) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST_CASE("block keys: chained, salted, fingerprinted, media-aware") {
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_kv c3(tiertest::tier_shape(3));
    const auto fp = tier::memory_fingerprint(c);
    CHECK(fp == tier::memory_fingerprint(tiertest::tier_kv(tiertest::tier_shape())));
    CHECK(fp != tier::memory_fingerprint(c3));
    CHECK(fp != tier::memory_fingerprint(kv_cache<f32>(tiertest::tier_shape())));

    const prompt_tokens p = tiertest::tier_prompt(100, 1);
    const auto k = tier::block_keys(p, 16, fp, 0);
    REQUIRE(k.size() == 6);
    for (std::size_t i = 0; i < k.size(); ++i) CHECK(k[i].n_tokens == 16 * (i + 1));
    CHECK(k[0].k.hex().size() == 64);
    CHECK(tier::block_keys(p, 16, fp, 0, 40).size() == 2);
    // A prompt sharing the first 40 tokens shares the first two keys only.
    prompt_tokens q = p;
    q.keep_first(40);
    q.push_back(1);
    while (q.size() < 100) q.push_back(2);
    const auto kq = tier::block_keys(q, 16, fp, 0);
    CHECK(kq[0].k == k[0].k);
    CHECK(kq[1].k == k[1].k);
    CHECK(kq[2].k != k[2].k);
    CHECK(tier::block_keys(p, 16, fp, 7)[0].k != k[0].k);          // tenant salt
    CHECK(tier::block_keys(p, 16, tier::memory_fingerprint(c3), 0)[0].k != k[0].k);  // model
    CHECK(tier::block_keys(p, 8, fp, 0)[1].k != k[0].k);           // block size is part of the seed
    // A media chunk straddling a boundary removes that boundary's key; ids matter.
    prompt_tokens m;
    for (int i = 0; i < 10; ++i) m.push_back(i);
    m.push_media(42, 12);  // positions [10, 22)
    while (m.size() < 48) m.push_back(5);
    const auto km = tier::block_keys(m, 16, fp, 0);
    REQUIRE(km.size() == 2);
    CHECK(km[0].n_tokens == 32);
    CHECK(km[1].n_tokens == 48);
    prompt_tokens m2;
    for (int i = 0; i < 10; ++i) m2.push_back(i);
    m2.push_media(43, 12);
    while (m2.size() < 48) m2.push_back(5);
    CHECK(tier::block_keys(m2, 16, fp, 0)[0].k != km[0].k);
    CHECK_THROWS_AS(static_cast<void>(tier::block_keys(p, 0, fp, 0)), kvcache::error);
}

TEST_CASE("blob: every refusal reason, and the accepted view") {
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 40, 3);
    const prompt_tokens p = tiertest::tier_prompt(40, 3);
    const auto fp = tier::memory_fingerprint(c);
    const auto keys = tier::block_keys(p, 16, fp, 5);
    const tier::prefix_key pk = keys.back();  // 32 tokens
    const auto payload = io::save_seq(c, 0);
    const auto blob = tier::make_blob(pk.k, fp, 5, pk.n_tokens, p, payload);
    tier::blob_view v;
    REQUIRE(tier::verify_blob(blob, pk.k, pk.n_tokens, fp, 5, p, v) == tier::refusal::none);
    CHECK(v.tokens == p);
    CHECK(std::vector<std::byte>(v.payload.begin(), v.payload.end()) == payload);
    // A longer request sharing the covered prefix is served.
    prompt_tokens longer = p;
    longer.push_back(9);
    CHECK(tier::verify_blob(blob, pk.k, pk.n_tokens, fp, 5, longer, v) == tier::refusal::none);

    CHECK(tier::verify_blob(blob, keys[0].k, keys[0].n_tokens, fp, 5, p, v) == tier::refusal::key);
    auto fp2 = fp;
    fp2[0] ^= 1;
    CHECK(tier::verify_blob(blob, pk.k, pk.n_tokens, fp2, 5, p, v) == tier::refusal::fingerprint);
    CHECK(tier::verify_blob(blob, pk.k, pk.n_tokens, fp, 6, p, v) == tier::refusal::tenant);
    prompt_tokens other = p;
    other.keep_first(20);
    while (other.size() < 40) other.push_back(1);
    CHECK(tier::verify_blob(blob, pk.k, pk.n_tokens, fp, 5, other, v) == tier::refusal::tokens);
    // Every single-byte flip anywhere is refused (sampled), as is every truncation tried.
    for (std::size_t at = 0; at < blob.size(); at += 37) {
        auto bad = blob;
        bad[at] ^= std::byte{0x10};
        CHECK(tier::verify_blob(bad, pk.k, pk.n_tokens, fp, 5, p, v) != tier::refusal::none);
    }
    for (std::size_t n : {std::size_t{0}, std::size_t{50}, tier::blob_header_size, blob.size() - 1}) {
        auto cut = blob;
        cut.resize(n);
        CHECK(tier::verify_blob(cut, pk.k, pk.n_tokens, fp, 5, p, v) == tier::refusal::corrupt);
    }
    CHECK_THROWS_AS(static_cast<void>(tier::make_blob(pk.k, fp, 5, 41, p, payload)), kvcache::error);
}

TEST_CASE("memory_tier: LRU under a byte limit") {
    tier::memory_tier t(300);
    auto key_of = [](int i) {
        tier::key k;
        k.digest[0] = static_cast<std::uint8_t>(i);
        return k;
    };
    const std::vector<std::byte> b100(100, std::byte{1});
    for (int i = 0; i < 3; ++i) REQUIRE(t.put(key_of(i), b100));
    std::vector<std::byte> out;
    CHECK(t.get(key_of(0), out));  // 0 is now the most recent
    REQUIRE(t.put(key_of(3), b100));
    CHECK(t.contains(key_of(0)));
    CHECK_FALSE(t.contains(key_of(1)));
    CHECK(t.bytes() == 300);
    CHECK(t.evictions() == 1);
    CHECK_FALSE(t.put(key_of(9), std::vector<std::byte>(301)));
    CHECK(t.erase(key_of(0)));
    CHECK_FALSE(t.erase(key_of(0)));
    CHECK_FALSE(t.get(key_of(0), out));
    static_assert(tier::storage_tier<tier::memory_tier>);
    static_assert(tier::storage_tier<tier::disk_tier>);
}
}
