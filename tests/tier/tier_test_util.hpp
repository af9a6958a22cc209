// Shared helpers of the storage-tier tests: a small cache filled through the public API,
// prompts, scratch directories.
#pragma once

#include <kvcache/kvcache.hpp>
#include <kvcache/tier/disk_tier.hpp>

#include <cstdint>
#include <filesystem>
#include <new>
#include <span>
#include <string_view>
#include <unistd.h>
#include <random>
#include <string>
#include <vector>

namespace tiertest {

using kvcache::pos_t;
using kvcache::seq_id_t;
using tier_kv = kvcache::kv_cache<kvcache::f16>;

inline kvcache::model_shape tier_shape(std::uint32_t n_layer = 2) {
    kvcache::model_shape s;
    s.n_layer = n_layer;
    s.n_head_kv = 2;
    s.head_dim_k = 8;
    s.n_cells = 256;
    s.n_seq_max = 4;
    return s;
}

/// Places positions [from, n) of sequence s (holding [0, from) already) with K/V derived
/// from (seed, position): the same values whatever `from` is.
inline void tier_fill(tier_kv& c, seq_id_t s, std::uint32_t n, std::uint32_t seed, std::uint32_t from = 0) {
    std::vector<pos_t> pos;
    for (std::uint32_t i = from; i < n; ++i) pos.push_back(static_cast<pos_t>(i));
    std::vector<seq_id_t> seq(pos.size(), s);
    auto r = c.place(pos, seq);
    REQUIRE(r);
    const auto& sh = c.shape();
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    const std::size_t kr = sh.k_row_size(), vr = sh.v_row_size();
    std::vector<float> k(n * kr), v(n * vr);
    for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
        for (auto& x : k) x = u(rng);
        for (auto& x : v) x = u(rng);
        c.write_k(l, r.value().cells, k.data() + from * kr);
        c.write_v(l, r.value().cells, v.data() + from * vr);
    }
    static_cast<void>(c.commit());
}

/// n text tokens derived from seed.
inline kvcache::prompt_tokens tier_prompt(std::uint32_t n, std::uint32_t seed) {
    kvcache::prompt_tokens p;
    for (std::uint32_t i = 0; i < n; ++i) p.push_back(static_cast<kvcache::token_t>((seed * 7919u + i * 31u) % 32000u));
    return p;
}

/// Sequence s's state bytes without tokens (compares K/V and positions bit for bit).
inline std::vector<std::byte> tier_seq_bytes(const tier_kv& c, seq_id_t s) { return kvcache::io::save_seq(c, s); }

/// A fresh, empty scratch directory under the build's working directory.
inline std::string tier_scratch_dir(const std::string& name) {
    const std::string d = "tier_scratch_" + name + "_" + std::to_string(::getpid());
    std::filesystem::remove_all(d);
    return d;
}
inline void tier_remove_dir(const std::string& d) { std::filesystem::remove_all(d); }

/// A storage tier whose calls throw std::bad_alloc while `fail` is set (else a memory tier).
struct throwing_tier {
    bool* fail;
    kvcache::tier::memory_tier inner;
    kvcache::result<void> put(const kvcache::tier::key& k, std::span<const std::byte> b) {
        if (*fail) throw std::bad_alloc();
        return inner.put(k, b);
    }
    bool get(const kvcache::tier::key& k, std::vector<std::byte>& out) {
        if (*fail) throw std::bad_alloc();
        return inner.get(k, out);
    }
    bool contains(const kvcache::tier::key& k) const { return inner.contains(k); }
    bool erase(const kvcache::tier::key& k) { return inner.erase(k); }
    std::size_t bytes() const { return inner.bytes(); }
    std::string_view name() const { return "throwing"; }
};

}  // namespace tiertest
